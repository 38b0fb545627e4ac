//! A delivery as the bytes of a gRPC frame, for both subscription bodies
//! ([`super::subscription_body`], [`super::session_body`]): the frame
//! header (`GRPC_HEADER`), the encode buffer's growth (`reserve_frame`,
//! `FRAME_THRESHOLD`), the `deliver` span each delivery gets (and the
//! `publish` span of each published message), and the
//! `Message` itself ([`EncodedMessage`]).
//!
//! A delivery is encoded straight from the published message. Protobuf
//! parses concatenated encodings as one message, so a delivery is written
//! as three pieces: the published message's fields (topic, payload,
//! headers, sequence, publish time), read from the one `Arc<Published>`
//! every subscriber shares; the subscription's own fields (id, group),
//! encoded once per subscription; and the delivery attempt. Nothing is
//! allocated or copied per delivery before the subscription's encode buffer
//! (`grpc::SubscriptionBody`): the payload is copied once, into that buffer.
//!
//! (An earlier version encoded the shared fields once per published message
//! into their own buffer and copied that into each subscriber's. The extra
//! allocation and copy cost more than the few varints it saved, and a
//! consumer group, with one receiver per message, gained nothing from it;
//! see BENCHMARKS.md.)

use crate::engine::Published;
use crate::engine::TracingHeaders;
use crate::ops::telemetry;
use crate::ops::telemetry::TRACEPARENT;
use crate::pb;
use crate::pb::codec::ENCODE_CHUNK;
use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{DecodeContext, WireType};
use std::sync::Arc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Field number of `Message.delivery_attempt` in `broker.proto`.
const DELIVERY_ATTEMPT_FIELD: u32 = 8;
/// Keys (field number and wire type, one byte each) of `Message.publish_time`
/// (field 5, length-delimited) and of its `google.protobuf.Timestamp`'s
/// `seconds` (field 1, varint) and `nanos` (field 2, varint).
const PUBLISH_TIME_KEY: u8 = (5 << 3) | 2;
const SECONDS_KEY: u8 = 1 << 3;
const NANOS_KEY: u8 = 2 << 3;

/// One delivery on the wire, byte for byte a `tinybroker.v1.Message`. The
/// server only sends it (`grpc::SubscriptionBody` encodes it); clients
/// decode [`pb::Message`].
#[derive(Debug, Clone, Default)]
pub struct EncodedMessage {
    /// `None` only for `Default` (which prost requires): an empty message.
    message: Option<Arc<Published>>,
    /// `publish_time` as protobuf has it, converted once per delivery.
    publish_time: prost_types::Timestamp,
    subscriber: Bytes,
    delivery_attempt: u32,
}

impl EncodedMessage {
    /// `#[inline]`: built once per delivery by the subscription stream;
    /// without it this was a call of its own that returned the struct
    /// through memory (BENCHMARKS.md, "Refactor to an engine seam").
    #[inline]
    pub fn new(message: Arc<Published>, subscriber: &SubscriberFields, delivery_attempt: u32) -> Self {
        Self {
            publish_time: prost_types::Timestamp::from(message.publish_time),
            message: Some(message),
            subscriber: subscriber.0.clone(),
            delivery_attempt,
        }
    }

    /// Encoded length of fields 1 to 5.
    #[inline]
    fn published_len(&self) -> usize {
        use prost::encoding::{bytes, encoded_len_varint, hash_map, string, uint64};
        let Some(m) = &self.message else { return 0 };
        let headers = if m.headers.is_empty() {
            0
        } else {
            hash_map::encoded_len(string::encoded_len, string::encoded_len, 3, &m.headers)
        };
        let topic = if m.topic.is_empty() {
            0
        } else {
            string::encoded_len(1, &m.topic)
        };
        let payload = if m.payload.is_empty() {
            0
        } else {
            bytes::encoded_len(2, &m.payload)
        };
        let sequence = if m.sequence != 0 {
            uint64::encoded_len(4, &m.sequence)
        } else {
            0
        };
        let publish_time = timestamp_len(&self.publish_time);
        topic + payload + headers + sequence + 1 + encoded_len_varint(publish_time as u64) + publish_time
    }
}

/// Encoded length of a Timestamp's fields (`seconds`, `nanos`; 0 is not
/// written), as `prost_types::Timestamp::encoded_len` gives it.
#[inline]
fn timestamp_len(t: &prost_types::Timestamp) -> usize {
    use prost::encoding::encoded_len_varint;
    let seconds = if t.seconds != 0 {
        1 + encoded_len_varint(t.seconds as u64)
    } else {
        0
    };
    let nanos = if t.nanos != 0 {
        1 + encoded_len_varint(t.nanos as u64)
    } else {
        0
    };
    seconds + nanos
}

/// The encoded fields of a delivery that depend only on the subscription.
#[derive(Debug, Clone)]
pub struct SubscriberFields(Bytes);

impl SubscriberFields {
    pub fn new(subscription_id: &str, consumer_group: &str) -> Self {
        let fields = pb::Message {
            subscription_id: subscription_id.to_owned(),
            consumer_group: consumer_group.to_owned(),
            ..Default::default()
        };
        Self(prost::Message::encode_to_vec(&fields).into())
    }
}

impl prost::Message for EncodedMessage {
    /// Fields 1 to 5 as prost encodes them (the same order, the same
    /// defaults skipped), then the subscription's fields and the attempt.
    /// This and `encoded_len` are `#[inline]`: both run once per delivery,
    /// and as calls of their own they returned through memory
    /// (BENCHMARKS.md, "Refactor to an engine seam").
    #[inline]
    fn encode_raw(&self, buf: &mut impl BufMut) {
        use prost::encoding::{bytes, encode_varint, hash_map, string, uint64};
        if let Some(m) = &self.message {
            if !m.topic.is_empty() {
                string::encode(1, &m.topic, buf);
            }
            if !m.payload.is_empty() {
                bytes::encode(2, &m.payload, buf);
            }
            // prost writes nothing for an empty map either, but walking even
            // an empty HashMap costs more than this check, per delivery.
            if !m.headers.is_empty() {
                hash_map::encode(
                    string::encode,
                    string::encoded_len,
                    string::encode,
                    string::encoded_len,
                    3,
                    &m.headers,
                    buf,
                );
            }
            if m.sequence != 0 {
                uint64::encode(4, &m.sequence, buf);
            }
            // What prost's nested-message encoder writes for a Timestamp
            // (key, length, the fields that are not 0), by hand: through it,
            // the length is computed twice and the Timestamp's own encoder
            // is one more call per delivery.
            let t = &self.publish_time;
            buf.put_u8(PUBLISH_TIME_KEY);
            encode_varint(timestamp_len(t) as u64, buf);
            if t.seconds != 0 {
                buf.put_u8(SECONDS_KEY);
                encode_varint(t.seconds as u64, buf);
            }
            if t.nanos != 0 {
                buf.put_u8(NANOS_KEY);
                // An int32 is sign-extended, as prost does.
                encode_varint(t.nanos as u64, buf);
            }
        }
        buf.put_slice(&self.subscriber);
        if self.delivery_attempt != 0 {
            prost::encoding::uint32::encode(DELIVERY_ATTEMPT_FIELD, &self.delivery_attempt, buf);
        }
    }

    #[inline]
    fn encoded_len(&self) -> usize {
        let attempt = if self.delivery_attempt != 0 {
            prost::encoding::uint32::encoded_len(DELIVERY_ATTEMPT_FIELD, &self.delivery_attempt)
        } else {
            0
        };
        self.published_len() + self.subscriber.len() + attempt
    }

    /// Never called by the server, which only sends these; decoding one is
    /// refused rather than half-done (decode a `pb::Message` instead).
    fn merge_field(
        &mut self,
        _tag: u32,
        _wire_type: WireType,
        _buf: &mut impl bytes::Buf,
        _ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // prost has no other way to make a decode error of our own words.
        #[allow(deprecated)]
        Err(prost::DecodeError::new(
            "EncodedMessage is send-only; decode tinybroker.v1.Message into pb::Message",
        ))
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// How much a subscription's body encodes before it hands the frame to h2,
/// when more deliveries are ready (tonic's own threshold).
pub(crate) const FRAME_THRESHOLD: usize = 32 * 1024;

/// Makes room for `framed` more bytes in a body's encode buffer.
#[inline]
pub(crate) fn reserve_frame(buf: &mut BytesMut, framed: usize) {
    if buf.is_empty() && buf.capacity() < ENCODE_CHUNK {
        // Everything encoded so far was handed out. Once h2 has written it
        // and dropped it, the chunk is this buffer's alone again: encode
        // from its start rather than into the next bytes of it, so that a
        // stream woken for one message at a time writes the same few cache
        // lines each time instead of 8 KiB of them, cold. (Not yet, when h2
        // still holds some of it: then go on after it.)
        let _ = buf.try_reclaim(ENCODE_CHUNK);
    }
    if buf.capacity() - buf.len() < framed {
        // A chunk at a time, so a busy stream encodes many deliveries per
        // allocation; what is handed out shares it.
        buf.reserve(framed.max(ENCODE_CHUNK));
    }
}

/// The `deliver` span of one delivery, a child of the publisher's trace
/// (tracing on only).
pub(crate) fn deliver_span(m: &Published, group: &str, subscription_id: &str, attempt: u32) {
    let span = tracing::info_span!(
        "deliver",
        otel.kind = "consumer",
        messaging.system = "tinybroker",
        messaging.operation.type = "deliver",
        messaging.destination.name = %m.topic,
        messaging.message.id = m.sequence,
        messaging.consumer.group.name = %group,
        subscription_id = %subscription_id,
        delivery_attempt = attempt,
    );
    let _ = span.set_parent(telemetry::extract_headers(&m.headers));
}

/// The length of gRPC's message header: the compressed flag and 4 bytes of
/// length.
pub(crate) const GRPC_HEADER: usize = 5;

/// A `publish` span whose parent is the caller's `traceparent`; its own
/// context goes into the message's headers, unless the publisher set one
/// ([`telemetry::inject`]: which headers it added, counted against no
/// limit).
pub(crate) fn publish_span(
    request: &mut pb::PublishRequest,
    parent: &opentelemetry::Context,
) -> (tracing::Span, TracingHeaders) {
    let span = tracing::info_span!(
        "publish",
        otel.kind = "producer",
        messaging.system = "tinybroker",
        messaging.operation.type = "publish",
        messaging.destination.name = %request.topic,
        messaging.message.id = tracing::field::Empty,
    );
    let _ = span.set_parent(parent.clone());
    let tracing = match request.headers.contains_key(TRACEPARENT) {
        true => TracingHeaders::default(),
        false => telemetry::inject(&span.context(), &mut request.headers),
    };
    (span, tracing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;
    use std::collections::HashMap;
    use std::time::{Duration, SystemTime};

    /// What prost itself encodes for `published` delivered to `fields`.
    fn expected(published: &Published, id: &str, group: &str, attempt: u32) -> pb::Message {
        pb::Message {
            topic: published.topic.clone(),
            payload: published.payload.clone(),
            headers: published.headers.clone(),
            sequence: published.sequence,
            publish_time: Some(prost_types::Timestamp::from(published.publish_time)),
            subscription_id: id.into(),
            consumer_group: group.into(),
            delivery_attempt: attempt,
        }
    }

    #[test]
    fn encodes_the_bytes_prost_encodes() {
        let mut full = Published::for_test("deploy.rollout", 42);
        full.payload = Bytes::from_static(b"v42 is out");
        full.headers = HashMap::from([
            ("team".to_string(), "web".to_string()),
            ("traceparent".to_string(), "00-abc-def-01".to_string()),
        ]);
        let mut bare = Published::for_test("a", 0);
        bare.publish_time = SystemTime::UNIX_EPOCH - Duration::from_millis(1500);
        let mut big = Published::for_test("metrics.cpu.host-1", u64::MAX);
        big.payload = Bytes::from(vec![7u8; 70_000]);
        // publish_time's seconds and nanos each 0 or not, before and after 1970.
        let mut epoch = Published::for_test("t", 1);
        epoch.publish_time = SystemTime::UNIX_EPOCH;
        let mut whole = Published::for_test("t", 2);
        whole.publish_time = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut before_whole = Published::for_test("t", 3);
        before_whole.publish_time = SystemTime::UNIX_EPOCH - Duration::from_secs(3);
        let mut nanos_only = Published::for_test("t", 4);
        nanos_only.publish_time = SystemTime::UNIX_EPOCH + Duration::from_nanos(999_999_999);
        for published in [full, bare, big, epoch, whole, before_whole, nanos_only] {
            let published = Arc::new(published);
            for (id, group, attempt) in [("sub-1", "workers", 3), ("s", "", 1), ("", "", 0)] {
                let encoded = EncodedMessage::new(published.clone(), &SubscriberFields::new(id, group), attempt);
                let bytes = encoded.encode_to_vec();
                assert_eq!(bytes.len(), encoded.encoded_len());
                let want = expected(&published, id, group, attempt);
                if published.headers.len() < 2 {
                    // A map of several entries may come out in any order.
                    assert_eq!(bytes, want.encode_to_vec(), "the same bytes as prost's own encoding");
                }
                assert_eq!(pb::Message::decode(bytes.as_slice()).unwrap(), want);
            }
        }
    }

    #[test]
    fn deliveries_share_the_published_message() {
        let published = Arc::new(Published::for_test("deploy.rollout", 7));
        let a = EncodedMessage::new(published.clone(), &SubscriberFields::new("a", ""), 1);
        let b = EncodedMessage::new(published.clone(), &SubscriberFields::new("b", ""), 1);
        assert_eq!(Arc::strong_count(&published), 3, "no copy per delivery");
        drop((a, b));
        assert_eq!(Arc::strong_count(&published), 1);
    }

    #[test]
    fn is_send_only() {
        let published = Arc::new(Published::for_test("deploy.rollout", 7));
        let bytes = EncodedMessage::new(published, &SubscriberFields::new("a", ""), 1).encode_to_vec();
        assert!(EncodedMessage::decode(bytes.as_slice()).is_err(), "send-only");
        assert!(EncodedMessage::default().encode_to_vec().is_empty());
    }
}
