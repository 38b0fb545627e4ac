//! tinybroker: a single-node, in-memory publish/subscribe broker over gRPC.
//!
//! Modules, one concern each: [`topic`] (syntax), [`sublist`] (matching),
//! [`broker`] (the routing core), [`grpc`] (tonic adapter) with [`wire`] (pre-encoded deliveries), [`server`]
//! (lifecycle) with [`connections`] (the gRPC listener) and [`incoming`] (requests being received),
//! [`memory`] (the byte budget), [`side`] (HTTP side server), [`metrics`], [`config`], [`telemetry`],
//! [`client`] and [`cli`].

pub mod auth;
pub mod broker;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod connections;
pub mod engine;
pub mod grpc;
pub mod incoming;
pub mod memory;
pub mod metrics;
pub mod pb;
pub mod server;
pub mod side;
pub mod sublist;
pub mod telemetry;
pub mod topic;
pub mod wire;
