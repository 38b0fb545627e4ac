//! tinybroker: an in-memory publish/subscribe broker over gRPC, single-node
//! or several replicas over a NATS cluster. ARCHITECTURE.md is the map.
//!
//! The modules are in layers, each importing only from its own and those
//! below; ARCHITECTURE.md draws them ("Layers", checked by
//! `scripts/layers.py`) and says which file holds what ("Code map").

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
