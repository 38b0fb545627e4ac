//! The gRPC front: adapts an [`Engine`](crate::engine::Engine) to
//! `tinybroker.v1` over tonic and hyper, and holds no broker logic.
//! ARCHITECTURE.md's "Code map" says which file holds what.
//!
//! The public surface (what `server.rs`, tests and the fuzz harness use) is
//! re-exported here.

pub mod coalesce;
pub mod connections;
pub mod convert;
pub mod executor;
pub mod framing;
pub mod request_budget;
pub mod services;
pub mod session_body;
pub mod subscription_body;

pub use convert::{decoding_limit, map_oversized_response, status};
pub use services::{AdminService, BrokerService};
pub use subscription_body::{
    DROPPED_METADATA, END_REASON_METADATA, LAST_SEQUENCE_METADATA, NotInstalled, SUBSCRIPTION_ID_METADATA,
    SubscriptionBody, install_subscription_body, take_subscription_body,
};
