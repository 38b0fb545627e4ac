//! What operators read and scrape, beside the gRPC front: the HTTP side
//! server ([`http_server`]: `/metrics`, `/healthz`, `/readyz`, the status
//! page) with [`status`] (the page's data, `/status.json`), the Prometheus
//! registry ([`metrics`]) with [`process_metrics`] (the `process_*` family
//! read from `/proc`), and [`telemetry`] (logs, OpenTelemetry traces and
//! trace-context propagation). None of it routes a message: each reads the
//! engine through [`crate::engine::Engine`], or is called by the front.

pub mod http_server;
pub mod metrics;
pub mod process_metrics;
pub mod status;
pub mod telemetry;
