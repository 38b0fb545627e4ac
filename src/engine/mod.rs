//! The seam between the front (the gRPC services, Admin, metrics and the
//! server's lifecycle) and the engine that carries messages.
//!
//! An engine is what [`Engine`] says it is: it publishes, opens
//! subscriptions whose deliveries come out of a [`DeliveryStream`], takes
//! acks, nacks and admin closes, and reports itself as plain snapshots
//! (never live objects). The front is generic over it and `server` picks one
//! at start-up, so calls are statically dispatched: the in-memory engine's
//! publish path has no boxed future and no `dyn` call per message.
//!
//! Engines: [`crate::broker::Broker`], the embedded single-node engine, and
//! [`crate::cluster::ClusterEngine`] (docs/contract.md, "Cluster mode"),
//! which reuses the local fan-out machinery of `broker` (trie, bounded
//! queues, eviction, subscription streams) for its own replica's
//! subscribers.
//!
//! The types here are the engine-neutral vocabulary of both sides: requests,
//! outcomes, refusals and snapshots. [`validate`] holds the checks every
//! engine applies to what clients send.

pub mod message;
pub mod queue;
pub mod validate;

use crate::config::Limits;
use bytes::Bytes;
use futures::Stream;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

pub use message::{Delivery, Published, message_size};
pub use queue::WakeBatch;

/// What a routed publish still waits for ([`Engine::publish_routed`]):
/// resolves to the number of groups that took the message.
pub type Confirmation = futures::future::BoxFuture<'static, Result<u32, BrokerError>>;

/// An engine behind the gRPC front. Cheap to clone (a handle).
///
/// Calls that may have to ask other replicas (Ack, Nack, CloseSubscription,
/// the Admin listings) return futures; an engine that answers at once
/// returns a ready one. The front publishes a run of messages received
/// together inside one [`WakeBatch`], each publish under
/// [`WakeBatch::across_waits`]: the subscribers the run
/// reached are woken once, at its end, or when a publish has to wait (a
/// cluster publish waiting for room in its outbox, a group's
/// store), before the task yields.
/// Whether one counter numbers every message an instance delivers, so a
/// client may compute the sequences it missed between two deliveries on
/// sessions of one instance (docs/clients.md, "Gaps").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SequenceScope {
    /// Single node: the broker's one counter, new at each start.
    Instance,
    /// Cluster mode: each publishing replica (each start of it) counts apart,
    /// so sequences delivered on one replica come from several counters.
    Replica,
}

impl SequenceScope {
    /// The header's value.
    pub fn as_str(self) -> &'static str {
        match self {
            SequenceScope::Instance => "instance",
            SequenceScope::Replica => "replica",
        }
    }
}

pub trait Engine: Clone + Send + Sync + 'static {
    /// A publish stream's own state, kept across its messages (the
    /// in-memory engine: its route cache).
    type Publisher: Default + Send + 'static;
    /// The deliveries of one open subscription.
    type Stream: DeliveryStream;

    /// The limits this engine enforces.
    fn limits(&self) -> &Limits;

    /// The largest message (payload plus headers) it takes now: `limits()`'s,
    /// except in cluster mode with `TINYBROKER_MAX_MESSAGE_BYTES` unset,
    /// where the NATS server's `max_payload` may lower it once connected.
    fn max_message_bytes(&self) -> usize {
        self.limits().max_message_bytes
    }

    /// Where the sequences delivered by this engine come from, as the
    /// `tinybroker-sequence-scope` response header says to clients.
    fn sequence_scope(&self) -> SequenceScope {
        SequenceScope::Instance
    }

    /// Validates and publishes one message.
    fn publish(
        &self,
        message: NewMessage,
        publisher: &mut Self::Publisher,
        at: PublishTime,
    ) -> impl Future<Output = Result<PublishOutcome, BrokerError>> + Send;

    /// [`Engine::publish`] for one of a run of messages on a stream: resolves
    /// once the message is routed (in order with the stream's others), with
    /// what it still waits for, if anything: a cluster group's store ack,
    /// which the caller awaits, in order, before it counts the message as
    /// accepted. Meanwhile the next messages are routed, so a stream's
    /// stores overlap instead of taking a round trip each.
    fn publish_routed(
        &self,
        message: NewMessage,
        publisher: &mut Self::Publisher,
        at: PublishTime,
    ) -> impl Future<Output = Result<(PublishOutcome, Option<Confirmation>), BrokerError>> + Send {
        use futures::FutureExt;
        self.publish(message, publisher, at).map(|r| r.map(|o| (o, None)))
    }

    /// Publishes a batch (a session's `publish`): each message validated,
    /// given its sequence and routed as [`Engine::publish`] would, in order;
    /// the accepted ones get consecutive sequences, and each bad one is
    /// rejected by its index while the rest are published. The memory
    /// budget is charged once for the batch when it fits, and the
    /// subscribers it reaches are woken once, at its end.
    fn publish_batch(
        &self,
        messages: Vec<NewMessage>,
        publisher: &mut Self::Publisher,
        at: PublishTime,
    ) -> impl Future<Output = BatchOutcome> + Send;

    /// Opens a subscription: once this resolves, every matching message
    /// published afterwards reaches the stream.
    fn subscribe(&self, request: SubscribeRequest) -> impl Future<Output = Result<Self::Stream, BrokerError>> + Send;

    /// Acks manual-ack messages a group member holds.
    fn ack(&self, subscription_id: &str, sequences: &[u64]) -> impl Future<Output = Result<Acked, BrokerError>> + Send;

    /// Hands manual-ack messages back for redelivery.
    fn nack(
        &self,
        subscription_id: &str,
        sequences: &[u64],
    ) -> impl Future<Output = Result<Nacked, BrokerError>> + Send;

    /// Admin/CloseSubscription: ends one subscription's stream cleanly.
    fn close_subscription(&self, subscription_id: &str) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Admin/ListSubscriptions: every open subscription, oldest first.
    fn list_subscriptions(&self) -> impl Future<Output = Result<Vec<SubscriptionInfo>, BrokerError>> + Send;

    /// Admin/ListConsumerGroups: every group, by name.
    fn list_groups(&self) -> impl Future<Output = Result<Vec<GroupInfo>, BrokerError>> + Send;

    /// Admin/ListEvictions: the most recent evictions, newest first.
    fn list_evictions(&self) -> impl Future<Output = Result<Vec<EvictionRecord>, BrokerError>> + Send;

    /// Admin/GetBrokerInfo's view of the engine.
    fn info(&self) -> impl Future<Output = Result<EngineInfo, BrokerError>> + Send;

    /// The lifetime counters alone: what GetBrokerInfo and the status page
    /// read, without listing every subscription as [`Engine::snapshot`] does.
    fn counters(&self) -> Counters;

    /// Everything the metrics report, read at once. With
    /// [`Peaks::Take`], every queue starts a new peak period (one scrape).
    fn snapshot(&self, peaks: Peaks) -> Snapshot;

    /// Whether the engine can serve, as it changes (the embedded engine
    /// always can; the cluster engine needs its NATS connection).
    fn health(&self) -> tokio::sync::watch::Receiver<EngineHealth>;

    /// Resolves when shutdown begins (ends idle publish streams).
    fn draining(&self) -> impl Future<Output = ()> + Send + 'static;

    /// Refuses new work from now on; what is queued keeps draining.
    fn begin_shutdown(&self);

    /// Messages that can still reach a subscriber (what shutdown waits for).
    fn drainable(&self) -> usize;

    /// Ends every stream; returns what was discarded, by kind.
    fn close_all(&self) -> Discarded;

    /// The engine's background work (deadlines, idle groups), until `stop`.
    fn maintain(self, stop: impl Future<Output = ()> + Send + 'static) -> impl Future<Output = ()> + Send + 'static;
}

/// The deliveries of one subscription, in order; ends when the engine ends
/// the subscription (then [`DeliveryStream::end`] says why). Dropping it
/// closes the subscription.
pub trait DeliveryStream: Stream<Item = Delivery> + Send + Unpin + 'static {
    fn id(&self) -> &str;
    /// The group's name, for consumer-group members.
    fn consumer_group(&self) -> Option<&str>;
    /// Why the engine ended it, once it has (None while open).
    fn end(&self) -> Option<StreamEnd>;
    /// Ready once the engine has ended the subscription, without taking a
    /// delivery: a session polls this for a subscription it may not send to
    /// (no credit), so that it still learns of an eviction at once. Pending
    /// registers the task to be woken when a message is queued or the
    /// subscription ends.
    fn poll_ended(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()>;
    /// As `poll_next`, and with a delivery says whether nothing else is
    /// queued behind it (`true`): the task is then registered to be woken
    /// as by a `Pending`, so a session need not poll again to learn it
    /// (one poll per delivery instead of two when a subscriber keeps up).
    /// `false` says nothing: poll again.
    fn poll_next_drained(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<(Delivery, bool)>> {
        futures::StreamExt::poll_next_unpin(self, cx).map(|next| next.map(|delivery| (delivery, false)))
    }
    /// The client closed the subscription (a session's `close`, or its
    /// half-close): ends it now, as a cancelled stream ends (a broadcast
    /// subscription's queued messages dropped and counted, a member's handed
    /// back to its group), and says what it lost. A subscription the engine
    /// had ended already keeps that end.
    fn close(&mut self) -> StreamEnd;
    /// A session added credit for it (opened with `SubscribeRequest::credit`):
    /// a consumer-group member may be handed that many more.
    fn add_credit(&mut self, _messages: u64) {}
    /// A session's in-band ack (or nack, `nack`) of `sequences`, applied
    /// through the subscription the stream holds, with no lookup by id:
    /// how many of them it did not hold. None: this stream cannot settle
    /// them itself (the engine's [`Engine::ack`] by id does).
    fn settle(&mut self, _sequences: &[u64], _nack: bool) -> Option<u32> {
        None
    }
}

/// What a batch of publishes did ([`Engine::publish_batch`]).
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// The sequence of the first accepted message (0: none was).
    pub first_sequence: u64,
    pub accepted: u32,
    /// Each message not published, by its index in the batch, in index
    /// order.
    pub rejected: Vec<(u32, BrokerError)>,
}

impl BatchOutcome {
    /// Every message of a batch of `len` rejected for `error`.
    pub fn all_rejected(len: usize, error: &BrokerError) -> Self {
        Self {
            first_sequence: 0,
            accepted: 0,
            rejected: (0..len as u32).map(|i| (i, error.clone())).collect(),
        }
    }
}

/// What a publisher sends.
#[derive(Debug, Default, Clone)]
pub struct NewMessage {
    pub topic: String,
    pub payload: Bytes,
    pub headers: HashMap<String, String>,
    /// Which of `headers` the broker added for tracing: delivered like the
    /// others, counted against no limit (only the publisher's own are).
    pub tracing: TracingHeaders,
}

/// W3C trace context header, in request metadata and message headers.
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace state header, beside it.
pub const TRACESTATE: &str = "tracestate";
/// Longest `tracestate` the broker adds to a message: what W3C Trace
/// Context asks every vendor to propagate at least; a longer one is
/// truncated as it says (`ops::telemetry`).
pub const TRACESTATE_MAX_BYTES: usize = 512;
/// Most bytes the headers the broker adds for tracing take in a message's
/// protobuf encoding (`Message.headers` map entries): `traceparent` (55
/// bytes) and a `tracestate` of at most [`TRACESTATE_MAX_BYTES`], names,
/// tags and lengths included. What the cluster engine must leave room for
/// on NATS beyond `max_message_bytes`.
pub const TRACING_HEADERS_MAX_ENCODED: usize =
    (2 + 2 + TRACEPARENT.len() + 2 + 55) + (3 + 2 + TRACESTATE.len() + 3 + TRACESTATE_MAX_BYTES);

/// The headers the broker added to a message for tracing
/// (docs/contract.md, "Logs and tracing"); none without tracing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TracingHeaders {
    pub traceparent: bool,
    pub tracestate: bool,
}

/// When a message was published: the wall clock for its `publish_time`, the
/// monotonic clock for its group's ack deadlines.
#[derive(Debug, Clone, Copy)]
pub struct PublishTime {
    pub wall: SystemTime,
    pub monotonic: tokio::time::Instant,
}

impl PublishTime {
    pub fn now() -> Self {
        Self {
            wall: SystemTime::now(),
            monotonic: tokio::time::Instant::now(),
        }
    }
}

/// Where a published message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishOutcome {
    pub sequence: u64,
    pub matched_subscriptions: u32,
    pub matched_groups: u32,
}

/// What a subscriber asks for.
#[derive(Debug, Default, Clone)]
pub struct SubscribeRequest {
    pub topic_patterns: Vec<String>,
    pub subscription_id: String,
    pub mode: DeliveryMode,
    pub consumer_group: String,
    pub ack_mode: AckMode,
    /// 0: the broker default.
    pub max_in_flight: u32,
    /// 0: the broker default.
    pub ack_deadline_ms: u32,
    pub peer: Option<SocketAddr>,
    /// A session subscription opened with credit: how many messages it may
    /// be sent before the session adds more ([`DeliveryStream::add_credit`]).
    /// A consumer group hands such a member no more than that
    /// (docs/contract.md, "Sessions"); None: no limit.
    pub credit: Option<u64>,
}

/// How a subscription receives: the contract's names (`DELIVERY_MODE_*`,
/// and the `mode` label of the metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeliveryMode {
    /// Broadcast: every matching message.
    #[default]
    Multi,
    /// A consumer-group member: each message to one member of the group.
    Single,
}

impl DeliveryMode {
    /// The value of the metrics' `mode` label.
    pub fn label(self) -> &'static str {
        match self {
            DeliveryMode::Multi => "multi",
            DeliveryMode::Single => "single",
        }
    }
}

/// How a member's messages count as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum AckMode {
    /// Done once handed to the member's stream (at most once).
    #[default]
    Auto,
    /// In flight until acked; redelivered on deadline, nack or disconnect.
    Manual,
}

/// What an Ack did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Acked {
    pub acked: u32,
    /// Sequences the member does not hold (never had, acked already, or
    /// lost to a redelivery): they change nothing.
    pub unknown: u32,
}

/// What a Nack did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Nacked {
    /// Handed back (requeued, or dead-lettered after its last attempt).
    pub requeued: u32,
    pub unknown: u32,
}

/// A refused request. The gRPC layer maps each kind to its status code; the
/// text names the bad value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerError {
    InvalidArgument(String),
    FailedPrecondition(String),
    AlreadyExists(String),
    NotFound(String),
    ResourceExhausted(String),
    Unavailable(String),
}

impl fmt::Display for BrokerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (Self::InvalidArgument(m)
        | Self::FailedPrecondition(m)
        | Self::AlreadyExists(m)
        | Self::NotFound(m)
        | Self::ResourceExhausted(m)
        | Self::Unavailable(m)) = self;
        f.write_str(m)
    }
}

impl std::error::Error for BrokerError {}

/// Why the broker ended a subscription; decides what happens to what its
/// queue still held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// The subscriber fell too far behind.
    Evicted,
    /// The client cancelled its stream.
    Cancelled,
    /// An operator closed it through the Admin API.
    ClosedByAdmin,
    /// The broker is shutting down.
    Shutdown,
}

impl CloseReason {
    /// The value of the `tinybroker-end-reason` trailer a stream ended by the
    /// broker carries.
    pub fn label(self) -> &'static str {
        match self {
            CloseReason::Evicted => "evicted",
            CloseReason::Cancelled => "cancelled",
            CloseReason::ClosedByAdmin => "closed_by_admin",
            CloseReason::Shutdown => "shutdown",
        }
    }
}

/// How a subscription's stream ended (its trailers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamEnd {
    pub reason: CloseReason,
    /// Messages queued for it that it lost (0 for group members, whose
    /// messages go back to the group).
    pub dropped: u64,
    /// The sequence of the last message handed to the stream.
    pub last_sequence: u64,
}

/// One open subscription, at one moment.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SubscriptionInfo {
    pub subscription_id: String,
    pub mode: DeliveryMode,
    /// The group of a member; empty for broadcast subscriptions.
    pub consumer_group: String,
    /// A member's ack mode; None for broadcast subscriptions.
    pub ack_mode: Option<AckMode>,
    pub topic_patterns: Vec<String>,
    pub queue_depth: usize,
    /// Highest queue depth of the last two peak periods (see [`Peaks`]).
    pub queue_peak: usize,
    pub capacity: usize,
    pub delivered: u64,
    pub opened_at: SystemTime,
    pub peer: Option<SocketAddr>,
    /// The replica serving it (cluster mode; empty otherwise).
    pub replica_id: String,
    /// A MANUAL group member's messages on its stream and not acked or
    /// nacked yet (0 for any other subscription). Not in the JSON that
    /// replicas of the previous version speak (they have no such field).
    #[serde(skip)]
    pub unacked: u64,
    /// How long ago the oldest message it holds unacked was handed to it.
    #[serde(skip)]
    pub oldest_unacked_age: Option<Duration>,
    /// How long it has held messages without acking or nacking any: a
    /// redelivery after its ack deadline does not restart it, as it does
    /// `oldest_unacked_age` (None while it holds none; the metrics only).
    #[serde(skip)]
    pub stalled: Option<Duration>,
}

/// One consumer group, at one moment.
#[derive(Debug, Clone, Default)]
pub struct GroupInfo {
    pub name: String,
    pub topic_patterns: Vec<String>,
    pub members: usize,
    pub backlog: usize,
    /// Bytes of the backlog's messages.
    pub backlog_bytes: usize,
    /// Messages its members hold: queued for them, or on their streams and
    /// not acked yet.
    pub in_flight: usize,
    pub oldest_unacked_age: Option<Duration>,
    /// How long it has had work without completing any (zero with no work).
    pub stalled: Duration,
    /// How long it has had no member (None while one is connected).
    pub memberless: Option<Duration>,
    pub redeliveries: u64,
    pub dead_lettered: u64,
    /// Oldest backlog messages dropped because the backlog was full.
    pub dropped: u64,
    /// Messages acked by manual-ack members.
    pub acked: u64,
    /// Messages written to members' streams, redeliveries included.
    pub delivered: u64,
}

/// One slow-consumer eviction, kept for the Admin API.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EvictionRecord {
    pub subscription_id: String,
    pub evicted_at: SystemTime,
    pub topic_patterns: Vec<String>,
    pub queue_depth: usize,
    pub last_delivered_sequence: u64,
    pub peer: Option<SocketAddr>,
    /// The replica that served it (cluster mode; empty otherwise).
    pub replica_id: String,
}

/// A consumer group removed after its idle TTL while it still held
/// messages, kept for the metrics (`tinybroker_recent_group_removal_*`).
#[derive(Debug, Clone)]
pub struct GroupRemoval {
    pub consumer_group: String,
    pub removed_at: SystemTime,
    /// Messages it still held, dropped with it.
    pub dropped: usize,
}

/// Whether an engine can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    Serving,
    /// Not now, for this reason (health NOT_SERVING; requests UNAVAILABLE).
    NotServing(String),
    /// Never: the process should stop, for this reason.
    Failed(String),
}

/// Whether reading a [`Snapshot`] starts a new peak period of every queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peaks {
    /// A scrape: each peak covers the last two scrape intervals.
    Take,
    /// A look that leaves the peaks as they are.
    Keep,
}

/// What a shutdown discarded once its grace period was over, by kind
/// (`tinybroker_messages_discarded_on_shutdown_total` counts them all; the
/// shutdown WARN names each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Discarded {
    /// Messages queued for broadcast subscribers.
    pub queued: usize,
    /// Messages in consumer-group backlogs, waiting for a member (or a
    /// member with room).
    pub backlog: usize,
    /// Messages in flight to group members: queued for a member's stream,
    /// or delivered to it and not acked.
    pub in_flight: usize,
}

impl Discarded {
    pub fn total(&self) -> usize {
        self.queued + self.backlog + self.in_flight
    }

    /// The shutdown WARN: every kind with its count. `drained`: the grace
    /// period was not spent (what was left could not drain: the backlogs of
    /// groups without members, and messages members hold unacked).
    pub fn describe(&self, drained: bool) -> String {
        let what = if drained {
            "queues drained; what could not drain was discarded"
        } else {
            "grace period over: messages still queued were discarded"
        };
        format!(
            "{what}: {} queued for broadcast subscribers, {} in consumer-group backlogs, {} in flight to group members (queued for a member, or delivered and not acked)",
            self.queued, self.backlog, self.in_flight
        )
    }
}

/// Lifetime counters of an engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub published: u64,
    pub unrouted: u64,
    pub evictions: u64,
    pub delivered_multi: u64,
    pub delivered_single: u64,
    pub dropped_evicted: u64,
    pub dropped_closed: u64,
    pub dropped_group_overflow: u64,
    pub dropped_group_expired: u64,
    pub dropped_dead_letter_invalid: u64,
    pub discarded_on_shutdown: u64,
    pub refused_memory_limit: u64,
    pub evictions_memory_limit: u64,
}

/// Bytes charged to a memory budget, and its limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryUse {
    pub used: usize,
    pub limit: Option<usize>,
}

/// Everything the metrics report about an engine.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub counters: Counters,
    pub subscriptions: Vec<SubscriptionInfo>,
    pub groups: Vec<GroupInfo>,
    pub evictions: Vec<EvictionRecord>,
    pub group_removals: Vec<GroupRemoval>,
    /// The messages' budget.
    pub memory: MemoryUse,
    pub shutting_down: bool,
    /// Cluster mode: the replica's NATS connection.
    pub nats: Option<NatsStatus>,
}

/// A cluster replica's NATS connection, for the metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsStatus {
    pub connected: bool,
    pub reconnects: u64,
    /// Messages NATS (or the client) dropped on their way to this replica
    /// because it did not read fast enough.
    pub slow_consumer_dropped: u64,
    /// Consumer-group messages lost when NATS lost what it kept in memory.
    pub state_lost: u64,
    /// Broadcast messages of other replicas that arrived too late to be
    /// delivered (their replica was cut off from NATS meanwhile).
    pub unreachable_dropped: u64,
}

impl Snapshot {
    /// What a shutdown can still lose: messages queued for broadcast
    /// subscriptions, and everything consumer groups hold (their backlogs,
    /// and what their members hold: a member closed by the shutdown hands
    /// those back to the backlog, which is discarded with it).
    pub fn at_risk(&self) -> usize {
        let multi: usize = self
            .subscriptions
            .iter()
            .filter(|s| s.mode == DeliveryMode::Multi)
            .map(|s| s.queue_depth)
            .sum();
        let groups: usize = self.groups.iter().map(|g| g.backlog + g.in_flight).sum();
        multi + groups
    }
}

/// GetBrokerInfo's view of an engine.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub started_at: SystemTime,
    pub uptime: Duration,
    pub subscriptions: u64,
    pub consumer_groups: u64,
    pub last_sequence: u64,
    /// Cluster mode: this replica and its NATS connection.
    pub cluster: Option<ClusterInfo>,
}

/// GetBrokerInfo's cluster-mode part.
#[derive(Debug, Clone)]
pub struct ClusterInfo {
    pub replica_id: String,
    /// The NATS server connected to (empty while disconnected).
    pub nats_server: String,
}

/// A peer address as logs and metrics labels show it.
pub fn display_peer(peer: Option<SocketAddr>) -> String {
    peer.map_or_else(|| "unknown".to_owned(), |p| p.to_string())
}
