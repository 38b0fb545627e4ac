//! The HTTP side server on `TINYBROKER_METRICS_ADDR`: `/metrics` (Prometheus
//! text format), `/healthz` (the process runs), `/readyz` (gRPC health is
//! SERVING), and the status page: `/status` (one self-contained HTML page,
//! served to anyone: it holds no data) and `/status.json` (its data, see
//! [`crate::ops::status`]; behind the bearer token when one is configured).

use crate::ops::metrics::Metrics;
use crate::ops::status::{self, StatusSource};
use axum::Router;
use axum::extract::{RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::net::TcpListener;

/// Whether the broker is ready for traffic: mirrors the gRPC health status
/// (set by `server.rs`), read by `/readyz`.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    pub(crate) fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }
}

/// The status page: no external assets, no build step.
const STATUS_PAGE: &str = include_str!("status.html");

/// What the page may load and run: its own inline style and script, and
/// fetches of this server (nothing from elsewhere, whatever it shows).
const STATUS_PAGE_POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; \
     connect-src 'self'; img-src data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'";

/// The status page's data source and the token `/status.json` asks for.
#[derive(Clone)]
pub struct StatusPage {
    source: StatusSource,
    token: Option<Arc<[u8]>>,
}

impl StatusPage {
    pub fn new(source: StatusSource, token: Option<&str>) -> Self {
        Self {
            source,
            token: token.map(|t| Arc::from(t.as_bytes())),
        }
    }
}

#[derive(Clone)]
struct SideState {
    readiness: Readiness,
    metrics: Metrics,
    status: StatusPage,
}

pub async fn serve(
    listener: TcpListener,
    readiness: Readiness,
    metrics: Metrics,
    status: StatusPage,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status_page))
        .route("/status.json", get(status_json))
        .with_state(SideState {
            readiness,
            metrics,
            status,
        });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn metrics_text(State(state): State<SideState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
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

async fn status_page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, STATUS_PAGE_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        STATUS_PAGE,
    )
}

async fn status_json(State(state): State<SideState>, RawQuery(query): RawQuery, request: Request) -> Response {
    if let Some(token) = &state.status.token
        && !crate::auth::authorized(token, &request)
    {
        let message = if request.headers().contains_key(header::AUTHORIZATION) {
            "the bearer token in the Authorization header is not valid"
        } else {
            "this broker has a token (TINYBROKER_AUTH_TOKEN): /status.json needs `Authorization: Bearer <token>`"
        };
        let mut response = json_error(StatusCode::UNAUTHORIZED, message);
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"tinybroker\""),
        );
        return response;
    }
    let limit = match status::limit_from_query(query.as_deref()) {
        Ok(limit) => limit,
        Err(message) => return json_error(StatusCode::BAD_REQUEST, &message),
    };
    match state.status.source.status(limit).await {
        Ok(status) => json(StatusCode::OK, &status),
        Err(e) => json_error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

fn json_error(code: StatusCode, message: &str) -> Response {
    json(code, &serde_json::json!({ "error": message }))
}

fn json(code: StatusCode, body: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (
            code,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            bytes,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode JSON: {e}\n")).into_response(),
    }
}
