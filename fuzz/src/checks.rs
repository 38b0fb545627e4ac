//! Invariant checks shared by the cargo-fuzz targets (`fuzz/fuzz_targets/`)
//! and the normal test run (`tests/fuzz_corpus.rs` includes this file with
//! `#[path]`), so a crash the fuzzer finds replays under `cargo test`.
//!
//! * [`check_topic_input`]: topic and pattern syntax against an independent
//!   reading of docs/contract.md (Topics and patterns), the reference
//!   matcher, and the routing trie.
//! * [`check_request_input`]: raw bytes decoded as each request type, and an
//!   `arbitrary`-driven sequence of requests, sent to the real tonic service
//!   implementations on an in-process broker, against a model of what the
//!   broker must do (exact for broadcast queues and evictions, conservation
//!   of messages for consumer groups, Admin and metrics agreeing throughout).
//!   Batches on a `Session` (`SessionPublish`, with and without batched
//!   deliveries) are checked against the same model: one answer per
//!   publish, in order, with its id; rejections by index with the code
//!   `Publish` gives; consecutive sequences; the batch limit.
//!
//! Every check panics on a violation; a panic is a finding.

#![allow(dead_code)]

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use prost::Message as _;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;
use tinybroker::broker::Broker;
use tinybroker::config::Limits;
use tinybroker::engine::validate::{MAX_HEADER_BYTES, MAX_HEADERS, MAX_NAME_BYTES, MAX_PATTERNS_PER_SUBSCRIPTION};
use tinybroker::grpc::{AdminService, BrokerService, SUBSCRIPTION_ID_METADATA, take_subscription_body};
use tinybroker::ops::metrics::Metrics;
use tinybroker::pb;
use tinybroker::pb::admin_server::Admin as _;
use tinybroker::pb::broker_server::Broker as _;
use tinybroker::sublist::Sublist;
use tinybroker::topic::{MAX_TOPIC_BYTES, TopicPattern, validate_topic};
use tonic::{Code, Request, Status};

/// What the model checks have seen, over all runs in this process: lets a
/// test show that the checks are not passing vacuously.
pub mod coverage {
    use std::sync::atomic::{AtomicU64, Ordering};

    pub static OPENED: AtomicU64 = AtomicU64::new(0);
    pub static BROADCAST_DELIVERED: AtomicU64 = AtomicU64::new(0);
    pub static GROUP_DELIVERED: AtomicU64 = AtomicU64::new(0);
    pub static REDELIVERED: AtomicU64 = AtomicU64::new(0);
    pub static ACKED: AtomicU64 = AtomicU64::new(0);
    pub static NACKED: AtomicU64 = AtomicU64::new(0);
    pub static EVICTED: AtomicU64 = AtomicU64::new(0);
    pub static DEAD_LETTERED: AtomicU64 = AtomicU64::new(0);
    pub static REFUSED: AtomicU64 = AtomicU64::new(0);

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn report() -> Vec<(&'static str, u64)> {
        [
            ("opened", &OPENED),
            ("broadcast delivered", &BROADCAST_DELIVERED),
            ("group delivered", &GROUP_DELIVERED),
            ("redelivered", &REDELIVERED),
            ("acked", &ACKED),
            ("nacked", &NACKED),
            ("evicted", &EVICTED),
            ("dead-lettered", &DEAD_LETTERED),
            ("refused", &REFUSED),
        ]
        .into_iter()
        .map(|(name, c)| (name, c.load(Ordering::Relaxed)))
        .collect()
    }
}

/// Longest status message any handler may produce: error messages quote
/// client values, and must stay bounded however large those are.
pub const MAX_STATUS_MESSAGE: usize = 4096;

// ===================================================================
// topics and patterns
// ===================================================================

/// The `topic` target: the whole input as one string, and the input split at
/// newlines as a set of patterns and topics for the trie.
pub fn check_topic_input(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        check_topic_str(s);
    }
    let parts: Vec<&str> = data
        .split(|b| *b == b'\n')
        .filter_map(|p| std::str::from_utf8(p).ok())
        .take(64)
        .collect();
    for part in &parts {
        check_topic_str(part);
    }
    check_sublist(&parts);
}

/// The syntax of docs/contract.md (Topics and patterns), written
/// independently of `tinybroker::topic`.
pub fn spec_valid(s: &str, pattern: bool) -> bool {
    if s.is_empty() || s.len() > MAX_TOPIC_BYTES {
        return false;
    }
    let tokens: Vec<&str> = s.split('.').collect();
    let last = tokens.len() - 1;
    tokens.iter().enumerate().all(|(i, t)| {
        let printable = !t.is_empty() && t.bytes().all(|b| (0x21..=0x7e).contains(&b));
        let wildcards = match *t {
            "*" => pattern,
            ">" => pattern && i == last,
            t => !t.contains(['*', '>']),
        };
        printable && wildcards
    })
}

/// NATS matching, written independently of `TopicPattern::matches`.
pub fn spec_matches(pattern: &[&str], topic: &[&str]) -> bool {
    match (pattern.split_first(), topic.split_first()) {
        (None, None) => true,
        (Some((&">", [])), Some(_)) => true,
        (Some((p, prest)), Some((t, trest))) => (*p == "*" || p == t) && spec_matches(prest, trest),
        _ => false,
    }
}

/// One string as a topic and as a pattern.
pub fn check_topic_str(s: &str) {
    let topic = validate_topic(s);
    let pattern = TopicPattern::parse(s);
    assert_eq!(
        topic.is_ok(),
        spec_valid(s, false),
        "topic validity of {s:?}: {topic:?}"
    );
    assert_eq!(
        pattern.is_ok(),
        spec_valid(s, true),
        "pattern validity of {s:?}: {pattern:?}"
    );
    if let Err(e) = &topic {
        let m = e.to_string();
        assert!(m.starts_with("invalid topic "), "{m}");
        // Bounded however bad the value: quoted values are truncated, though
        // `{:?}` escaping can make a control character 6 bytes long.
        assert!(
            m.len() <= MAX_STATUS_MESSAGE,
            "error for a {}-byte topic is {} bytes",
            s.len(),
            m.len()
        );
    }
    if let Err(e) = &pattern {
        let m = e.to_string();
        assert!(m.starts_with("invalid topic pattern "), "{m}");
        assert!(
            m.len() <= MAX_STATUS_MESSAGE,
            "error for a {}-byte pattern is {} bytes",
            s.len(),
            m.len()
        );
    }
    if topic.is_ok() {
        let p = pattern.as_ref().expect("a valid topic is a valid pattern");
        assert!(p.matches(s), "{s:?} as a pattern matches itself as a topic");
    }
    if let Ok(p) = &pattern {
        // Round trip: text, display, tokens, parse again.
        assert_eq!(p.as_str(), s);
        assert_eq!(p.to_string(), s);
        assert_eq!(p.tokens().collect::<Vec<_>>().join("."), s);
        assert_eq!(TopicPattern::parse(&p.to_string()).as_ref(), Ok(p));
        // A topic made from the pattern (each `*` one token, `>` two) is
        // matched by it, as the spec's matcher says.
        let concrete = p.tokens().map(|t| match t {
            "*" => "x",
            ">" => "x.y",
            t => t,
        });
        let concrete = concrete.collect::<Vec<_>>().join(".");
        assert!(p.matches(&concrete), "{s:?} matches {concrete:?}");
        if concrete.len() <= MAX_TOPIC_BYTES {
            assert_eq!(validate_topic(&concrete), Ok(()), "{concrete:?}");
        }
        // The pattern never matches anything with fewer tokens than its
        // fixed part, e.g. its prefix without the last token.
        let tokens: Vec<&str> = p.tokens().collect();
        if tokens.len() > 1 {
            let shorter = tokens[..tokens.len() - 1]
                .iter()
                .map(|t| if *t == "*" { "x" } else { t })
                .collect::<Vec<_>>()
                .join(".");
            assert!(!p.matches(&shorter), "{s:?} must not match {shorter:?}");
        }
    }
}

/// The routing trie (cache on and off) agrees with the reference matcher and
/// the spec's for every valid pattern and topic among `parts`, before and
/// after removing half of the patterns.
pub fn check_sublist(parts: &[&str]) {
    let patterns: Vec<TopicPattern> = parts.iter().filter_map(|p| TopicPattern::parse(p).ok()).collect();
    let mut topics: Vec<String> = parts
        .iter()
        .filter(|t| validate_topic(t).is_ok())
        .map(|t| t.to_string())
        .collect();
    for p in &patterns {
        let concrete: Vec<&str> = p
            .tokens()
            .map(|t| match t {
                "*" => "x",
                ">" => "x.y",
                t => t,
            })
            .collect();
        topics.push(concrete.join("."));
    }
    topics.push("x".into());
    for cache in [0, 2, 64] {
        let mut trie: Sublist<u64> = Sublist::with_cache_capacity(cache);
        let mut live: Vec<(TopicPattern, u64)> = Vec::new();
        for (i, p) in patterns.iter().enumerate() {
            // Ids repeat so that one id sits under several patterns.
            let id = (i % 5) as u64;
            if live.iter().any(|(q, j)| q == p && *j == id) {
                continue;
            }
            trie.insert(p, id, id);
            live.push((p.clone(), id));
        }
        let check = |trie: &Sublist<u64>, live: &[(TopicPattern, u64)]| {
            for topic in &topics {
                let topic_tokens: Vec<&str> = topic.split('.').collect();
                let mut expected: Vec<u64> = live
                    .iter()
                    .filter(|(p, _)| {
                        let naive = p.matches(topic);
                        let spec = spec_matches(&p.tokens().collect::<Vec<_>>(), &topic_tokens);
                        assert_eq!(naive, spec, "pattern {p} vs topic {topic:?}");
                        naive
                    })
                    .map(|(_, id)| *id)
                    .collect();
                expected.sort_unstable();
                expected.dedup();
                assert_eq!(
                    &*trie.matches(topic),
                    &expected[..],
                    "trie for {topic:?} (cache {cache})"
                );
                assert_eq!(&*trie.matches(topic), &expected[..], "again, from the cache");
            }
            assert_eq!(trie.stats().entries, live.len());
        };
        check(&trie, &live);
        let mut i = 0;
        live.retain(|(p, id)| {
            i += 1;
            if i % 2 == 0 {
                assert!(trie.remove(p, *id), "remove {p} {id}");
                false
            } else {
                true
            }
        });
        check(&trie, &live);
        for (p, id) in live.drain(..) {
            assert!(trie.remove(&p, id));
            assert!(!trie.remove(&p, id), "second remove of {p} {id}");
        }
        check(&trie, &live);
    }
}

// ===================================================================
// requests
// ===================================================================

/// The `requests` target: the input decoded as each request type and sent
/// once, then read as an `arbitrary` [`Scenario`] and run against the model.
pub fn check_request_input(data: &[u8]) {
    block_on(async {
        check_decoded_requests(data).await;
        if let Ok(scenario) = Scenario::arbitrary_take_rest(Unstructured::new(data)) {
            run_scenario(scenario).await;
        }
    });
}

/// Runs a future on this thread's runtime, whose clock is paused and only
/// moves when a scenario says so (ack deadlines are deterministic).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a current-thread runtime");
    }
    // Unconstrained: the model polls streams directly and must not see a
    // `Pending` that only means "budget used up".
    RUNTIME.with(|rt| rt.block_on(tokio::task::unconstrained(future)))
}

/// The input as a `PublishRequest`, an `OpenSubscriptionRequest`, an
/// `AckRequest`, a `NackRequest`, a `CloseSubscriptionRequest` and a
/// `PublishStream` body, each sent to a fresh broker (so whatever decodes is
/// tried, and an open subscription is there for the ack to find).
pub async fn check_decoded_requests(data: &[u8]) {
    let mut h = Harness::new(FuzzConfig::default().limits());
    if let Ok(open) = pb::OpenSubscriptionRequest::decode(data) {
        h.open(open.clone()).await;
        // A second member of the same group asking for other patterns is
        // refused (FAILED_PRECONDITION naming both sets, within bounds).
        let mut other = open;
        other.subscription_id.clear();
        other.topic_patterns.iter_mut().for_each(|p| p.insert_str(0, "x."));
        h.open(other).await;
    }
    if let Ok(publish) = pb::PublishRequest::decode(data) {
        h.publish(publish).await;
    }
    h.poll_all().await;
    if let Ok(ack) = pb::AckRequest::decode(data) {
        h.ack(ack.subscription_id, ack.sequences).await;
    }
    if let Ok(nack) = pb::NackRequest::decode(data) {
        h.nack(nack.subscription_id, nack.sequences).await;
    }
    if let Ok(close) = pb::CloseSubscriptionRequest::decode(data) {
        h.admin_close(close.subscription_id).await;
    }
    h.publish_stream_raw(data.to_vec()).await;
    if let Ok(publish) = pb::SessionPublish::decode(data) {
        // As it is, then twice under one id on a batched session that
        // subscribes to everything it publishes.
        h.session_publish(vec![publish.clone()], false).await;
        h.session_publish(vec![publish.clone(), publish], true).await;
    }
    h.check_admin().await;
    h.finish().await;
}

/// Broker limits for a scenario, kept small so that every limit is hit.
#[derive(Arbitrary, Debug, Clone, Default)]
pub struct FuzzConfig {
    pub consumer_capacity: u8,
    pub group_capacity: u8,
    pub default_max_in_flight: u8,
    pub max_delivery_attempts: u8,
    pub max_subscriptions: u8,
    pub max_message_bytes: u16,
    pub max_batch_messages: u8,
}

impl FuzzConfig {
    pub fn limits(&self) -> Limits {
        Limits {
            consumer_capacity: 1 + usize::from(self.consumer_capacity % 8),
            group_capacity: 1 + usize::from(self.group_capacity % 16),
            default_max_in_flight: 1 + u32::from(self.default_max_in_flight % 4),
            default_ack_deadline: Duration::from_millis(1000),
            max_delivery_attempts: u32::from(self.max_delivery_attempts % 4),
            // Groups never expire during a scenario (time only moves to
            // expire ack deadlines, at most ~50 days a step).
            group_idle_ttl: Duration::from_secs(100 * 365 * 24 * 3600),
            max_message_bytes: 1 + usize::from(self.max_message_bytes % 4096),
            max_subscriptions: 1 + usize::from(self.max_subscriptions % 16),
            // 0: the default (1024), else 1 to 16, so batches go over it.
            max_batch_messages: match self.max_batch_messages % 17 {
                0 => Limits::default().max_batch_messages,
                n => usize::from(n),
            },
            ..Limits::default()
        }
    }
}

/// Words the fuzzer picks often: valid and invalid topics, patterns, ids
/// and group names, so that scenarios route, collide and fail often.
pub const WORDS: &[&str] = &[
    "a",
    "b",
    "a.b",
    "a.c",
    "a.b.c",
    "*",
    "a.*",
    "*.b",
    ">",
    "a.>",
    "*.*",
    "*.>",
    "s1",
    "s2",
    "g",
    "h",
    "",
    ">.a",
    "a.>.b",
    "a..b",
    ".a",
    "a.",
    " ",
    "a b",
    "a\tb",
    "\u{e9}",
    "a.\u{e9}",
    "a*",
    "**",
    "_dlq.g",
    "_dlq.*",
    "_dlq.>",
    "\0",
    "x-y_z.1~2!@#$%^&()",
    "A",
    "a.B",
];

/// A string the fuzzer builds: a word, raw text, or a long run (lengths
/// around the 256-byte limits, or much longer).
#[derive(Arbitrary, Debug, Clone)]
pub enum Text {
    Word(u8),
    Raw(String),
    Long { len: u16, dot_every: u8, fill: u8 },
}

impl Text {
    pub fn render(&self) -> String {
        match self {
            Text::Word(i) => WORDS[usize::from(*i) % WORDS.len()].to_owned(),
            Text::Raw(s) => s.clone(),
            Text::Long { len, dot_every, fill } => {
                let len = if *len < 0x8000 {
                    250 + usize::from(*len % 10)
                } else {
                    usize::from(*len % 12_000)
                };
                let fill = match fill % 4 {
                    0 => 'a',
                    1 => '*',
                    2 => ' ',
                    _ => 'x',
                };
                let every = usize::from(*dot_every);
                (0..len)
                    .map(|i| {
                        if every > 0 && i % (every + 1) == every {
                            '.'
                        } else {
                            fill
                        }
                    })
                    .collect()
            }
        }
    }
}

/// A stream (subscription) the scenario opened, by its order of opening.
pub type StreamRef = u8;

/// A sequence number to ack or nack: one the member holds, or any.
#[derive(Arbitrary, Debug, Clone)]
pub enum SeqRef {
    Held(u8),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    Publish {
        topic: Text,
        payload_len: u16,
        headers: Vec<(Text, Text)>,
    },
    PublishStream {
        messages: Vec<(Text, u16)>,
    },
    PublishStreamRaw(Vec<u8>),
    /// Publishes on one `Session`, sent back to back (ids may repeat);
    /// `batched`: the session asks for batched deliveries and subscribes
    /// to everything.
    SessionPublish {
        batched: bool,
        publishes: Vec<(u8, Vec<(Text, u16)>)>,
    },
    Open {
        patterns: Vec<Text>,
        mode: i32,
        id: Text,
        group: Text,
        ack_mode: i32,
        max_in_flight: u32,
        ack_deadline_ms: u32,
    },
    Poll {
        stream: StreamRef,
        max: u8,
    },
    PollAll,
    Drop {
        stream: StreamRef,
    },
    Ack {
        stream: StreamRef,
        sequences: Vec<SeqRef>,
        other_id: Option<Text>,
    },
    Nack {
        stream: StreamRef,
        sequences: Vec<SeqRef>,
        other_id: Option<Text>,
    },
    AdminClose {
        stream: StreamRef,
        other_id: Option<Text>,
    },
    /// Moves the paused clock past every ack deadline and runs the broker's
    /// maintenance tick: every manual-ack message in flight is redelivered.
    ExpireAll,
    CheckAdmin,
    CheckMetrics,
}

#[derive(Arbitrary, Debug, Clone)]
pub struct Scenario {
    pub config: FuzzConfig,
    pub ops: Vec<Op>,
}

/// Small enum values most of the time, any value sometimes.
fn enum_value(raw: i32) -> i32 {
    if raw.rem_euclid(8) < 6 { raw.rem_euclid(3) } else { raw }
}

pub async fn run_scenario(scenario: Scenario) {
    let mut h = Harness::new(scenario.config.limits());
    for op in scenario.ops.into_iter().take(256) {
        h.apply(op).await;
        h.check_admin().await;
    }
    h.check_metrics();
    h.finish().await;
}

// ----- the model -----

struct Sub {
    id: String,
    stream: Option<Deliveries>,
    /// Open as far as the broker is concerned (not dropped, evicted or closed).
    open: bool,
    kind: Kind,
}

enum Kind {
    Broadcast {
        patterns: Vec<TopicPattern>,
        /// Sequences queued for it, in order.
        pending: VecDeque<u64>,
        delivered: u64,
        capacity: usize,
    },
    Member {
        group: String,
        manual: bool,
        ack_deadline: Duration,
        /// Manual: sequences received and not acked, nacked or expired.
        held: BTreeSet<u64>,
    },
}

#[derive(Default)]
struct Group {
    patterns: Vec<TopicPattern>,
    /// The ack mode its first member fixed (MANUAL or not).
    manual: Option<bool>,
    offered: BTreeSet<u64>,
    /// Acked, or streamed to an auto-ack member.
    done: BTreeSet<u64>,
    /// Last attempt number each sequence reached a stream with.
    attempts: HashMap<u64, u32>,
    dead_seen: u64,
}

struct PublishedMessage {
    topic: String,
    payload_len: usize,
    headers: HashMap<String, String>,
}

pub struct Harness {
    broker: Broker,
    service: BrokerService<Broker>,
    admin: AdminService<Broker>,
    metrics: Metrics,
    limits: Limits,
    subs: Vec<Sub>,
    groups: BTreeMap<String, Group>,
    published: HashMap<u64, PublishedMessage>,
    last_sequence: u64,
    evictions: u64,
    /// Publish requests answered on sessions (tinybroker_publish_batch_size
    /// observations), and `deliveries` events sent.
    session_publishes: u64,
    delivery_events: u64,
}

fn check_status(call: &str, status: &Status, allowed: &[Code]) {
    assert!(
        allowed.contains(&status.code()),
        "{call}: code {:?} is not one of {allowed:?}: {}",
        status.code(),
        status.message()
    );
    assert!(
        !status.message().trim().is_empty(),
        "{call}: {:?} with an empty message",
        status.code()
    );
    assert!(
        status.message().len() <= MAX_STATUS_MESSAGE,
        "{call}: {:?} message is {} bytes: {:.200}",
        status.code(),
        status.message().len(),
        status.message()
    );
}

/// A subscription's response body as a client reads it: gRPC frames, each
/// one `Message`, several to a DATA frame, then the trailers.
struct Deliveries {
    body: tonic::body::Body,
    decoded: VecDeque<pb::Message>,
}

/// The next delivery, decoded as a client would from the bytes the body
/// sends (`grpc::SubscriptionBody`); the trailers as the stream's status.
fn poll_once(stream: &mut Deliveries) -> Poll<Option<Result<pb::Message, Status>>> {
    use http_body::Body as _;
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Some(message) = stream.decoded.pop_front() {
            return Poll::Ready(Some(Ok(message)));
        }
        let Some(frame) = ready!(Pin::new(&mut stream.body).poll_frame(&mut cx)) else {
            return Poll::Ready(None);
        };
        let frame = frame.expect("a subscription's body does not fail");
        let frame = match frame.into_data() {
            Ok(mut data) => {
                while !data.is_empty() {
                    assert!(data.len() >= 5 && data[0] == 0, "an uncompressed gRPC frame");
                    let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
                    let message = data.slice(5..5 + len);
                    data = data.slice(5 + len..);
                    let message =
                        <pb::Message as prost::Message>::decode(message).expect("a delivery decodes as a Message");
                    stream.decoded.push_back(message);
                }
                continue;
            }
            Err(frame) => frame,
        };
        let trailers = frame.into_trailers().expect("a data frame or the trailers");
        let status = Status::from_header_map(&trailers).expect("the trailers carry a status");
        return Poll::Ready(Some(Err(status)));
    }
}

fn publish_expectation(req: &pb::PublishRequest, max_message_bytes: usize) -> Option<Code> {
    if validate_topic(&req.topic).is_err() || req.headers.len() > MAX_HEADERS {
        return Some(Code::InvalidArgument);
    }
    let mut size = req.payload.len();
    for (k, v) in &req.headers {
        if k.is_empty() || k.len() > MAX_HEADER_BYTES || v.len() > MAX_HEADER_BYTES {
            return Some(Code::InvalidArgument);
        }
        size += k.len() + v.len();
    }
    (size > max_message_bytes).then_some(Code::ResourceExhausted)
}

fn name_ok(s: &str) -> bool {
    s.len() <= MAX_NAME_BYTES && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

fn frame(messages: &[pb::PublishRequest]) -> Vec<u8> {
    let mut body = Vec::new();
    for m in messages {
        let bytes = m.encode_to_vec();
        body.push(0);
        body.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        body.extend_from_slice(&bytes);
    }
    body
}

/// Splits a gRPC body into uncompressed frames the way a reader would,
/// stopping at the first one that is compressed, cut short or undecodable.
fn unframe(mut body: &[u8]) -> Vec<pb::PublishRequest> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if body[0] != 0 || body.len() - 5 < len {
            break;
        }
        match pb::PublishRequest::decode(&body[5..5 + len]) {
            Ok(m) => out.push(m),
            Err(_) => break,
        }
        body = &body[5 + len..];
    }
    out
}

impl Harness {
    pub fn new(limits: Limits) -> Self {
        let broker = Broker::new(limits.clone());
        let metrics = Metrics::new(broker.clone(), true);
        Self {
            service: BrokerService::new(broker.clone(), metrics.clone()),
            admin: AdminService::new(broker.clone(), false, false),
            broker,
            metrics,
            limits,
            subs: Vec::new(),
            groups: BTreeMap::new(),
            published: HashMap::new(),
            last_sequence: 0,
            evictions: 0,
            session_publishes: 0,
            delivery_events: 0,
        }
    }

    fn open_count(&self) -> usize {
        self.subs.iter().filter(|s| s.open).count()
    }

    fn sub_index(&self, r: StreamRef) -> Option<usize> {
        (!self.subs.is_empty()).then(|| usize::from(r) % self.subs.len())
    }

    pub async fn apply(&mut self, op: Op) {
        match op {
            Op::Publish {
                topic,
                payload_len,
                headers,
            } => {
                let req = pb::PublishRequest {
                    topic: topic.render(),
                    payload: vec![b'p'; usize::from(payload_len) % 5000].into(),
                    headers: headers.iter().take(80).map(|(k, v)| (k.render(), v.render())).collect(),
                };
                self.publish(req).await;
            }
            Op::PublishStream { messages } => {
                let reqs = messages
                    .iter()
                    .take(64)
                    .map(|(t, len)| pb::PublishRequest {
                        topic: t.render(),
                        payload: vec![b's'; usize::from(*len) % 5000].into(),
                        headers: HashMap::new(),
                    })
                    .collect::<Vec<_>>();
                self.publish_stream(reqs).await;
            }
            Op::PublishStreamRaw(body) => self.publish_stream_raw(body).await,
            Op::SessionPublish { batched, publishes } => {
                let publishes = publishes
                    .iter()
                    .take(8)
                    .map(|(id, messages)| pb::SessionPublish {
                        id: u64::from(*id % 4),
                        messages: messages
                            .iter()
                            .take(40)
                            .map(|(t, len)| pb::PublishRequest {
                                topic: t.render(),
                                payload: vec![b'b'; usize::from(*len) % 3000].into(),
                                headers: HashMap::new(),
                            })
                            .collect(),
                    })
                    .collect();
                self.session_publish(publishes, batched).await;
            }
            Op::Open {
                patterns,
                mode,
                id,
                group,
                ack_mode,
                max_in_flight,
                ack_deadline_ms,
            } => {
                let req = pb::OpenSubscriptionRequest {
                    topic_patterns: patterns.iter().take(70).map(Text::render).collect(),
                    mode: enum_value(mode),
                    subscription_id: id.render(),
                    consumer_group: group.render(),
                    ack_mode: enum_value(ack_mode),
                    max_in_flight: if max_in_flight < 1 << 31 {
                        max_in_flight % 6
                    } else {
                        max_in_flight
                    },
                    ack_deadline_ms,
                };
                self.open(req).await;
            }
            Op::Poll { stream, max } => {
                if let Some(i) = self.sub_index(stream) {
                    self.poll(i, usize::from(max)).await;
                }
            }
            Op::PollAll => self.poll_all().await,
            Op::Drop { stream } => {
                if let Some(i) = self.sub_index(stream) {
                    self.drop_stream(i).await;
                }
            }
            Op::Ack {
                stream,
                sequences,
                other_id,
            } => {
                let (id, seqs) = self.ack_args(stream, &sequences, other_id.as_ref());
                self.ack(id, seqs).await;
            }
            Op::Nack {
                stream,
                sequences,
                other_id,
            } => {
                let (id, seqs) = self.ack_args(stream, &sequences, other_id.as_ref());
                self.nack(id, seqs).await;
            }
            Op::AdminClose { stream, other_id } => {
                let id = match (&other_id, self.sub_index(stream)) {
                    (Some(t), _) => t.render(),
                    (None, Some(i)) => self.subs[i].id.clone(),
                    (None, None) => String::new(),
                };
                self.admin_close(id).await;
            }
            Op::ExpireAll => self.expire_all().await,
            Op::CheckAdmin => self.check_admin().await,
            Op::CheckMetrics => self.check_metrics(),
        }
    }
}

impl Harness {
    fn ack_args(&self, stream: StreamRef, sequences: &[SeqRef], other_id: Option<&Text>) -> (String, Vec<u64>) {
        let target = self.sub_index(stream);
        let id = match (other_id, target) {
            (Some(t), _) => t.render(),
            (None, Some(i)) => self.subs[i].id.clone(),
            (None, None) => String::new(),
        };
        let held: Vec<u64> = match target.map(|i| &self.subs[i].kind) {
            Some(Kind::Member { held, .. }) => held.iter().copied().collect(),
            _ => Vec::new(),
        };
        let seqs = sequences
            .iter()
            .take(100)
            .filter_map(|s| match s {
                SeqRef::Held(i) if !held.is_empty() => Some(held[usize::from(*i) % held.len()]),
                SeqRef::Held(_) => None,
                SeqRef::Raw(seq) => Some(*seq),
            })
            .collect();
        (id, seqs)
    }

    /// What the open member `id` holds (received, not acked), by sequence.
    pub fn held(&self, id: &str) -> Vec<u64> {
        match self.open_sub(id).map(|i| &self.subs[i].kind) {
            Some(Kind::Member { held, .. }) => held.iter().copied().collect(),
            _ => Vec::new(),
        }
    }

    fn open_sub(&self, id: &str) -> Option<usize> {
        let mut found = self.subs.iter().enumerate().filter(|(_, s)| s.open && s.id == id);
        let first = found.next().map(|(i, _)| i);
        assert!(found.next().is_none(), "two open subscriptions with id {id:?}");
        first
    }

    /// Routes a message the way docs/contract.md (Delivery) says: to every open broadcast
    /// subscription with a matching pattern (evicting one whose queue is
    /// full) and to every group with matching patterns.
    fn route(&mut self, seq: u64, message: PublishedMessage) -> (u32, u32) {
        let topic = message.topic.clone();
        self.published.insert(seq, message);
        let mut matched = (0, 0);
        for sub in self.subs.iter_mut().filter(|s| s.open) {
            if let Kind::Broadcast {
                patterns,
                pending,
                capacity,
                ..
            } = &mut sub.kind
                && patterns.iter().any(|p| p.matches(&topic))
            {
                if pending.len() >= *capacity {
                    sub.open = false;
                    pending.clear();
                    self.evictions += 1;
                    coverage::add(&coverage::EVICTED, 1);
                } else {
                    pending.push_back(seq);
                    matched.0 += 1;
                }
            }
        }
        for group in self.groups.values_mut() {
            if group.patterns.iter().any(|p| p.matches(&topic)) {
                group.offered.insert(seq);
                matched.1 += 1;
            }
        }
        matched
    }

    /// Sequences handed out besides publishes are dead letters: each group's
    /// new ones go to `_dlq.<group>`, groups in name order (as the broker's
    /// maintenance tick visits them).
    fn account_dead_letters(&mut self) {
        let mut letters = Vec::new();
        for group in self.broker.groups() {
            let model = self
                .groups
                .get_mut(&group.name)
                .unwrap_or_else(|| panic!("broker has group {:?} the model never opened", group.name));
            let dead = group.dead_lettered;
            assert!(dead >= model.dead_seen, "dead_lettered went down");
            for _ in model.dead_seen..dead {
                letters.push(group.name.clone());
            }
            coverage::add(&coverage::DEAD_LETTERED, dead - model.dead_seen);
            model.dead_seen = dead;
        }
        assert_eq!(
            self.broker.last_sequence() - self.last_sequence,
            letters.len() as u64,
            "every sequence not from a publish is a dead letter"
        );
        for name in letters {
            self.last_sequence += 1;
            let message = PublishedMessage {
                topic: format!("_dlq.{name}"),
                payload_len: usize::MAX,
                headers: HashMap::new(),
            };
            self.route(self.last_sequence, message);
        }
    }

    pub async fn publish(&mut self, req: pb::PublishRequest) {
        let expected = publish_expectation(&req, self.limits.max_message_bytes);
        let message = PublishedMessage {
            topic: req.topic.clone(),
            payload_len: req.payload.len(),
            headers: req.headers.clone(),
        };
        let topic_ok = validate_topic(&req.topic).is_ok();
        match (self.service.publish(Request::new(req)).await, expected) {
            (Ok(response), None) => {
                let r = response.into_inner();
                assert_eq!(r.sequence, self.last_sequence + 1, "sequences have no gaps");
                self.last_sequence = r.sequence;
                let matched = self.route(r.sequence, message);
                assert_eq!((r.matched_subscriptions, r.matched_groups), matched, "matched counts");
            }
            (Err(status), Some(code)) => {
                check_status("Publish", &status, &[code]);
                if !topic_ok {
                    assert!(status.message().contains("invalid topic"), "{}", status.message());
                }
            }
            (result, expected) => panic!(
                "Publish to {:?}: expected {expected:?}, got {:?}",
                message.topic,
                result.map(|r| r.into_inner())
            ),
        }
        assert_eq!(self.broker.last_sequence(), self.last_sequence);
    }

    async fn call_publish_stream(&self, body: Vec<u8>) -> Result<pb::PublishStreamResponse, Status> {
        let limit = tinybroker::grpc::decoding_limit(self.limits.max_message_bytes);
        let body = http_body_util::Full::new(Bytes::from(body));
        let decoder = tonic_prost::ProstDecoder::<pb::PublishRequest>::default();
        let streaming = tonic::Streaming::new_request(decoder, body, None, Some(limit));
        self.service
            .publish_stream(Request::new(streaming))
            .await
            .map(|r| r.into_inner())
    }

    /// Routes the first `accepted` messages of a stream.
    fn accept_stream(&mut self, messages: &[pb::PublishRequest], accepted: usize) {
        for m in &messages[..accepted] {
            self.last_sequence += 1;
            let message = PublishedMessage {
                topic: m.topic.clone(),
                payload_len: m.payload.len(),
                headers: m.headers.clone(),
            };
            self.route(self.last_sequence, message);
        }
    }

    pub async fn publish_stream(&mut self, messages: Vec<pb::PublishRequest>) {
        let limit = tinybroker::grpc::decoding_limit(self.limits.max_message_bytes);
        let first_bad = messages.iter().enumerate().find_map(|(i, m)| {
            if m.encoded_len() > limit {
                return Some((i, Code::ResourceExhausted));
            }
            publish_expectation(m, self.limits.max_message_bytes).map(|c| (i, c))
        });
        let result = self.call_publish_stream(frame(&messages)).await;
        let accepted = (self.broker.last_sequence() - self.last_sequence) as usize;
        let first = self.last_sequence + 1;
        match (result, first_bad) {
            (Ok(r), None) => {
                assert_eq!(r.accepted as usize, messages.len());
                assert_eq!(accepted, messages.len());
                if accepted > 0 {
                    assert_eq!(
                        (r.first_sequence, r.last_sequence),
                        (first, first + accepted as u64 - 1)
                    );
                }
            }
            (Err(status), Some((i, code))) => {
                check_status("PublishStream", &status, &[code]);
                assert_eq!(accepted, i, "messages before the first bad one stay published");
                let said = format!("{i} earlier messages");
                assert!(status.message().contains(&said), "{}", status.message());
            }
            (result, expected) => panic!("PublishStream: expected {expected:?}, got {result:?}"),
        }
        self.accept_stream(&messages, accepted);
    }

    pub async fn publish_stream_raw(&mut self, body: Vec<u8>) {
        let frames = unframe(&body);
        let result = self.call_publish_stream(body).await;
        let accepted = (self.broker.last_sequence() - self.last_sequence) as usize;
        assert!(
            accepted <= frames.len(),
            "{accepted} accepted of {} frames",
            frames.len()
        );
        for m in &frames[..accepted] {
            assert_eq!(publish_expectation(m, self.limits.max_message_bytes), None, "{m:?}");
        }
        match result {
            Ok(r) => {
                assert_eq!(r.accepted as usize, accepted);
                assert_eq!(accepted, frames.len());
            }
            Err(status) => {
                // A body that is not a sequence of protobuf frames is turned
                // away by tonic's decoder (INTERNAL) before the handler sees it.
                let mut allowed = vec![Code::InvalidArgument, Code::ResourceExhausted, Code::Internal];
                allowed.push(Code::Unimplemented);
                check_status("PublishStream (raw body)", &status, &allowed);
                if let Some(next) = frames.get(accepted) {
                    let limit = tinybroker::grpc::decoding_limit(self.limits.max_message_bytes);
                    assert!(
                        next.encoded_len() > limit
                            || publish_expectation(next, self.limits.max_message_bytes).is_some(),
                        "a valid message ended the stream: {status:?}"
                    );
                }
            }
        }
        self.accept_stream(&frames, accepted);
    }

    fn open_expectation(&self, req: &pb::OpenSubscriptionRequest) -> Option<Code> {
        let group_mode = match req.mode {
            0 | 1 => false,
            2 => true,
            _ => return Some(Code::InvalidArgument),
        };
        if !(0..=2).contains(&req.ack_mode)
            || req.topic_patterns.is_empty()
            || req.topic_patterns.len() > MAX_PATTERNS_PER_SUBSCRIPTION
            || req.topic_patterns.iter().any(|p| !spec_valid(p, true))
        {
            return Some(Code::InvalidArgument);
        }
        let group = &req.consumer_group;
        let group_ok = match group_mode {
            false => group.is_empty(),
            true => !group.is_empty() && name_ok(group) && spec_valid(&format!("_dlq.{group}"), false),
        };
        if !group_ok || !name_ok(&req.subscription_id) {
            return Some(Code::InvalidArgument);
        }
        if group_mode && let Some(g) = self.groups.get(group) {
            let mut wanted: Vec<&str> = req.topic_patterns.iter().map(String::as_str).collect();
            wanted.sort_unstable();
            wanted.dedup();
            if g.patterns.iter().map(TopicPattern::as_str).collect::<Vec<_>>() != wanted
                || g.manual.is_some_and(|manual| manual != (req.ack_mode == 2))
            {
                return Some(Code::FailedPrecondition);
            }
        }
        if !req.subscription_id.is_empty() && self.open_sub(&req.subscription_id).is_some() {
            return Some(Code::AlreadyExists);
        }
        (self.open_count() >= self.limits.max_subscriptions).then_some(Code::ResourceExhausted)
    }

    pub async fn open(&mut self, req: pb::OpenSubscriptionRequest) {
        let expected = self.open_expectation(&req);
        let result = self.service.open_subscription(Request::new(req.clone())).await;
        let mut response = match (result, expected) {
            (Ok(response), None) => response,
            (Err(status), Some(code)) => {
                check_status("OpenSubscription", &status, &[code]);
                coverage::add(&coverage::REFUSED, 1);
                return;
            }
            (result, expected) => panic!(
                "OpenSubscription {req:?}: expected {expected:?}, got {:?}",
                result.map(|_| "a stream")
            ),
        };
        let id = response
            .metadata()
            .get(SUBSCRIPTION_ID_METADATA)
            .expect("the id is in the response metadata")
            .to_str()
            .expect("an ASCII id")
            .to_owned();
        if req.subscription_id.is_empty() {
            assert!(!id.is_empty() && name_ok(&id), "generated id {id:?}");
        } else {
            assert_eq!(id, req.subscription_id);
        }
        assert!(self.open_sub(&id).is_none(), "{id:?} opened twice");
        let mut patterns: Vec<TopicPattern> = req
            .topic_patterns
            .iter()
            .map(|p| TopicPattern::parse(p).expect("accepted patterns parse"))
            .collect();
        patterns.sort();
        patterns.dedup();
        let kind = if req.mode == 2 {
            let group = self.groups.entry(req.consumer_group.clone()).or_default();
            let manual = req.ack_mode == 2;
            if group.patterns.is_empty() {
                group.patterns = patterns;
                group.manual = Some(manual);
            }
            Kind::Member {
                group: req.consumer_group.clone(),
                manual,
                ack_deadline: match req.ack_deadline_ms {
                    0 => self.limits.default_ack_deadline,
                    ms => Duration::from_millis(ms.into()),
                },
                held: BTreeSet::new(),
            }
        } else {
            Kind::Broadcast {
                patterns,
                pending: VecDeque::new(),
                delivered: 0,
                capacity: self.limits.consumer_capacity,
            }
        };
        coverage::add(&coverage::OPENED, 1);
        self.subs.push(Sub {
            id,
            stream: Some(Deliveries {
                body: take_subscription_body(&mut response).expect("the handler made the subscription's body"),
                decoded: VecDeque::new(),
            }),
            open: true,
            kind,
        });
    }

    pub async fn poll_all(&mut self) {
        for i in 0..self.subs.len() {
            self.poll(i, usize::MAX).await;
        }
    }

    pub async fn poll(&mut self, index: usize, max: usize) {
        for _ in 0..max.clamp(1, 10_000) {
            let sub = &mut self.subs[index];
            let Some(stream) = sub.stream.as_mut() else {
                return;
            };
            let message = match poll_once(stream) {
                Poll::Pending => {
                    assert!(sub.open, "the stream of closed subscription {:?} did not end", sub.id);
                    if let Kind::Broadcast { pending, .. } = &sub.kind {
                        assert!(
                            pending.is_empty(),
                            "{:?} has {} queued, yet nothing came",
                            sub.id,
                            pending.len()
                        );
                    }
                    return;
                }
                // The stream's end: an OK status whose trailers say why
                // (tonic sends it as the trailers), then nothing more.
                Poll::Ready(Some(Err(status))) if status.code() == Code::Ok => {
                    assert!(!sub.open, "the stream of open subscription {:?} ended", sub.id);
                    assert!(
                        status.metadata().get("tinybroker-end-reason").is_some(),
                        "the end of {:?} says why: {status:?}",
                        sub.id
                    );
                    assert!(matches!(poll_once(stream), Poll::Ready(None)), "{:?} ends once", sub.id);
                    sub.stream = None;
                    return;
                }
                Poll::Ready(None) => {
                    assert!(!sub.open, "the stream of open subscription {:?} ended", sub.id);
                    sub.stream = None;
                    return;
                }
                Poll::Ready(Some(Err(status))) => panic!("subscription {:?} failed: {status:?}", sub.id),
                Poll::Ready(Some(Ok(m))) => m,
            };
            assert!(sub.open, "closed subscription {:?} got {message:?}", sub.id);
            assert_eq!(message.subscription_id, sub.id);
            assert!(message.publish_time.is_some());
            let published = self
                .published
                .get(&message.sequence)
                .unwrap_or_else(|| panic!("{:?} got unknown sequence {}", sub.id, message.sequence));
            assert_eq!(message.topic, published.topic);
            if published.payload_len != usize::MAX {
                assert_eq!(message.payload.len(), published.payload_len);
                assert_eq!(message.headers, published.headers);
            }
            match &mut sub.kind {
                Kind::Broadcast { pending, delivered, .. } => {
                    assert_eq!(
                        pending.pop_front(),
                        Some(message.sequence),
                        "broadcast order of {:?}",
                        sub.id
                    );
                    assert_eq!(message.delivery_attempt, 1);
                    assert_eq!(message.consumer_group, "");
                    *delivered += 1;
                    coverage::add(&coverage::BROADCAST_DELIVERED, 1);
                }
                Kind::Member {
                    group, manual, held, ..
                } => {
                    assert_eq!(&message.consumer_group, group);
                    let g = self.groups.get_mut(group.as_str()).expect("the member's group");
                    assert!(g.patterns.iter().any(|p| p.matches(&message.topic)));
                    let seq = message.sequence;
                    assert!(g.offered.contains(&seq), "{seq} was never offered to {group:?}");
                    assert!(
                        !g.done.contains(&seq),
                        "{seq} of {group:?} delivered again after it was done"
                    );
                    let attempt = g.attempts.entry(seq).or_insert(0);
                    assert_eq!(message.delivery_attempt, *attempt + 1, "attempt of {seq} in {group:?}");
                    *attempt += 1;
                    coverage::add(&coverage::GROUP_DELIVERED, 1);
                    coverage::add(&coverage::REDELIVERED, u64::from(*attempt > 1));
                    if *manual {
                        assert!(held.insert(seq), "{seq} held twice by {:?}", sub.id);
                    } else {
                        g.done.insert(seq);
                    }
                }
            }
        }
    }

    /// The member forgets what it held; the broker redelivers it.
    fn close_in_model(&mut self, index: usize) {
        let sub = &mut self.subs[index];
        sub.open = false;
        match &mut sub.kind {
            Kind::Broadcast { pending, .. } => pending.clear(),
            Kind::Member { held, .. } => held.clear(),
        }
        self.account_dead_letters();
    }

    pub async fn drop_stream(&mut self, index: usize) {
        drop(self.subs[index].stream.take());
        if self.subs[index].open {
            self.close_in_model(index);
        }
        assert_eq!(self.broker.last_sequence(), self.last_sequence);
    }

    /// Leaves out sequences whose fate the model cannot know: offered to the
    /// member's group and maybe waiting in its queue (acking those works and
    /// is right, but the model would not know which message was done).
    fn knowable(&self, id: &str, sequences: Vec<u64>) -> Vec<u64> {
        let Some(i) = self.open_sub(id) else {
            return sequences;
        };
        let Kind::Member { group, held, .. } = &self.subs[i].kind else {
            return sequences;
        };
        let g = &self.groups[group];
        let held_by_others: HashSet<u64> = self
            .subs
            .iter()
            .filter(|s| s.open)
            .filter_map(|s| match &s.kind {
                Kind::Member { group: other, held, .. } if other == group => Some(held),
                _ => None,
            })
            .flatten()
            .copied()
            .collect();
        sequences
            .into_iter()
            .filter(|s| held.contains(s) || !g.offered.contains(s) || g.done.contains(s) || held_by_others.contains(s))
            .collect()
    }

    /// (expected error, sequences the member holds among `sequences`).
    fn ack_expectation(&self, id: &str, sequences: &[u64]) -> Result<BTreeSet<u64>, Code> {
        if id.is_empty() || sequences.is_empty() {
            return Err(Code::InvalidArgument);
        }
        let i = self.open_sub(id).ok_or(Code::NotFound)?;
        Ok(match &self.subs[i].kind {
            Kind::Member { held, .. } => sequences.iter().filter(|s| held.contains(s)).copied().collect(),
            Kind::Broadcast { .. } => BTreeSet::new(),
        })
    }

    pub async fn ack(&mut self, id: String, sequences: Vec<u64>) {
        let sequences = self.knowable(&id, sequences);
        let expected = self.ack_expectation(&id, &sequences);
        let req = pb::AckRequest {
            subscription_id: id.clone(),
            sequences: sequences.clone(),
        };
        match (self.service.ack(Request::new(req)).await, expected) {
            (Ok(r), Ok(held)) => {
                let r = r.into_inner();
                assert_eq!(r.acked as usize, held.len(), "acked of {sequences:?}");
                coverage::add(&coverage::ACKED, held.len() as u64);
                assert_eq!((r.acked + r.unknown) as usize, sequences.len());
                let i = self.open_sub(&id).expect("acked on an open subscription");
                if let Kind::Member { group, held: h, .. } = &mut self.subs[i].kind {
                    let g = self.groups.get_mut(group.as_str()).expect("group");
                    for seq in held {
                        h.remove(&seq);
                        assert!(g.done.insert(seq), "{seq} acked twice");
                    }
                }
            }
            (Err(status), Err(code)) => check_status("Ack", &status, &[code]),
            (result, expected) => panic!("Ack {id:?} {sequences:?}: expected {expected:?}, got {result:?}"),
        }
        assert_eq!(self.broker.last_sequence(), self.last_sequence);
    }

    pub async fn nack(&mut self, id: String, sequences: Vec<u64>) {
        let sequences = self.knowable(&id, sequences);
        let expected = self.ack_expectation(&id, &sequences);
        let req = pb::NackRequest {
            subscription_id: id.clone(),
            sequences: sequences.clone(),
        };
        match (self.service.nack(Request::new(req)).await, expected) {
            (Ok(r), Ok(held)) => {
                let r = r.into_inner();
                assert_eq!(r.requeued as usize, held.len(), "requeued of {sequences:?}");
                coverage::add(&coverage::NACKED, held.len() as u64);
                assert_eq!((r.requeued + r.unknown) as usize, sequences.len());
                let i = self.open_sub(&id).expect("nacked on an open subscription");
                if let Kind::Member { held: h, .. } = &mut self.subs[i].kind {
                    for seq in held {
                        h.remove(&seq);
                    }
                }
            }
            (Err(status), Err(code)) => check_status("Nack", &status, &[code]),
            (result, expected) => panic!("Nack {id:?} {sequences:?}: expected {expected:?}, got {result:?}"),
        }
        self.account_dead_letters();
    }

    pub async fn admin_close(&mut self, id: String) {
        let expected = if id.is_empty() {
            Err(Code::InvalidArgument)
        } else {
            self.open_sub(&id).ok_or(Code::NotFound)
        };
        let req = pb::CloseSubscriptionRequest {
            subscription_id: id.clone(),
        };
        match (self.admin.close_subscription(Request::new(req)).await, expected) {
            (Ok(_), Ok(i)) => self.close_in_model(i),
            (Err(status), Err(code)) => check_status("CloseSubscription", &status, &[code]),
            (result, expected) => panic!("CloseSubscription {id:?}: expected {expected:?}, got {result:?}"),
        }
        assert_eq!(self.broker.last_sequence(), self.last_sequence);
    }

    pub async fn expire_all(&mut self) {
        let longest = self
            .subs
            .iter()
            .filter(|s| s.open)
            .filter_map(|s| match &s.kind {
                Kind::Member { ack_deadline, .. } => Some(*ack_deadline),
                Kind::Broadcast { .. } => None,
            })
            .max()
            .unwrap_or_default();
        tokio::time::advance(longest + Duration::from_millis(1)).await;
        self.broker.tick(tokio::time::Instant::now());
        for sub in &mut self.subs {
            if let Kind::Member { held, .. } = &mut sub.kind {
                held.clear();
            }
        }
        self.account_dead_letters();
    }

    /// Admin agrees with the model: the open subscriptions (ids, modes,
    /// patterns, broadcast queue depths and delivered counts), the groups
    /// and their members, the evictions, and the broker info.
    pub async fn check_admin(&mut self) {
        let listed = self
            .admin
            .list_subscriptions(Request::new(pb::ListSubscriptionsRequest {}))
            .await
            .expect("ListSubscriptions")
            .into_inner()
            .subscriptions;
        let mut by_id = BTreeMap::new();
        for info in listed {
            let id = info.subscription_id.clone();
            assert!(by_id.insert(id.clone(), info).is_none(), "{id:?} listed twice");
        }
        let open: BTreeSet<&str> = self.subs.iter().filter(|s| s.open).map(|s| s.id.as_str()).collect();
        assert_eq!(
            by_id.keys().map(String::as_str).collect::<BTreeSet<_>>(),
            open,
            "open subscriptions"
        );
        let mut members: BTreeMap<&str, u32> = self.groups.keys().map(|g| (g.as_str(), 0)).collect();
        for sub in self.subs.iter().filter(|s| s.open) {
            let info = &by_id[&sub.id];
            match &sub.kind {
                Kind::Broadcast {
                    patterns,
                    pending,
                    delivered,
                    capacity,
                } => {
                    assert_eq!(info.mode, pb::DeliveryMode::Multi as i32);
                    assert_eq!(info.consumer_group, "");
                    let names: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
                    assert_eq!(info.topic_patterns, names);
                    assert_eq!(info.queue_depth as usize, pending.len(), "queue depth of {:?}", sub.id);
                    assert_eq!(info.delivered, *delivered, "delivered by {:?}", sub.id);
                    assert_eq!(info.capacity as usize, *capacity);
                }
                Kind::Member { group, manual, .. } => {
                    assert_eq!(info.mode, pb::DeliveryMode::Single as i32);
                    assert_eq!(&info.consumer_group, group);
                    let ack = if *manual {
                        pb::AckMode::Manual
                    } else {
                        pb::AckMode::Auto
                    };
                    assert_eq!(info.ack_mode, ack as i32);
                    *members.get_mut(group.as_str()).expect("group") += 1;
                }
            }
        }
        let groups = self
            .admin
            .list_consumer_groups(Request::new(pb::ListConsumerGroupsRequest {}))
            .await
            .expect("ListConsumerGroups")
            .into_inner()
            .groups;
        let listed: BTreeMap<&str, u32> = groups.iter().map(|g| (g.name.as_str(), g.members)).collect();
        assert_eq!(listed, members, "groups and their members");
        for g in &groups {
            let names: Vec<String> = self.groups[&g.name].patterns.iter().map(|p| p.to_string()).collect();
            assert_eq!(g.topic_patterns, names);
        }
        let evictions = self
            .admin
            .list_evictions(Request::new(pb::ListEvictionsRequest {}))
            .await
            .expect("ListEvictions")
            .into_inner()
            .evictions;
        assert_eq!(evictions.len() as u64, self.evictions.min(1024), "evictions listed");
        let info = self
            .admin
            .get_broker_info(Request::new(pb::GetBrokerInfoRequest {}))
            .await
            .expect("GetBrokerInfo")
            .into_inner();
        assert_eq!(info.subscriptions as usize, open.len());
        assert_eq!(info.consumer_groups as usize, self.groups.len());
        assert_eq!(info.last_sequence, self.last_sequence);
    }

    /// `/metrics` agrees with the model too.
    pub fn check_metrics(&self) {
        let text = self.metrics.render();
        let open = self.subs.iter().filter(|s| s.open).count() as f64;
        assert_eq!(metric_sum(&text, "tinybroker_subscriptions"), open, "{text}");
        let series = text
            .lines()
            .filter(|l| l.starts_with("tinybroker_subscription_queue_depth{"))
            .count();
        assert_eq!(series as f64, open, "one queue-depth series per subscription");
        assert_eq!(metric_sum(&text, "tinybroker_evictions_total"), self.evictions as f64);
        assert_eq!(
            metric_sum(&text, "tinybroker_messages_published_total"),
            self.last_sequence as f64
        );
        let members = self
            .subs
            .iter()
            .filter(|s| s.open && matches!(s.kind, Kind::Member { .. }))
            .count();
        assert_eq!(metric_sum(&text, "tinybroker_consumer_group_members"), members as f64);
        assert_eq!(
            metric_sum(&text, "tinybroker_publish_batch_size_count"),
            self.session_publishes as f64,
            "one publish_batch_size observation per session publish"
        );
        assert_eq!(
            metric_sum(&text, "tinybroker_delivery_batch_size_count"),
            self.delivery_events as f64,
            "one delivery_batch_size observation per deliveries event"
        );
    }

    /// Closes everything, drains every group with a fresh auto-ack member,
    /// and checks that no group message was lost unaccounted: each one
    /// offered was acked, streamed to an auto-ack member, drained now, or
    /// counted as dropped (backlog overflow) or dead-lettered.
    pub async fn finish(mut self) {
        self.poll_all().await;
        for i in 0..self.subs.len() {
            self.drop_stream(i).await;
        }
        self.check_admin().await;
        self.check_metrics();
        let names: Vec<String> = self.groups.keys().cloned().collect();
        for name in &names {
            let patterns: Vec<String> = self.groups[name].patterns.iter().map(|p| p.to_string()).collect();
            // With the group's own ack mode (fixed by its first member).
            let manual = self.groups[name].manual == Some(true);
            self.open(pb::OpenSubscriptionRequest {
                topic_patterns: patterns,
                mode: pb::DeliveryMode::Single as i32,
                consumer_group: name.clone(),
                ack_mode: if manual { pb::AckMode::Manual } else { pb::AckMode::Auto } as i32,
                max_in_flight: u32::MAX,
                ..Default::default()
            })
            .await;
            let drain = self.subs.len() - 1;
            assert!(self.subs[drain].open, "the drain member of {name:?} opened");
            self.poll(drain, usize::MAX).await;
            if let Kind::Member { held, .. } = &self.subs[drain].kind
                && !held.is_empty()
            {
                let (id, sequences) = (self.subs[drain].id.clone(), held.iter().copied().collect());
                self.ack(id, sequences).await;
            }
            self.drop_stream(drain).await;
        }
        let groups = self
            .admin
            .list_consumer_groups(Request::new(pb::ListConsumerGroupsRequest {}))
            .await
            .expect("ListConsumerGroups")
            .into_inner()
            .groups;
        for info in groups {
            let g = &self.groups[&info.name];
            let lost = g.offered.difference(&g.done).count() as u64;
            assert_eq!(
                lost,
                info.dropped + info.dead_lettered,
                "group {:?}: offered {}, done {}, dropped {}, dead-lettered {}",
                info.name,
                g.offered.len(),
                g.done.len(),
                info.dropped,
                info.dead_lettered
            );
            assert_eq!((info.members, info.backlog, info.in_flight), (0, 0, 0), "{info:?}");
        }
        assert_eq!(self.broker.subscription_count(), 0);
    }
}

// ----- batches on a session -----

/// The most bytes of deliveries in one `deliveries` event, unless it holds
/// one delivery (docs/contract.md, "Batches").
pub const DELIVERIES_BOUND: usize = 64 * 1024;

/// Session requests as a gRPC request body.
fn frame_requests(requests: &[pb::SessionRequest]) -> Vec<u8> {
    let mut body = Vec::new();
    for r in requests {
        let bytes = r.encode_to_vec();
        body.push(0);
        body.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        body.extend_from_slice(&bytes);
    }
    body
}

/// What a session's response body brought: its events and its status.
struct SessionRun {
    events: Vec<pb::session_event::Event>,
    status: Status,
}

impl Harness {
    /// Sends `requests` on one `Session` (batched: with `tinybroker-batch:
    /// 1`), half-closes, and reads the whole response as a client would.
    async fn run_session(&self, requests: &[pb::SessionRequest], batched: bool) -> SessionRun {
        use http_body_util::BodyExt as _;
        let limit = tinybroker::grpc::decoding_limit(self.limits.max_message_bytes);
        let body = http_body_util::Full::new(Bytes::from(frame_requests(requests)));
        let decoder = tonic_prost::ProstDecoder::<pb::SessionRequest>::default();
        let mut request = Request::new(tonic::Streaming::new_request(decoder, body, None, Some(limit)));
        if batched {
            request
                .metadata_mut()
                .insert("tinybroker-batch", "1".parse().expect("a metadata value"));
        }
        let mut response = match self.service.session(request).await {
            Ok(response) => response,
            Err(status) => panic!("the session was refused: {status:?}"),
        };
        let mut body = take_subscription_body(&mut response).expect("the handler made the session's body");
        let mut events = Vec::new();
        let mut buf = Vec::new();
        loop {
            let frame = body
                .frame()
                .await
                .expect("a session's body ends with its trailers")
                .expect("a session's body does not fail");
            let frame = match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    let mut rest = &buf[..];
                    while rest.len() >= 5 {
                        assert_eq!(rest[0], 0, "an uncompressed gRPC frame");
                        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
                        if rest.len() < 5 + len {
                            break;
                        }
                        let event = pb::SessionEvent::decode(&rest[5..5 + len]).expect("an event decodes");
                        events.push(event.event.expect("every event has its variant set"));
                        rest = &rest[5 + len..];
                    }
                    buf = rest.to_vec();
                    continue;
                }
                Err(frame) => frame,
            };
            let trailers = frame.into_trailers().expect("a data frame or the trailers");
            assert!(buf.is_empty(), "the body ended in the middle of an event");
            let status = Status::from_header_map(&trailers).expect("the trailers carry a status");
            return SessionRun { events, status };
        }
    }

    /// Publishes `publishes` back to back on one session and checks each
    /// answer against the model: one per publish, in order, with its id;
    /// every bad message rejected by index with the code and message
    /// `Publish` gives, the rest published with consecutive sequences from
    /// `first_sequence`; a batch over `max_batch_messages` rejected whole
    /// in a small answer; a request over the decoding limit ends the
    /// session (RESOURCE_EXHAUSTED) after answering those before it.
    /// `batched`: the session first opens handle 1 on `>`, and must get its
    /// deliveries in `deliveries` events only, each within the byte bound,
    /// in order, a prefix of what it published, until the handle ends.
    pub async fn session_publish(&mut self, publishes: Vec<pb::SessionPublish>, batched: bool) {
        let limit = tinybroker::grpc::decoding_limit(self.limits.max_message_bytes);
        let max_batch = self.limits.max_batch_messages;
        let mut requests = Vec::new();
        let open_refused = batched && self.open_count() >= self.limits.max_subscriptions;
        if batched {
            requests.push(pb::SessionRequest {
                request: Some(pb::session_request::Request::Open(pb::SessionOpen {
                    handle: 1,
                    subscription: Some(pb::OpenSubscriptionRequest {
                        topic_patterns: vec![">".into()],
                        ..Default::default()
                    }),
                    credit: 0,
                })),
            });
        }
        let publish_requests: Vec<pb::SessionRequest> = publishes
            .iter()
            .map(|p| pb::SessionRequest {
                request: Some(pb::session_request::Request::Publish(p.clone())),
            })
            .collect();
        // The publishes before the first one too large to be read.
        let readable = publish_requests
            .iter()
            .position(|r| r.encoded_len() > limit)
            .unwrap_or(publishes.len());
        requests.extend(publish_requests);
        let run = self.run_session(&requests, batched).await;

        let mut answers = Vec::new();
        let mut delivered: Vec<pb::Message> = Vec::new();
        let mut opened = None;
        let mut ended = None;
        for event in run.events {
            use pb::session_event::Event;
            match event {
                Event::Published(p) => answers.push(p),
                Event::Opened(o) => {
                    assert!(batched && o.handle == 1 && opened.is_none() && ended.is_none(), "{o:?}");
                    opened = Some(o.subscription_id);
                }
                Event::Ended(e) => {
                    assert!(batched && e.handle == 1 && ended.is_none(), "{e:?}");
                    ended = Some(e);
                }
                Event::Deliveries(b) => {
                    assert!(batched, "deliveries on a session that did not ask for them");
                    assert!(!b.deliveries.is_empty(), "an empty deliveries event");
                    assert!(
                        b.encoded_len() <= DELIVERIES_BOUND || b.deliveries.len() == 1,
                        "a deliveries event of {} bytes",
                        b.encoded_len()
                    );
                    self.delivery_events += 1;
                    for d in b.deliveries {
                        assert_eq!(d.handles, [1], "{d:?}");
                        assert!(ended.is_none(), "a delivery after the handle's ended");
                        let m = d.message.expect("a delivery carries its message");
                        assert_eq!(Some(&m.subscription_id), opened.as_ref(), "one handle: its id");
                        delivered.push(m);
                    }
                }
                Event::Delivery(d) => panic!("a bare delivery: {d:?}"),
            }
        }
        if readable < publishes.len() {
            check_status("Session (an oversize publish)", &run.status, &[Code::ResourceExhausted]);
        } else {
            assert_eq!(run.status.code(), Code::Ok, "the session ends OK: {:?}", run.status);
        }
        assert_eq!(answers.len(), readable, "one answer per publish read");
        self.session_publishes += readable as u64;

        let mut accepted_sequences = Vec::new();
        for (publish, answer) in publishes.iter().zip(&answers) {
            assert_eq!(answer.id, publish.id, "answers in request order, ids echoed");
            let len = publish.messages.len();
            assert_eq!(answer.accepted as usize + answer.rejected.len(), len, "{answer:?}");
            if len > max_batch {
                assert_eq!((answer.accepted, answer.first_sequence), (0, 0), "over the batch limit");
                for (i, r) in answer.rejected.iter().enumerate() {
                    assert_eq!((r.index as usize, r.code), (i, Code::ResourceExhausted as u32));
                }
                let said = format!("max_batch_messages {max_batch} (TINYBROKER_MAX_BATCH_MESSAGES)");
                assert!(answer.rejected[0].message.contains(&said), "{:?}", answer.rejected[0]);
                if len > 4 * max_batch {
                    // A huge count: the text once, the answer a few bytes
                    // per message.
                    assert!(
                        answer.encoded_len() <= 16 * len + 4096,
                        "an answer of {} bytes for {len} rejections",
                        answer.encoded_len()
                    );
                } else {
                    assert!(answer.rejected.iter().all(|r| r.message.contains(&said)), "{answer:?}");
                }
                continue;
            }
            let mut rejected = answer.rejected.iter().peekable();
            let first = self.last_sequence + 1;
            for (i, m) in publish.messages.iter().enumerate() {
                let expected = publish_expectation(m, self.limits.max_message_bytes);
                let r = rejected.next_if(|r| r.index as usize == i);
                match (expected, r) {
                    (None, None) => {
                        self.last_sequence += 1;
                        accepted_sequences.push(self.last_sequence);
                        let message = PublishedMessage {
                            topic: m.topic.clone(),
                            payload_len: m.payload.len(),
                            headers: m.headers.clone(),
                        };
                        self.route(self.last_sequence, message);
                    }
                    (Some(code), Some(r)) => {
                        assert_eq!(r.code, code as u32, "index {i}: {r:?}");
                        // The code and text Publish gives.
                        let status = self
                            .service
                            .publish(Request::new(m.clone()))
                            .await
                            .expect_err("Publish refuses it too");
                        assert_eq!(r.code, status.code() as u32);
                        assert!(
                            !r.message.is_empty() && r.message.ends_with(status.message()),
                            "index {i}: {:?}, Publish says {:?}",
                            r.message,
                            status.message()
                        );
                    }
                    (expected, r) => panic!("message {i} of {:?}: expected {expected:?}, got {r:?}", m.topic),
                }
            }
            assert!(
                rejected.next().is_none(),
                "rejections by index, in index order: {answer:?}"
            );
            let accepted = self.last_sequence + 1 - first;
            assert_eq!(u64::from(answer.accepted), accepted);
            let want_first = if accepted > 0 { first } else { 0 };
            assert_eq!(answer.first_sequence, want_first, "consecutive from first_sequence");
        }
        assert_eq!(self.broker.last_sequence(), self.last_sequence);

        if batched {
            match (open_refused, &opened, &ended) {
                (true, None, Some(e)) => {
                    assert_eq!(
                        (e.reason.as_str(), e.code),
                        ("rejected", Code::ResourceExhausted as u32)
                    );
                }
                (false, Some(_), _) => {}
                other => panic!("the batched session's handle: {other:?}"),
            }
            if opened.is_some() {
                let got: Vec<u64> = delivered.iter().map(|m| m.sequence).collect();
                assert!(
                    accepted_sequences.starts_with(&got),
                    "the handle gets what was published, in order, from the start: {got:?} of {accepted_sequences:?}"
                );
                for m in &delivered {
                    let published = &self.published[&m.sequence];
                    assert_eq!((&m.topic, m.payload.len()), (&published.topic, published.payload_len));
                }
                match &ended {
                    Some(e) if e.reason == "evicted" => {
                        self.evictions += 1;
                        coverage::add(&coverage::EVICTED, 1);
                    }
                    Some(e) => {
                        assert_eq!(e.reason, "closed", "{e:?}");
                        assert_eq!(
                            got.len() as u64 + e.dropped,
                            accepted_sequences.len() as u64,
                            "delivered or dropped: {e:?}"
                        );
                    }
                    // The session failed (an oversize request): no ends.
                    None => assert!(readable < publishes.len(), "the handle never ended"),
                }
                if let Some(e) = &ended {
                    assert_eq!(e.last_sequence, got.last().copied().unwrap_or(0), "{e:?}");
                }
                coverage::add(&coverage::BROADCAST_DELIVERED, got.len() as u64);
            }
        }
    }
}

/// Sum of every sample of metric `name` in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
