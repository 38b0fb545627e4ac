//! The HTTP side server on `TINYBROKER_METRICS_ADDR`: `/metrics` (Prometheus
//! text format), `/healthz` (the process runs) and `/readyz` (gRPC health is
//! SERVING).

use crate::metrics::Metrics;
use crate::server::Readiness;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::future::Future;
use tokio::net::TcpListener;

#[derive(Clone)]
struct SideState {
    readiness: Readiness,
    metrics: Metrics,
}

pub async fn serve(
    listener: TcpListener,
    readiness: Readiness,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(SideState { readiness, metrics });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn metrics_text(State(state): State<SideState>) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn readyz(State(state): State<SideState>) -> (StatusCode, &'static str) {
    if state.readiness.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
