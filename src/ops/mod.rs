//! What operators read and scrape, beside the gRPC front: the HTTP side
//! server and its status page, the Prometheus metrics, logs and
//! OpenTelemetry traces. None of it routes a message: it reads the engine
//! through [`crate::engine::Engine`]'s snapshots and the front through the
//! counters `server.rs` hands it, or is called by the front.
//! ARCHITECTURE.md's "Code map" says which file holds what.

pub mod http_server;
pub mod metrics;
pub mod process_metrics;
pub mod status;
pub mod telemetry;
