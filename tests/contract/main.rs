//! The contract's behaviours (docs/contract.md), each written once and run
//! against the engine the harness picks (`common::test_engine`, from
//! `TB_ENGINE`), the way nats-server runs its sublist tests with the cache
//! on and off: `cargo test --test contract` for the embedded engine;
//! `TB_ENGINE=cluster cargo test --test contract` for the cluster engine,
//! two replicas over a nats-server >= 2.10 of each test's own
//! (`TB_NATS_SERVER`, `tests/common/nats.rs`; without one the run fails:
//! it asked for the cluster).
//!
//! In cluster mode the harness hands out connections to the two replicas
//! in turn, so a test's publisher and subscribers, or a member and its
//! Ack, are on different replicas: the same contract across replicas.
//! Where the contract says cluster mode differs (docs/contract.md,
//! "Cluster mode": `matched_subscriptions` counts the publishing replica's
//! matches, a Nack's redelivery goes to any member, no `dropped` count for
//! a full group backlog yet), a test branches on the engine with a
//! comment citing it and asserts the cluster's behaviour; a test whose
//! observable is the publishing replica's `matched_subscriptions` keeps
//! its subscriber and publisher on one connection. Every test applies to
//! both engines.
//!
//! - [`batches`]: publishes in batches on a session and batched
//!   deliveries;
//! - [`broadcast`]: fan-out, message fields, ordering, eviction,
//!   subscription ids and error codes;
//! - [`groups`]: consumer groups, manual ack, redelivery, dead letters,
//!   overflow and idle TTL;
//! - [`sizes`]: messages from empty to near the limit, whole and in order.

#[path = "../common/mod.rs"]
mod common;

mod batches;
mod broadcast;
mod groups;
mod sizes;
mod transport;
