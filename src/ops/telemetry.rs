//! Logs and traces. Logs: `tracing` with `RUST_LOG` (default `info`) and
//! `TINYBROKER_LOG_FORMAT=text|json`, to stderr. Traces: with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` set, publish and delivery spans are exported
//! over OTLP/gRPC (standard `OTEL_*` variables); without it no OpenTelemetry
//! layer is installed and the span code paths are skipped entirely.

use crate::config::{ConfigError, LogFormat};
use crate::engine::TracingHeaders;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

pub use crate::engine::{TRACEPARENT, TRACESTATE, TRACESTATE_MAX_BYTES, TRACING_HEADERS_MAX_ENCODED};

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

/// Writes `cx` (the publish span's context) into a message's headers,
/// keeping what the publisher set: `traceparent` unless it set one (then
/// nothing, not even a `tracestate` that would not belong to its
/// `traceparent`), and `tracestate` only when it set none and the trace
/// carries state. Says which it added: they count against no limit
/// ([`crate::engine::validate::message`]).
pub fn inject(cx: &opentelemetry::Context, headers: &mut HashMap<String, String>) -> TracingHeaders {
    /// What the propagator writes, in its own format.
    #[derive(Default)]
    struct Written {
        traceparent: Option<String>,
        tracestate: Option<String>,
    }
    impl Injector for Written {
        fn set(&mut self, key: &str, value: String) {
            match key {
                TRACEPARENT => self.traceparent = Some(value),
                TRACESTATE => self.tracestate = Some(value),
                _ => {}
            }
        }
    }
    let mut added = TracingHeaders::default();
    if headers.contains_key(TRACEPARENT) {
        return added;
    }
    let mut written = Written::default();
    TraceContextPropagator::new().inject_context(cx, &mut written);
    let Some(traceparent) = written.traceparent else {
        return added;
    };
    headers.insert(TRACEPARENT.to_owned(), traceparent);
    added.traceparent = true;
    if let Some(state) = written.tracestate
        && !headers.contains_key(TRACESTATE)
    {
        let state = bounded_tracestate(state);
        if !state.is_empty() {
            headers.insert(TRACESTATE.to_owned(), state);
            added.tracestate = true;
        }
    }
    added
}

/// A `tracestate` of at most [`TRACESTATE_MAX_BYTES`], truncated as W3C
/// Trace Context says: entries longer than 128 bytes go first, then
/// entries from the end.
fn bounded_tracestate(state: String) -> String {
    if state.len() <= TRACESTATE_MAX_BYTES {
        return state;
    }
    let mut entries: Vec<&str> = state.split(',').filter(|e| e.trim().len() <= 128).collect();
    let length = |entries: &[&str]| entries.iter().map(|e| e.len()).sum::<usize>() + entries.len().saturating_sub(1);
    while length(&entries) > TRACESTATE_MAX_BYTES {
        entries.pop();
    }
    entries.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN_ID: &str = "00f067aa0ba902b7";

    fn context(state: &str) -> opentelemetry::Context {
        let span = SpanContext::new(
            TraceId::from_hex(TRACE_ID).unwrap(),
            SpanId::from_hex(SPAN_ID).unwrap(),
            TraceFlags::SAMPLED,
            true,
            state.parse::<TraceState>().unwrap(),
        );
        opentelemetry::Context::new().with_remote_span_context(span)
    }

    fn headers(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn inject_adds_what_the_publisher_did_not_set_and_says_so() {
        let traceparent = format!("00-{TRACE_ID}-{SPAN_ID}-01");
        // Nothing set: traceparent, and tracestate when the trace has state
        // (never an empty one).
        let mut h = headers(&[("k", "v")]);
        let added = inject(&context(""), &mut h);
        assert_eq!(h, headers(&[("k", "v"), (TRACEPARENT, &traceparent)]));
        assert_eq!((added.traceparent, added.tracestate), (true, false));
        let mut h = HashMap::new();
        let added = inject(&context("vendor=abc"), &mut h);
        assert_eq!(h, headers(&[(TRACEPARENT, &traceparent), (TRACESTATE, "vendor=abc")]));
        assert_eq!((added.traceparent, added.tracestate), (true, true));
        // The publisher's traceparent: nothing added, not even a
        // tracestate of another trace.
        let own = headers(&[(TRACEPARENT, "00-11111111111111111111111111111111-2222222222222222-00")]);
        let mut h = own.clone();
        assert_eq!(inject(&context("vendor=abc"), &mut h), TracingHeaders::default());
        assert_eq!(h, own);
        // The publisher's tracestate alone: kept as sent (even one the
        // W3C grammar would refuse), traceparent added.
        let mut h = headers(&[(TRACESTATE, " Not, a=valid tracestate ")]);
        let added = inject(&context("vendor=abc"), &mut h);
        assert_eq!(
            h,
            headers(&[(TRACESTATE, " Not, a=valid tracestate "), (TRACEPARENT, &traceparent)])
        );
        assert_eq!((added.traceparent, added.tracestate), (true, false));
        // No valid context (tracing off for this span): nothing.
        let mut h = HashMap::new();
        assert_eq!(
            inject(&opentelemetry::Context::new(), &mut h),
            TracingHeaders::default()
        );
        assert!(h.is_empty());
    }

    #[test]
    fn a_long_tracestate_is_truncated_as_w3c_says() {
        let long = format!("big={}", "x".repeat(200));
        let small: Vec<String> = (0..40).map(|i| format!("k{i:02}=vvvvvvvv")).collect();
        let state = format!("{},{long},{}", small[..20].join(","), small[20..].join(","));
        assert!(state.len() > TRACESTATE_MAX_BYTES);
        let bounded = bounded_tracestate(state);
        assert!(bounded.len() <= TRACESTATE_MAX_BYTES, "{}", bounded.len());
        // The long entry went first, then entries from the end.
        let kept: Vec<&str> = bounded.split(',').collect();
        assert_eq!(kept, small[..kept.len()].iter().map(String::as_str).collect::<Vec<_>>());
        assert!(kept.len() > 30, "{kept:?}");
        assert_eq!(bounded_tracestate("a=1,b=2".into()), "a=1,b=2");
    }
}
