//! The gRPC front: adapts an [`Engine`](crate::engine::Engine) to
//! `tinybroker.v1` over tonic and hyper, and holds no broker logic. One
//! concern per file:
//! - [`services`]: the `Broker` and `Admin` services (each RPC: convert,
//!   call the engine, convert back);
//! - [`convert`]: every proto ↔ engine conversion, and errors to statuses;
//! - [`subscription_body`]: an `OpenSubscription` stream's response body
//!   and trailers, and how a handler's own body is installed;
//! - [`session_body`]: the `Session` RPC, many subscriptions on one stream
//!   (its response body, which also reads its requests);
//! - [`framing`]: a delivery as gRPC frame bytes, encoded straight from the
//!   published message, shared by both bodies;
//! - [`coalesce`]: how a connection's writes reach its socket (one system
//!   call for what one turn of the connection's task wrote);
//! - [`connections`]: the accept loop and what one connection may hold
//!   (cap, handshake timeout, TLS, HTTP/2 windows, abuse counted);
//! - [`executor`]: runs a connection's requests inside its own task;
//! - [`request_budget`]: the bytes of requests still being received,
//!   bounded per connection and overall.
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
