//! Calls between replicas: a NATS request to `<prefix>.rpc.<replica>`,
//! answered by that replica. Used for what only the serving replica can
//! answer: Ack, Nack and CloseSubscription of its subscriptions, and its
//! part of the Admin listings; and to tell the others of a new group and of
//! this replica's broadcast interest.
//!
//! On the wire a call is a `tinybroker.cluster.v1.Call` and its answer an
//! `Answer` (`proto/tinybroker/cluster/v1/cluster.proto`), or, to and from
//! a replica of the version before, the JSON of [`Call`] and [`Answer`]
//! (their serde form, kept as it was). Which one a replica is called in is
//! learned from its answers: `wire.rs` says how. In the code, calls and
//! answers are [`Call`] and [`Answer`]; `rpc/proto.rs` converts them.

use super::wire::{self, WIRE_HEADER, WIRE_VERSION, pb};
use super::{RPC_TIMEOUT, key};
use crate::engine::{Acked, BrokerError, EvictionRecord, Nacked, SubscriptionInfo};
use bytes::Bytes;
use prost::Message as _;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::LazyLock;

mod proto;

/// The subject replica `replica` answers calls on.
pub fn subject(prefix: &str, replica: &str) -> String {
    format!("{prefix}.rpc.{}", key(replica))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub(super) enum Call {
    Ping,
    Ack {
        id: String,
        sequences: Vec<u64>,
    },
    Nack {
        id: String,
        sequences: Vec<u64>,
    },
    Close {
        id: String,
    },
    ListSubscriptions,
    ListEvictions,
    ListGroups,
    /// A group just made by the calling replica: route it now.
    RouteGroup {
        name: String,
        patterns: Vec<String>,
    },
    /// Whether the calling replica has broadcast subscriptions
    /// (`interest.rs`); answered with a pong.
    Interest {
        replica: String,
        version: Version,
        some: bool,
        /// It reads batched messages on core NATS (`wire.rs`); replicas
        /// before them never say so (and the JSON of one that does not
        /// is the previous version's, byte for byte).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        reads_batches: bool,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "answer", content = "value", rename_all = "snake_case")]
pub(super) enum Answer {
    Pong,
    Acked(Acked),
    Nacked(Nacked),
    Closed,
    Subscriptions(Vec<SubscriptionInfo>),
    Evictions(Vec<EvictionRecord>),
    Groups(Vec<LocalGroup>),
    Routed,
    Error(WireError),
}

/// One replica's part of a group, for the cluster-wide listing: its
/// answer to [`Call::ListGroups`] (`groups/listing.rs` makes and sums them).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct LocalGroup {
    pub(super) name: String,
    pub(super) members: usize,
    pub(super) held: usize,
    pub(super) redeliveries: u64,
    pub(super) dead_lettered: u64,
    pub(super) acked: u64,
    /// Dropped from the full backlog by this replica's publishes (absent
    /// from a replica of an earlier version).
    #[serde(default)]
    pub(super) dropped: u64,
    /// Written to the streams of members here, redeliveries included
    /// (absent from a replica of an earlier version).
    #[serde(default)]
    pub(super) delivered: u64,
    /// How long the oldest message members here hold has been held, in
    /// milliseconds (absent from a replica of an earlier version).
    #[serde(default)]
    pub(super) oldest_held_ms: Option<u64>,
}

/// An interest announcement's number (`interest.rs` says what it orders):
/// later incarnations of a replica id, then later announcements of one
/// incarnation, are newer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Version {
    pub incarnation: u64,
    pub n: u64,
}

impl Answer {
    /// An answer that is not the one the call expects.
    pub fn into_error(self) -> BrokerError {
        match self {
            Answer::Error(e) => e.into(),
            other => BrokerError::Unavailable(format!("a replica gave an unexpected answer: {other:?}")),
        }
    }
}

/// A [`BrokerError`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WireError {
    code: String,
    message: String,
}

impl From<BrokerError> for WireError {
    fn from(error: BrokerError) -> Self {
        let code = match &error {
            BrokerError::InvalidArgument(_) => "invalid_argument",
            BrokerError::FailedPrecondition(_) => "failed_precondition",
            BrokerError::AlreadyExists(_) => "already_exists",
            BrokerError::NotFound(_) => "not_found",
            BrokerError::ResourceExhausted(_) => "resource_exhausted",
            BrokerError::Unavailable(_) => "unavailable",
        };
        WireError {
            code: code.into(),
            message: error.to_string(),
        }
    }
}

impl From<WireError> for BrokerError {
    fn from(e: WireError) -> Self {
        match e.code.as_str() {
            "invalid_argument" => BrokerError::InvalidArgument(e.message),
            "failed_precondition" => BrokerError::FailedPrecondition(e.message),
            "already_exists" => BrokerError::AlreadyExists(e.message),
            "not_found" => BrokerError::NotFound(e.message),
            "resource_exhausted" => BrokerError::ResourceExhausted(e.message),
            _ => BrokerError::Unavailable(e.message),
        }
    }
}

// === the caller's end ===

/// The call subjects of replicas heard to accept `tinybroker.cluster.v1`
/// calls (their answers carry [`WIRE_HEADER`]); every other replica is
/// called in JSON. Process-wide: it says what the replica on a subject
/// speaks, whoever calls it. Updated by every answer, so a replica that
/// restarts as another version is called in its format from its next
/// answer on.
static PROTO_PEERS: LazyLock<parking_lot::Mutex<HashSet<String>>> = LazyLock::new(Default::default);
/// Subjects remembered at most (forgetting them all only means calling
/// each in JSON once more).
const PROTO_PEERS_MAX: usize = 1024;

fn called_in_proto(subject: &str) -> bool {
    !wire::speaks_previous() && PROTO_PEERS.lock().contains(subject)
}

/// Notes what the replica on `subject` said it accepts.
fn heard(subject: &str, accepts_proto: bool) {
    let mut peers = PROTO_PEERS.lock();
    if !accepts_proto {
        peers.remove(subject);
    } else if !peers.contains(subject) {
        if peers.len() >= PROTO_PEERS_MAX {
            peers.clear();
        }
        peers.insert(subject.to_owned());
    }
}

/// Whether NATS headers carry [`WIRE_HEADER`] (whatever version it names:
/// each version accepts the calls of the one before).
fn has_wire_header(headers: Option<&async_nats::HeaderMap>) -> bool {
    headers.is_some_and(|h| h.get(WIRE_HEADER).is_some())
}

/// Sends `call` to `replica` and waits (at most [`RPC_TIMEOUT`]) for its answer.
pub async fn call(
    client: &async_nats::Client,
    prefix: &str,
    replica: &str,
    call: &Call,
) -> Result<Answer, BrokerError> {
    call_within(client, prefix, replica, call, RPC_TIMEOUT).await
}

/// [`call`], waiting at most `timeout` (twice, when a proto call must be
/// sent again in JSON).
pub async fn call_within(
    client: &async_nats::Client,
    prefix: &str,
    replica: &str,
    call: &Call,
    timeout: std::time::Duration,
) -> Result<Answer, BrokerError> {
    let subject = subject(prefix, replica);
    let proto = called_in_proto(&subject);
    let (answer, accepts_proto) = request(client, &subject, replica, call, proto, timeout).await?;
    if !wire::speaks_previous() {
        heard(&subject, accepts_proto);
    }
    if proto && !accepts_proto {
        // A replica of the previous version now holds that id: it could
        // not read the call, so it did nothing. Again, in its format.
        tracing::info!(
            %replica,
            "replica speaks the previous version's wire format (JSON calls): calling it in JSON"
        );
        return request(client, &subject, replica, call, false, timeout)
            .await
            .map(|(answer, _)| answer);
    }
    Ok(answer)
}

/// One request: `call` in proto or JSON; its answer (in the same format)
/// and whether the replica accepts proto calls.
async fn request(
    client: &async_nats::Client,
    subject: &str,
    replica: &str,
    call: &Call,
    proto: bool,
    timeout: std::time::Duration,
) -> Result<(Answer, bool), BrokerError> {
    let mut request = async_nats::Request::new().timeout(Some(timeout));
    if proto {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(WIRE_HEADER, WIRE_VERSION);
        request = request
            .headers(headers)
            .payload(pb::Call::from(call.clone()).encode_to_vec().into());
    } else {
        let body = serde_json::to_vec(call).map_err(|e| BrokerError::Unavailable(e.to_string()))?;
        request = request.payload(body.into());
    }
    let reply = client
        .send_request(subject.to_owned(), request)
        .await
        .map_err(|e| BrokerError::Unavailable(format!("replica {replica} did not answer: {e}")))?;
    let accepts_proto = !wire::speaks_previous() && has_wire_header(reply.headers.as_ref());
    // A proto call is answered in proto only by a replica that read it.
    decode_answer(&reply.payload, proto && accepts_proto)
        .map(|answer| (answer, accepts_proto))
        .map_err(|e| BrokerError::Unavailable(format!("replica {replica} answered something undecodable: {e}")))
}

/// An answer in proto or JSON.
fn decode_answer(payload: &[u8], proto: bool) -> Result<Answer, String> {
    if proto {
        let answer = pb::Answer::decode(payload).map_err(|e| e.to_string())?;
        Answer::try_from(answer)
    } else {
        serde_json::from_slice(payload).map_err(|e| e.to_string())
    }
}

// === the called end's formats ===

/// A call as it came, and whether it came in proto (so is answered in
/// proto); an error (in the call's format) when it does not decode.
fn decode_call(headers: Option<&async_nats::HeaderMap>, payload: &[u8]) -> (Result<Call, String>, bool) {
    let version = headers.and_then(|h| h.get(WIRE_HEADER)).map(|v| v.as_str());
    match version {
        // The previous version read every call as JSON.
        _ if wire::speaks_previous() => (serde_json::from_slice(payload).map_err(|e| e.to_string()), false),
        None => (serde_json::from_slice(payload).map_err(|e| e.to_string()), false),
        Some(WIRE_VERSION) => {
            let call = pb::Call::decode(payload)
                .map_err(|e| e.to_string())
                .and_then(Call::try_from);
            (call, true)
        }
        Some(other) => (
            Err(format!(
                "a call in wire format {other:?}, which this replica (accepting {WIRE_VERSION:?} and JSON) does not read"
            )),
            false,
        ),
    }
}

/// An answer in proto or JSON, with the headers it goes out with: none
/// from a replica speaking the previous version's wire.
fn encode_answer(answer: Answer, proto: bool) -> (Option<async_nats::HeaderMap>, Bytes) {
    let body = if proto {
        pb::Answer::from(answer).encode_to_vec()
    } else {
        serde_json::to_vec(&answer).unwrap_or_else(|e| {
            tracing::error!(error = %e, "bug: a forwarded call's answer cannot be encoded");
            let error = Answer::Error(WireError::from(BrokerError::Unavailable(format!(
                "the replica could not encode its answer: {e}"
            ))));
            serde_json::to_vec(&error).unwrap_or_default()
        })
    };
    let headers = (!wire::speaks_previous()).then(|| {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(WIRE_HEADER, WIRE_VERSION);
        headers
    });
    (headers, body.into())
}

// === both ends of a call ===

use super::{ClusterEngine, Ready};
use crate::engine::Peaks;
use futures::StreamExt;

impl ClusterEngine {
    /// Answers calls forwarded by other replicas.
    pub(super) async fn answer(self, mut calls: async_nats::Subscriber) {
        while let Some(request) = calls.next().await {
            let Some(reply) = request.reply.clone() else { continue };
            let engine = self.clone();
            tokio::spawn(async move {
                let (call, proto) = decode_call(request.headers.as_ref(), &request.payload);
                let answer = match call {
                    Ok(call) => engine.answer_one(call).await,
                    Err(e) => Answer::Error(WireError::from(BrokerError::InvalidArgument(format!(
                        "undecodable forwarded call: {e}"
                    )))),
                };
                let client = &engine.inner.client;
                let _ = match encode_answer(answer, proto) {
                    (Some(headers), body) => client.publish_with_headers(reply, headers, body).await,
                    (None, body) => client.publish(reply, body).await,
                };
            });
        }
    }

    pub(super) async fn answer_one(&self, call: Call) -> Answer {
        let local = &self.inner.local;
        let result = match call {
            Call::Ping => Ok(Answer::Pong),
            Call::Ack { id, sequences } => self.ack_here(&id, &sequences).await.map(Answer::Acked),
            Call::Nack { id, sequences } => self.nack_here(&id, &sequences).await.map(Answer::Nacked),
            Call::Close { id } => local.close_subscription(&id).map(|()| Answer::Closed),
            Call::ListSubscriptions => Ok(Answer::Subscriptions(self.local_subscriptions(Peaks::Keep))),
            Call::ListEvictions => Ok(Answer::Evictions(local.evictions())),
            Call::ListGroups => Ok(Answer::Groups(self.local_groups())),
            Call::RouteGroup { name, patterns } => {
                self.route_group(&name, patterns);
                Ok(Answer::Routed)
            }
            Call::Interest {
                replica,
                version,
                some,
                reads_batches,
            } => {
                self.noted_interest(&replica, version, some, reads_batches);
                Ok(Answer::Pong)
            }
        };
        result.unwrap_or_else(|e| Answer::Error(e.into()))
    }

    /// Sends `call` to the replica serving subscription `id`, when that is
    /// another live replica; None when no replica serves it.
    pub(super) async fn forward(&self, ready: &Ready, id: &str, call: Call) -> Result<Option<Answer>, BrokerError> {
        let Some(owner) = self.owner(ready, id).await? else {
            return Ok(None);
        };
        if owner == self.inner.config.replica_id || !self.is_live(ready, &owner).await {
            return Ok(None);
        }
        self::call(&self.inner.client, &self.inner.config.prefix, &owner, &call)
            .await
            .map(Some)
    }

    /// Gathers `call`'s answers from every live replica.
    pub(super) async fn gather(&self, ready: &Ready, call: Call) -> Vec<Answer> {
        self.gather_all(ready, call).await.0
    }

    /// [`ClusterEngine::gather`], and whether every live replica answered.
    pub(super) async fn gather_all(&self, ready: &Ready, call: Call) -> (Vec<Answer>, bool) {
        let replicas = self.live_replicas(ready).await;
        let calls = replicas.iter().map(|replica| {
            let call = call.clone();
            async move {
                if *replica == self.inner.config.replica_id {
                    return Some(self.answer_one(call).await);
                }
                match self::call(&self.inner.client, &self.inner.config.prefix, replica, &call).await {
                    Ok(answer) => Some(answer),
                    Err(error) => {
                        tracing::warn!(replica = %replica, %error, "replica left out of an Admin listing: it did not answer");
                        None
                    }
                }
            }
        });
        let answers: Vec<Answer> = futures::future::join_all(calls).await.into_iter().flatten().collect();
        let complete = answers.len() == replicas.len();
        (answers, complete)
    }

    /// `here`, what this replica answered about subscription `id`, unless it
    /// does not serve it: then the answer of the replica that does, to
    /// `call()`, picked by `pick` (NOT_FOUND when no live replica serves it).
    pub(super) async fn here_or_forwarded<T>(
        &self,
        id: &str,
        here: Result<T, BrokerError>,
        call: impl FnOnce() -> Call,
        pick: impl FnOnce(Answer) -> Result<T, Answer>,
    ) -> Result<T, BrokerError> {
        let Err(BrokerError::NotFound(not_here)) = here else {
            return here;
        };
        let ready = self.serving()?;
        match self.forward(&ready, id, call()).await? {
            Some(answer) => pick(answer).map_err(Answer::into_error),
            None => Err(BrokerError::NotFound(not_here)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::proto::{subscription_from_wire, subscription_to_wire};
    use super::*;
    use crate::engine::{AckMode, DeliveryMode, SubscriptionInfo};
    use std::time::{Duration, SystemTime};

    /// Every call, as the previous version (commit c253cdc) wrote it in
    /// JSON, in the order of [`calls`].
    const OLD_CALLS: [&str; 9] = [
        r#"{"call":"ping"}"#,
        r#"{"call":"ack","id":"s-1","sequences":[1,2]}"#,
        r#"{"call":"nack","id":"s-1","sequences":[3]}"#,
        r#"{"call":"close","id":"s-1"}"#,
        r#"{"call":"list_subscriptions"}"#,
        r#"{"call":"list_evictions"}"#,
        r#"{"call":"list_groups"}"#,
        r#"{"call":"route_group","name":"workers","patterns":["jobs.>"]}"#,
        r#"{"call":"interest","replica":"a","version":{"incarnation":4,"n":2},"some":true}"#,
    ];
    /// Every answer, likewise, in the order of [`answers`].
    const OLD_ANSWERS: [&str; 9] = [
        r#"{"answer":"pong"}"#,
        r#"{"answer":"acked","value":{"acked":1,"unknown":2}}"#,
        r#"{"answer":"nacked","value":{"requeued":3,"unknown":4}}"#,
        r#"{"answer":"closed"}"#,
        r#"{"answer":"subscriptions","value":[{"subscription_id":"m-1","mode":"Single","consumer_group":"workers","ack_mode":"Manual","topic_patterns":["jobs.>"],"queue_depth":1,"queue_peak":2,"capacity":3,"delivered":4,"opened_at":{"secs_since_epoch":1700000000,"nanos_since_epoch":5},"peer":"127.0.0.1:5","replica_id":"a"}]}"#,
        r#"{"answer":"evictions","value":[{"subscription_id":"slow","evicted_at":{"secs_since_epoch":1700000001,"nanos_since_epoch":6},"topic_patterns":["live.>"],"queue_depth":64,"last_delivered_sequence":99,"peer":null,"replica_id":"b"}]}"#,
        r#"{"answer":"groups","value":[{"name":"workers","members":2,"held":3,"redeliveries":4,"dead_lettered":5,"acked":6,"dropped":7,"delivered":8,"oldest_held_ms":9}]}"#,
        r#"{"answer":"routed"}"#,
        r#"{"answer":"error","value":{"code":"not_found","message":"no subscription \"x\""}}"#,
    ];

    fn calls() -> Vec<Call> {
        vec![
            Call::Ping,
            Call::Ack {
                id: "s-1".into(),
                sequences: vec![1, 2],
            },
            Call::Nack {
                id: "s-1".into(),
                sequences: vec![3],
            },
            Call::Close { id: "s-1".into() },
            Call::ListSubscriptions,
            Call::ListEvictions,
            Call::ListGroups,
            Call::RouteGroup {
                name: "workers".into(),
                patterns: vec!["jobs.>".into()],
            },
            Call::Interest {
                replica: "a".into(),
                version: Version { incarnation: 4, n: 2 },
                some: true,
                // The previous version's call (this one's says true).
                reads_batches: false,
            },
        ]
    }

    fn subscription() -> SubscriptionInfo {
        SubscriptionInfo {
            subscription_id: "m-1".into(),
            mode: DeliveryMode::Single,
            consumer_group: "workers".into(),
            ack_mode: Some(AckMode::Manual),
            topic_patterns: vec!["jobs.>".into()],
            queue_depth: 1,
            queue_peak: 2,
            capacity: 3,
            delivered: 4,
            opened_at: SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 5),
            peer: Some("127.0.0.1:5".parse().unwrap()),
            replica_id: "a".into(),
            // Not in the previous version's JSON: see the proto round trip.
            unacked: 0,
            oldest_unacked_age: None,
            stalled: None,
        }
    }

    fn answers() -> Vec<Answer> {
        let eviction = EvictionRecord {
            subscription_id: "slow".into(),
            evicted_at: SystemTime::UNIX_EPOCH + Duration::new(1_700_000_001, 6),
            topic_patterns: vec!["live.>".into()],
            queue_depth: 64,
            last_delivered_sequence: 99,
            peer: None,
            replica_id: "b".into(),
        };
        let group = LocalGroup {
            name: "workers".into(),
            members: 2,
            held: 3,
            redeliveries: 4,
            dead_lettered: 5,
            acked: 6,
            dropped: 7,
            delivered: 8,
            oldest_held_ms: Some(9),
        };
        vec![
            Answer::Pong,
            Answer::Acked(Acked { acked: 1, unknown: 2 }),
            Answer::Nacked(Nacked {
                requeued: 3,
                unknown: 4,
            }),
            Answer::Closed,
            Answer::Subscriptions(vec![subscription()]),
            Answer::Evictions(vec![eviction]),
            Answer::Groups(vec![group]),
            Answer::Routed,
            Answer::Error(BrokerError::NotFound("no subscription \"x\"".into()).into()),
        ]
    }

    fn headers(version: &str) -> async_nats::HeaderMap {
        let mut h = async_nats::HeaderMap::new();
        h.insert(WIRE_HEADER, version);
        h
    }

    /// A replica that reads batches says so in JSON as in proto (a new
    /// replica calls one it has not heard accept proto in JSON).
    #[test]
    fn reading_batches_is_said_in_both_formats() {
        let call = Call::Interest {
            replica: "a".into(),
            version: Version { incarnation: 1, n: 1 },
            some: false,
            reads_batches: true,
        };
        let json = serde_json::to_vec(&call).unwrap();
        let (read, _) = decode_call(None, &json);
        assert!(matches!(
            read.unwrap(),
            Call::Interest {
                reads_batches: true,
                ..
            }
        ));
        let body = pb::Call::from(call).encode_to_vec();
        let (read, proto) = decode_call(Some(&headers(WIRE_VERSION)), &body);
        assert!(proto);
        assert!(matches!(
            read.unwrap(),
            Call::Interest {
                reads_batches: true,
                ..
            }
        ));
    }

    /// An old replica's calls (JSON, no header) are read, and answered in
    /// JSON; the answers as the old replica wrote them are read too.
    #[test]
    fn calls_and_answers_of_the_previous_version_are_read() {
        for (old, call) in OLD_CALLS.iter().zip(calls()) {
            let (read, proto) = decode_call(None, old.as_bytes());
            assert_eq!(format!("{:?}", read.unwrap()), format!("{call:?}"), "{old}");
            assert!(!proto, "answered in JSON: {old}");
        }
        for (old, answer) in OLD_ANSWERS.iter().zip(answers()) {
            let read = decode_answer(old.as_bytes(), false).unwrap_or_else(|e| panic!("{old}: {e}"));
            assert_eq!(format!("{read:?}"), format!("{answer:?}"));
        }
    }

    /// What this version sends a replica it has not heard accept proto, and
    /// answers a JSON call with, is byte for byte what the previous version
    /// wrote, so an old replica reads it (the old decoding is serde's, of
    /// these same types); only the header is new, and old replicas ignore
    /// headers.
    #[test]
    fn what_an_old_replica_gets_is_the_previous_json() {
        for (old, call) in OLD_CALLS.iter().zip(calls()) {
            assert_eq!(serde_json::to_string(&call).unwrap(), *old);
        }
        for (old, answer) in OLD_ANSWERS.iter().zip(answers()) {
            let (headers, body) = encode_answer(answer, false);
            assert_eq!(std::str::from_utf8(&body).unwrap(), *old);
            assert_eq!(
                headers.unwrap().get(WIRE_HEADER).map(|v| v.as_str()),
                Some(WIRE_VERSION),
                "the answer says this replica accepts proto calls"
            );
        }
    }

    /// Every call and answer survives the proto wire, and a proto call is
    /// answered in proto.
    #[test]
    fn calls_and_answers_round_trip_in_proto() {
        for call in calls() {
            let body = pb::Call::from(call.clone()).encode_to_vec();
            let (read, proto) = decode_call(Some(&headers(WIRE_VERSION)), &body);
            assert_eq!(format!("{:?}", read.unwrap()), format!("{call:?}"));
            assert!(proto);
        }
        let hung = SubscriptionInfo {
            unacked: 6,
            oldest_unacked_age: Some(Duration::from_millis(7)),
            ..subscription()
        };
        for answer in answers().into_iter().chain([Answer::Subscriptions(vec![hung])]) {
            let (_, body) = encode_answer(answer.clone(), true);
            let read = decode_answer(&body, true).unwrap();
            assert_eq!(format!("{read:?}"), format!("{answer:?}"));
        }
        // Every error code keeps its kind.
        for error in [
            BrokerError::InvalidArgument("a".into()),
            BrokerError::FailedPrecondition("b".into()),
            BrokerError::AlreadyExists("c".into()),
            BrokerError::NotFound("d".into()),
            BrokerError::ResourceExhausted("e".into()),
            BrokerError::Unavailable("f".into()),
        ] {
            let (_, body) = encode_answer(Answer::Error(error.clone().into()), true);
            let read = decode_answer(&body, true).unwrap();
            assert_eq!(read.into_error(), error);
        }
    }

    /// A proto call sent to an old replica is undecodable there (it reads
    /// JSON), so the old replica did nothing and said so in JSON without the
    /// header: what makes the caller send it again in JSON.
    #[test]
    fn a_proto_call_is_undecodable_to_an_old_replica() {
        let body = pb::Call::from(calls()[1].clone()).encode_to_vec();
        assert!(serde_json::from_slice::<Call>(&body).is_err());
        assert!(!has_wire_header(None));
        assert!(has_wire_header(Some(&headers(WIRE_VERSION))));
        // A later version's header still says "accepts proto calls"...
        assert!(has_wire_header(Some(&headers("tinybroker.cluster.v2"))));
        // ...but a call in a format this replica does not read is refused,
        // naming it, in JSON (which every version reads).
        let (read, proto) = decode_call(Some(&headers("tinybroker.cluster.v2")), &body);
        assert!(read.unwrap_err().contains("\"tinybroker.cluster.v2\""));
        assert!(!proto);
    }

    /// What a replica learns from answers: proto after an answer with the
    /// header, JSON again after one without (the id now runs an old version).
    #[test]
    fn what_a_replica_speaks_is_learned_from_its_answers() {
        let subject = subject("learn", "r");
        assert!(!called_in_proto(&subject), "JSON until heard");
        heard(&subject, true);
        assert!(called_in_proto(&subject));
        heard(&subject, false);
        assert!(!called_in_proto(&subject));
    }

    /// Malformed proto answers are errors naming the bad value, not
    /// silently wrong listings.
    #[test]
    fn malformed_proto_answers_name_the_bad_value() {
        let mut bad = subscription_to_wire(subscription());
        bad.peer = "not-an-address".into();
        let answer = pb::Answer {
            answer: Some(pb::answer::Answer::Subscriptions(pb::Subscriptions {
                subscriptions: vec![bad],
            })),
        };
        let error = Answer::try_from(answer).unwrap_err();
        assert!(
            error.contains("\"not-an-address\"") && error.contains("\"m-1\""),
            "{error}"
        );
        let mut bad = subscription_to_wire(subscription());
        bad.mode = 7;
        let error = subscription_from_wire(bad).unwrap_err();
        assert!(error.contains("delivery mode 7"), "{error}");
        let mut bad = subscription_to_wire(subscription());
        bad.opened_at = None;
        let error = subscription_from_wire(bad).unwrap_err();
        assert!(error.contains("opened_at is missing"), "{error}");
        let error = Answer::try_from(pb::Answer { answer: None }).unwrap_err();
        assert!(error.contains("naming no answer"), "{error}");
        let (read, _) = decode_call(Some(&headers(WIRE_VERSION)), &pb::Call { call: None }.encode_to_vec());
        assert!(read.unwrap_err().contains("naming no call"));
    }
}
