//! Logs and traces. Logs: `tracing` with `RUST_LOG` (default `info`) and
//! `TINYBROKER_LOG_FORMAT=text|json`, to stderr. Traces: with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` set, publish and delivery spans are exported
//! over OTLP/gRPC (standard `OTEL_*` variables); without it no OpenTelemetry
//! layer is installed and the span code paths are skipped entirely.

use crate::config::{ConfigError, LogFormat};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// W3C trace context header, in request metadata and message headers.
pub const TRACEPARENT: &str = "traceparent";

static TRACING: AtomicBool = AtomicBool::new(false);

/// Whether spans are being exported (read on the publish/delivery paths).
pub fn tracing_enabled() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// Owns the span exporter; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Flushes and stops span export (on shutdown).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            TRACING.store(false, Ordering::Relaxed);
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "flushing spans on shutdown failed");
            }
        }
    }
}

/// The OTLP settings read from the standard environment variables.
fn otlp_endpoint() -> Result<Option<String>, ConfigError> {
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty());
    let Some(endpoint) = endpoint else {
        return Ok(None);
    };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(ConfigError::new(format!(
            "OTEL_EXPORTER_OTLP_ENDPOINT={endpoint:?} is invalid: expected an http:// or https:// URL such as http://otel-collector:4317"
        )));
    }
    for name in ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] {
        if let Ok(protocol) = std::env::var(name)
            && !protocol.is_empty()
            && protocol != "grpc"
        {
            return Err(ConfigError::new(format!(
                "{name}={protocol:?} is not supported: tinybroker exports OTLP over gRPC only; set it to \"grpc\" (port 4317) or leave it unset"
            )));
        }
    }
    Ok(Some(endpoint))
}

/// Installs logging and, when configured, span export. Call once, before any
/// port is bound (a bad OTEL_* value is a start-up error).
pub fn init(format: LogFormat) -> Result<Telemetry, ConfigError> {
    let endpoint = otlp_endpoint()?;
    let provider = match endpoint {
        None => None,
        Some(_) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .build()
                .map_err(|e| ConfigError::new(format!("cannot set up the OTLP span exporter: {e}")))?;
            let mut resource = opentelemetry_sdk::Resource::builder();
            if std::env::var("OTEL_SERVICE_NAME").is_err() {
                resource = resource.with_service_name("tinybroker");
            }
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(resource.build())
                    .build(),
            )
        }
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let otel_layer = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("tinybroker")));
    let ansi = std::io::stderr().is_terminal();
    let registry = tracing_subscriber::registry().with(filter).with(otel_layer);
    // Already installed (tests run several brokers in one process): keep it.
    let _ = match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
    if provider.is_some() {
        TRACING.store(true, Ordering::Relaxed);
    }
    Ok(Telemetry { provider })
}

/// The trace context a client sent in its request metadata.
pub fn extract(metadata: &tonic::metadata::MetadataMap) -> opentelemetry::Context {
    struct Metadata<'a>(&'a tonic::metadata::MetadataMap);
    impl Extractor for Metadata<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0
                .keys()
                .filter_map(|k| match k {
                    tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                    tonic::metadata::KeyRef::Binary(_) => None,
                })
                .collect()
        }
    }
    TraceContextPropagator::new().extract(&Metadata(metadata))
}

/// The trace context carried in a message's headers.
pub fn extract_headers(headers: &HashMap<String, String>) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(headers)
}

/// Writes `cx` as `traceparent` (and `tracestate`) into message headers.
pub fn inject(cx: &opentelemetry::Context, headers: &mut HashMap<String, String>) {
    TraceContextPropagator::new().inject_context(cx, headers);
}
