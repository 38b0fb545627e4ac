//! Every proto ↔ engine conversion of the gRPC front, written once: a
//! request into the engine's (`subscribe_request`, its modes), an engine
//! record into the proto's (the Admin listings), a [`BrokerError`] into the
//! status docs/contract.md (Errors) gives for it ([`status`]), and tonic's
//! own decoding failures into the statuses the contract promises
//! (`request_stream_error`, [`map_oversized_response`]).

use crate::engine::{AckMode, BrokerError, DeliveryMode, NewMessage, SubscribeRequest, TracingHeaders};
use crate::pb;
use tonic::codegen::http;
use tonic::{Code, Status};

/// Maps a core error to the status code docs/contract.md (Errors) gives for it.
/// The message of a publish request; `tracing`: the headers its `publish`
/// span added (none without tracing).
pub fn new_message(request: pb::PublishRequest, tracing: TracingHeaders) -> NewMessage {
    NewMessage {
        topic: request.topic,
        payload: request.payload,
        headers: request.headers,
        tracing,
    }
}

pub fn status(error: BrokerError) -> Status {
    let code = match &error {
        BrokerError::InvalidArgument(_) => Code::InvalidArgument,
        BrokerError::FailedPrecondition(_) => Code::FailedPrecondition,
        BrokerError::AlreadyExists(_) => Code::AlreadyExists,
        BrokerError::NotFound(_) => Code::NotFound,
        BrokerError::ResourceExhausted(_) => Code::ResourceExhausted,
        BrokerError::Unavailable(_) => Code::Unavailable,
    };
    Status::new(code, error.to_string())
}

/// Largest encoded `PublishRequest` that can still hold a valid message:
/// payload and headers within `max_message_bytes`, plus the topic and the
/// protobuf framing of up to the maximal number of headers.
pub fn decoding_limit(max_message_bytes: usize) -> usize {
    max_message_bytes.saturating_add(64 * 1024)
}

/// The engine's request for an `OpenSubscriptionRequest` (an
/// `OpenSubscription` call's, or a session's `open`).
pub(crate) fn subscribe_request(
    request: pb::OpenSubscriptionRequest,
    peer: Option<std::net::SocketAddr>,
) -> Result<SubscribeRequest, Status> {
    Ok(SubscribeRequest {
        mode: delivery_mode(request.mode)?,
        ack_mode: ack_mode(request.ack_mode)?,
        topic_patterns: request.topic_patterns,
        subscription_id: request.subscription_id,
        consumer_group: request.consumer_group,
        max_in_flight: request.max_in_flight,
        ack_deadline_ms: request.ack_deadline_ms,
        peer,
        credit: None,
    })
}

/// The inverse of [`decoding_limit`]: the `max_message_bytes` a decoding
/// limit was made from.
fn max_message_bytes_of(decoding_limit: usize) -> usize {
    decoding_limit.saturating_sub(64 * 1024)
}

/// The RESOURCE_EXHAUSTED text for a request tonic refused as over the
/// decoding limit, from tonic's own text ("... found N bytes, the limit is:
/// L bytes"): it names the request's size and `max_message_bytes`, not
/// the decoding limit the operator never set. Falls back to tonic's text
/// when it has another shape.
fn oversized_message(tonic_message: &str) -> String {
    let number_after = |label: &str| -> Option<usize> {
        let rest = &tonic_message[tonic_message.find(label)? + label.len()..];
        rest.trim_start().split(' ').next()?.parse().ok()
    };
    match (number_after("found"), number_after("the limit is:")) {
        (Some(found), Some(limit)) => format!(
            "request of {found} bytes is larger than max_message_bytes {} (TINYBROKER_MAX_MESSAGE_BYTES) allows",
            max_message_bytes_of(limit)
        ),
        _ => format!("message larger than max_message_bytes (TINYBROKER_MAX_MESSAGE_BYTES): {tonic_message}"),
    }
}

/// What a failed read of a request stream (`PublishStream`, `Session`)
/// means for the client, named by the message the stream carries
/// (`tinybroker.v1.SessionRequest`).
///
/// tonic reports bytes that are not a gRPC message of that type as INTERNAL
/// (a stream that ends in the middle of a message, a compressed flag other
/// than 0, or 1 with no `grpc-encoding`, bytes that are not its protobuf
/// encoding): the client sent them, so they are INVALID_ARGUMENT, saying
/// what was wrong. A message over the decoding limit is RESOURCE_EXHAUSTED
/// ([`oversized_to_exhausted`]). Anything else (the client reset the
/// stream) is passed on as it is; the client no longer reads it.
pub(crate) fn request_stream_error(error: Status, message: &str) -> Status {
    if error.code() != Code::Internal {
        return oversized_to_exhausted(error);
    }
    let text = error.message();
    let what = if text.starts_with("Unexpected EOF decoding stream") {
        "the stream ended in the middle of a gRPC message (its length prefix announced more bytes than came)"
    } else if text.starts_with("protocol error: received message with compressed-flag but no grpc-encoding") {
        "a gRPC message has its compressed flag set (1) but the request names no grpc-encoding (none is accepted)"
    } else if text.starts_with("protocol error: received message with invalid compression flag") {
        "a gRPC message's compressed flag is neither 0 nor 1"
    } else if text.starts_with("failed to decode Protobuf message") {
        "a gRPC message is not a valid protobuf encoding of it"
    } else if text.starts_with("Error decompressing") {
        "a gRPC message cannot be decompressed"
    } else {
        return error;
    };
    Status::invalid_argument(format!(
        "the request stream cannot be decoded as {message}: {what} ({text})"
    ))
}

/// tonic reports a request over the decoding limit as OUT_OF_RANGE; the
/// contract says an oversized message is RESOURCE_EXHAUSTED.
pub(crate) fn oversized_to_exhausted(error: Status) -> Status {
    if error.code() == Code::OutOfRange && error.message().contains("message length too large") {
        return Status::resource_exhausted(oversized_message(error.message()));
    }
    error
}

/// Rewrites the trailers-only OUT_OF_RANGE response tonic sends for a unary
/// request over the decoding limit into RESOURCE_EXHAUSTED (see
/// [`oversized_to_exhausted`]); used as a tower `map_response` layer.
pub fn map_oversized_response<B>(mut response: http::Response<B>) -> http::Response<B> {
    // Cheap for every other response: only an OUT_OF_RANGE one is read.
    if response.headers().get("grpc-status").is_none_or(|s| s != "11") {
        return response;
    }
    if let Some(status) = Status::from_header_map(response.headers()) {
        let mapped = oversized_to_exhausted(status);
        if mapped.code() == Code::ResourceExhausted {
            // tonic percent-encodes grpc-message.
            let _ = mapped.add_header(response.headers_mut());
        }
    }
    response
}

// === proto ↔ engine conversions, each written once ===

fn delivery_mode(raw: i32) -> Result<DeliveryMode, Status> {
    match pb::DeliveryMode::try_from(raw) {
        Ok(pb::DeliveryMode::Unspecified | pb::DeliveryMode::Multi) => Ok(DeliveryMode::Multi),
        Ok(pb::DeliveryMode::Single) => Ok(DeliveryMode::Single),
        Err(_) => Err(Status::invalid_argument(format!(
            "mode {raw} is not a DeliveryMode (0 UNSPECIFIED, 1 MULTI, 2 SINGLE)"
        ))),
    }
}

fn ack_mode(raw: i32) -> Result<AckMode, Status> {
    match pb::AckMode::try_from(raw) {
        Ok(pb::AckMode::Unspecified | pb::AckMode::Auto) => Ok(AckMode::Auto),
        Ok(pb::AckMode::Manual) => Ok(AckMode::Manual),
        Err(_) => Err(Status::invalid_argument(format!(
            "ack_mode {raw} is not an AckMode (0 UNSPECIFIED, 1 AUTO, 2 MANUAL)"
        ))),
    }
}

impl From<DeliveryMode> for pb::DeliveryMode {
    fn from(mode: DeliveryMode) -> Self {
        match mode {
            DeliveryMode::Multi => pb::DeliveryMode::Multi,
            DeliveryMode::Single => pb::DeliveryMode::Single,
        }
    }
}

impl From<Option<AckMode>> for pb::AckMode {
    /// None (a broadcast subscription) is UNSPECIFIED.
    fn from(mode: Option<AckMode>) -> Self {
        match mode {
            None => pb::AckMode::Unspecified,
            Some(AckMode::Auto) => pb::AckMode::Auto,
            Some(AckMode::Manual) => pb::AckMode::Manual,
        }
    }
}

/// A peer address in a proto record: empty when unknown.
fn peer_address(peer: Option<std::net::SocketAddr>) -> String {
    peer.map(|p| p.to_string()).unwrap_or_default()
}

impl From<crate::engine::SubscriptionInfo> for pb::SubscriptionInfo {
    fn from(info: crate::engine::SubscriptionInfo) -> Self {
        pb::SubscriptionInfo {
            subscription_id: info.subscription_id,
            mode: pb::DeliveryMode::from(info.mode) as i32,
            consumer_group: info.consumer_group,
            topic_patterns: info.topic_patterns,
            queue_depth: info.queue_depth as u64,
            capacity: info.capacity as u64,
            delivered: info.delivered,
            opened_at: Some(info.opened_at.into()),
            peer_address: peer_address(info.peer),
            ack_mode: pb::AckMode::from(info.ack_mode) as i32,
            replica_id: info.replica_id,
            unacked: info.unacked,
            oldest_unacked_age: info.oldest_unacked_age.map(duration_to_pb),
        }
    }
}

fn duration_to_pb(age: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: age.as_secs() as i64,
        nanos: age.subsec_nanos() as i32,
    }
}

impl From<crate::engine::GroupInfo> for pb::ConsumerGroupInfo {
    fn from(group: crate::engine::GroupInfo) -> Self {
        pb::ConsumerGroupInfo {
            name: group.name,
            topic_patterns: group.topic_patterns,
            members: group.members as u32,
            backlog: group.backlog as u64,
            in_flight: group.in_flight as u64,
            redeliveries: group.redeliveries,
            dead_lettered: group.dead_lettered,
            dropped: group.dropped,
            oldest_unacked_age: group.oldest_unacked_age.map(duration_to_pb),
        }
    }
}

impl From<crate::engine::EvictionRecord> for pb::EvictionInfo {
    fn from(e: crate::engine::EvictionRecord) -> Self {
        pb::EvictionInfo {
            subscription_id: e.subscription_id,
            evicted_at: Some(e.evicted_at.into()),
            topic_patterns: e.topic_patterns,
            queue_depth: e.queue_depth as u64,
            last_delivered_sequence: e.last_delivered_sequence,
            peer_address: peer_address(e.peer),
            replica_id: e.replica_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2 MB publish is refused naming its size and the configured limit,
    /// not the decoding limit (max_message_bytes + 64 KiB) nobody set.
    #[test]
    fn an_oversized_request_names_its_size_and_max_message_bytes() {
        let tonic = format!(
            "Error, decoded message length too large: found 2000010 bytes, the limit is: {} bytes",
            decoding_limit(1_048_576)
        );
        let status = oversized_to_exhausted(Status::out_of_range(tonic.clone()));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "request of 2000010 bytes is larger than max_message_bytes 1048576 (TINYBROKER_MAX_MESSAGE_BYTES) allows"
        );
        // The unary path: tonic's trailers-only response, percent-encoded.
        let mut response = http::Response::new(());
        Status::out_of_range(tonic).add_header(response.headers_mut()).unwrap();
        let response = map_oversized_response(response);
        assert_eq!(response.headers()["grpc-status"], "8");
        let read = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(read.message(), status.message());
        // Any other response passes as it was.
        let mut other = http::Response::new(());
        Status::out_of_range("sequence out of range")
            .add_header(other.headers_mut())
            .unwrap();
        assert_eq!(map_oversized_response(other).headers()["grpc-status"], "11");
    }
}
