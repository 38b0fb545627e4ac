//! What cluster mode needs of the NATS server it connects to, checked from
//! the server's INFO when the set-up starts: its version, and a
//! `max_payload` that carries the largest message the replica accepts
//! (docs/contract.md, "Cluster mode"). Pure functions of the INFO's
//! figures and the settings, so the rules are tested without a server.

use super::ENCODING_ALLOWANCE;

/// The oldest NATS server cluster mode runs on: the JetStream API
/// async-nats speaks (its `server_2_10` feature) is 2.10's, and an older
/// server's answers do not decode ("data did not match any variant of
/// untagged enum Response").
pub(super) const MIN_VERSION: (u64, u64) = (2, 10);

/// What a nacked message offered to another replica (`handover.rs`) adds
/// to its stored envelope on NATS at most: the header block naming the
/// group (at most 256 bytes), the JetStream reply subject (stream
/// `<prefix>_g_<16 hex>`, consumer, seven numbers: under 300 bytes) and
/// the attempt, with names and framing (under 700 bytes in all).
pub(super) const OFFER_ALLOWANCE: usize = 1024;

/// How many bytes a message's payload and headers may take so that it
/// still fits `max_payload` however it travels on NATS: in its envelope
/// ([`ENCODING_ALLOWANCE`]), and as an offer ([`OFFER_ALLOWANCE`]).
pub(super) fn carried_by(max_payload: usize) -> usize {
    max_payload.saturating_sub(ENCODING_ALLOWANCE + OFFER_ALLOWANCE)
}

/// Refuses a server older than [`MIN_VERSION`], in one line naming the
/// version found and the one needed; a version that does not parse is let
/// through (a development build), JetStream's own answers then tell.
pub(super) fn check_version(version: &str) -> Result<(), String> {
    let mut numbers = version
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .map(|part| part.parse::<u64>().ok());
    let (Some(Some(major)), Some(Some(minor))) = (numbers.next(), numbers.next()) else {
        return Ok(());
    };
    if (major, minor) >= MIN_VERSION {
        return Ok(());
    }
    let (need_major, need_minor) = MIN_VERSION;
    Err(format!(
        "the NATS server is version {version}; cluster mode needs NATS {need_major}.{need_minor} or later (JetStream's API as tinybroker speaks it): upgrade the NATS servers"
    ))
}

/// The message limit a replica enforces against a server with
/// `max_payload`: with `TINYBROKER_MAX_MESSAGE_BYTES` unset (`from_nats`),
/// the smaller of `configured` (the default) and what `max_payload`
/// carries ([`carried_by`]); set, `configured`, unless it is above
/// `max_payload`, which stops the replica (a line naming both).
pub(super) fn message_limit(configured: usize, from_nats: bool, max_payload: usize) -> Result<usize, String> {
    if from_nats {
        return Ok(configured.min(carried_by(max_payload)));
    }
    if configured > max_payload {
        return Err(format!(
            "TINYBROKER_MAX_MESSAGE_BYTES={configured} is above the NATS server's max_payload {max_payload}: lower it (or unset it, to take the largest message max_payload carries, {}), or raise max_payload on the NATS servers",
            carried_by(max_payload)
        ));
    }
    Ok(configured)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::validate::{MAX_HEADER_BYTES, MAX_HEADERS};
    use crate::ops::telemetry::{TRACESTATE, TRACESTATE_MAX_BYTES, TRACING_HEADERS_MAX_ENCODED, inject};
    use crate::pb;
    use prost::Message as _;
    use std::collections::HashMap;

    #[test]
    fn servers_before_2_10_are_refused_naming_both_versions() {
        for old in ["2.9.10", "2.2.0", "1.4.1", "v2.9.25"] {
            let error = check_version(old).unwrap_err();
            assert!(error.contains(old) && error.contains("2.10"), "{error}");
        }
        for new in ["2.10.0", "2.10.29", "2.11.0-RC.1", "2.12.1", "3.0.0", "", "dev"] {
            assert_eq!(check_version(new), Ok(()), "{new}");
        }
    }

    #[test]
    fn an_unset_limit_is_what_max_payload_carries_and_a_set_one_must_fit() {
        const MIB: usize = 1 << 20;
        // Default NATS, default tinybroker.
        let limit = message_limit(MIB, true, MIB).unwrap();
        assert_eq!(limit, MIB - ENCODING_ALLOWANCE - OFFER_ALLOWANCE);
        // A larger max_payload keeps the default.
        assert_eq!(message_limit(MIB, true, 8 * MIB), Ok(MIB));
        // Set: as set when it fits; above max_payload, both named.
        assert_eq!(message_limit(MIB, false, MIB), Ok(MIB));
        let error = message_limit(MIB + 1, false, MIB).unwrap_err();
        assert!(
            error.contains(&format!("TINYBROKER_MAX_MESSAGE_BYTES={}", MIB + 1)) && error.contains(&MIB.to_string()),
            "{error}"
        );
    }

    /// A remote span context whose trace state is `state`.
    fn context(state: &str) -> opentelemetry::Context {
        use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
        let span = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            state.parse::<TraceState>().unwrap(),
        );
        opentelemetry::Context::new().with_remote_span_context(span)
    }

    /// The envelope the cluster engine sends on NATS for a maximal valid
    /// message (256-byte topic, 64 headers of the longest framing, payload
    /// and headers at `max_message_bytes`), with the largest tracing
    /// headers the broker adds, fits `max_message_bytes` plus the cluster's
    /// allowance.
    #[test]
    fn the_largest_tracing_headers_fit_the_cluster_encoding_allowance() {
        let max_message_bytes = MAX_HEADERS * 2 * MAX_HEADER_BYTES;
        let mut headers: HashMap<String, String> = (0..MAX_HEADERS)
            .map(|i| {
                (
                    format!("{i:02}{}", "n".repeat(MAX_HEADER_BYTES - 2)),
                    "v".repeat(MAX_HEADER_BYTES),
                )
            })
            .collect();
        let message = |headers: HashMap<String, String>| pb::Message {
            topic: "t".repeat(256),
            payload: Default::default(),
            headers,
            publish_time: Some(prost_types::Timestamp {
                seconds: i64::from(u32::MAX) * 8,
                nanos: 999_999_999,
            }),
            sequence: u64::MAX,
            ..Default::default()
        };
        // The sender and count ahead of it on core NATS (cluster/wire.rs).
        const COUNT_PREFIX: usize = 2 + 10 + 2 + 8;
        let untraced = message(headers.clone()).encoded_len() + COUNT_PREFIX;
        assert!(untraced <= max_message_bytes + 1024, "{}", untraced - max_message_bytes);
        let state: String = (0..32)
            .map(|i| format!("v{i:02}={}", "s".repeat(60)))
            .collect::<Vec<_>>()
            .join(",");
        let added = inject(&context(&state), &mut headers);
        assert_eq!((added.traceparent, added.tracestate), (true, true));
        assert!(
            headers[TRACESTATE].len() > TRACESTATE_MAX_BYTES - 64,
            "{}",
            headers[TRACESTATE].len()
        );
        let traced = message(headers).encoded_len() + COUNT_PREFIX;
        assert!(
            traced - untraced <= TRACING_HEADERS_MAX_ENCODED,
            "{}",
            traced - untraced
        );
        assert!(
            traced <= max_message_bytes + ENCODING_ALLOWANCE,
            "{} bytes over max_message_bytes",
            traced - max_message_bytes
        );
    }
}
