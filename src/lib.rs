//! tinybroker: an in-memory publish/subscribe broker over gRPC, single-node
//! or several replicas over a NATS cluster.
//!
//! Modules, one concern each: [`topic`] (syntax), [`sublist`] (matching),
//! [`engine`] (the seam between the gRPC front and an engine: its trait, the
//! engine-neutral types, [`engine::validate`]), [`broker`] (the embedded
//! engine: routing, queues, eviction, groups), [`cluster`] (the cluster
//! engine over NATS, each replica's fan-out a [`broker::Broker`]), [`grpc`]
//! (tonic adapter over any engine) with [`wire`] (pre-encoded deliveries),
//! [`server`] (lifecycle; picks the engine) with [`connections`] (the gRPC
//! listener) and [`incoming`] (requests being received), [`memory`] (the byte
//! budget), [`side`] (HTTP side server) with [`status`] (the status page's
//! data), [`metrics`] with [`process_metrics`], [`config`], [`telemetry`],
//! [`client`] and [`cli`].

pub mod auth;
pub mod broker;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod grpc;
pub mod memory;
pub mod ops;
pub mod pb;
pub mod server;
pub mod sublist;
pub mod topic;
