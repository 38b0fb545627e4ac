//! Prometheus metrics: one registry owned by the broker process (not the
//! global default). Counters and gauges are read from the broker's live state
//! when `/metrics` is scraped, so queue depths cannot drift and the publish
//! path only touches its own atomics; series of closed subscriptions and
//! removed groups disappear with them, except the bounded `tinybroker_recent_*`
//! series that name an evicted subscriber or a group removed with its backlog
//! for 15 minutes. Only the two latency histograms are observed as events
//! happen (lock-free atomics). Each scrape starts a new peak period of every
//! queue, so peaks cover the last two scrape intervals.

use crate::engine::{DeliveryMode, Engine, EvictionRecord, GroupRemoval, Peaks, Snapshot, display_peer};
use prometheus::core::{Collector, Desc};
use prometheus::local::LocalHistogram;
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Label value of `mode` for broadcast subscriptions.
pub const MODE_MULTI: &str = "multi";
/// Label value of `mode` for consumer-group members.
pub const MODE_SINGLE: &str = "single";

/// Where the collectors read the engine's state at scrape time (a scrape is
/// rare, so one dynamic call per scrape keeps `Metrics` free of the engine
/// type).
type SnapshotSource = Arc<dyn Fn(Peaks) -> Snapshot + Send + Sync>;

/// The gRPC listener's counters, as a scrape reads them: `server.rs` reads
/// them from the front (its connections, and the requests it is still
/// receiving), which the metrics do not name.
#[derive(Debug, Default, Clone)]
pub struct FrontCounters {
    pub open_connections: usize,
    /// Connections refused or ended, by reason (the label), every reason
    /// listed, 0 or not.
    pub rejected: Vec<(&'static str, u64)>,
    pub accept_errors: u64,
    /// Bytes of requests being received, and the share of the memory limit
    /// they may take (None: no limit).
    pub incoming_bytes: usize,
    pub incoming_limit: Option<usize>,
    /// Requests refused because the broker's memory budget was spent.
    pub refused_memory_limit: u64,
    /// Requests refused because their connection held too much.
    pub refused_connection_limit: u64,
}

/// Reads the front's counters at scrape time.
pub type FrontSource = Arc<dyn Fn() -> FrontCounters + Send + Sync>;

/// The registry and the histograms observed on the hot paths.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    source: SnapshotSource,
    publish_duration: Histogram,
    delivery_lag_multi: Histogram,
    delivery_lag_single: Histogram,
    publish_batch_size: Histogram,
    delivery_batch_size: Histogram,
    sessions: IntGauge,
    session_ignored: IntCounterVec,
}

/// Why a session request was ignored: the `reason` label of
/// `tinybroker_session_requests_ignored_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoredRequest {
    /// A request with no variant set.
    NoRequest,
    /// Credit, close, ack or nack for a handle that is not open.
    UnknownHandle,
    /// An acked or nacked sequence the subscription does not hold (counted
    /// per sequence).
    UnknownSequence,
    /// An ack or nack without sequences.
    NoSequences,
}

impl IgnoredRequest {
    pub const ALL: [IgnoredRequest; 4] = [
        Self::NoRequest,
        Self::UnknownHandle,
        Self::UnknownSequence,
        Self::NoSequences,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::NoRequest => "no_request",
            Self::UnknownHandle => "unknown_handle",
            Self::UnknownSequence => "unknown_sequence",
            Self::NoSequences => "no_sequences",
        }
    }
}

/// One open session, counted in `tinybroker_sessions` while it lives.
pub struct SessionGauge(IntGauge);

impl Drop for SessionGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    /// Builds the registry for `engine`.
    pub fn new<E: Engine>(engine: E, per_subscription: bool) -> Self {
        let source: SnapshotSource = Arc::new(move |peaks| engine.snapshot(peaks));
        let registry = Registry::new();
        let publish_duration = Histogram::with_opts(
            HistogramOpts::new(
                "tinybroker_publish_duration_seconds",
                "Time to validate and route one published message to every matching queue.",
            )
            .buckets(vec![
                0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.005, 0.025,
            ]),
        )
        .expect("valid histogram");
        let delivery_lag = HistogramVec::new(
            HistogramOpts::new(
                "tinybroker_delivery_lag_seconds",
                "Time from publish to the message being written to a subscriber's stream.",
            )
            // Fine below a millisecond for broadcast; up to hours for
            // consumer groups, whose messages can wait in a backlog for a
            // member (up to the idle TTL) or for a long ack deadline.
            .buckets(vec![
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 15.0, 30.0,
                60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0,
            ]),
            &["mode"],
        )
        .expect("valid histogram");
        // 1 to TINYBROKER_MAX_BATCH_MESSAGES's default and beyond.
        let batch_buckets = vec![
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
        ];
        let publish_batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "tinybroker_publish_batch_size",
                "Messages in one SessionPublish (one observation per publish request on a session).",
            )
            .buckets(batch_buckets.clone()),
        )
        .expect("valid histogram");
        let delivery_batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "tinybroker_delivery_batch_size",
                "Deliveries in one SessionDeliveries event (sessions opened with tinybroker-batch: 1).",
            )
            .buckets(batch_buckets),
        )
        .expect("valid histogram");
        let build_info = IntGaugeVec::new(
            Opts::new(
                "tinybroker_build_info",
                "Always 1; the version label names the running build.",
            ),
            &["version"],
        )
        .expect("valid gauge");
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let sessions = IntGauge::new("tinybroker_sessions", "Open Session streams.").expect("valid gauge");
        let session_ignored = IntCounterVec::new(
            Opts::new(
                "tinybroker_session_requests_ignored_total",
                "Session requests (or acked sequences) that named nothing the session holds, by why.",
            ),
            &["reason"],
        )
        .expect("valid counter");
        for reason in IgnoredRequest::ALL {
            session_ignored.with_label_values(&[reason.label()]);
        }
        let collectors: Vec<Box<dyn Collector>> = vec![
            Box::new(publish_duration.clone()),
            Box::new(delivery_lag.clone()),
            Box::new(publish_batch_size.clone()),
            Box::new(delivery_batch_size.clone()),
            Box::new(build_info),
            Box::new(sessions.clone()),
            Box::new(session_ignored.clone()),
            Box::new(crate::ops::process_metrics::ProcessCollector::for_self()),
            Box::new(BrokerCollector::new(source.clone(), per_subscription)),
        ];
        for collector in collectors {
            registry.register(collector).expect("metric names are unique");
        }
        Self {
            registry,
            source,
            publish_duration,
            delivery_lag_multi: delivery_lag.with_label_values(&[MODE_MULTI]),
            delivery_lag_single: delivery_lag.with_label_values(&[MODE_SINGLE]),
            publish_batch_size,
            delivery_batch_size,
            sessions,
            session_ignored,
        }
    }

    /// Counts a session as open until the guard is dropped.
    pub fn session_opened(&self) -> SessionGauge {
        self.sessions.inc();
        SessionGauge(self.sessions.clone())
    }

    /// Counts `count` session requests (or sequences) ignored for `reason`.
    pub fn session_request_ignored(&self, reason: IgnoredRequest, count: u64) {
        if count > 0 {
            self.session_ignored.with_label_values(&[reason.label()]).inc_by(count);
        }
    }

    /// Adds the gRPC listener's metrics: open and rejected connections, and
    /// requests refused for what they would hold.
    pub fn with_front(self, front: FrontSource) -> Self {
        let collector = ResourceCollector::new(self.source.clone(), front);
        self.registry
            .register(Box::new(collector))
            .expect("metric names are unique");
        self
    }

    /// One observation of `tinybroker_publish_duration_seconds` (a unary
    /// Publish; streams use [`Metrics::publish_duration`]).
    pub fn observe_publish(&self, seconds: f64) {
        self.publish_duration.observe(seconds);
    }

    /// A private view of `tinybroker_publish_duration_seconds` for one
    /// publishing stream (see [`LocalObserver`]).
    pub fn publish_duration(&self) -> LocalObserver {
        LocalObserver::new(&self.publish_duration)
    }

    /// `tinybroker_publish_batch_size` (observed once per batch: no
    /// private view needed).
    pub fn publish_batch_size(&self) -> Histogram {
        self.publish_batch_size.clone()
    }

    /// `tinybroker_delivery_batch_size` (observed once per event).
    pub fn delivery_batch_size(&self) -> Histogram {
        self.delivery_batch_size.clone()
    }

    /// The same for one subscription's `tinybroker_delivery_lag_seconds`.
    pub fn delivery_lag(&self, group: bool) -> LocalObserver {
        LocalObserver::new(if group {
            &self.delivery_lag_single
        } else {
            &self.delivery_lag_multi
        })
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// One task's observations of a shared histogram: observing touches no
/// cache line other tasks write, and they are merged into the histogram on
/// [`LocalObserver::flush`], every 256 observations, and on drop.
///
/// A run of one observation (a subscription woken for one message, the
/// everyday case at modest rates) is kept as a value and goes straight to the
/// shared histogram on flush; the local buckets are made only for a run of
/// two or more, so a stream that never delivers, or delivers one message at
/// a time, holds only the shared histogram's handle (issue 16: the buckets
/// were 182 bytes of every idle subscription, and merging all of them for a
/// single observation was 3.5 % of the CPU of a paced wide fan-out).
pub struct LocalObserver {
    shared: Histogram,
    /// Boxed: 8 bytes of every subscription instead of 56 while it has none.
    local: Option<Box<LocalHistogram>>,
    /// The run's only observation so far, when `unflushed` is 1 (8 bytes,
    /// not an `Option`'s 16: the observer is 32 bytes, and a
    /// subscription's response body 80, in jemalloc's 80-byte class).
    single: f64,
    unflushed: u32,
}

impl LocalObserver {
    const FLUSH_EVERY: u32 = 256;

    fn new(shared: &Histogram) -> Self {
        Self {
            shared: shared.clone(),
            local: None,
            single: 0.0,
            unflushed: 0,
        }
    }

    pub fn observe(&mut self, seconds: f64) {
        self.unflushed += 1;
        if self.unflushed == 1 {
            self.single = seconds;
            return;
        }
        let shared = &self.shared;
        let local = self.local.get_or_insert_with(|| Box::new(shared.local()));
        if self.unflushed == 2 {
            local.observe(self.single);
        }
        local.observe(seconds);
        if self.unflushed >= Self::FLUSH_EVERY {
            self.flush();
        }
    }

    /// Observes `seconds` `count` times.
    pub fn observe_many(&mut self, seconds: f64, count: usize) {
        for _ in 0..count {
            self.observe(seconds);
        }
    }

    pub fn flush(&mut self) {
        if self.unflushed == 1 {
            self.shared.observe(self.single);
        } else if self.unflushed > 0
            && let Some(local) = &self.local
        {
            local.flush();
        }
        self.unflushed = 0;
    }
}

impl Drop for LocalObserver {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Reads the broker's live state at scrape time.
struct BrokerCollector {
    source: SnapshotSource,
    per_subscription: bool,
    /// Templates: they give `desc()` and the options of the fresh metrics
    /// built at every scrape.
    t: Templates,
    o: OperatorTemplates,
    /// What a scrape leaves for the next ones. Held for the whole scrape, so
    /// that concurrent scrapes each start one peak period.
    marks: parking_lot::Mutex<ScrapeMarks>,
}

#[derive(Clone)]
struct Templates {
    published: IntCounter,
    delivered: IntCounterVec,
    unrouted: IntCounter,
    dropped: IntCounterVec,
    subscriptions: IntGaugeVec,
    queue_depth: IntGaugeVec,
    queued: IntGaugeVec,
    fill_ratio: Histogram,
    evictions: IntCounter,
    group_members: IntGaugeVec,
    group_backlog: IntGaugeVec,
    group_in_flight: IntGaugeVec,
    redeliveries: IntCounterVec,
    dead_lettered: IntCounterVec,
    oldest_unacked: GaugeVec,
    discarded_on_shutdown: IntCounter,
}

impl Templates {
    fn new() -> prometheus::Result<Self> {
        let group = &["consumer_group"];
        Ok(Self {
            published: IntCounter::new(
                "tinybroker_messages_published_total",
                "Messages accepted by Publish and PublishStream.",
            )?,
            delivered: IntCounterVec::new(
                Opts::new(
                    "tinybroker_messages_delivered_total",
                    "Messages written to subscribers' streams, by delivery mode (multi: broadcast, single: consumer group).",
                ),
                &["mode"],
            )?,
            unrouted: IntCounter::new(
                "tinybroker_messages_unrouted_total",
                "Published messages that matched no subscription and no group.",
            )?,
            dropped: IntCounterVec::new(
                Opts::new(
                    "tinybroker_messages_dropped_total",
                    "Messages lost before delivery, by reason: evicted (queued for an evicted subscriber), closed (queued for a cancelled or admin-closed subscription), group_overflow (oldest of a full group backlog), group_expired (backlog of a group removed after its idle TTL), dead_letter_invalid (a dead letter that the broker's two headers took over a message limit), nats_slow_consumer (cluster mode: other replicas' messages NATS dropped on the way to this one), nats_state_lost (cluster mode: group messages lost when NATS lost what it kept in memory), nats_unreachable (cluster mode: other replicas' broadcast messages that arrived more than 5 s after they were published, held up while a replica was cut off from NATS).",
                ),
                &["reason"],
            )?,
            subscriptions: IntGaugeVec::new(
                Opts::new("tinybroker_subscriptions", "Open subscriptions, by delivery mode."),
                &["mode"],
            )?,
            queue_depth: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_subscription_queue_depth",
                    "Messages waiting in one subscription's queue (consumer_group empty for broadcast).",
                ),
                &["subscription_id", "consumer_group"],
            )?,
            queued: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_queued_messages",
                    "Messages waiting in all subscription queues, by delivery mode.",
                ),
                &["mode"],
            )?,
            fill_ratio: Histogram::with_opts(
                HistogramOpts::new(
                    "tinybroker_queue_fill_ratio",
                    "Queue depth over capacity of each subscription, sampled at scrape.",
                )
                .buckets(vec![0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
            )?,
            evictions: IntCounter::new(
                "tinybroker_evictions_total",
                "Subscriptions evicted because their queue was full (slow consumers).",
            )?,
            group_members: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_consumer_group_members",
                    "Connected members of a consumer group.",
                ),
                group,
            )?,
            group_backlog: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_consumer_group_backlog",
                    "Messages waiting in a consumer group's backlog for a member with room.",
                ),
                group,
            )?,
            group_in_flight: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_consumer_group_in_flight",
                    "Messages held by a group's members: queued for their streams, or delivered and not yet acked.",
                ),
                group,
            )?,
            redeliveries: IntCounterVec::new(
                Opts::new(
                    "tinybroker_redeliveries_total",
                    "Group messages handed out again after an ack deadline, a nack or a member leaving.",
                ),
                group,
            )?,
            dead_lettered: IntCounterVec::new(
                Opts::new(
                    "tinybroker_dead_lettered_total",
                    "Group messages published to _dlq.<group> after their last delivery attempt.",
                ),
                group,
            )?,
            oldest_unacked: GaugeVec::new(
                Opts::new(
                    "tinybroker_consumer_group_oldest_unacked_age_seconds",
                    "Age of the oldest delivered, unacked message of a manual-ack group (0 when none).",
                ),
                group,
            )?,
            discarded_on_shutdown: IntCounter::new(
                "tinybroker_messages_discarded_on_shutdown_total",
                "Messages still queued when the shutdown grace period ended.",
            )?,
        })
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.published,
            &self.delivered,
            &self.unrouted,
            &self.dropped,
            &self.subscriptions,
            &self.queue_depth,
            &self.queued,
            &self.fill_ratio,
            &self.evictions,
            &self.group_members,
            &self.group_backlog,
            &self.group_in_flight,
            &self.redeliveries,
            &self.dead_lettered,
            &self.oldest_unacked,
            &self.discarded_on_shutdown,
        ]
    }
}

// === operator metrics: peaks, stalled groups, recent evictions and removals ===

/// How long an eviction or a lossy group removal stays in
/// `tinybroker_recent_*` after it happened.
pub const RECENT_WINDOW: Duration = Duration::from_secs(15 * 60);
/// Most series of each `tinybroker_recent_*` metric (the newest win).
pub const RECENT_SERIES: usize = 20;
/// Longest `topic_patterns` label of a recent eviction.
const PATTERNS_LABEL_BYTES: usize = 200;

/// The metrics that name what went wrong (which subscriber, which group)
/// and catch what happens between scrapes. Built fresh at every scrape, like
/// [`Templates`].
#[derive(Clone)]
struct OperatorTemplates {
    queue_depth_peak: IntGaugeVec,
    subscription_unacked: IntGaugeVec,
    subscription_oldest_unacked: GaugeVec,
    subscription_stalled: GaugeVec,
    recent_eviction: GaugeVec,
    group_stalled: GaugeVec,
    group_memberless: GaugeVec,
    group_acked: IntCounterVec,
    group_delivered: IntCounterVec,
    recent_removal: GaugeVec,
    recent_removal_dropped: IntGaugeVec,
}

impl OperatorTemplates {
    fn new() -> prometheus::Result<Self> {
        let group = &["consumer_group"];
        Ok(Self {
            queue_depth_peak: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_subscription_queue_depth_peak",
                    "Highest depth of one subscription's queue over the last two scrape intervals (consumer_group empty for broadcast): a queue that fills and drains between scrapes still shows.",
                ),
                &["subscription_id", "consumer_group"],
            )?,
            subscription_unacked: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_subscription_unacked",
                    "Messages delivered to one manual-ack group member and not acked or nacked yet: a hung member among healthy ones holds many (up to its max_in_flight) while its queue depth stays 0.",
                ),
                &["subscription_id", "consumer_group"],
            )?,
            subscription_oldest_unacked: GaugeVec::new(
                Opts::new(
                    "tinybroker_subscription_oldest_unacked_age_seconds",
                    "Age of the oldest message delivered to one manual-ack group member and not acked or nacked yet (0 when none; restarts when the message is redelivered): a member far older than its group's others is likely hung.",
                ),
                &["subscription_id", "consumer_group"],
            )?,
            subscription_stalled: GaugeVec::new(
                Opts::new(
                    "tinybroker_subscription_stalled_seconds",
                    "How long one manual-ack group member has held messages without acking or nacking any (0 when it holds none). Redeliveries after its ack deadline do not reset it: a hung member's keeps growing while the rest of its group acks.",
                ),
                &["subscription_id", "consumer_group"],
            )?,
            recent_eviction: GaugeVec::new(
                Opts::new(
                    "tinybroker_recent_eviction_timestamp_seconds",
                    "Unix time of a slow subscriber's latest eviction; one series per subscription evicted in the last 15 minutes, at most 20 (the newest).",
                ),
                &["subscription_id", "peer", "topic_patterns"],
            )?,
            group_stalled: GaugeVec::new(
                Opts::new(
                    "tinybroker_consumer_group_stalled_seconds",
                    "How long a consumer group has had work (backlog or messages held by members) without completing any (no ack; no auto-ack delivery); 0 when it has no work. Redeliveries do not reset it.",
                ),
                group,
            )?,
            group_memberless: GaugeVec::new(
                Opts::new(
                    "tinybroker_consumer_group_memberless_seconds",
                    "How long a consumer group has had no member (0 while one is connected); it is removed with its backlog at TINYBROKER_GROUP_IDLE_TTL_SECONDS.",
                ),
                group,
            )?,
            group_acked: IntCounterVec::new(
                Opts::new(
                    "tinybroker_consumer_group_acked_total",
                    "Messages of a consumer group acked by its manual-ack members.",
                ),
                group,
            )?,
            group_delivered: IntCounterVec::new(
                Opts::new(
                    "tinybroker_consumer_group_delivered_total",
                    "Messages of a consumer group written to its members' streams, redeliveries included.",
                ),
                group,
            )?,
            recent_removal: GaugeVec::new(
                Opts::new(
                    "tinybroker_recent_group_removal_timestamp_seconds",
                    "Unix time a consumer group was removed after its idle TTL with messages left; one series per group removed so in the last 15 minutes, at most 20 (the newest).",
                ),
                group,
            )?,
            recent_removal_dropped: IntGaugeVec::new(
                Opts::new(
                    "tinybroker_recent_group_removal_dropped_messages",
                    "Messages dropped with a consumer group removed after its idle TTL (the series of tinybroker_recent_group_removal_timestamp_seconds).",
                ),
                group,
            )?,
        })
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.queue_depth_peak,
            &self.subscription_unacked,
            &self.subscription_oldest_unacked,
            &self.subscription_stalled,
            &self.recent_eviction,
            &self.group_stalled,
            &self.group_memberless,
            &self.group_acked,
            &self.group_delivered,
            &self.recent_removal,
            &self.recent_removal_dropped,
        ]
    }

    /// Sets the recent-eviction and recent-removal series.
    fn set_recent(&self, evictions: &[EvictionRecord], removals: &[GroupRemoval], now: SystemTime) {
        for e in recent(evictions, now, |e| &e.subscription_id, |e| e.evicted_at) {
            let peer = display_peer(e.peer);
            let patterns = patterns_label(&e.topic_patterns);
            self.recent_eviction
                .with_label_values(&[e.subscription_id.as_str(), &peer, &patterns])
                .set(unix_seconds(e.evicted_at));
        }
        for r in recent(removals, now, |r| &r.consumer_group, |r| r.removed_at) {
            let name = &[r.consumer_group.as_str()];
            self.recent_removal
                .with_label_values(name)
                .set(unix_seconds(r.removed_at));
            self.recent_removal_dropped
                .with_label_values(name)
                .set(r.dropped as i64);
        }
    }
}

/// What one scrape leaves for the next ones.
#[derive(Debug, Default)]
struct ScrapeMarks {
    /// `tinybroker_evictions_total` at the scrape before the previous one and
    /// at the previous one: subscriptions evicted since the older mark count
    /// as full in `tinybroker_queue_fill_ratio`, the same two-interval period
    /// as the peaks of the open ones.
    evictions: [u64; 2],
}

impl ScrapeMarks {
    /// Subscriptions evicted over the last two scrape intervals, given the
    /// evictions counter now; moves the marks on.
    fn evicted_recently(&mut self, evictions: u64) -> u64 {
        let [older, newer] = self.evictions;
        self.evictions = [newer, evictions];
        evictions.saturating_sub(older)
    }
}

/// The newest entry for each key among `entries` (newest first) that
/// happened within [`RECENT_WINDOW`] before `now`, newest first, at most
/// [`RECENT_SERIES`]. A time after `now` (the wall clock went back) counts
/// as recent.
fn recent<T>(entries: &[T], now: SystemTime, key: impl Fn(&T) -> &str, at: impl Fn(&T) -> SystemTime) -> Vec<&T> {
    let mut seen = std::collections::HashSet::new();
    entries
        .iter()
        .filter(|e| now.duration_since(at(e)).unwrap_or_default() <= RECENT_WINDOW)
        .filter(|e| seen.insert(key(e).to_owned()))
        .take(RECENT_SERIES)
        .collect()
}

fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// A subscription's patterns as one label value: comma-separated, cut at
/// [`PATTERNS_LABEL_BYTES`] (patterns are ASCII).
fn patterns_label(patterns: &[String]) -> String {
    let mut label = patterns.join(",");
    if label.len() > PATTERNS_LABEL_BYTES {
        label.truncate(PATTERNS_LABEL_BYTES);
        label.push_str("...");
    }
    label
}

impl BrokerCollector {
    fn new(source: SnapshotSource, per_subscription: bool) -> Self {
        Self {
            source,
            per_subscription,
            t: Templates::new().expect("valid metric definitions"),
            o: OperatorTemplates::new().expect("valid metric definitions"),
            marks: parking_lot::Mutex::new(ScrapeMarks::default()),
        }
    }

    /// Fresh metrics holding the broker's current values. Starts a new peak
    /// period of every queue.
    fn snapshot(&self) -> prometheus::Result<(Templates, OperatorTemplates)> {
        let mut marks = self.marks.lock();
        let m = Templates::new()?;
        let o = OperatorTemplates::new()?;
        let snapshot = (self.source)(Peaks::Take);
        let c = &snapshot.counters;
        m.published.inc_by(c.published);
        m.unrouted.inc_by(c.unrouted);
        m.evictions.inc_by(c.evictions);
        m.discarded_on_shutdown.inc_by(c.discarded_on_shutdown);
        m.delivered.with_label_values(&[MODE_MULTI]).inc_by(c.delivered_multi);
        m.delivered.with_label_values(&[MODE_SINGLE]).inc_by(c.delivered_single);
        for (reason, count) in [
            ("evicted", c.dropped_evicted),
            ("closed", c.dropped_closed),
            ("group_overflow", c.dropped_group_overflow),
            ("group_expired", c.dropped_group_expired),
            ("dead_letter_invalid", c.dropped_dead_letter_invalid),
        ] {
            m.dropped.with_label_values(&[reason]).inc_by(count);
        }
        if let Some(nats) = snapshot.nats {
            m.dropped
                .with_label_values(&["nats_slow_consumer"])
                .inc_by(nats.slow_consumer_dropped);
            m.dropped
                .with_label_values(&["nats_state_lost"])
                .inc_by(nats.state_lost);
            m.dropped
                .with_label_values(&["nats_unreachable"])
                .inc_by(nats.unreachable_dropped);
        }

        let (mut subs, mut queued) = ([0i64; 2], [0i64; 2]);
        for sub in &snapshot.subscriptions {
            let mode = usize::from(sub.mode == DeliveryMode::Single);
            subs[mode] += 1;
            queued[mode] += sub.queue_depth as i64;
            m.fill_ratio.observe(sub.queue_peak as f64 / sub.capacity.max(1) as f64);
            if self.per_subscription {
                let labels = &[sub.subscription_id.as_str(), sub.consumer_group.as_str()];
                m.queue_depth.with_label_values(labels).set(sub.queue_depth as i64);
                o.queue_depth_peak.with_label_values(labels).set(sub.queue_peak as i64);
                if sub.ack_mode == Some(crate::engine::AckMode::Manual) {
                    let seconds = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64());
                    o.subscription_unacked.with_label_values(labels).set(sub.unacked as i64);
                    o.subscription_oldest_unacked
                        .with_label_values(labels)
                        .set(seconds(sub.oldest_unacked_age));
                    o.subscription_stalled
                        .with_label_values(labels)
                        .set(seconds(sub.stalled));
                }
            }
        }
        // An evicted subscription's queue was full.
        for _ in 0..marks.evicted_recently(c.evictions) {
            m.fill_ratio.observe(1.0);
        }
        drop(marks);
        for mode in [DeliveryMode::Multi, DeliveryMode::Single] {
            let i = usize::from(mode == DeliveryMode::Single);
            m.subscriptions.with_label_values(&[mode.label()]).set(subs[i]);
            m.queued.with_label_values(&[mode.label()]).set(queued[i]);
        }

        for g in &snapshot.groups {
            let name = &[g.name.as_str()];
            m.group_members.with_label_values(name).set(g.members as i64);
            m.group_backlog.with_label_values(name).set(g.backlog as i64);
            m.group_in_flight.with_label_values(name).set(g.in_flight as i64);
            m.redeliveries.with_label_values(name).inc_by(g.redeliveries);
            m.dead_lettered.with_label_values(name).inc_by(g.dead_lettered);
            m.oldest_unacked
                .with_label_values(name)
                .set(g.oldest_unacked_age.map_or(0.0, |d| d.as_secs_f64()));
            o.group_stalled.with_label_values(name).set(g.stalled.as_secs_f64());
            o.group_memberless
                .with_label_values(name)
                .set(g.memberless.map_or(0.0, |d| d.as_secs_f64()));
            o.group_acked.with_label_values(name).inc_by(g.acked);
            o.group_delivered.with_label_values(name).inc_by(g.delivered);
        }
        o.set_recent(&snapshot.evictions, &snapshot.group_removals, SystemTime::now());
        Ok((m, o))
    }
}

impl Collector for BrokerCollector {
    fn desc(&self) -> Vec<&Desc> {
        let operator = self.o.collectors();
        self.t
            .collectors()
            .into_iter()
            .chain(operator)
            .flat_map(|c| c.desc())
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match self.snapshot() {
            Ok((m, o)) => m
                .collectors()
                .into_iter()
                .chain(o.collectors())
                .flat_map(|c| c.collect())
                .collect(),
            Err(e) => {
                tracing::error!(error = %e, "cannot collect broker metrics");
                Vec::new()
            }
        }
    }
}

/// The broker's resources and what protects them: memory in use and its
/// limit, connections, refusals, and shutdown progress. Read at scrape time.
struct ResourceCollector {
    source: SnapshotSource,
    front: FrontSource,
    t: ResourceMetrics,
}

struct ResourceMetrics {
    memory_used: IntGauge,
    memory_limit: IntGauge,
    connections: IntGauge,
    rejected: IntCounterVec,
    accept_errors: IntCounter,
    refused: IntCounterVec,
    memory_evictions: IntCounter,
    shutting_down: IntGauge,
    shutdown_pending: IntGauge,
    /// Cluster mode only (left out of a scrape otherwise).
    nats_connected: IntGauge,
    nats_reconnects: IntCounter,
    cluster: bool,
}

impl ResourceMetrics {
    fn new() -> prometheus::Result<Self> {
        Ok(Self {
            memory_used: IntGauge::new(
                "tinybroker_memory_used_bytes",
                "Bytes charged to the broker's memory budget: every message held for subscribers and groups (once, however many hold it; up to 7/8 of the limit), and requests being received (up to 1/8).",
            )?,
            memory_limit: IntGauge::new(
                "tinybroker_memory_limit_bytes",
                "max_memory_bytes (TINYBROKER_MAX_MEMORY_BYTES, by default 75% of the container's memory limit); 0 when there is none.",
            )?,
            connections: IntGauge::new("tinybroker_connections", "Open gRPC connections.")?,
            rejected: IntCounterVec::new(
                Opts::new(
                    "tinybroker_connections_rejected_total",
                    "gRPC connections the broker closed, by reason: connection_limit (TINYBROKER_MAX_CONNECTIONS open already), handshake_timeout, tls_handshake, not_http2, http2_flood (HTTP/2 flood protection, GOAWAY ENHANCE_YOUR_CALM), http2_protocol_error.",
                ),
                &["reason"],
            )?,
            accept_errors: IntCounter::new(
                "tinybroker_accept_errors_total",
                "Failed accepts of gRPC connections (out of file descriptors or memory); the listener backs off after each.",
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "tinybroker_requests_refused_total",
                    "Requests refused with RESOURCE_EXHAUSTED for the memory they would take, by reason: memory_limit (the broker's budget, TINYBROKER_MAX_MEMORY_BYTES), connection_incoming_limit (one connection's requests still being received).",
                ),
                &["reason"],
            )?,
            memory_evictions: IntCounter::new(
                "tinybroker_memory_limit_evictions_total",
                "Subscriptions evicted to bring the broker back under its memory limit (also in tinybroker_evictions_total).",
            )?,
            shutting_down: IntGauge::new(
                "tinybroker_shutting_down",
                "1 from SIGTERM until the process exits (health NOT_SERVING, queues draining).",
            )?,
            shutdown_pending: IntGauge::new(
                "tinybroker_shutdown_pending_messages",
                "While shutting down: messages still queued for broadcast subscribers, in group backlogs and held by group members (queued for them, or delivered and not acked), which are discarded if the grace period ends first.",
            )?,
            nats_connected: IntGauge::new(
                "tinybroker_nats_connected",
                "Cluster mode: 1 while this replica is connected to NATS, 0 while it is not (health NOT_SERVING).",
            )?,
            nats_reconnects: IntCounter::new(
                "tinybroker_nats_reconnects_total",
                "Cluster mode: times this replica's NATS connection came back after it was lost.",
            )?,
            cluster: false,
        })
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.memory_used,
            &self.memory_limit,
            &self.connections,
            &self.rejected,
            &self.accept_errors,
            &self.refused,
            &self.memory_evictions,
            &self.shutting_down,
            &self.shutdown_pending,
        ]
    }

    /// What a scrape reports: the cluster-mode series only in cluster mode.
    fn reported(&self) -> Vec<&dyn Collector> {
        let mut collectors = self.collectors();
        if self.cluster {
            collectors.push(&self.nats_connected);
            collectors.push(&self.nats_reconnects);
        }
        collectors
    }
}

impl ResourceCollector {
    fn new(source: SnapshotSource, front: FrontSource) -> Self {
        Self {
            source,
            front,
            t: ResourceMetrics::new().expect("valid metric definitions"),
        }
    }

    fn snapshot(&self) -> prometheus::Result<ResourceMetrics> {
        let mut m = ResourceMetrics::new()?;
        let snapshot = (self.source)(Peaks::Keep);
        let front = (self.front)();
        let messages = snapshot.memory;
        m.memory_used.set((messages.used + front.incoming_bytes) as i64);
        m.memory_limit.set(
            messages
                .limit
                .map_or(0, |l| (l + front.incoming_limit.unwrap_or(0)) as i64),
        );
        m.connections.set(front.open_connections as i64);
        for (reason, count) in front.rejected {
            m.rejected.with_label_values(&[reason]).inc_by(count);
        }
        m.accept_errors.inc_by(front.accept_errors);
        let c = &snapshot.counters;
        m.refused
            .with_label_values(&["memory_limit"])
            .inc_by(c.refused_memory_limit + front.refused_memory_limit);
        m.refused
            .with_label_values(&["connection_incoming_limit"])
            .inc_by(front.refused_connection_limit);
        m.memory_evictions.inc_by(c.evictions_memory_limit);
        m.shutting_down.set(i64::from(snapshot.shutting_down));
        if let Some(nats) = snapshot.nats {
            m.cluster = true;
            m.nats_connected.set(i64::from(nats.connected));
            m.nats_reconnects.inc_by(nats.reconnects);
        }
        m.shutdown_pending.set(if snapshot.shutting_down {
            snapshot.at_risk() as i64
        } else {
            0
        });
        Ok(m)
    }
}

impl Collector for ResourceCollector {
    fn desc(&self) -> Vec<&Desc> {
        let mut all = self.t.collectors();
        all.push(&self.t.nats_connected);
        all.push(&self.t.nats_reconnects);
        all.into_iter().flat_map(|c| c.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match self.snapshot() {
            Ok(m) => m.reported().into_iter().flat_map(|c| c.collect()).collect(),
            Err(e) => {
                tracing::error!(error = %e, "cannot collect resource metrics");
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Broker;
    use crate::config::Limits;
    use crate::engine::{NewMessage, SubscribeRequest};
    use futures::StreamExt;
    use std::task::{Context, Poll, Waker};

    /// Runs of one, two and hundreds of observations, flushed or dropped:
    /// every one reaches the shared histogram once, in the right bucket.
    #[test]
    fn a_local_observer_loses_and_doubles_nothing() {
        let shared = Histogram::with_opts(prometheus::HistogramOpts::new("h", "h").buckets(vec![0.5, 2.0])).unwrap();
        let mut local = LocalObserver::new(&shared);
        local.observe(0.1);
        assert_eq!(shared.get_sample_count(), 0, "held until flushed");
        local.flush();
        assert_eq!(shared.get_sample_count(), 1);
        local.flush();
        assert_eq!(shared.get_sample_count(), 1, "a second flush adds nothing");
        local.observe(1.0);
        local.observe(1.0);
        local.flush();
        assert_eq!(shared.get_sample_count(), 3);
        local.observe_many(3.0, 300);
        assert_eq!(shared.get_sample_count(), 3 + 256, "flushed every 256");
        local.flush();
        local.observe(0.2);
        drop(local);
        assert_eq!(shared.get_sample_count(), 304, "the last one flushed on drop");
        assert!((shared.get_sample_sum() - (0.1 + 2.0 + 900.0 + 0.2)).abs() < 1e-9);
        use prometheus::core::Metric as _;
        let buckets: Vec<u64> = shared
            .metric()
            .get_histogram()
            .get_bucket()
            .iter()
            .map(|b| b.cumulative_count())
            .collect();
        assert_eq!(buckets, vec![2, 4], "0.1 and 0.2 under 0.5; the two 1.0 under 2.0");
    }

    /// The value of the one sample `series` (name and labels as rendered).
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    fn publish(broker: &Broker, topic: &str) {
        let message = NewMessage {
            topic: topic.into(),
            ..Default::default()
        };
        broker.publish(message, None).unwrap();
    }

    fn subscriber(broker: &Broker, id: &str) -> crate::broker::SubscriptionStream {
        broker
            .subscribe(SubscribeRequest {
                topic_patterns: vec!["t".into()],
                subscription_id: id.into(),
                ..Default::default()
            })
            .unwrap()
    }

    /// A member that never acks beside one that does: its queue reads 0
    /// like the healthy one's, but Admin's record and the per-member
    /// metric name what it holds and for how long.
    #[tokio::test(start_paused = true)]
    async fn a_hung_member_is_named_by_its_unacked_messages() {
        let broker = Broker::new(Limits::default());
        let metrics = Metrics::new(broker.clone(), true);
        let member = |id: &str| {
            broker
                .subscribe(SubscribeRequest {
                    topic_patterns: vec!["t".into()],
                    subscription_id: id.into(),
                    mode: DeliveryMode::Single,
                    consumer_group: "g".into(),
                    ack_mode: crate::engine::AckMode::Manual,
                    ..Default::default()
                })
                .unwrap()
        };
        let (mut hung, mut healthy) = (member("hung"), member("healthy"));
        for _ in 0..6 {
            publish(&broker, "t");
        }
        let mut cx = Context::from_waker(Waker::noop());
        let mut taken = 0;
        while let Poll::Ready(Some(_)) = hung.poll_next_unpin(&mut cx) {
            taken += 1;
        }
        assert_eq!(taken, 3, "round-robin: half each");
        tokio::time::advance(Duration::from_secs(7)).await;
        while let Poll::Ready(Some(d)) = healthy.poll_next_unpin(&mut cx) {
            broker.ack("healthy", &[d.message.sequence]).unwrap();
        }
        let list = broker.subscriptions(Peaks::Keep);
        let record = |id: &str| list.iter().find(|s| s.subscription_id == id).unwrap();
        assert_eq!((record("hung").queue_depth, record("hung").unacked), (0, 3));
        assert_eq!(record("hung").oldest_unacked_age, Some(Duration::from_secs(7)));
        assert_eq!(
            (record("healthy").unacked, record("healthy").oldest_unacked_age),
            (0, None)
        );
        let text = metrics.render();
        assert_eq!(
            value(
                &text,
                r#"tinybroker_subscription_unacked{consumer_group="g",subscription_id="hung"}"#
            ),
            Some(3.0)
        );
        assert_eq!(
            value(
                &text,
                r#"tinybroker_subscription_unacked{consumer_group="g",subscription_id="healthy"}"#
            ),
            Some(0.0)
        );
        for (metric, id, seconds) in [
            ("tinybroker_subscription_oldest_unacked_age_seconds", "hung", 7.0),
            ("tinybroker_subscription_oldest_unacked_age_seconds", "healthy", 0.0),
            ("tinybroker_subscription_stalled_seconds", "hung", 7.0),
            ("tinybroker_subscription_stalled_seconds", "healthy", 0.0),
        ] {
            let series = format!(r#"{metric}{{consumer_group="g",subscription_id="{id}"}}"#);
            assert_eq!(value(&text, &series), Some(seconds), "{series} in\n{text}");
        }
        let quiet = Metrics::new(broker.clone(), false).render();
        assert!(!quiet.contains("subscription_id=\"hung\""), "{quiet}");
    }

    #[test]
    fn a_queue_that_filled_and_drained_between_scrapes_shows_its_peak() {
        let broker = Broker::new(Limits {
            consumer_capacity: 10,
            ..Limits::default()
        });
        let metrics = Metrics::new(broker.clone(), true);
        let mut stream = subscriber(&broker, "bursty");
        metrics.render();
        for _ in 0..10 {
            publish(&broker, "t");
        }
        let mut cx = Context::from_waker(Waker::noop());
        while let Poll::Ready(Some(_)) = stream.poll_next_unpin(&mut cx) {}
        let text = metrics.render();
        let labels = r#"{consumer_group="",subscription_id="bursty"}"#;
        assert_eq!(
            value(&text, &format!("tinybroker_subscription_queue_depth{labels}")),
            Some(0.0)
        );
        assert_eq!(
            value(&text, &format!("tinybroker_subscription_queue_depth_peak{labels}")),
            Some(10.0)
        );
        assert_eq!(
            value(&text, r#"tinybroker_queue_fill_ratio_bucket{le="0.9"}"#),
            Some(0.0)
        );
        assert_eq!(value(&text, "tinybroker_queue_fill_ratio_count"), Some(1.0));
        metrics.render();
        let text = metrics.render();
        assert_eq!(
            value(&text, &format!("tinybroker_subscription_queue_depth_peak{labels}")),
            Some(0.0),
            "two scrapes later the peak is forgotten"
        );
        assert_eq!(
            value(&text, r#"tinybroker_queue_fill_ratio_bucket{le="0.1"}"#),
            Some(1.0)
        );
    }

    #[test]
    fn an_evicted_subscriber_is_named_and_counted_as_full() {
        let broker = Broker::new(Limits {
            consumer_capacity: 2,
            ..Limits::default()
        });
        let metrics = Metrics::new(broker.clone(), false);
        let _slow = subscriber(&broker, "slow-1");
        metrics.render();
        for _ in 0..3 {
            publish(&broker, "t");
        }
        let text = metrics.render();
        let line = text
            .lines()
            .find(|l| l.starts_with("tinybroker_recent_eviction_timestamp_seconds{"))
            .unwrap_or_else(|| panic!("no recent eviction in\n{text}"));
        assert!(
            line.starts_with(
                r#"tinybroker_recent_eviction_timestamp_seconds{peer="unknown",subscription_id="slow-1",topic_patterns="t"}"#
            ),
            "{line}"
        );
        let at: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((unix_seconds(SystemTime::now()) - at).abs() < 60.0, "{line}");
        // Gone from the open subscriptions, but its full queue is counted,
        // in this scrape and the next.
        assert_eq!(value(&text, "tinybroker_queue_fill_ratio_count"), Some(1.0));
        assert_eq!(
            value(&text, r#"tinybroker_queue_fill_ratio_bucket{le="0.9"}"#),
            Some(0.0)
        );
        let text = metrics.render();
        assert_eq!(value(&text, "tinybroker_queue_fill_ratio_count"), Some(1.0));
        let text = metrics.render();
        assert_eq!(value(&text, "tinybroker_queue_fill_ratio_count"), Some(0.0));
        assert!(text.contains(r#"subscription_id="slow-1""#), "still a recent eviction");
    }

    fn eviction(id: &str, evicted_at: SystemTime) -> EvictionRecord {
        EvictionRecord {
            subscription_id: id.into(),
            evicted_at,
            topic_patterns: vec!["a.>".into()],
            queue_depth: 8,
            last_delivered_sequence: 0,
            peer: None,
            replica_id: String::new(),
        }
    }

    #[test]
    fn recent_evictions_are_bounded_one_per_subscription_and_expire() {
        let now = SystemTime::now();
        let ago = |s| now - Duration::from_secs(s);
        // Newest first, as Broker::evictions lists them: "again" twice,
        // then 30 others, then one too old.
        let mut records = vec![eviction("again", ago(1)), eviction("again", ago(2))];
        records.extend((0..30).map(|i| eviction(&format!("s{i}"), ago(3 + i))));
        let names = |r: &[&EvictionRecord]| r.iter().map(|e| e.subscription_id.clone()).collect::<Vec<_>>();
        let recent_ones = recent(&records, now, |e| &e.subscription_id, |e| e.evicted_at);
        assert_eq!(recent_ones.len(), RECENT_SERIES);
        assert_eq!(
            recent_ones[0].evicted_at,
            ago(1),
            "the newest eviction of a subscription"
        );
        assert_eq!(names(&recent_ones)[..3], ["again", "s0", "s1"]);
        let old = [
            eviction("old", now - RECENT_WINDOW - Duration::from_secs(1)),
            eviction("future", now + Duration::from_secs(5)),
        ];
        assert_eq!(
            names(&recent(&old, now, |e| &e.subscription_id, |e| e.evicted_at)),
            ["future"]
        );
    }

    #[test]
    fn long_pattern_lists_make_a_bounded_label() {
        let patterns: Vec<String> = (0..64).map(|i| format!("{i:03}.{}", "p".repeat(200))).collect();
        let label = patterns_label(&patterns);
        assert_eq!(label.len(), PATTERNS_LABEL_BYTES + 3);
        assert!(label.starts_with("000.ppp") && label.ends_with("..."));
        assert_eq!(patterns_label(&["a.*".into(), "b".into()]), "a.*,b");
    }
}
