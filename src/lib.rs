//! tinybroker: an in-memory publish/subscribe broker over gRPC, single-node
//! or several replicas over a NATS cluster. ARCHITECTURE.md is the map.
//!
//! Modules, one concern each:
//! - [`topic`] (topic and pattern syntax), [`sublist`] (matching: the
//!   pattern trie);
//! - [`engine`]: the seam between the gRPC front and an engine (its trait,
//!   the engine-neutral types, [`engine::validate`]);
//! - [`broker`]: the embedded single-node engine (routing, queues, eviction,
//!   consumer groups);
//! - [`cluster`]: the cluster engine over NATS, each replica's fan-out a
//!   [`broker::Broker`];
//! - [`group`]: the consumer-group rules both engines decide with (the
//!   state machine, admission, backlog overflow, idle TTL, stall reports,
//!   dead letters);
//! - [`grpc`]: the gRPC front over any engine (services, conversions, the
//!   subscription and session response bodies, framing, the generated
//!   servers' codec, connections, the per-connection executor, the request
//!   budget);
//! - [`ops`]: what operators read (the HTTP side server, the status page's
//!   data, metrics, process metrics, logs and traces);
//! - [`server`]: the lifecycle (on listeners already bound: picks the engine, starts the
//!   front and the side server, drains on shutdown);
//! - [`memory`] (the byte budget), [`auth`] (the bearer token), [`config`]
//!   (the environment, parsed and validated once), [`pb`] (generated code),
//!   [`retry`] (the jittered backoff of every retry loop);
//! - [`client`] (a Rust client over one `Session`) and [`cli`] (the
//!   `tinybroker` commands).

pub mod auth;
pub mod broker;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod group;
pub mod grpc;
pub mod memory;
pub mod ops;
pub mod pb;
pub mod retry;
pub mod server;
pub mod sublist;
pub mod topic;
