//! The gRPC front (placeholder docs, rewritten below).

pub mod connections;
pub mod executor;
pub mod framing;
pub mod request_budget;
pub mod services;
pub mod session_body;

pub use services::{
    AdminService, BrokerService, DROPPED_METADATA, END_REASON_METADATA, LAST_SEQUENCE_METADATA, NotInstalled,
    SUBSCRIPTION_ID_METADATA, SubscriptionBody, decoding_limit, install_subscription_body, map_oversized_response,
    status, take_subscription_body,
};
