//! The HTTP side server on `TINYBROKER_METRICS_ADDR`: `/healthz` (the process
//! runs) and `/readyz` (gRPC health is SERVING).

use crate::server::Readiness;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::future::Future;
use tokio::net::TcpListener;

pub async fn serve(
    listener: TcpListener,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(readiness);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn readyz(State(readiness): State<Readiness>) -> (StatusCode, &'static str) {
    if readiness.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
