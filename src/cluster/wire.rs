//! The wire formats between replicas: what each is, where it is declared,
//! and how two versions of the broker read each other's during a rolling
//! update. This module writes and reads the envelope; `rpc.rs` the calls.
//!
//! - **The envelope** of a message: `tinybroker.cluster.v1.Envelope`
//!   (`proto/tinybroker/cluster/v1/cluster.proto`). The publishing replica
//!   encodes it once per publish ([`encode_head`], [`put_sequence`],
//!   [`set_count`], from `fanout.rs`), sends it on core NATS to the other
//!   replicas (`<prefix>.m.<topic>`) and stores the same bytes in the stream
//!   of each consumer group the message matches; `fanout.rs` and
//!   `groups/` read it back with [`decode`], and `handover.rs` passes it
//!   on unchanged. Its fields 1 to 5 are the public `tinybroker.v1.Message`'s
//!   (same numbers and types), and its sender and count (fields 101 and
//!   100) are written first, in that order: byte for byte what replicas
//!   before this file wrote (they spliced the two fields ahead of a
//!   `Message` by hand, and read them back only from the front). So
//!   nothing needs negotiating: every replica of either version reads every
//!   envelope, a group stream's messages included.
//! - **Batches** of envelopes: the messages of one `SessionPublish` to one
//!   topic, published by one replica in a row, go out on core NATS as one
//!   NATS message on their subject, with the header [`BATCH_HEADER`] (their
//!   number) and, as payload, each envelope in turn, its length (a varint)
//!   in front ([`put_batched`], [`batched`]). Each envelope is exactly what
//!   it would be alone (sender, count, sequence), so the other replicas
//!   count gaps and deliver each as before, and each consumer group's
//!   stream stores its envelope alone (a slice of the batch). Replicas
//!   before batches read such a payload as one undecodable envelope, so a
//!   replica sends batches only while every other replica said it reads
//!   them (`interest.rs`).
//! - **Calls** between replicas (Ack, Nack, CloseSubscription of a
//!   subscription served elsewhere, the Admin listings, new groups, the
//!   broadcast-interest word): `tinybroker.cluster.v1.Call` and `Answer`,
//!   NATS requests to `<prefix>.rpc.<replica>` (`rpc.rs`). A proto call
//!   carries the header [`WIRE_HEADER`]: [`WIRE_VERSION`]; without it the
//!   payload is JSON, the format of replicas before this file (the serde
//!   form of `rpc::Call` and `rpc::Answer`, kept as it was). A replica
//!   answers in the format of the call, and every answer of this version
//!   carries the header, naming the call format it accepts. A caller
//!   calls a replica in JSON until it has heard that header from it, and
//!   in proto after; a proto call answered without the header (the
//!   replica was rolled back to the previous version under the same id)
//!   was not understood, so nothing was done, and it is sent again in
//!   JSON. So old and new replicas call each other in a mixed cluster,
//!   and new ones call each other in proto. The rule for the next version:
//!   accept the calls of this one, and answer them in kind.
//! - **Offers of a nacked message** to another replica (`handover.rs`):
//!   NATS headers naming the group, the JetStream handle and the attempt,
//!   the envelope as payload, answered `taken` or `refused`.
//! - **What the buckets hold**: `<prefix>_replicas` each replica's presence
//!   (JSON, `registry::Presence`; a field added is skipped by earlier
//!   readers), `<prefix>_subscriptions` the id of the replica serving each
//!   subscription, `<prefix>_groups` the group table (JSON, `groups/table.rs`),
//!   `<prefix>_attempts` delivery attempts (`attempts.rs`) and
//!   `<prefix>_incarnations` nothing (an entry's revision is the number).
//!
//! A test can make a replica speak the previous version's wire
//! ([`PREVIOUS_WIRE_VAR`]), to run a mixed cluster from one build.

use crate::engine::NewMessage;
pub(super) use crate::pb::cluster as pb;
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message as _;
use std::sync::LazyLock;
use std::time::SystemTime;

/// The NATS header of a call in `tinybroker.cluster.v1` (its payload a
/// `Call`), and of every answer of a replica that accepts such calls.
pub(super) const WIRE_HEADER: &str = "Tinybroker-Wire";
/// [`WIRE_HEADER`]'s value: the package of the call format.
pub(super) const WIRE_VERSION: &str = "tinybroker.cluster.v1";

/// Set (to anything) in a replica's environment, for tests only: the
/// replica speaks the wire of the version before `tinybroker.cluster.v1`.
/// It calls others in JSON only and reads their answers as JSON, answers
/// in JSON without [`WIRE_HEADER`], reads every call as JSON (a proto one
/// is undecodable, as it was), and reads envelopes as public `Message`s.
/// So `tests/cluster_wire.rs` runs a mixed cluster without building the
/// previous version. Logged at WARN when set.
pub const PREVIOUS_WIRE_VAR: &str = "TB_TEST_PREVIOUS_WIRE";

/// Whether this process speaks the previous version's wire
/// ([`PREVIOUS_WIRE_VAR`]). Read once: process-wide, like a build.
pub(super) fn speaks_previous() -> bool {
    static PREVIOUS: LazyLock<bool> = LazyLock::new(|| {
        let set = std::env::var_os(PREVIOUS_WIRE_VAR).is_some();
        if set {
            tracing::warn!(
                "{PREVIOUS_WIRE_VAR} is set: this replica speaks the previous version's wire format between replicas (JSON calls), for tests only; unset it"
            );
        }
        set
    });
    *PREVIOUS
}

/// The NATS header of a batch of envelopes (`put_batched`): how many it
/// holds.
pub(super) const BATCH_HEADER: &str = "Tinybroker-Batch";

/// Appends `envelope` to a batch's payload, its length in front; returns
/// where the envelope itself lies in `out`.
pub(super) fn put_batched(out: &mut BytesMut, envelope: &[u8]) -> std::ops::Range<usize> {
    prost::encoding::encode_varint(envelope.len() as u64, out);
    let start = out.len();
    out.extend_from_slice(envelope);
    start..out.len()
}

/// What [`put_batched`] adds to an envelope of `len` bytes.
pub(super) fn batched_len(len: usize) -> usize {
    prost::encoding::encoded_len_varint(len as u64) + len
}

/// The envelopes of a batch's payload, in order (each a slice of it); an
/// error ends them (a truncated or garbled payload).
pub(super) fn batched(payload: Bytes) -> impl Iterator<Item = Result<Bytes, &'static str>> {
    let mut rest = payload;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cursor: &[u8] = &rest;
        let next = match prost::encoding::decode_varint(&mut cursor) {
            Err(_) => Err("a batched envelope's length is not a varint"),
            Ok(len) => {
                let head = rest.len() - cursor.len();
                match usize::try_from(len).ok().filter(|&len| len <= cursor.len()) {
                    Some(len) => Ok(rest.slice(head..head + len)),
                    None => Err("a batched envelope runs past the end of its batch"),
                }
            }
        };
        match &next {
            Ok(envelope) => {
                let used = rest.len() - cursor.len() + envelope.len();
                rest = rest.slice(used..);
            }
            Err(_) => rest = Bytes::new(),
        }
        Some(next)
    })
}

// === the envelope ===

/// Field numbers of [`pb::Envelope`] written or read by hand (the test
/// `hand_written_fields_are_the_declared_ones` holds them to the proto).
const TOPIC_FIELD: u32 = 1;
const PAYLOAD_FIELD: u32 = 2;
const SEQUENCE_FIELD: u32 = 4;
const PUBLISH_TIME_FIELD: u32 = 5;
const COUNT_FIELD: u32 = 100;
const SENDER_FIELD: u32 = 101;
/// The sender and count, at most: two keys, a varint and a fixed64.
const COUNT_PREFIX_MAX: usize = 2 + 10 + 2 + 8;
/// What [`put_sequence`] adds at most: a key and a varint.
pub(super) const SEQUENCE_MAX: usize = 1 + 10;

/// Encodes `head` (an envelope whose sequence, count and sender are unset:
/// routing assigns the sequence after the encoding, the count as it goes
/// out) into a buffer with room for all three, so it never grows. With
/// `incarnation` (the message goes out on core NATS) the sender and a
/// count of 0 come first; returns where the count's 8 bytes are, for
/// [`set_count`]. One encoding, the payload copied once, into the buffer.
pub(super) fn encode_head(
    head: &pb::Envelope,
    incarnation: Option<u64>,
) -> Result<(BytesMut, Option<usize>), prost::EncodeError> {
    let mut body = BytesMut::with_capacity(COUNT_PREFIX_MAX + head.encoded_len() + SEQUENCE_MAX);
    let count_at = incarnation.map(|incarnation| {
        use prost::encoding::{WireType, encode_key, encode_varint};
        encode_key(SENDER_FIELD, WireType::Varint, &mut body);
        encode_varint(incarnation, &mut body);
        encode_key(COUNT_FIELD, WireType::SixtyFourBit, &mut body);
        let at = body.len();
        body.put_u64_le(0);
        at
    });
    head.encode(&mut body)?;
    Ok((body, count_at))
}

/// Appends the sequence (protobuf takes fields in any order).
pub(super) fn put_sequence(body: &mut BytesMut, sequence: u64) {
    prost::encoding::encode_key(SEQUENCE_FIELD, prost::encoding::WireType::Varint, body);
    prost::encoding::encode_varint(sequence, body);
}

/// Writes the count where [`encode_head`] left room for it.
pub(super) fn set_count(body: &mut [u8], at: usize, count: u64) {
    body[at..at + 8].copy_from_slice(&count.to_le_bytes());
}

/// The sender and count at the front of an envelope, if it has them with a
/// count (a group stream's copy of a message that did not go out on core
/// NATS has none): read without decoding the rest.
pub(super) fn count_prefix(payload: &[u8]) -> Option<(u64, u64)> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    let mut buf = payload;
    if decode_key(&mut buf).ok()? != (SENDER_FIELD, WireType::Varint) {
        return None;
    }
    let sender = decode_varint(&mut buf).ok()?;
    if decode_key(&mut buf).ok()? != (COUNT_FIELD, WireType::SixtyFourBit) {
        return None;
    }
    let count = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
    (count > 0).then_some((sender, count))
}

/// An envelope, from any replica of this version or the one before. A
/// replica speaking the previous wire reads it as that version did: as a
/// public `tinybroker.v1.Message` (sender and count skipped).
pub(super) fn decode(bytes: Bytes) -> Result<pb::Envelope, prost::DecodeError> {
    if speaks_previous() {
        return crate::pb::Message::decode(bytes).map(|m| pb::Envelope {
            topic: m.topic,
            payload: m.payload,
            headers: m.headers,
            sequence: m.sequence,
            publish_time: m.publish_time,
            ..Default::default()
        });
    }
    if let Some(envelope) = decode_plain(&bytes) {
        return Ok(envelope);
    }
    pb::Envelope::decode(bytes)
}

/// The envelope as replicas write it, decoded by hand: sender, count,
/// topic, payload (a slice of `bytes`, not a copy), sequence and publish
/// time, each at most once. `None` for anything else (headers, a field
/// this version does not write, a malformed one), which [`decode`] leaves
/// to prost: the same result, about a third of the instructions for the
/// envelopes every replica receives.
fn decode_plain(bytes: &Bytes) -> Option<pb::Envelope> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    let mut envelope = pb::Envelope::default();
    let mut buf: &[u8] = bytes;
    let mut seen = 0u8;
    while !buf.is_empty() {
        let (field, wire_type) = decode_key(&mut buf).ok()?;
        let bit = match (field, wire_type) {
            (SENDER_FIELD, WireType::Varint) => {
                envelope.sender_incarnation = decode_varint(&mut buf).ok()?;
                1
            }
            (COUNT_FIELD, WireType::SixtyFourBit) => {
                envelope.count = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
                buf = &buf[8..];
                2
            }
            (SEQUENCE_FIELD, WireType::Varint) => {
                envelope.sequence = decode_varint(&mut buf).ok()?;
                4
            }
            (TOPIC_FIELD | PAYLOAD_FIELD | PUBLISH_TIME_FIELD, WireType::LengthDelimited) => {
                let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                let value = buf.get(..len)?;
                match field {
                    TOPIC_FIELD => envelope.topic = std::str::from_utf8(value).ok()?.to_owned(),
                    PAYLOAD_FIELD => {
                        let start = bytes.len() - buf.len();
                        envelope.payload = bytes.slice(start..start + len);
                    }
                    _ => envelope.publish_time = Some(decode_timestamp(value)?),
                }
                buf = &buf[len..];
                match field {
                    TOPIC_FIELD => 8,
                    PAYLOAD_FIELD => 16,
                    _ => 32,
                }
            }
            _ => return None,
        };
        // A field twice: prost's rules (a message merged) are prost's.
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
    }
    Some(envelope)
}

/// A `google.protobuf.Timestamp` of seconds and nanos only.
fn decode_timestamp(mut buf: &[u8]) -> Option<prost_types::Timestamp> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    let mut time = prost_types::Timestamp::default();
    let mut seen = 0u8;
    while !buf.is_empty() {
        let bit = match decode_key(&mut buf).ok()? {
            (1, WireType::Varint) => {
                time.seconds = decode_varint(&mut buf).ok()? as i64;
                1
            }
            (2, WireType::Varint) => {
                time.nanos = decode_varint(&mut buf).ok()? as i32;
                2
            }
            _ => return None,
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
    }
    Some(time)
}

/// What an envelope gives the local engine: the message, its cluster-wide
/// sequence and its publish time (now, if it has none that converts).
pub(super) fn from_envelope(m: pb::Envelope) -> (NewMessage, u64, SystemTime) {
    let publish_time = m
        .publish_time
        .and_then(|t| SystemTime::try_from(t).ok())
        .unwrap_or_else(SystemTime::now);
    let message = NewMessage {
        topic: m.topic,
        payload: m.payload,
        headers: m.headers,
        ..Default::default()
    };
    (message, m.sequence, publish_time)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Captured from the previous version's `route_cluster` (commit
    /// c253cdc): topic "orders.eu", payload "hello", header k=v, publish
    /// time 1700000000 s + 5 ns, sequence 7 << 44 | 3; on core NATS from
    /// incarnation 7 as its 9th message there...
    const OLD_CORE: &str = "a80607a10609000000000000000a096f72646572732e6575120568656c6c6f1a060a016b1201762a080880e2cfaa061005208380808080801c";
    /// ...and the same message stored in a group stream without going out
    /// on core NATS.
    const OLD_GROUP: &str = "0a096f72646572732e6575120568656c6c6f1a060a016b1201762a080880e2cfaa061005208380808080801c";
    const SEQUENCE: u64 = (7 << 44) | 3;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn head() -> pb::Envelope {
        pb::Envelope {
            topic: "orders.eu".into(),
            payload: Bytes::from_static(b"hello"),
            headers: HashMap::from([("k".to_owned(), "v".to_owned())]),
            publish_time: Some(prost_types::Timestamp {
                seconds: 1_700_000_000,
                nanos: 5,
            }),
            ..Default::default()
        }
    }

    /// How the previous version read an envelope (its `fanout.rs`, kept
    /// here as the "old replica"): the count from the front, by hand, and
    /// the rest as a public `Message`.
    fn old_replica_reads(bytes: &[u8]) -> (Option<(u64, u64)>, crate::pb::Message) {
        use prost::encoding::{WireType, decode_key, decode_varint};
        let count = (|| {
            let mut buf = bytes;
            if decode_key(&mut buf).ok()? != (101, WireType::Varint) {
                return None;
            }
            let sender = decode_varint(&mut buf).ok()?;
            if decode_key(&mut buf).ok()? != (100, WireType::SixtyFourBit) {
                return None;
            }
            let count = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
            (count > 0).then_some((sender, count))
        })();
        (count, crate::pb::Message::decode(bytes).unwrap())
    }

    /// An old replica's envelopes, from core NATS and from a group stream,
    /// decode with the declared type, count and sender included.
    #[test]
    fn envelopes_of_the_previous_version_decode() {
        let core = pb::Envelope::decode(Bytes::from(unhex(OLD_CORE))).unwrap();
        let want = pb::Envelope {
            sequence: SEQUENCE,
            count: 9,
            sender_incarnation: 7,
            ..head()
        };
        assert_eq!(core, want);
        assert_eq!(count_prefix(&unhex(OLD_CORE)), Some((7, 9)));
        let group = pb::Envelope::decode(Bytes::from(unhex(OLD_GROUP))).unwrap();
        assert_eq!(
            group,
            pb::Envelope {
                sequence: SEQUENCE,
                ..head()
            }
        );
        assert_eq!(count_prefix(&unhex(OLD_GROUP)), None);
        let (message, sequence, at) = from_envelope(core);
        assert_eq!(
            (message.topic.as_str(), &message.payload[..]),
            ("orders.eu", &b"hello"[..])
        );
        assert_eq!(message.headers["k"], "v");
        assert_eq!(sequence, SEQUENCE);
        assert_eq!(at, SystemTime::UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5));
    }

    /// What this version sends is byte for byte what the previous one
    /// sent, so an old replica reads it (with its own logic, above).
    #[test]
    fn envelopes_of_this_version_are_the_previous_bytes() {
        let (mut core, at) = encode_head(&head(), Some(7)).unwrap();
        let capacity = core.capacity();
        put_sequence(&mut core, SEQUENCE);
        set_count(&mut core, at.unwrap(), 9);
        assert_eq!(core.capacity(), capacity, "the buffer had room: no growing, no copy");
        assert_eq!(core[..], unhex(OLD_CORE)[..]);
        let (mut group, none) = encode_head(&head(), None).unwrap();
        assert_eq!(none, None);
        put_sequence(&mut group, SEQUENCE);
        assert_eq!(group[..], unhex(OLD_GROUP)[..]);

        let (count, message) = old_replica_reads(&core);
        assert_eq!(count, Some((7, 9)));
        assert_eq!(
            (message.topic.as_str(), &message.payload[..], message.sequence),
            ("orders.eu", &b"hello"[..], SEQUENCE)
        );
        assert_eq!(message.headers["k"], "v");
        assert_eq!(message.publish_time, head().publish_time);
        let (count, message) = old_replica_reads(&group);
        assert_eq!((count, message.sequence), (None, SEQUENCE));
        // A count of 0 (not sent yet) is no count, for either version.
        let (unsent, _) = encode_head(&head(), Some(7)).unwrap();
        assert_eq!(count_prefix(&unsent), None);
        assert_eq!(old_replica_reads(&unsent).0, None);
    }

    /// The fields written and read by hand are the ones the proto declares:
    /// each encoded alone by the generated code gives the same bytes.
    #[test]
    fn hand_written_fields_are_the_declared_ones() {
        let prefix = |incarnation| {
            let (body, at) = encode_head(&pb::Envelope::default(), Some(incarnation)).unwrap();
            (body, at.unwrap())
        };
        let (mut body, at) = prefix(300);
        set_count(&mut body, at, 7);
        let sender = pb::Envelope {
            sender_incarnation: 300,
            ..Default::default()
        };
        let count = pb::Envelope {
            count: 7,
            ..Default::default()
        };
        let declared = [sender.encode_to_vec(), count.encode_to_vec()].concat();
        assert_eq!(body[..], declared[..]);
        assert!(body.len() <= COUNT_PREFIX_MAX);
        let mut sequence = BytesMut::new();
        put_sequence(&mut sequence, u64::MAX);
        let declared = pb::Envelope {
            sequence: u64::MAX,
            ..Default::default()
        };
        assert_eq!(sequence[..], declared.encode_to_vec()[..]);
        assert_eq!(sequence.len(), SEQUENCE_MAX);
    }

    /// The envelope's fields below 100 are `tinybroker.v1.Message`'s (same
    /// name, number, type), and Message's other numbers are reserved in it:
    /// a replica of the previous version decodes an envelope as a Message.
    #[test]
    fn the_envelope_is_a_message_to_the_previous_version() {
        use prost_types::FileDescriptorSet;
        let find = |set: &[u8], name: &str| {
            let set = FileDescriptorSet::decode(set).unwrap();
            set.file
                .into_iter()
                .flat_map(|f| f.message_type)
                .find(|m| m.name() == name)
                .unwrap_or_else(|| panic!("{name} in the descriptor set"))
        };
        let cluster = include_bytes!(concat!(env!("OUT_DIR"), "/cluster_descriptor.bin"));
        let envelope = find(cluster, "Envelope");
        let message = find(crate::pb::FILE_DESCRIPTOR_SET, "Message");
        let shape = |f: &prost_types::FieldDescriptorProto| {
            (f.name().to_owned(), f.r#type(), f.label(), f.type_name().to_owned())
        };
        let mut shared = 0;
        for field in envelope.field.iter().filter(|f| f.number() < 100) {
            let theirs = message
                .field
                .iter()
                .find(|m| m.number() == field.number())
                .unwrap_or_else(|| panic!("Message has no field {}", field.number()));
            // The map entry types are named after their message.
            let mine = shape(field);
            let theirs = shape(theirs);
            assert_eq!(
                (
                    &mine.0,
                    mine.1,
                    mine.2,
                    mine.3.replace(".tinybroker.cluster.v1.Envelope.", "")
                ),
                (
                    &theirs.0,
                    theirs.1,
                    theirs.2,
                    theirs.3.replace(".tinybroker.v1.Message.", "")
                ),
                "field {}",
                field.number()
            );
            shared += 1;
        }
        assert_eq!(shared, 5);
        for field in &message.field {
            let declared = envelope.field.iter().any(|f| f.number() == field.number());
            let reserved = envelope
                .reserved_range
                .iter()
                .any(|r| (r.start()..r.end()).contains(&field.number()));
            assert!(
                declared || reserved,
                "Message's field {} ({}) is neither in the envelope nor reserved there",
                field.number(),
                field.name()
            );
        }
    }

    /// The hand decoder reads what replicas write as prost does, and
    /// leaves anything else to prost.
    #[test]
    fn the_plain_decoder_agrees_with_prost() {
        let plain = |headers: bool, time: Option<prost_types::Timestamp>| {
            let head = pb::Envelope {
                headers: if headers { head().headers } else { HashMap::new() },
                publish_time: time,
                ..head()
            };
            let (mut body, at) = encode_head(&head, Some(7)).unwrap();
            put_sequence(&mut body, SEQUENCE);
            set_count(&mut body, at.unwrap(), 9);
            body.freeze()
        };
        let negative = prost_types::Timestamp { seconds: -5, nanos: -1 };
        for (bytes, by_hand) in [
            (plain(false, head().publish_time), true),
            (plain(false, Some(negative)), true),
            (plain(false, None), true),
            (plain(true, head().publish_time), false),
            (Bytes::from(unhex(OLD_GROUP)), false),
            (Bytes::new(), true),
        ] {
            let expected = pb::Envelope::decode(bytes.clone()).unwrap();
            assert_eq!(decode_plain(&bytes).is_some(), by_hand, "{expected:?}");
            assert_eq!(decode(bytes).unwrap(), expected);
        }
        // A field twice, an unknown one, one cut short: prost's answer.
        let (mut twice, _) = encode_head(&pb::Envelope::default(), None).unwrap();
        put_sequence(&mut twice, 1);
        put_sequence(&mut twice, 2);
        let twice = twice.freeze();
        assert!(decode_plain(&twice).is_none());
        assert_eq!(decode(twice).unwrap().sequence, 2);
        let unknown = Bytes::from_static(&[0x30, 0x01]);
        assert!(decode_plain(&unknown).is_none());
        assert!(decode(unknown).is_ok());
        let cut = plain(false, head().publish_time);
        let cut = cut.slice(..cut.len() - 1);
        assert!(decode_plain(&cut).is_none());
        assert!(decode(cut).is_err());
    }

    /// A batch's envelopes come back whole and in order, as slices of the
    /// payload; a truncated one is an error that ends them.
    #[test]
    fn a_batch_of_envelopes_splits_back_into_them() {
        let envelopes: Vec<Vec<u8>> = vec![vec![1; 3], vec![], vec![7; 300]];
        let mut out = BytesMut::new();
        let ranges: Vec<_> = envelopes.iter().map(|e| put_batched(&mut out, e)).collect();
        assert_eq!(out.len(), envelopes.iter().map(|e| batched_len(e.len())).sum::<usize>());
        for (range, envelope) in ranges.iter().zip(&envelopes) {
            assert_eq!(&out[range.clone()], &envelope[..]);
        }
        let payload = out.freeze();
        let back: Vec<Bytes> = batched(payload.clone()).map(Result::unwrap).collect();
        assert_eq!(
            back,
            envelopes.iter().map(|e| Bytes::from(e.clone())).collect::<Vec<_>>()
        );
        let cut = payload.slice(..payload.len() - 1);
        let parts: Vec<_> = batched(cut).collect();
        assert_eq!(parts.len(), 3);
        assert!(parts[2].is_err(), "the cut one is an error");
    }
}
