//! A small Rust client for tinybroker, used by the CLI: publish, the Admin
//! calls, and subscriptions that re-subscribe with backoff after an
//! eviction or a lost connection, and report each such event. Every
//! subscription of a [`Client`] (and of its clones) is opened on one
//! `Session` stream ([`session_task`]), with credit given back as the
//! application takes messages and acks sent in-band; the session asks for
//! batched deliveries. Messages are published on that same session: one
//! at a time into the client's bounded buffer ([`Client::publish`], then
//! [`Client::flush`]), or in batches of the application's own
//! ([`Client::publish_batch`], the [`Publisher`] the CLI uses);
//! [`Client::publish_confirmed`] is the unary `Publish`. The client follows
//! docs/clients.md: its constants, gaps, connection events
//! ([`Client::connection_events`]), counters ([`Client::stats`]) and
//! [`Client::close`]. Sends `authorization: Bearer <token>` when a token is
//! set (by default from `TINYBROKER_AUTH_TOKEN`).

mod buffer;
mod publisher;
mod session_task;

use crate::pb;
use crate::pb::admin_client::AdminClient;
use crate::pb::broker_client::BrokerClient;
use crate::retry::Backoff;
use bytes::Bytes;
use session_task::{CREDIT_BATCH, Command, HandleEvent, PublishAnswer, SequenceSpace};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

pub use crate::pb::Message;
pub use buffer::{BUFFER_BYTES, FlushReport};
pub use publisher::{DEFAULT_BATCH_BYTES, DEFAULT_BATCH_MESSAGES, FailedBatch, PublishSummary, Publisher, Rejection};

/// The address the CLI uses when none is given.
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// A connection to one broker. Cheap to clone (clones share the channel and
/// the session their subscribers open on).
#[derive(Clone)]
pub struct Client {
    broker: BrokerClient<Channel>,
    admin: AdminClient<Channel>,
    authorization: Option<MetadataValue<Ascii>>,
    session: Arc<SessionLink>,
}

/// How a client's subscribers reach its session task.
#[derive(Default)]
struct SessionLink {
    /// The task's commands; started by the first open (which runs in a
    /// runtime), started again if that runtime is gone. A parking_lot
    /// mutex: nothing awaits while it is held.
    commands: parking_lot::Mutex<Option<mpsc::UnboundedSender<Command>>>,
    /// The last handle given out; handles are never reused while the
    /// client lives (u32 wraps after four billion opens).
    last_handle: AtomicU32,
    /// What the task and the client both see.
    shared: Arc<Shared>,
}

/// What the session task shares with its client: the publish buffer's
/// bound, the counters and the connection events.
pub(crate) struct Shared {
    /// Bytes of room in the publish buffer (docs/clients.md `BUFFER_BYTES`):
    /// a message takes its bytes before it is buffered and gives them back
    /// once written; closed when the client is closed.
    room: tokio::sync::Semaphore,
    events: tokio::sync::broadcast::Sender<ConnectionEvent>,
    closed: std::sync::atomic::AtomicBool,
    messages_in: AtomicU64,
    bytes_in: AtomicU64,
    messages_out: AtomicU64,
    bytes_out: AtomicU64,
    reconnects: AtomicU64,
    pending_messages: AtomicU64,
    pending_bytes: AtomicU64,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            room: tokio::sync::Semaphore::new(BUFFER_BYTES),
            events: tokio::sync::broadcast::channel(CONNECTION_EVENTS).0,
            closed: Default::default(),
            messages_in: Default::default(),
            bytes_in: Default::default(),
            messages_out: Default::default(),
            bytes_out: Default::default(),
            reconnects: Default::default(),
            pending_messages: Default::default(),
            pending_bytes: Default::default(),
        }
    }
}

impl Shared {
    fn count_in(&self, payload_bytes: usize) {
        self.messages_in.fetch_add(1, Ordering::Relaxed);
        self.bytes_in.fetch_add(payload_bytes as u64, Ordering::Relaxed);
    }

    fn count_out(&self, messages: &[pb::PublishRequest]) {
        let bytes: usize = messages.iter().map(|m| m.payload.len()).sum();
        self.messages_out.fetch_add(messages.len() as u64, Ordering::Relaxed);
        self.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// `messages` of `bytes` left the buffer (written, or dropped at close).
    fn unpend(&self, messages: usize, bytes: usize) {
        self.pending_messages.fetch_sub(messages as u64, Ordering::Relaxed);
        self.pending_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
}

/// Connection events a receiver that falls behind may miss (it then hears
/// `Lagged` from tokio's broadcast channel).
const CONNECTION_EVENTS: usize = 64;

/// A change of the client's connection (docs/clients.md, "Connection events
/// and counters"): one per change, whatever the number of subscriptions.
#[derive(Debug, Clone)]
pub enum ConnectionEvent {
    /// The first session is open, on this broker instance.
    Connected { instance: Option<String> },
    /// An open session was lost.
    Disconnected { reason: Status },
    /// A session is open again; on another instance (a restarted broker,
    /// another replica) when `instance_changed`.
    Reconnected {
        instance: Option<String>,
        instance_changed: bool,
    },
    /// [`Client::close`] finished.
    Closed,
}

/// The client's counters (docs/clients.md), as [`Client::stats`] reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Deliveries handed to subscriptions, and their payload bytes.
    pub messages_in: u64,
    pub bytes_in: u64,
    /// Messages written in batches on the session, and their payload bytes.
    pub messages_out: u64,
    pub bytes_out: u64,
    /// Sessions opened again after a lost one.
    pub reconnects: u64,
    /// Published with [`Client::publish`] and not yet written: messages and
    /// encoded bytes.
    pub pending_messages: u64,
    pub pending_bytes: u64,
}

/// How to reach a broker beyond its address.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// Sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// PEM file of the CA that signed the broker's certificate, for an
    /// `https://` address; without it the system's roots are used.
    pub ca: Option<PathBuf>,
}

impl ConnectOptions {
    /// The token from `TINYBROKER_AUTH_TOKEN`, if set and not empty.
    pub fn from_env() -> Self {
        Self {
            token: std::env::var("TINYBROKER_AUTH_TOKEN").ok().filter(|t| !t.is_empty()),
            ca: None,
        }
    }
}

impl Client {
    /// Connects to `addr` (`http://host:port`, or `https://` for TLS with the
    /// system's roots), with the token from `TINYBROKER_AUTH_TOKEN` if set.
    pub async fn connect(addr: &str) -> anyhow::Result<Self> {
        Self::connect_with(addr, &ConnectOptions::from_env()).await
    }

    pub async fn connect_with(addr: &str, options: &ConnectOptions) -> anyhow::Result<Self> {
        let addr = &with_scheme(addr);
        let mut endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(|e| anyhow::anyhow!("invalid broker address {addr:?}: {e}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5));
        let https = addr.starts_with("https://");
        if !https && options.ca.is_some() {
            anyhow::bail!("--ca is given but the address {addr:?} is not https://");
        }
        if https {
            let mut tls = ClientTlsConfig::new();
            tls = match &options.ca {
                Some(path) => {
                    let pem = std::fs::read(path)
                        .map_err(|e| anyhow::anyhow!("cannot read the CA file {}: {e}", path.display()))?;
                    tls.ca_certificate(Certificate::from_pem(pem))
                }
                None => tls.with_native_roots(),
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| anyhow::anyhow!("cannot set up TLS for {addr}: {e}"))?;
        }
        // The error's own text is only "transport error": its sources tell.
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| anyhow::Error::new(e).context(format!("cannot connect to {addr}")))?;
        Self::from_channel(channel, options.token.as_deref())
    }

    /// Wraps an existing channel.
    pub fn from_channel(channel: Channel, token: Option<&str>) -> anyhow::Result<Self> {
        let authorization = token
            .map(|t| {
                MetadataValue::try_from(format!("Bearer {t}"))
                    .map_err(|_| anyhow::anyhow!("the auth token contains characters not allowed in a header"))
            })
            .transpose()?;
        Ok(Self {
            broker: BrokerClient::new(channel.clone()).max_decoding_message_size(usize::MAX),
            admin: AdminClient::new(channel).max_decoding_message_size(usize::MAX),
            authorization,
            session: Arc::default(),
        })
    }

    /// The session task's commands, starting the task if it is not running
    /// (a closed client's go nowhere).
    fn session(&self) -> mpsc::UnboundedSender<Command> {
        let mut commands = self.session.commands.lock();
        if self.session.shared.closed.load(Ordering::Acquire) {
            return mpsc::unbounded_channel().0;
        }
        match &*commands {
            Some(sender) if !sender.is_closed() => sender.clone(),
            _ => {
                let sender = session_task::spawn(
                    self.broker.clone(),
                    self.admin.clone(),
                    self.authorization.clone(),
                    self.session.shared.clone(),
                );
                *commands = Some(sender.clone());
                sender
            }
        }
    }

    fn is_closed(&self) -> bool {
        self.session.shared.closed.load(Ordering::Acquire)
    }

    fn next_handle(&self) -> u32 {
        loop {
            let handle = self.session.last_handle.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            if handle != 0 {
                return handle;
            }
        }
    }

    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// Publishes one message with the unary `Publish` and returns its
    /// sequence and matched counts (it does not go through the publish
    /// buffer, so it may overtake messages buffered before it).
    pub async fn publish_confirmed(
        &mut self,
        topic: impl Into<String>,
        payload: impl Into<Bytes>,
        headers: HashMap<String, String>,
    ) -> Result<pb::PublishResponse, Status> {
        if self.is_closed() {
            return Err(closed());
        }
        let request = self.request(pb::PublishRequest {
            topic: topic.into(),
            payload: payload.into(),
            headers,
        });
        Ok(self.broker.publish(request).await?.into_inner())
    }

    /// Puts a message in the client's publish buffer and returns
    /// (docs/clients.md, "Publishing"): it goes out in a `SessionPublish`
    /// batch on the client's session as soon as the session task's turn
    /// ends, and [`Client::flush`] says what became of it. Waits only while
    /// the buffer holds [`BUFFER_BYTES`] (backpressure); while the
    /// connection is down, messages wait there and go out once a session
    /// is open again. CANCELLED once the client is closed.
    pub async fn publish(
        &self,
        topic: impl Into<String>,
        payload: impl Into<Bytes>,
        headers: HashMap<String, String>,
    ) -> Result<(), Status> {
        let message = pb::PublishRequest {
            topic: topic.into(),
            payload: payload.into(),
            headers,
        };
        let bytes = buffer::message_bytes(&message);
        let permits = bytes.min(BUFFER_BYTES) as u32;
        let shared = &self.session.shared;
        let room = shared.room.acquire_many(permits).await.map_err(|_| closed())?;
        room.forget();
        // Counted before the task can write it (and uncount it).
        shared.pending_messages.fetch_add(1, Ordering::Relaxed);
        shared.pending_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if self.session().send(Command::Buffer { message, permits }).is_err() {
            shared.unpend(1, bytes);
            shared.room.add_permits(permits as usize);
            return Err(closed());
        }
        Ok(())
    }

    /// Waits until every message [`Client::publish`]ed before it has an
    /// outcome, and returns what became of those published since the
    /// previous flush. With `timeout`, DEADLINE_EXCEEDED after it (nothing
    /// is lost: the next flush reports them).
    pub async fn flush(&self, timeout: Option<Duration>) -> Result<FlushReport, Status> {
        let (answer, report) = oneshot::channel();
        if self.is_closed() || self.session().send(Command::Flush { answer }).is_err() {
            return Err(closed());
        }
        let report = async { report.await.map_err(|_| closed()) };
        match timeout {
            None => report.await,
            Some(limit) => tokio::time::timeout(limit, report).await.unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(format!(
                    "flush: not every message published before it had an outcome within {} ms; the next flush reports them",
                    limit.as_millis()
                )))
            }),
        }
    }

    /// Closes the client (every clone of it): what is buffered gets up to
    /// 5 s to be answered, then every subscription ends, the session is
    /// closed and [`ConnectionEvent::Closed`] is sent. Returns how many
    /// buffered messages were never sent. After it, every call fails with
    /// CANCELLED, "the client is closed".
    pub async fn close(&self) -> u64 {
        let commands = self.session.commands.lock().take();
        self.session.shared.closed.store(true, Ordering::Release);
        let Some(commands) = commands else {
            self.session.shared.room.close();
            let _ = self.session.shared.events.send(ConnectionEvent::Closed);
            return 0;
        };
        let (done, not_sent) = oneshot::channel();
        if commands.send(Command::Shutdown { done }).is_err() {
            self.session.shared.room.close();
            return 0;
        }
        not_sent.await.unwrap_or(0)
    }

    /// The client's connection events, from now on.
    pub fn connection_events(&self) -> tokio::sync::broadcast::Receiver<ConnectionEvent> {
        self.session.shared.events.subscribe()
    }

    /// The client's counters now.
    pub fn stats(&self) -> ClientStats {
        let shared = &self.session.shared;
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ClientStats {
            messages_in: read(&shared.messages_in),
            bytes_in: read(&shared.bytes_in),
            messages_out: read(&shared.messages_out),
            bytes_out: read(&shared.bytes_out),
            reconnects: read(&shared.reconnects),
            pending_messages: read(&shared.pending_messages),
            pending_bytes: read(&shared.pending_bytes),
        }
    }

    /// Publishes `messages` as one batch (`SessionPublish`) on this
    /// client's session (the one its subscriptions ride on, started if
    /// there is none), and returns the broker's answer: how many were
    /// accepted, with consecutive sequences from `first_sequence` in the
    /// order given, and each rejected one by its index in `messages`, with
    /// the code and message `Publish` would have given.
    ///
    /// The batch is sent as it is, never split: keep it within the broker's
    /// `max_batch_messages` (TINYBROKER_MAX_BATCH_MESSAGES, 1024 by default;
    /// a larger batch is rejected whole, every index RESOURCE_EXHAUSTED) and
    /// its encoded size within the broker's request limit
    /// (`max_message_bytes` + 64 KiB; a larger one ends the session, and
    /// every batch unanswered on it is then unconfirmed). [`Publisher`]
    /// splits for you.
    ///
    /// Batches sent from one task are answered in the order they were sent.
    /// If the session is lost before the answer comes, the error is
    /// [`PublishError::Unconfirmed`]: the batch may or may not have been
    /// published (in whole or in part), and it is not sent again.
    pub async fn publish_batch(&self, messages: Vec<pb::PublishRequest>) -> Result<pb::SessionPublished, PublishError> {
        self.send_batch(messages).answer().await
    }

    /// Hands a batch to the session task without waiting for its answer.
    fn send_batch(&self, messages: Vec<pb::PublishRequest>) -> PendingBatch {
        let count = messages.len();
        let (answer, receiver) = oneshot::channel();
        if let Err(mpsc::error::SendError(Command::Publish { answer, .. })) =
            self.session().send(Command::Publish { messages, answer })
        {
            let _ = answer.send(Err(PublishError::NotSent {
                messages: count,
                cause: session_gone(),
            }));
        }
        PendingBatch {
            messages: count,
            answer: receiver,
        }
    }

    /// A buffered publisher on this client's session: see [`Publisher`].
    pub fn publisher(&self) -> Publisher {
        Publisher::new(self.clone())
    }

    /// Acknowledges manual-ack group messages.
    pub async fn ack(&mut self, subscription_id: &str, sequences: Vec<u64>) -> Result<pb::AckResponse, Status> {
        let request = self.request(pb::AckRequest {
            subscription_id: subscription_id.to_owned(),
            sequences,
        });
        Ok(self.broker.ack(request).await?.into_inner())
    }

    /// Hands manual-ack group messages back for redelivery.
    pub async fn nack(&mut self, subscription_id: &str, sequences: Vec<u64>) -> Result<pb::NackResponse, Status> {
        let request = self.request(pb::NackRequest {
            subscription_id: subscription_id.to_owned(),
            sequences,
        });
        Ok(self.broker.nack(request).await?.into_inner())
    }

    /// Admin/ListSubscriptions: every open subscription (of the whole
    /// cluster in cluster mode).
    pub async fn list_subscriptions(&mut self) -> Result<Vec<pb::SubscriptionInfo>, Status> {
        let request = self.request(pb::ListSubscriptionsRequest {});
        Ok(self.admin.list_subscriptions(request).await?.into_inner().subscriptions)
    }

    /// Admin/ListConsumerGroups: every consumer group.
    pub async fn list_groups(&mut self) -> Result<Vec<pb::ConsumerGroupInfo>, Status> {
        let request = self.request(pb::ListConsumerGroupsRequest {});
        Ok(self.admin.list_consumer_groups(request).await?.into_inner().groups)
    }

    /// Admin/ListEvictions: the most recent evictions, newest first.
    pub async fn list_evictions(&mut self) -> Result<Vec<pb::EvictionInfo>, Status> {
        let request = self.request(pb::ListEvictionsRequest {});
        Ok(self.admin.list_evictions(request).await?.into_inner().evictions)
    }

    /// Admin/GetBrokerInfo: version, uptime, limits, counters.
    pub async fn broker_info(&mut self) -> Result<pb::GetBrokerInfoResponse, Status> {
        let request = self.request(pb::GetBrokerInfoRequest {});
        Ok(self.admin.get_broker_info(request).await?.into_inner())
    }

    /// Admin/CloseSubscription: ends one subscription (NOT_FOUND if none).
    pub async fn close_subscription(&mut self, subscription_id: &str) -> Result<(), Status> {
        let request = self.request(pb::CloseSubscriptionRequest {
            subscription_id: subscription_id.to_owned(),
        });
        self.admin.close_subscription(request).await?;
        Ok(())
    }

    /// A subscription that is opened on the first [`Subscriber::next`], on
    /// this client's session.
    pub fn subscriber(&self, request: pb::OpenSubscriptionRequest, reconnect: bool) -> Subscriber {
        Subscriber {
            client: self.clone(),
            request,
            live: None,
            subscription_id: None,
            reconnect,
            backoff: resubscribe_backoff(),
            opened_once: false,
            last_sequence: None,
            last_space: SequenceSpace::default(),
            space: SequenceSpace::default(),
            resuming: false,
            on_event: None,
        }
    }
}

/// Why a batch published on the session has no answer.
#[derive(Debug, Clone)]
pub enum PublishError {
    /// It was written to a session that was lost before the broker
    /// answered it: all, some or none of its messages may have been
    /// published. The client never sends it again; the application decides.
    Unconfirmed { messages: usize, cause: Status },
    /// It was not sent (no session could be started, or the client's
    /// session task is gone): nothing of it was published.
    NotSent { messages: usize, cause: Status },
}

impl PublishError {
    /// How many messages the batch held.
    pub fn messages(&self) -> usize {
        match self {
            PublishError::Unconfirmed { messages, .. } | PublishError::NotSent { messages, .. } => *messages,
        }
    }

    /// What failed: the session's status.
    pub fn cause(&self) -> &Status {
        match self {
            PublishError::Unconfirmed { cause, .. } | PublishError::NotSent { cause, .. } => cause,
        }
    }

    pub fn is_unconfirmed(&self) -> bool {
        matches!(self, PublishError::Unconfirmed { .. })
    }
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cause = self.cause();
        match self {
            PublishError::Unconfirmed { messages, .. } => write!(
                f,
                "a batch of {messages} messages is unconfirmed: the session was lost before the broker answered \
                 (it may or may not have been published; it was not sent again): {:?}: {}",
                cause.code(),
                cause.message()
            ),
            PublishError::NotSent { messages, .. } => write!(
                f,
                "a batch of {messages} messages was not sent (nothing of it was published): {:?}: {}",
                cause.code(),
                cause.message()
            ),
        }
    }
}

impl std::error::Error for PublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.cause())
    }
}

/// A batch handed to the session task, and its answer to come.
struct PendingBatch {
    messages: usize,
    answer: oneshot::Receiver<PublishAnswer>,
}

impl PendingBatch {
    async fn answer(self) -> PublishAnswer {
        let messages = self.messages;
        self.answer.await.unwrap_or_else(|_| Err(gone_with(messages)))
    }

    /// The answer if it has come.
    fn try_answer(&mut self) -> Option<PublishAnswer> {
        match self.answer.try_recv() {
            Ok(answer) => Some(answer),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(gone_with(self.messages))),
        }
    }
}

/// A batch whose session task ended before answering it: it may have been
/// written.
fn gone_with(messages: usize) -> PublishError {
    PublishError::Unconfirmed {
        messages,
        cause: session_gone(),
    }
}

/// Why the broker ended a subscription, from the `reason` of the session's
/// `ended` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    /// A slow consumer: its queue was full.
    Evicted,
    /// An operator called Admin/CloseSubscription.
    ClosedByAdmin,
    /// The broker is shutting down.
    Shutdown,
    /// A broker that did not say (an older version), or a reason this client
    /// does not know.
    Unknown(String),
}

/// What happens to a subscription besides its messages. The CLI prints each
/// as one line on stderr; a program can log them (see [`Subscriber::on_event`]).
#[derive(Debug, Clone)]
pub enum SubscriberEvent {
    /// The broker ended the stream, with what the subscription lost then
    /// and the last sequence it was handed.
    Ended {
        subscription_id: String,
        reason: EndReason,
        /// Messages lost with the stream (`ended.dropped`): those
        /// queued for it and, for an eviction of a full queue, the one that
        /// did not fit; the same count as
        /// `tinybroker_messages_dropped_total`.
        dropped: Option<u64>,
        last_sequence: Option<u64>,
        /// An eviction: the queue depth then, from Admin/ListEvictions (the
        /// number the broker's WARN line and ListEvictions show); `None`
        /// when the broker did not list it.
        queue_depth: Option<u64>,
    },
    /// The session carrying it failed (the connection was lost): with
    /// `reconnect` every subscription of the client is opened again on a
    /// new session.
    Failed { subscription_id: String, status: Status },
    /// Opening again in `delay`.
    Reconnecting { delay: Duration, cause: Option<Status> },
    /// Open again, under a new id.
    Resubscribed { subscription_id: String },
    /// The first message after re-subscribing, and what was missed while
    /// the subscription was away.
    Resumed {
        last_before: Option<u64>,
        first_after: u64,
        missed: Gap,
    },
}

/// What a subscription missed while it was away (docs/clients.md, "Gaps").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gap {
    /// Nothing: the first message after is the one after the last before.
    Nothing,
    /// These sequences, inclusive (both messages came from one instance
    /// that numbers everything it delivers with one counter).
    Range { first: u64, last: u64 },
    /// Not known: the sequences before and after cannot be compared.
    Unknown(GapUnknown),
}

/// Why a [`Gap`] is not known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapUnknown {
    /// The broker restarted, or the subscription is now on another replica:
    /// sequences count apart.
    InstanceChanged,
    /// Cluster mode: each publishing replica counts apart.
    SequenceScope,
    /// Nothing was delivered before.
    NothingBefore,
}

impl Gap {
    /// The gap between `last` (of `before`) and `first` (of `after`).
    pub(crate) fn between(last: Option<(u64, &SequenceSpace)>, first: u64, after: &SequenceSpace) -> Gap {
        let Some((last, before)) = last else {
            return Gap::Unknown(GapUnknown::NothingBefore);
        };
        if before.instance.is_none() || before.instance != after.instance {
            return Gap::Unknown(GapUnknown::InstanceChanged);
        }
        if !after.one_counter {
            return Gap::Unknown(GapUnknown::SequenceScope);
        }
        match first.checked_sub(1) {
            Some(end) if end > last => Gap::Range {
                first: last + 1,
                last: end,
            },
            _ => Gap::Nothing,
        }
    }
}

impl std::fmt::Display for SubscriberEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubscriberEvent::Ended {
                subscription_id,
                reason,
                dropped,
                last_sequence,
                queue_depth,
            } => {
                let why = match reason {
                    EndReason::Evicted => "evicted by the broker as a slow consumer".to_owned(),
                    EndReason::ClosedByAdmin => "closed by an admin (Admin/CloseSubscription)".to_owned(),
                    EndReason::Shutdown => "ended: the broker is shutting down".to_owned(),
                    EndReason::Unknown(r) if r.is_empty() => "ended by the broker".to_owned(),
                    EndReason::Unknown(r) => format!("ended by the broker ({r})"),
                };
                write!(f, "subscription {subscription_id} {why}")?;
                if let Some(depth) = queue_depth {
                    write!(f, ": queue depth {depth}")?;
                }
                match (dropped, queue_depth) {
                    (Some(n), Some(depth)) if *n > *depth => write!(
                        f,
                        "; {n} messages dropped: the {depth} queued for it and {} that did not fit",
                        n - depth
                    )?,
                    (Some(n), _) if *reason == EndReason::Evicted && *n > 0 => write!(
                        f,
                        "; {n} messages dropped (those queued for it, and the one that did not fit a full queue)"
                    )?,
                    (Some(n), _) if *n > 0 => write!(f, "; {n} messages queued for it dropped")?,
                    _ => {}
                }
                if let Some(seq) = last_sequence.filter(|s| *s > 0) {
                    write!(f, "; last sequence delivered {seq}")?;
                }
                Ok(())
            }
            SubscriberEvent::Failed {
                subscription_id,
                status,
            } => write!(
                f,
                "subscription {subscription_id} lost: {:?}: {}",
                status.code(),
                status.message()
            ),
            SubscriberEvent::Reconnecting { delay, cause } => {
                write!(f, "re-subscribing in {} ms", delay.as_millis())?;
                if let Some(status) = cause {
                    write!(f, " (last attempt: {:?}: {})", status.code(), status.message())?;
                }
                Ok(())
            }
            SubscriberEvent::Resubscribed { subscription_id } => write!(
                f,
                "re-subscribed as {subscription_id}; messages published while away are not delivered"
            ),
            SubscriberEvent::Resumed {
                last_before,
                first_after,
                missed,
            } => {
                write!(f, "receiving again from sequence {first_after}")?;
                if let Some(last) = last_before {
                    write!(f, " (last before: {last})")?;
                }
                match missed {
                    Gap::Nothing => write!(f, "; nothing missed"),
                    Gap::Range { first, last } => write!(f, "; missed sequences {first}..{last}"),
                    Gap::Unknown(GapUnknown::InstanceChanged) => write!(
                        f,
                        "; what was published while away is unknown (the broker restarted, or this is another replica: sequences count apart)"
                    ),
                    Gap::Unknown(GapUnknown::SequenceScope) => write!(
                        f,
                        "; what was published while away is unknown (cluster mode: each replica numbers its own publishes)"
                    ),
                    Gap::Unknown(GapUnknown::NothingBefore) => Ok(()),
                }
            }
        }
    }
}

/// `addr` with `http://` in front when it names no scheme, so that
/// `127.0.0.1:50051` works as users type it.
fn with_scheme(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    }
}

/// What [`Subscriber::on_event`] calls.
type EventHandler = Box<dyn FnMut(&SubscriberEvent) + Send>;

/// A subscription on its client's session. With `reconnect`, a
/// subscription that ends (eviction, shutdown) or is lost with the session
/// is opened again after a backoff, so the caller just keeps calling
/// [`Subscriber::next`]. One an admin closed is not opened again: `next`
/// then returns `Ok(None)`. The broker sends it at most a window of
/// messages beyond what `next` has returned: an application that stops
/// calling `next` stalls this subscription only.
pub struct Subscriber {
    client: Client,
    request: pb::OpenSubscriptionRequest,
    /// Its handle on the session while it is open (or being opened again
    /// after a lost session).
    live: Option<Live>,
    subscription_id: Option<String>,
    reconnect: bool,
    backoff: Backoff,
    opened_once: bool,
    /// Sequence of the last message returned.
    last_sequence: Option<u64>,
    /// Where that sequence came from.
    last_space: SequenceSpace,
    /// Where the current stream's sequences come from.
    space: SequenceSpace,
    /// Set from a re-subscription until its first message.
    resuming: bool,
    on_event: Option<EventHandler>,
}

/// A subscription's handle on the session, and its events.
struct Live {
    handle: u32,
    events: mpsc::UnboundedReceiver<HandleEvent>,
    commands: mpsc::UnboundedSender<Command>,
    /// Which open of the handle the messages being taken belong to.
    generation: u64,
    /// Messages taken and not yet given back as credit.
    taken: u32,
    /// Deliveries the session task sent it that were not taken yet.
    held: Arc<AtomicU32>,
}

impl Live {
    fn send(&self, command: Command) -> Result<(), Status> {
        self.commands.send(command).map_err(|_| session_gone())
    }

    /// One more message taken: credit goes back in batches.
    fn took_one(&mut self) {
        self.held.fetch_sub(1, Ordering::AcqRel);
        self.taken += 1;
        if self.taken >= CREDIT_BATCH {
            let messages = std::mem::take(&mut self.taken);
            let _ = self.send(Command::Credit {
                handle: self.handle,
                generation: self.generation,
                messages,
            });
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        // Ignored by the task if the subscription has ended already.
        let _ = self.send(Command::Close { handle: self.handle });
    }
}

fn session_gone() -> Status {
    Status::cancelled("the client's session task has ended (the client was closed)")
}

/// What every call of a closed client fails with.
pub(crate) fn closed() -> Status {
    Status::cancelled("the client is closed")
}

/// The status an `open` would have failed with, from a rejected one.
fn rejection(ended: &pb::SessionEnded) -> Status {
    Status::new(Code::from_i32(ended.code as i32), ended.message.clone())
}

impl Subscriber {
    /// The id the broker gave the current subscription.
    pub fn subscription_id(&self) -> Option<&str> {
        self.subscription_id.as_deref()
    }

    /// What it subscribes to.
    pub fn request(&self) -> &pb::OpenSubscriptionRequest {
        &self.request
    }

    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    /// Calls `f` for every [`SubscriberEvent`].
    pub fn on_event(&mut self, f: impl FnMut(&SubscriberEvent) + Send + 'static) {
        self.on_event = Some(Box::new(f));
    }

    fn emit(&mut self, event: SubscriberEvent) {
        tracing::debug!(%event, "subscriber event");
        if let Some(f) = &mut self.on_event {
            f(&event);
        }
    }

    /// Opens the subscription on the session now (the first `next` does it
    /// otherwise); returns once the broker has registered it.
    pub async fn open(&mut self) -> Result<(), Status> {
        self.live = None;
        loop {
            let (events_tx, events) = mpsc::unbounded_channel();
            let commands = self.client.session();
            let handle = self.client.next_handle();
            let held = Arc::new(AtomicU32::new(0));
            let mut live = Live {
                handle,
                events,
                commands,
                generation: 0,
                taken: 0,
                held: held.clone(),
            };
            live.send(Command::Open {
                handle,
                request: self.request.clone(),
                reconnect: self.reconnect,
                events: events_tx,
                held,
            })?;
            let failure = loop {
                match live.events.recv().await {
                    Some(HandleEvent::Opened {
                        subscription_id,
                        generation,
                        space,
                    }) => {
                        live.generation = generation;
                        self.space = space;
                        self.opened(subscription_id);
                        self.live = Some(live);
                        return Ok(());
                    }
                    Some(HandleEvent::Ended(ended)) => break rejection(&ended),
                    Some(HandleEvent::Retrying { delay, cause }) => {
                        self.emit(SubscriberEvent::Reconnecting { delay, cause })
                    }
                    // The session task opens it again on the next session.
                    Some(HandleEvent::Lost { retrying: true, .. }) => {}
                    Some(HandleEvent::Lost { status, .. }) => return Err(status),
                    // Nothing is delivered before `opened`.
                    Some(HandleEvent::Delivery(_)) => {}
                    None => return Err(session_gone()),
                }
            };
            drop(live);
            if !(self.reconnect && self.retryable(&failure)) {
                return Err(failure);
            }
            self.wait_to_retry(Some(failure)).await;
        }
    }

    /// The subscription is open (again) under `subscription_id`.
    fn opened(&mut self, subscription_id: String) {
        self.subscription_id = Some(subscription_id);
        if self.opened_once {
            self.resuming = true;
            let subscription_id = self.current_id();
            self.emit(SubscriberEvent::Resubscribed { subscription_id });
        }
        self.opened_once = true;
    }

    fn current_id(&self) -> String {
        self.subscription_id.clone().unwrap_or_default()
    }

    async fn wait_to_retry(&mut self, cause: Option<Status>) {
        let delay = self.backoff.next_delay();
        self.emit(SubscriberEvent::Reconnecting { delay, cause });
        tokio::time::sleep(delay).await;
    }

    /// The next message; `Ok(None)` when the subscription ended and is not
    /// opened again (`reconnect` is off, or an admin closed it). Each
    /// message returned lets the broker send one more.
    pub async fn next(&mut self) -> Result<Option<pb::Message>, Status> {
        loop {
            if self.live.is_none() {
                self.open().await?;
            }
            let Some(live) = self.live.as_mut() else {
                continue;
            };
            let Some(event) = live.events.recv().await else {
                self.live = None;
                return Err(session_gone());
            };
            match event {
                HandleEvent::Delivery(message) => {
                    live.took_one();
                    self.backoff.reset();
                    if std::mem::take(&mut self.resuming) {
                        let last_before = self.last_sequence;
                        let missed = Gap::between(
                            last_before.map(|last| (last, &self.last_space)),
                            message.sequence,
                            &self.space,
                        );
                        self.emit(SubscriberEvent::Resumed {
                            last_before,
                            first_after: message.sequence,
                            missed,
                        });
                    }
                    self.last_sequence = Some(message.sequence);
                    self.last_space.clone_from(&self.space);
                    return Ok(Some(message));
                }
                HandleEvent::Opened {
                    subscription_id,
                    generation,
                    space,
                } => {
                    // Open again on a new session, with a fresh window.
                    live.generation = generation;
                    live.taken = 0;
                    self.space = space;
                    self.opened(subscription_id);
                }
                HandleEvent::Retrying { delay, cause } => self.emit(SubscriberEvent::Reconnecting { delay, cause }),
                HandleEvent::Lost { status, retrying } => {
                    let subscription_id = self.current_id();
                    self.emit(SubscriberEvent::Failed {
                        subscription_id,
                        status: status.clone(),
                    });
                    if !retrying {
                        self.live = None;
                        return Err(status);
                    }
                }
                HandleEvent::Ended(ended) if ended.reason == "rejected" => {
                    // Opened again after a lost session, and refused.
                    self.live = None;
                    let status = rejection(&ended);
                    if !(self.reconnect && self.retryable(&status)) {
                        return Err(status);
                    }
                    self.wait_to_retry(Some(status)).await;
                }
                HandleEvent::Ended(ended) => {
                    self.live = None;
                    if self.ended(ended).await {
                        return Ok(None);
                    }
                    self.wait_to_retry(None).await;
                }
            }
        }
    }

    /// Says that the broker ended the subscription; true if it is not to be
    /// opened again.
    async fn ended(&mut self, ended: pb::SessionEnded) -> bool {
        let reason = match ended.reason.as_str() {
            "evicted" => EndReason::Evicted,
            "closed_by_admin" => EndReason::ClosedByAdmin,
            "shutdown" => EndReason::Shutdown,
            other => EndReason::Unknown(other.to_owned()),
        };
        let closed_by_admin = reason == EndReason::ClosedByAdmin;
        let subscription_id = self.current_id();
        let queue_depth = if reason == EndReason::Evicted {
            self.evicted_queue_depth(&subscription_id).await
        } else {
            None
        };
        self.emit(SubscriberEvent::Ended {
            subscription_id,
            reason,
            dropped: Some(ended.dropped),
            last_sequence: Some(ended.last_sequence),
            queue_depth,
        });
        // An operator closed it on purpose: do not come back.
        !self.reconnect || closed_by_admin
    }

    /// Acknowledges manual-ack group messages this subscription received,
    /// in-band on the session (no reply; sequences it does not hold are
    /// counted by the broker). FAILED_PRECONDITION when it is not open.
    pub fn ack(&self, sequences: Vec<u64>) -> Result<(), Status> {
        self.acknowledge(sequences, false)
    }

    /// Hands manual-ack group messages back for redelivery, in-band.
    pub fn nack(&self, sequences: Vec<u64>) -> Result<(), Status> {
        self.acknowledge(sequences, true)
    }

    fn acknowledge(&self, sequences: Vec<u64>, nack: bool) -> Result<(), Status> {
        let Some(live) = &self.live else {
            return Err(Status::failed_precondition("the subscription is not open"));
        };
        live.send(Command::Ack {
            handle: live.handle,
            sequences,
            nack,
        })
    }

    /// Closes the subscription and waits until the broker has ended it:
    /// acks sent before it have then been applied. Messages it had not
    /// returned yet are dropped (a manual-ack group's go to another member).
    pub async fn close(&mut self) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        if live.send(Command::Close { handle: live.handle }).is_err() {
            return;
        }
        while let Some(event) = live.events.recv().await {
            if matches!(event, HandleEvent::Ended(_) | HandleEvent::Lost { .. }) {
                return;
            }
        }
    }

    /// The queue depth Admin/ListEvictions lists for this subscription's
    /// eviction: the broker records it just after it ends the stream, so a
    /// few looks within a second. `None` when it is not listed (a token
    /// without Admin access, an older broker, a record already pushed out).
    async fn evicted_queue_depth(&mut self, subscription_id: &str) -> Option<u64> {
        if subscription_id.is_empty() {
            return None;
        }
        for _ in 0..10 {
            match self.client.list_evictions().await {
                Ok(evictions) => {
                    if let Some(e) = evictions.iter().find(|e| e.subscription_id == subscription_id) {
                        return Some(e.queue_depth);
                    }
                }
                Err(status) => {
                    tracing::debug!(%status, "cannot list evictions");
                    return None;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    fn retryable(&self, status: &Status) -> bool {
        match status.code() {
            // Our own earlier subscription may not be reaped yet.
            Code::AlreadyExists => self.opened_once,
            _ => session_task::retryable(status),
        }
    }
}

/// `CONNECT_DELAY_FIRST` (docs/clients.md, "The constants").
const CONNECT_DELAY_FIRST: Duration = Duration::from_millis(100);
/// `CONNECT_DELAY_CAP`: short, so a broker that answers again has every
/// subscription back within 0.5 s.
const CONNECT_DELAY_CAP: Duration = Duration::from_millis(250);
/// `RESUBSCRIBE_DELAY_FIRST`.
const RESUBSCRIBE_DELAY_FIRST: Duration = Duration::from_millis(100);
/// `RESUBSCRIBE_DELAY_CAP`.
const RESUBSCRIBE_DELAY_CAP: Duration = Duration::from_secs(5);

/// Between attempts to start a session (`CONNECT_DELAY_*`, with `JITTER`:
/// [`Backoff`]'s factor in [0.8, 1.2]).
fn connect_backoff() -> Backoff {
    Backoff::new(CONNECT_DELAY_FIRST, CONNECT_DELAY_CAP)
}

/// Before opening again a subscription the broker ended or refused
/// (`RESUBSCRIBE_DELAY_*`, with `JITTER`).
fn resubscribe_backoff() -> Backoff {
    Backoff::new(RESUBSCRIBE_DELAY_FIRST, RESUBSCRIBE_DELAY_CAP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_without_a_scheme_are_plain_http() {
        assert_eq!(with_scheme("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(with_scheme("https://broker:443"), "https://broker:443");
    }
}
