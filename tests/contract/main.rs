//! The contract's behaviours (docs/contract.md), each written once and run
//! against the engine the harness picks (`common::test_engine`, from
//! `TB_ENGINE`), the way nats-server runs its sublist tests with the cache
//! on and off: `cargo test --test contract` for the embedded engine; the
//! cluster engine joins with cluster mode (issue 15).
//!
//! - [`broadcast`]: fan-out, message fields, ordering, eviction,
//!   subscription ids and error codes;
//! - [`groups`]: consumer groups, manual ack, redelivery, dead letters,
//!   overflow and idle TTL;
//! - [`sizes`]: messages from empty to near the limit, whole and in order.

#[path = "../common/mod.rs"]
mod common;

mod broadcast;
mod groups;
mod sizes;
