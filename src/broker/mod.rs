//! The routing core: subscriptions, their queues, publishing and eviction.
//!
//! Knows nothing of gRPC or HTTP: the `grpc` module adapts it to tonic and the
//! `metrics` module reads its live state at scrape time.

mod group;
mod queue;
mod subscription;

pub use group::{AckMode, ConsumerGroup, DeadLetter, GroupSnapshot, MemberSettings};
pub use queue::{CloseReason, WakeBatch};
use subscription::Membership;
pub use subscription::{Subscription, SubscriptionInfo, SubscriptionStream};

use crate::config::Limits;
use crate::memory::{self, MemoryBudget};
use crate::sublist::Sublist;
use crate::topic::{self, TopicPattern};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use queue::{Push, Queue};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

/// Most patterns one subscription may hold.
pub const MAX_PATTERNS_PER_SUBSCRIPTION: usize = 64;
/// Most headers one message may carry.
pub const MAX_HEADERS: usize = 64;
/// Longest header name or value.
pub const MAX_HEADER_BYTES: usize = 8192;
/// Longest subscription id or consumer group name.
pub const MAX_NAME_BYTES: usize = 256;
/// Evictions remembered for the Admin API.
pub const EVICTION_HISTORY: usize = 1024;
/// Removals of groups that still held messages, remembered for the metrics.
pub const GROUP_REMOVAL_HISTORY: usize = 64;
/// How often ack deadlines and idle groups are checked.
pub const MAINTENANCE_INTERVAL: Duration = Duration::from_millis(50);
/// A group that has had work but completed nothing for this long is logged
/// at WARN, once per stall (the shipped `TinybrokerConsumerGroupStuck` alert
/// uses the same threshold).
pub const STALL_WARNING_AFTER: Duration = Duration::from_secs(45);
/// Prefix of dead-letter topics: `_dlq.<group>`.
pub const DEAD_LETTER_PREFIX: &str = "_dlq.";
/// Header of a dead letter naming the topic it was first published to.
pub const ORIGINAL_TOPIC_HEADER: &str = "tinybroker-original-topic";
/// Header of a dead letter giving how many deliveries were tried.
pub const DELIVERY_ATTEMPTS_HEADER: &str = "tinybroker-delivery-attempts";

/// A message as published: shared by every subscription it fans out to.
/// Charged to the broker's memory budget from its creation until the last
/// queue, group or stream holding it lets go.
#[derive(Debug)]
pub struct Published {
    pub topic: String,
    pub payload: Bytes,
    pub headers: HashMap<String, String>,
    pub sequence: u64,
    pub publish_time: SystemTime,
    /// What it is charged: see [`message_size`].
    size: usize,
    budget: &'static MemoryBudget,
}

impl Published {
    /// The bytes it is charged, in the broker's budget and in every queue's
    /// and group's byte limit.
    pub fn size(&self) -> usize {
        self.size
    }

    #[cfg(test)]
    pub(crate) fn for_test(topic: &str, sequence: u64) -> Self {
        static UNLIMITED: MemoryBudget = MemoryBudget::unlimited();
        let size = message_size(topic, &Bytes::new(), &HashMap::new());
        UNLIMITED.charge(size);
        Self {
            topic: topic.into(),
            payload: Bytes::new(),
            headers: HashMap::new(),
            sequence,
            publish_time: SystemTime::now(),
            size,
            budget: &UNLIMITED,
        }
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        self.budget.release(self.size);
    }
}

/// What a message is charged against byte limits: its topic, payload and
/// headers, plus the bookkeeping around them.
pub fn message_size(topic: &str, payload: &Bytes, headers: &HashMap<String, String>) -> usize {
    let headers: usize = headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + memory::HEADER_OVERHEAD)
        .sum();
    memory::MESSAGE_OVERHEAD + topic.len() + payload.len() + headers
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

/// One message on its way to one subscriber.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: Arc<Published>,
    /// 1 on first delivery, +1 on each redelivery.
    pub attempt: u32,
}

/// What a publisher sends.
#[derive(Debug, Default, Clone)]
pub struct NewMessage {
    pub topic: String,
    pub payload: Bytes,
    pub headers: HashMap<String, String>,
}

/// Where a published message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishOutcome {
    pub sequence: u64,
    pub matched_subscriptions: u32,
    pub matched_groups: u32,
}

/// What a subscriber asks for (mode-independent part of the request).
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
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryMode {
    #[default]
    Broadcast,
    Group,
}

/// A refused request. The grpc layer maps each kind to its status code; the
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

/// One slow-consumer eviction, kept for the Admin API.
#[derive(Debug, Clone)]
pub struct EvictionRecord {
    pub subscription_id: String,
    pub evicted_at: SystemTime,
    pub topic_patterns: Vec<String>,
    pub queue_depth: usize,
    pub last_delivered_sequence: u64,
    pub peer: Option<SocketAddr>,
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

/// Lifetime counters, all plain atomics so the publish path never locks for
/// them. Counts of live subscriptions are read from the subscriptions.
#[derive(Debug, Default)]
pub struct Stats {
    pub published: AtomicU64,
    pub unrouted: AtomicU64,
    pub evictions: AtomicU64,
    /// Messages handed to broadcast subscribers' streams (flushed by each
    /// stream in batches, so it may trail the live streams by a little).
    pub delivered_broadcast: AtomicU64,
    /// The same for consumer-group members.
    pub delivered_group: AtomicU64,
    /// Messages queued for a subscription when it was evicted (and the one
    /// that did not fit).
    pub dropped_evicted: AtomicU64,
    /// Messages queued for a subscription its client cancelled or an admin
    /// closed.
    pub dropped_closed: AtomicU64,
    /// Oldest backlog messages dropped because a group's backlog was full.
    pub dropped_group_overflow: AtomicU64,
    /// Backlog of groups removed after their idle TTL.
    pub dropped_group_expired: AtomicU64,
    pub discarded_on_shutdown: AtomicU64,
    /// Dead letters that would have broken a message limit (more than
    /// [`MAX_HEADERS`] headers, or over `max_message_bytes`, once the
    /// broker's two headers were added): not published, counted.
    pub dropped_dead_letter_invalid: AtomicU64,
    /// Publishes refused because the broker's memory budget was spent.
    pub refused_memory_limit: AtomicU64,
    /// Subscriptions evicted to bring the broker back under its memory
    /// budget (also counted in `evictions`).
    pub evictions_memory_limit: AtomicU64,
}

/// Handle to the broker; cheap to clone.
#[derive(Clone)]
pub struct Broker {
    shared: Arc<Shared>,
}

struct Shared {
    limits: Limits,
    /// Last sequence handed out.
    sequence: AtomicU64,
    /// Pattern trie of live subscriptions. Read-locked by publishers that miss
    /// their own route cache, write-locked by subscribe/unsubscribe.
    routes: RwLock<Sublist<Route>>,
    /// Bumped after every change of `routes`; publishers compare it to decide
    /// whether their cached routes are still good.
    routes_generation: AtomicU64,
    /// Open subscriptions by id. Never touched on the publish path.
    subscriptions: Mutex<HashMap<Arc<str>, Arc<Subscription>>>,
    /// Consumer groups by name, including memberless ones within their idle
    /// TTL. Never touched on the publish path; taken before a group's own
    /// lock, never after it.
    groups: Mutex<HashMap<Arc<str>, Arc<ConsumerGroup>>>,
    next_key: AtomicU64,
    /// Most recent evictions, newest last, at most [`EVICTION_HISTORY`].
    evictions: Mutex<VecDeque<EvictionRecord>>,
    /// Most recent removals of groups with messages left, newest last, at
    /// most [`GROUP_REMOVAL_HISTORY`].
    group_removals: Mutex<VecDeque<GroupRemoval>>,
    stats: Stats,
    /// Set when shutdown begins: new work is refused from then on.
    draining: AtomicBool,
    /// Cancelled when shutdown begins, so that idle publish streams end.
    drain_signal: CancellationToken,
    started_at: SystemTime,
    started: Instant,
    /// Bytes of every message alive: the messages' share (7/8) of
    /// `TINYBROKER_MAX_MEMORY_BYTES` (requests being received have the rest,
    /// in the gRPC layer).
    memory: &'static MemoryBudget,
}

/// Why a subscription is evicted, with its queue's depth and bytes then.
#[derive(Debug, Clone, Copy)]
enum Eviction {
    /// A message did not fit: the queue was at its capacity or byte limit.
    QueueFull { depth: usize, bytes: usize },
    /// The broker's memory budget was spent and this queue held the most.
    MemoryLimit { depth: usize, bytes: usize },
}

/// A routing target of the trie.
#[derive(Clone)]
pub(crate) enum Route {
    Subscription(Arc<Subscription>),
    Group(Arc<ConsumerGroup>),
}

/// A publisher's own memo of topic → routes, valid while the broker's route
/// generation is unchanged. Lets a long `PublishStream` skip the shared trie
/// (and its locks) for topics it has seen. Hashed with foldhash (randomly
/// seeded, a fraction of SipHash's cost per lookup); the cache is the
/// stream's own and bounded, so colliding topics could only slow their
/// own publisher.
#[derive(Default)]
pub struct RouteCache {
    generation: u64,
    routes: HashMap<String, Arc<[Route]>, foldhash::fast::RandomState>,
}

impl RouteCache {
    const CAPACITY: usize = 256;
}

impl Broker {
    pub fn new(limits: Limits) -> Self {
        let memory = MemoryBudget::leak(memory::split(limits.max_memory_bytes).0);
        Self {
            shared: Arc::new(Shared {
                limits,
                sequence: AtomicU64::new(0),
                routes: RwLock::new(Sublist::default()),
                routes_generation: AtomicU64::new(0),
                subscriptions: Mutex::new(HashMap::new()),
                groups: Mutex::new(HashMap::new()),
                next_key: AtomicU64::new(1),
                evictions: Mutex::new(VecDeque::new()),
                group_removals: Mutex::new(VecDeque::new()),
                stats: Stats::default(),
                draining: AtomicBool::new(false),
                drain_signal: CancellationToken::new(),
                started_at: SystemTime::now(),
                started: Instant::now(),
                memory,
            }),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.shared.limits
    }

    pub fn stats(&self) -> &Stats {
        &self.shared.stats
    }

    /// The messages' memory budget (what the metrics report).
    pub fn memory(&self) -> &'static MemoryBudget {
        self.shared.memory
    }

    pub fn started_at(&self) -> SystemTime {
        self.shared.started_at
    }

    pub fn uptime(&self) -> std::time::Duration {
        self.shared.started.elapsed()
    }

    /// The last sequence handed out (0 before the first publish).
    pub fn last_sequence(&self) -> u64 {
        self.shared.sequence.load(Ordering::Relaxed)
    }

    // === publishing ===

    /// Validates and routes one message to every matching subscription.
    pub fn publish(&self, message: NewMessage, cache: Option<&mut RouteCache>) -> Result<PublishOutcome, BrokerError> {
        self.publish_at(message, cache, PublishTime::now())
    }

    /// [`Broker::publish`] with the publish time read by the caller, so a
    /// burst of messages received together reads the clocks once.
    pub fn publish_at(
        &self,
        message: NewMessage,
        cache: Option<&mut RouteCache>,
        at: PublishTime,
    ) -> Result<PublishOutcome, BrokerError> {
        self.check_open()?;
        let size = self.validate_message(&message)?;
        self.reserve(size, &message.topic)?;
        Ok(self.route(message, size, cache, at))
    }

    /// Charges a new message of `size` bytes to the memory budget. When the
    /// budget is spent, first evicts the broadcast subscriptions that hold
    /// the most bytes (the readers furthest behind: evicting frees what only
    /// they hold), then refuses the message.
    fn reserve(&self, size: usize, topic: &str) -> Result<(), BrokerError> {
        const MOST_EVICTIONS_PER_MESSAGE: usize = 4;
        let memory = self.shared.memory;
        if memory.try_charge(size) {
            return Ok(());
        }
        for _ in 0..MOST_EVICTIONS_PER_MESSAGE {
            let Some((subscription, depth, bytes)) = self.fullest_broadcast_queue() else {
                break;
            };
            self.evict(&subscription, Eviction::MemoryLimit { depth, bytes });
            if memory.try_charge(size) {
                return Ok(());
            }
        }
        self.shared.stats.refused_memory_limit.fetch_add(1, Ordering::Relaxed);
        Err(BrokerError::ResourceExhausted(format!(
            "the broker's memory limit is reached: messages held for subscribers and consumer groups take {} bytes, and the message to {:?} ({size} bytes) does not fit in their share ({} bytes, 7/8) of max_memory_bytes (TINYBROKER_MAX_MEMORY_BYTES); consumer groups' backlogs hold the rest, try again once their members catch up",
            memory.used(),
            truncate(topic),
            memory.limit().unwrap_or(usize::MAX)
        )))
    }

    /// The broadcast subscription whose queue holds the most bytes (and its
    /// depth and bytes), if one holds enough to be a reader far behind: at
    /// least 1/64 of the message budget (and 1 MiB). A reader that keeps up
    /// holds next to nothing, and is never evicted because consumer groups'
    /// backlogs filled the budget.
    fn fullest_broadcast_queue(&self) -> Option<(Arc<Subscription>, usize, usize)> {
        let budget = self.shared.memory.limit().unwrap_or(usize::MAX);
        let far_behind = (budget / 64).max(1 << 20);
        let subscriptions = self.shared.subscriptions.lock();
        subscriptions
            .values()
            .filter(|s| s.membership().is_none())
            .map(|s| (s, s.queue.bytes()))
            .filter(|(_, bytes)| *bytes >= far_behind)
            .max_by_key(|(_, bytes)| *bytes)
            .map(|(s, bytes)| (s.clone(), s.queue_depth(), bytes))
    }

    /// Assigns the sequence and hands the message, already charged `size`
    /// bytes, to every matching subscription and group. Never waits.
    fn route(
        &self,
        message: NewMessage,
        size: usize,
        cache: Option<&mut RouteCache>,
        at: PublishTime,
    ) -> PublishOutcome {
        let routes = match cache {
            Some(cache) => self.routes_cached(&message.topic, cache),
            None => self.shared.routes.read().matches(&message.topic),
        };
        let sequence = self.shared.sequence.fetch_add(1, Ordering::Relaxed) + 1;
        let published = Arc::new(Published {
            topic: message.topic,
            payload: message.payload,
            headers: message.headers,
            sequence,
            publish_time: at.wall,
            size,
            budget: self.shared.memory,
        });
        let stats = &self.shared.stats;
        stats.published.fetch_add(1, Ordering::Relaxed);
        if routes.is_empty() {
            stats.unrouted.fetch_add(1, Ordering::Relaxed);
        }
        let mut outcome = PublishOutcome {
            sequence,
            matched_subscriptions: 0,
            matched_groups: 0,
        };
        for route in routes.iter() {
            match route {
                Route::Subscription(sub) => {
                    let delivery = Delivery {
                        message: published.clone(),
                        attempt: 1,
                    };
                    match sub.queue.push(delivery) {
                        Push::Queued => outcome.matched_subscriptions += 1,
                        Push::Full { depth, bytes, .. } => self.evict(sub, Eviction::QueueFull { depth, bytes }),
                        Push::Closed(_) => {}
                    }
                }
                Route::Group(group) => {
                    outcome.matched_groups += 1;
                    let dropped = group.offer(published.clone(), at.monotonic);
                    if dropped > 0 {
                        stats.dropped_group_overflow.fetch_add(dropped, Ordering::Relaxed);
                    }
                }
            }
        }
        outcome
    }

    /// Publishes dead letters to `_dlq.<group>`, with the original topic and
    /// the attempts in headers. Runs even while shutting down.
    fn dead_letter(&self, group: &str, letters: Vec<DeadLetter>) {
        for letter in letters {
            let original = &letter.message;
            tracing::warn!(
                consumer_group = group,
                sequence = original.sequence,
                topic = %original.topic,
                attempts = letter.attempts,
                "message dead-lettered after its last delivery attempt"
            );
            let mut headers = original.headers.clone();
            headers.insert(ORIGINAL_TOPIC_HEADER.into(), original.topic.clone());
            headers.insert(DELIVERY_ATTEMPTS_HEADER.into(), letter.attempts.to_string());
            let letter = NewMessage {
                topic: format!("{DEAD_LETTER_PREFIX}{group}"),
                payload: original.payload.clone(),
                headers,
            };
            // A dead letter obeys the limits of every message a subscriber
            // can receive. One that breaks them (its original had more than
            // MAX_HEADERS - 2 headers, or was within the two headers' bytes
            // of max_message_bytes) is dropped and counted, never delivered
            // over a limit a client may rely on.
            let size = match self.validate_message(&letter) {
                Ok(size) => size,
                Err(error) => {
                    self.shared
                        .stats
                        .dropped_dead_letter_invalid
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        consumer_group = group,
                        sequence = original.sequence,
                        %error,
                        "dead letter dropped: with the broker's two dead-letter headers it breaks a message limit"
                    );
                    continue;
                }
            };
            // The original is released as the letter takes its place: charged
            // whatever the limit, so a dead letter is never lost to it.
            self.shared.memory.charge(size);
            self.route(letter, size, None, PublishTime::now());
        }
    }

    fn routes_cached(&self, topic: &str, cache: &mut RouteCache) -> Arc<[Route]> {
        let generation = self.shared.routes_generation.load(Ordering::Acquire);
        if cache.generation != generation {
            cache.routes.clear();
            cache.generation = generation;
        }
        if let Some(routes) = cache.routes.get(topic) {
            return routes.clone();
        }
        let routes = self.shared.routes.read().matches(topic);
        if cache.routes.len() >= RouteCache::CAPACITY {
            cache.routes.clear();
        }
        cache.routes.insert(topic.to_owned(), routes.clone());
        routes
    }

    /// Checks a message against the limits; returns the bytes it is charged.
    fn validate_message(&self, message: &NewMessage) -> Result<usize, BrokerError> {
        topic::validate_topic(&message.topic).map_err(|e| BrokerError::InvalidArgument(e.to_string()))?;
        if message.headers.len() > MAX_HEADERS {
            return Err(BrokerError::InvalidArgument(format!(
                "message to {:?} has {} headers, the limit is {MAX_HEADERS}",
                message.topic,
                message.headers.len()
            )));
        }
        let mut size = message.payload.len();
        for (name, value) in &message.headers {
            if name.is_empty() {
                return Err(BrokerError::InvalidArgument(format!(
                    "message to {:?} has a header with an empty name",
                    message.topic
                )));
            }
            if name.len() > MAX_HEADER_BYTES || value.len() > MAX_HEADER_BYTES {
                return Err(BrokerError::InvalidArgument(format!(
                    "header {:?} of a message to {:?} is longer than {MAX_HEADER_BYTES} bytes",
                    truncate(name),
                    message.topic
                )));
            }
            size += name.len() + value.len();
        }
        let max = self.shared.limits.max_message_bytes;
        if size > max {
            return Err(BrokerError::ResourceExhausted(format!(
                "message to {:?} is {size} bytes (payload plus headers), larger than max_message_bytes {max} (TINYBROKER_MAX_MESSAGE_BYTES)",
                message.topic
            )));
        }
        // message_size, from the sum just made rather than a second pass.
        Ok(memory::MESSAGE_OVERHEAD + message.topic.len() + size + message.headers.len() * memory::HEADER_OVERHEAD)
    }

    // === subscribing ===

    /// Opens a subscription. Registration is complete when this returns: every
    /// message published afterwards that matches reaches the stream.
    pub fn subscribe(&self, request: SubscribeRequest) -> Result<SubscriptionStream, BrokerError> {
        self.check_open()?;
        let patterns = parse_patterns(&request.topic_patterns)?;
        match request.mode {
            DeliveryMode::Broadcast if !request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(format!(
                    "consumer_group {:?} was given with DELIVERY_MODE_MULTI (broadcast); consumer groups need DELIVERY_MODE_SINGLE",
                    truncate(&request.consumer_group)
                )));
            }
            DeliveryMode::Broadcast => {}
            DeliveryMode::Group if request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(
                    "DELIVERY_MODE_SINGLE needs a consumer_group; it was empty".into(),
                ));
            }
            DeliveryMode::Group => check_group_name(&request.consumer_group)?,
        }
        let id: Arc<str> = if request.subscription_id.is_empty() {
            uuid::Uuid::new_v4().to_string().into()
        } else {
            check_name("subscription_id", &request.subscription_id)?;
            request.subscription_id.as_str().into()
        };
        let key = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        if request.mode == DeliveryMode::Group {
            return self.join_group(request, key, id, patterns);
        }
        let subscription = Arc::new(Subscription::new(
            key,
            id,
            patterns,
            request.peer,
            Queue::new(
                self.shared.limits.consumer_capacity,
                self.shared.limits.consumer_max_bytes,
            ),
            None,
        ));
        self.register(&subscription)?;
        self.add_routes(
            subscription.key,
            subscription.patterns(),
            Route::Subscription(subscription.clone()),
        );
        Ok(SubscriptionStream::new(self.clone(), subscription))
    }

    /// Routes `patterns` to `route` and tells publishers' caches.
    fn add_routes(&self, key: u64, patterns: &[TopicPattern], route: Route) {
        let mut routes = self.shared.routes.write();
        for pattern in patterns {
            routes.insert(pattern, key, route.clone());
        }
        self.shared.routes_generation.fetch_add(1, Ordering::Release);
    }

    fn remove_routes(&self, key: u64, patterns: &[TopicPattern]) {
        let mut routes = self.shared.routes.write();
        for pattern in patterns {
            routes.remove(pattern, key);
        }
        self.shared.routes_generation.fetch_add(1, Ordering::Release);
    }

    /// Adds a subscription to the registry, enforcing unique ids and the
    /// subscription limit.
    fn register(&self, subscription: &Arc<Subscription>) -> Result<(), BrokerError> {
        let id: Arc<str> = subscription.id().into();
        {
            let mut subs = self.shared.subscriptions.lock();
            // Checked under the registry lock, so a subscription can never
            // slip in after shutdown began closing them all.
            self.check_open()?;
            if subs.contains_key(&id) {
                return Err(BrokerError::AlreadyExists(format!(
                    "subscription id {:?} is already open",
                    &*id
                )));
            }
            let max = self.shared.limits.max_subscriptions;
            if subs.len() >= max {
                return Err(BrokerError::ResourceExhausted(format!(
                    "{} subscriptions are open, the limit is max_subscriptions {max} (TINYBROKER_MAX_SUBSCRIPTIONS)",
                    subs.len()
                )));
            }
            subs.insert(id, subscription.clone());
        }
        Ok(())
    }

    /// Opens a consumer-group member, creating the group on first use.
    fn join_group(
        &self,
        request: SubscribeRequest,
        key: u64,
        id: Arc<str>,
        patterns: Vec<TopicPattern>,
    ) -> Result<SubscriptionStream, BrokerError> {
        let limits = &self.shared.limits;
        let settings = MemberSettings {
            ack_mode: request.ack_mode,
            max_in_flight: match request.max_in_flight {
                0 => limits.default_max_in_flight,
                n => n,
            },
            ack_deadline: match request.ack_deadline_ms {
                0 => limits.default_ack_deadline,
                ms => Duration::from_millis(ms.into()),
            },
        };
        let name = request.consumer_group.as_str();
        let mut groups = self.shared.groups.lock();
        let existing = groups.get(name).cloned();
        if let Some(group) = &existing
            && group.patterns() != patterns.as_slice()
        {
            return Err(BrokerError::FailedPrecondition(format!(
                "consumer group {name:?} has topic_patterns {}; this member asked for {}; all members of a group must use the same set",
                pattern_list(group.patterns()),
                pattern_list(&patterns)
            )));
        }
        let is_new = existing.is_none();
        let group = existing.unwrap_or_else(|| {
            Arc::new(ConsumerGroup::new(
                self.shared.next_key.fetch_add(1, Ordering::Relaxed),
                name.into(),
                patterns.clone(),
                limits.group_capacity,
                limits.group_max_bytes,
                limits.max_delivery_attempts,
                tokio::time::Instant::now(),
            ))
        });
        let subscription = Arc::new(Subscription::new(
            key,
            id,
            patterns,
            request.peer,
            Queue::new(settings.max_in_flight as usize, usize::MAX),
            Some(Membership {
                group: group.clone(),
                settings,
            }),
        ));
        // Registered before a new group is published, so a refused member
        // (id in use, too many subscriptions) leaves no group behind.
        self.register(&subscription)?;
        if is_new {
            self.add_routes(group.key, group.patterns(), Route::Group(group.clone()));
            groups.insert(name.into(), group.clone());
        }
        // Under the registry lock, so the idle sweep cannot remove the group
        // between the lookup and the join.
        let joined = group.join(subscription.clone(), settings, tokio::time::Instant::now());
        debug_assert!(joined, "groups are only removed under the registry lock");
        drop(groups);
        Ok(SubscriptionStream::new(self.clone(), subscription))
    }

    /// Acks manual-ack messages held by a group member. Returns (acked, unknown).
    pub fn ack(&self, subscription_id: &str, sequences: &[u64]) -> Result<(u32, u32), BrokerError> {
        let subscription = self.subscription_for_ack("Ack", subscription_id, sequences)?;
        let Some(membership) = subscription.membership() else {
            // Nothing is ever in flight with a broadcast subscription.
            return Ok((0, sequences.len() as u32));
        };
        Ok(membership
            .group
            .ack(subscription.key, sequences, tokio::time::Instant::now()))
    }

    /// Hands manual-ack messages back for redelivery. Returns (requeued, unknown).
    pub fn nack(&self, subscription_id: &str, sequences: &[u64]) -> Result<(u32, u32), BrokerError> {
        let subscription = self.subscription_for_ack("Nack", subscription_id, sequences)?;
        let Some(membership) = subscription.membership() else {
            return Ok((0, sequences.len() as u32));
        };
        let group = &membership.group;
        let (requeued, unknown, dead) = group.nack(subscription.key, sequences, tokio::time::Instant::now());
        self.dead_letter(group.name(), dead);
        Ok((requeued, unknown))
    }

    /// The open subscription an Ack/Nack names.
    fn subscription_for_ack(
        &self,
        call: &str,
        subscription_id: &str,
        sequences: &[u64],
    ) -> Result<Arc<Subscription>, BrokerError> {
        if subscription_id.is_empty() {
            return Err(BrokerError::InvalidArgument(format!(
                "{call} needs a subscription_id; it was empty"
            )));
        }
        if sequences.is_empty() {
            return Err(BrokerError::InvalidArgument(format!(
                "{call} for subscription {:?} lists no sequences",
                truncate(subscription_id)
            )));
        }
        self.open_subscription(subscription_id)
    }

    /// The open subscription `id`, or NOT_FOUND naming it.
    fn open_subscription(&self, id: &str) -> Result<Arc<Subscription>, BrokerError> {
        let subscription = self.shared.subscriptions.lock().get(id).cloned();
        subscription.ok_or_else(|| BrokerError::NotFound(format!("no open subscription with id {:?}", truncate(id))))
    }

    /// Closes one subscription by id (Admin API); its stream ends cleanly.
    pub fn close_subscription(&self, id: &str) -> Result<(), BrokerError> {
        let subscription = self.open_subscription(id)?;
        let dropped = self.close(&subscription, CloseReason::ClosedByAdmin, 0);
        tracing::info!(
            subscription_id = id,
            peer = %display_peer(subscription.peer()),
            patterns = ?subscription.patterns().iter().map(|p| p.as_str()).collect::<Vec<_>>(),
            consumer_group = subscription.consumer_group().unwrap_or(""),
            dropped = dropped.unwrap_or(0),
            "subscription closed by an admin (Admin/CloseSubscription)"
        );
        Ok(())
    }

    /// Every open subscription.
    pub fn subscriptions(&self) -> Vec<Arc<Subscription>> {
        let mut subs: Vec<_> = self.shared.subscriptions.lock().values().cloned().collect();
        subs.sort_by(|a, b| a.opened_at().cmp(&b.opened_at()).then_with(|| a.id().cmp(b.id())));
        subs
    }

    pub fn subscription_count(&self) -> usize {
        self.shared.subscriptions.lock().len()
    }

    /// The most recent evictions, newest first.
    pub fn evictions(&self) -> Vec<EvictionRecord> {
        self.shared.evictions.lock().iter().rev().cloned().collect()
    }

    /// The most recent removals of groups that still held messages, newest
    /// first.
    pub fn group_removals(&self) -> Vec<GroupRemoval> {
        self.shared.group_removals.lock().iter().rev().cloned().collect()
    }

    /// Closes a subscription's queue and removes it from routing. Idempotent.
    /// A group member's undelivered messages go back to its group; a
    /// broadcast subscription's are dropped and counted, with `also_lost`
    /// more (the message that did not fit, for an eviction). Returns how
    /// many it held, or None when it was closed already.
    fn close(&self, subscription: &Arc<Subscription>, reason: CloseReason, also_lost: u64) -> Option<usize> {
        let lost = subscription.membership().is_none().then_some(also_lost);
        let left = subscription.queue.close(reason, lost);
        self.detach(subscription);
        let left = left?;
        if let Some(membership) = subscription.membership() {
            let group = &membership.group;
            let dead = group.leave(subscription.key, left, tokio::time::Instant::now());
            self.dead_letter(group.name(), dead);
            return Some(0);
        }
        let stats = &self.shared.stats;
        match reason {
            CloseReason::Evicted => &stats.dropped_evicted,
            CloseReason::Shutdown => &stats.discarded_on_shutdown,
            CloseReason::Cancelled | CloseReason::ClosedByAdmin => &stats.dropped_closed,
        }
        .fetch_add(left.len() as u64, Ordering::Relaxed);
        Some(left.len())
    }

    /// Removes a subscription from routing and the registry. Idempotent.
    pub(crate) fn detach(&self, subscription: &Arc<Subscription>) {
        if subscription.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        // Members are routed through their group, not the trie.
        if subscription.membership().is_none() {
            self.remove_routes(subscription.key, subscription.patterns());
        }
        self.shared.subscriptions.lock().remove(subscription.id());
    }

    /// The client went away: close what is left of its subscription.
    pub(crate) fn close_on_drop(&self, subscription: &Arc<Subscription>) {
        self.close(subscription, CloseReason::Cancelled, 0);
    }

    fn evict(&self, subscription: &Arc<Subscription>, why: Eviction) {
        // The message that did not fit a full queue is lost to it as well.
        let did_not_fit = u64::from(matches!(why, Eviction::QueueFull { .. }));
        let Some(_) = self.close(subscription, CloseReason::Evicted, did_not_fit) else {
            return;
        };
        let stats = &self.shared.stats;
        let (depth, bytes, reason) = match why {
            Eviction::QueueFull { depth, bytes } => {
                stats.dropped_evicted.fetch_add(did_not_fit, Ordering::Relaxed);
                let reason = if depth >= subscription.queue.capacity() {
                    "its queue was full"
                } else {
                    "its queue held more than consumer_max_bytes (TINYBROKER_CONSUMER_MAX_BYTES)"
                };
                (depth, bytes, reason)
            }
            Eviction::MemoryLimit { depth, bytes } => {
                stats.evictions_memory_limit.fetch_add(1, Ordering::Relaxed);
                (
                    depth,
                    bytes,
                    "the broker's memory limit (TINYBROKER_MAX_MEMORY_BYTES) was reached and its queue held the most bytes",
                )
            }
        };
        stats.evictions.fetch_add(1, Ordering::Relaxed);
        let record = EvictionRecord {
            subscription_id: subscription.id().to_owned(),
            evicted_at: SystemTime::now(),
            topic_patterns: subscription.patterns().iter().map(|p| p.to_string()).collect(),
            queue_depth: depth,
            last_delivered_sequence: subscription.last_delivered_sequence(),
            peer: subscription.peer(),
        };
        tracing::warn!(
            subscription_id = %record.subscription_id,
            peer = %display_peer(record.peer),
            patterns = ?record.topic_patterns,
            queue_depth = depth,
            queue_bytes = bytes,
            capacity = subscription.queue.capacity(),
            last_delivered_sequence = record.last_delivered_sequence,
            "slow consumer evicted: {reason}"
        );
        let mut evictions = self.shared.evictions.lock();
        if evictions.len() >= EVICTION_HISTORY {
            evictions.pop_front();
        }
        evictions.push_back(record);
    }

    // === lifecycle ===

    fn check_open(&self) -> Result<(), BrokerError> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(BrokerError::Unavailable("the broker is shutting down".into()));
        }
        Ok(())
    }

    /// Refuses new work from now on; queued messages keep draining.
    pub fn begin_shutdown(&self) {
        let _guard = self.shared.subscriptions.lock();
        self.shared.draining.store(true, Ordering::Release);
        self.shared.drain_signal.cancel();
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shared.draining.load(Ordering::Acquire)
    }

    /// Messages waiting anywhere: subscription queues and every group's
    /// backlog (what a shutdown puts at risk).
    pub fn queued_total(&self) -> usize {
        self.waiting(true)
    }

    /// Resolves when shutdown begins.
    pub fn draining(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.shared.drain_signal.clone().cancelled_owned()
    }

    /// What shutdown waits for: messages that can still reach a subscriber,
    /// that is every subscription queue and the backlogs of groups that have
    /// members. A memberless group's backlog cannot drain, so waiting for
    /// it would only spend the whole grace period.
    pub fn drainable(&self) -> usize {
        self.waiting(false)
    }

    fn waiting(&self, memberless_groups: bool) -> usize {
        let now = tokio::time::Instant::now();
        let queues: usize = self.subscriptions().iter().map(|s| s.queue_depth()).sum();
        let backlogs: usize = self
            .groups()
            .iter()
            .map(|g| g.snapshot(now))
            .filter(|s| memberless_groups || s.members > 0)
            .map(|s| s.backlog)
            .sum();
        queues + backlogs
    }

    pub fn close_all(&self) -> usize {
        let queued: usize = self
            .subscriptions()
            .iter()
            .filter_map(|s| self.close(s, CloseReason::Shutdown, 0))
            .sum();
        let in_groups: usize = self.groups().iter().map(|g| g.discard_all()).sum();
        self.shared
            .stats
            .discarded_on_shutdown
            .fetch_add(in_groups as u64, Ordering::Relaxed);
        queued + in_groups
    }

    // === consumer groups ===

    /// Every consumer group, by name.
    pub fn groups(&self) -> Vec<Arc<ConsumerGroup>> {
        let mut groups: Vec<_> = self.shared.groups.lock().values().cloned().collect();
        groups.sort_by(|a, b| a.name().cmp(b.name()));
        groups
    }

    /// Redelivers messages whose ack deadline passed and removes groups idle
    /// for longer than their TTL. Called every [`MAINTENANCE_INTERVAL`].
    pub fn tick(&self, now: tokio::time::Instant) {
        for group in self.groups() {
            let dead = group.expire(now);
            self.dead_letter(group.name(), dead);
            if let Some(s) = group.stall_to_report(now, STALL_WARNING_AFTER) {
                tracing::warn!(
                    consumer_group = group.name(),
                    stalled_seconds = s.stalled.as_secs(),
                    members = s.members,
                    backlog = s.backlog,
                    in_flight = s.in_flight,
                    redeliveries = group.redeliveries(),
                    "consumer group stalled: it has messages waiting or held but none was acked or delivered"
                );
            }
        }
        let ttl = self.shared.limits.group_idle_ttl;
        let mut groups = self.shared.groups.lock();
        let mut removed = Vec::new();
        groups.retain(|_, group| match group.remove_if_idle(now, ttl) {
            Some(left) => {
                removed.push((group.clone(), left));
                false
            }
            None => true,
        });
        drop(groups);
        let stats = &self.shared.stats;
        for (group, left) in removed {
            self.remove_routes(group.key, group.patterns());
            stats.dropped_group_expired.fetch_add(left as u64, Ordering::Relaxed);
            if left == 0 {
                tracing::info!(
                    consumer_group = group.name(),
                    dropped = left,
                    "consumer group removed after its idle TTL with no members"
                );
                continue;
            }
            tracing::warn!(
                consumer_group = group.name(),
                dropped = left,
                "consumer group removed after its idle TTL with no members"
            );
            let mut removals = self.shared.group_removals.lock();
            if removals.len() >= GROUP_REMOVAL_HISTORY {
                removals.pop_front();
            }
            removals.push_back(GroupRemoval {
                consumer_group: group.name().to_owned(),
                removed_at: SystemTime::now(),
                dropped: left,
            });
        }
    }

    /// Runs [`Broker::tick`] until the broker is dropped or `stop` resolves.
    pub async fn maintain(self, stop: impl std::future::Future<Output = ()>) {
        let mut interval = tokio::time::interval(MAINTENANCE_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                now = interval.tick() => self.tick(now),
            }
        }
    }
}

fn parse_patterns(raw: &[String]) -> Result<Vec<TopicPattern>, BrokerError> {
    if raw.is_empty() {
        return Err(BrokerError::InvalidArgument(
            "topic_patterns is empty; give at least one pattern such as \"deploy.>\"".into(),
        ));
    }
    if raw.len() > MAX_PATTERNS_PER_SUBSCRIPTION {
        return Err(BrokerError::InvalidArgument(format!(
            "{} topic_patterns given, the limit is {MAX_PATTERNS_PER_SUBSCRIPTION} per subscription",
            raw.len()
        )));
    }
    let mut patterns = raw
        .iter()
        .map(|p| TopicPattern::parse(p).map_err(|e| BrokerError::InvalidArgument(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    patterns.sort();
    patterns.dedup();
    Ok(patterns)
}

/// A group name must also make a valid dead-letter topic `_dlq.<group>`.
fn check_group_name(name: &str) -> Result<(), BrokerError> {
    check_name("consumer_group", name)?;
    topic::validate_topic(&format!("{DEAD_LETTER_PREFIX}{name}")).map_err(|e| {
        BrokerError::InvalidArgument(format!(
            "consumer_group {:?} cannot name its dead-letter topic: {e}",
            truncate(name)
        ))
    })
}

/// A pattern set for an error message, bounded so that two of them fit a
/// `grpc-message` trailer with room to spare: at most 8 patterns of at
/// most 64 bytes each are named, then how many more there are.
fn pattern_list(patterns: &[TopicPattern]) -> String {
    const SHOWN: usize = 8;
    const SHOWN_BYTES: usize = 64;
    let mut names: Vec<String> = patterns
        .iter()
        .take(SHOWN)
        .map(|p| {
            let p = p.as_str();
            if p.len() > SHOWN_BYTES {
                // Patterns are ASCII, so any byte index is a char boundary.
                format!("{}...", &p[..SHOWN_BYTES])
            } else {
                p.to_owned()
            }
        })
        .collect();
    if patterns.len() > SHOWN {
        names.push(format!("... and {} more", patterns.len() - SHOWN));
    }
    format!("[{}]", names.join(", "))
}

fn check_name(field: &str, value: &str) -> Result<(), BrokerError> {
    if value.len() > MAX_NAME_BYTES {
        return Err(BrokerError::InvalidArgument(format!(
            "{field} {:?} is {} bytes long, the limit is {MAX_NAME_BYTES}",
            truncate(value),
            value.len()
        )));
    }
    if let Some(bad) = value.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(BrokerError::InvalidArgument(format!(
            "{field} {:?} contains {bad:?}; only printable ASCII without spaces is allowed",
            truncate(value)
        )));
    }
    Ok(())
}

/// Bounds client-supplied values quoted in error messages.
fn truncate(value: &str) -> &str {
    let mut end = value.len().min(128);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

pub(crate) fn display_peer(peer: Option<SocketAddr>) -> String {
    peer.map_or_else(|| "unknown".to_owned(), |p| p.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, group: &str, pattern: &str) -> SubscribeRequest {
        SubscribeRequest {
            topic_patterns: vec![pattern.into()],
            subscription_id: id.into(),
            mode: DeliveryMode::Group,
            consumer_group: group.into(),
            ..Default::default()
        }
    }

    fn message(topic: &str) -> NewMessage {
        NewMessage {
            topic: topic.into(),
            ..Default::default()
        }
    }

    #[test]
    fn an_auto_ack_member_reports_what_it_streamed_when_its_queue_runs_dry() {
        use futures::StreamExt;
        use std::task::{Context, Poll, Waker};
        let broker = Broker::new(Limits::default());
        // max_in_flight 8: streamed messages are reported two at a time.
        let mut stream = broker
            .subscribe(SubscribeRequest {
                max_in_flight: 8,
                ..member("", "g", "t")
            })
            .unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..3 {
            broker.publish(message("t"), None).unwrap();
        }
        for _ in 0..3 {
            assert!(matches!(stream.poll_next_unpin(&mut cx), Poll::Ready(Some(_))));
        }
        // The third is reported when the queue runs dry, not left counted
        // against the member's room.
        assert!(stream.poll_next_unpin(&mut cx).is_pending());
        for _ in 0..8 {
            broker.publish(message("t"), None).unwrap();
        }
        let group = broker.groups().into_iter().next().unwrap();
        assert_eq!(group.snapshot(tokio::time::Instant::now()).backlog, 0, "all 8 fit");
    }

    #[test]
    fn validation_charges_what_message_size_says() {
        let broker = Broker::new(Limits::default());
        let message = NewMessage {
            topic: "a.b".into(),
            payload: Bytes::from_static(b"12345"),
            headers: HashMap::from([("k".into(), "vv".into()), ("kk".into(), "v".into())]),
        };
        let expected = message_size(&message.topic, &message.payload, &message.headers);
        assert_eq!(broker.validate_message(&message), Ok(expected));
    }

    #[test]
    fn the_memory_limit_evicts_a_reader_far_behind_but_never_one_that_keeps_up() {
        let big = |topic: &str| NewMessage {
            topic: topic.into(),
            payload: Bytes::from(vec![0u8; 1 << 20]),
            ..Default::default()
        };
        // 63 MiB for messages (7/8 of the limit).
        let broker = Broker::new(Limits {
            max_memory_bytes: Some(72 << 20),
            ..Limits::default()
        });
        let limit = broker.memory().limit().unwrap();
        let _keeps_up = broker
            .subscribe(SubscribeRequest {
                topic_patterns: vec!["small".into()],
                ..Default::default()
            })
            .unwrap();
        broker.publish(message("small"), None).unwrap();
        let _member = broker.subscribe(member("", "g", "jobs")).unwrap();
        drop(_member);
        // The memberless group fills the budget: the reader holding one small
        // message stays, the publish is refused.
        let mut refused = None;
        for _ in 0..(limit >> 20) + 2 {
            if let Err(e) = broker.publish(big("jobs"), None) {
                refused = Some(e);
                break;
            }
        }
        assert!(
            matches!(refused, Some(BrokerError::ResourceExhausted(_))),
            "{refused:?}"
        );
        assert_eq!(
            broker.stats().evictions.load(Ordering::Relaxed),
            0,
            "the reader that keeps up stays"
        );
        assert_eq!(broker.subscription_count(), 1);
    }

    #[test]
    fn a_refused_member_leaves_no_group_behind() {
        let broker = Broker::new(Limits::default());
        let _a = broker.subscribe(member("same-id", "first", "x")).unwrap();
        let err = broker.subscribe(member("same-id", "second", "x")).err().unwrap();
        assert!(matches!(err, BrokerError::AlreadyExists(_)), "{err}");
        let names: Vec<String> = broker.groups().iter().map(|g| g.name().to_owned()).collect();
        assert_eq!(names, ["first"]);
        assert_eq!(broker.publish(message("x"), None).unwrap().matched_groups, 1);
    }

    #[test]
    fn groups_removed_with_messages_are_remembered_bounded() {
        let broker = Broker::new(Limits::default());
        let ttl = broker.limits().group_idle_ttl;
        let now = tokio::time::Instant::now();
        drop(broker.subscribe(member("", "empty", "e")).unwrap());
        drop(broker.subscribe(member("", "full", "f")).unwrap());
        broker.publish(message("f"), None).unwrap();
        broker.publish(message("f"), None).unwrap();
        broker.tick(now + ttl + Duration::from_secs(1));
        assert!(broker.groups().is_empty());
        let removals = broker.group_removals();
        assert_eq!(removals.len(), 1, "only the group that lost messages: {removals:?}");
        assert_eq!((removals[0].consumer_group.as_str(), removals[0].dropped), ("full", 2));
        for i in 0..GROUP_REMOVAL_HISTORY + 5 {
            drop(broker.subscribe(member("", &format!("g{i}"), "f")).unwrap());
        }
        broker.publish(message("f"), None).unwrap();
        broker.tick(tokio::time::Instant::now() + ttl + Duration::from_secs(1));
        let removals = broker.group_removals();
        assert_eq!(removals.len(), GROUP_REMOVAL_HISTORY);
        assert!(removals.iter().all(|r| r.dropped == 1 && r.consumer_group != "full"));
    }

    #[test]
    fn pattern_lists_in_errors_are_bounded() {
        let patterns: Vec<TopicPattern> = (0..64)
            .map(|i| TopicPattern::parse(&format!("{i:03}{}", "a".repeat(250))).unwrap())
            .collect();
        let listed = pattern_list(&patterns);
        assert!(listed.len() < 1024, "{} bytes", listed.len());
        assert!(listed.contains("... and 56 more"), "{listed}");
        assert!(listed.starts_with("[000aaa"), "{listed}");
        let short = [TopicPattern::parse("a.*").unwrap(), TopicPattern::parse("b.>").unwrap()];
        assert_eq!(pattern_list(&short), "[a.*, b.>]");
    }

    #[test]
    fn what_is_left_at_shutdown_is_counted_as_discarded() {
        let broker = Broker::new(Limits::default());
        let broadcast = broker
            .subscribe(SubscribeRequest {
                topic_patterns: vec!["t".into()],
                ..Default::default()
            })
            .unwrap();
        let member_stream = broker.subscribe(member("", "g", "t")).unwrap();
        drop(member_stream);
        for _ in 0..3 {
            broker.publish(message("t"), None).unwrap();
        }
        assert_eq!(
            broker.queued_total(),
            6,
            "3 queued for the subscriber, 3 in the group backlog"
        );
        assert_eq!(broker.drainable(), 3, "the memberless group's backlog cannot drain");
        broker.begin_shutdown();
        assert!(matches!(
            broker.publish(message("t"), None),
            Err(BrokerError::Unavailable(_))
        ));
        assert_eq!(broker.close_all(), 6);
        assert_eq!(broker.stats().discarded_on_shutdown.load(Ordering::Relaxed), 6);
        assert_eq!(broker.subscription_count(), 0);
        drop(broadcast);
    }
}
