//! Pre-encoded `tinybroker.v1.Message`s for subscription streams. Protobuf
//! parses concatenated encodings as one message, so a delivery is written
//! as three pieces: the part every subscriber shares (topic, payload,
//! headers, sequence, publish time), encoded once per published message;
//! the subscription's own fields (id, group), encoded once per
//! subscription; and the delivery attempt. A fan-out to N subscribers thus
//! encodes the message once instead of N times and allocates nothing per
//! delivery.

use crate::broker::Published;
use crate::pb;
use bytes::{BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType};

/// Field number of `Message.delivery_attempt` in `broker.proto`.
const DELIVERY_ATTEMPT_FIELD: u32 = 8;

/// One delivery on the wire, byte for byte a `tinybroker.v1.Message`. The
/// server only sends it: the generated server code refers to it in place of
/// `pb::Message` (see `build.rs`); clients decode [`pb::Message`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EncodedMessage {
    shared: Bytes,
    subscriber: Bytes,
    delivery_attempt: u32,
}

impl EncodedMessage {
    pub fn new(message: &Published, subscriber: &SubscriberFields, delivery_attempt: u32) -> Self {
        let shared = message.encoded.get_or_init(|| shared_part(message)).clone();
        Self {
            shared,
            subscriber: subscriber.0.clone(),
            delivery_attempt,
        }
    }
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

/// Fields 1 to 5 of `Message`, encoded as prost would encode them, straight
/// from the published message (no copy of its topic or headers first).
fn shared_part(message: &Published) -> Bytes {
    use prost::encoding::{bytes, hash_map, message as nested, string, uint64};
    let publish_time = prost_types::Timestamp::from(message.publish_time);
    let len = string::encoded_len(1, &message.topic)
        + bytes::encoded_len(2, &message.payload)
        + hash_map::encoded_len(string::encoded_len, string::encoded_len, 3, &message.headers)
        + uint64::encoded_len(4, &message.sequence)
        + nested::encoded_len(5, &publish_time);
    let mut buf = Vec::with_capacity(len);
    if !message.topic.is_empty() {
        string::encode(1, &message.topic, &mut buf);
    }
    if !message.payload.is_empty() {
        bytes::encode(2, &message.payload, &mut buf);
    }
    hash_map::encode(
        string::encode,
        string::encoded_len,
        string::encode,
        string::encoded_len,
        3,
        &message.headers,
        &mut buf,
    );
    if message.sequence != 0 {
        uint64::encode(4, &message.sequence, &mut buf);
    }
    nested::encode(5, &publish_time, &mut buf);
    Bytes::from(buf)
}

impl prost::Message for EncodedMessage {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.shared);
        buf.put_slice(&self.subscriber);
        if self.delivery_attempt != 0 {
            prost::encoding::uint32::encode(DELIVERY_ATTEMPT_FIELD, &self.delivery_attempt, buf);
        }
    }

    fn encoded_len(&self) -> usize {
        let attempt = if self.delivery_attempt != 0 {
            prost::encoding::uint32::encoded_len(DELIVERY_ATTEMPT_FIELD, &self.delivery_attempt)
        } else {
            0
        };
        self.shared.len() + self.subscriber.len() + attempt
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

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;
    use std::collections::HashMap;

    #[test]
    fn decodes_as_the_message_it_stands_for() {
        let mut published = Published::for_test("deploy.rollout", 42);
        published.payload = Bytes::from_static(b"v42 is out");
        published.headers = HashMap::from([("team".to_string(), "web".to_string())]);
        let fields = SubscriberFields::new("sub-1", "workers");
        let encoded = EncodedMessage::new(&published, &fields, 3);
        let bytes = encoded.encode_to_vec();
        assert_eq!(bytes.len(), encoded.encoded_len());
        let decoded = pb::Message::decode(bytes.as_slice()).unwrap();
        let expected = pb::Message {
            topic: "deploy.rollout".into(),
            payload: Bytes::from_static(b"v42 is out"),
            headers: published.headers.clone(),
            sequence: 42,
            publish_time: Some(prost_types::Timestamp::from(published.publish_time)),
            subscription_id: "sub-1".into(),
            consumer_group: "workers".into(),
            delivery_attempt: 3,
        };
        assert_eq!(decoded, expected);
        assert_eq!(
            bytes,
            expected.encode_to_vec(),
            "the same bytes as prost's own encoding"
        );

        // The shared part is made once and reused by the next subscriber.
        let other = EncodedMessage::new(&published, &SubscriberFields::new("sub-2", ""), 1);
        assert_eq!(other.shared.as_ptr(), encoded.shared.as_ptr());
        let decoded = pb::Message::decode(other.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            (decoded.subscription_id.as_str(), decoded.consumer_group.as_str()),
            ("sub-2", "")
        );
        assert!(EncodedMessage::decode(bytes.as_slice()).is_err(), "send-only");
    }
}
