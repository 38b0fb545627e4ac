//! Prometheus metrics: one registry owned by the broker process (not the
//! global default). Counters and gauges are read from the broker's live state
//! when `/metrics` is scraped, so queue depths cannot drift and the publish
//! path only touches its own atomics; series of closed subscriptions and
//! removed groups disappear with them. Only the two latency histograms are
//! observed as events happen (lock-free atomics).

use crate::broker::Broker;
use crate::connections::{ConnectionStats, Rejection};
use crate::incoming::IncomingLimits;
use prometheus::core::{Collector, Desc};
use prometheus::local::LocalHistogram;
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Label value of `mode` for broadcast subscriptions.
pub const MODE_MULTI: &str = "multi";
/// Label value of `mode` for consumer-group members.
pub const MODE_SINGLE: &str = "single";

/// The registry and the histograms observed on the hot paths.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    broker: Broker,
    publish_duration: Histogram,
    delivery_lag_multi: Histogram,
    delivery_lag_single: Histogram,
}

impl Metrics {
    /// Builds the registry for `broker`.
    pub fn new(broker: Broker, per_subscription: bool) -> Self {
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
            .buckets(vec![
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
            ]),
            &["mode"],
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
        let collectors: Vec<Box<dyn Collector>> = vec![
            Box::new(publish_duration.clone()),
            Box::new(delivery_lag.clone()),
            Box::new(build_info),
            Box::new(prometheus::process_collector::ProcessCollector::for_self()),
            Box::new(BrokerCollector::new(broker.clone(), per_subscription)),
        ];
        for collector in collectors {
            registry.register(collector).expect("metric names are unique");
        }
        Self {
            registry,
            broker,
            publish_duration,
            delivery_lag_multi: delivery_lag.with_label_values(&[MODE_MULTI]),
            delivery_lag_single: delivery_lag.with_label_values(&[MODE_SINGLE]),
        }
    }

    /// Adds the gRPC listener's metrics: open and rejected connections, and
    /// requests refused for what they would hold.
    pub fn with_connections(self, connections: Arc<ConnectionStats>, incoming: Arc<IncomingLimits>) -> Self {
        let collector = ResourceCollector::new(self.broker.clone(), connections, incoming);
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
        LocalObserver::new(self.publish_duration.local())
    }

    /// The same for one subscription's `tinybroker_delivery_lag_seconds`.
    pub fn delivery_lag(&self, group: bool) -> LocalObserver {
        LocalObserver::new(if group {
            self.delivery_lag_single.local()
        } else {
            self.delivery_lag_multi.local()
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
pub struct LocalObserver {
    local: LocalHistogram,
    unflushed: u32,
}

impl LocalObserver {
    const FLUSH_EVERY: u32 = 256;

    fn new(local: LocalHistogram) -> Self {
        Self { local, unflushed: 0 }
    }

    pub fn observe(&mut self, seconds: f64) {
        self.local.observe(seconds);
        self.unflushed += 1;
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
        if self.unflushed > 0 {
            self.local.flush();
            self.unflushed = 0;
        }
    }
}

impl Drop for LocalObserver {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Reads the broker's live state at scrape time.
struct BrokerCollector {
    broker: Broker,
    per_subscription: bool,
    /// Templates: they give `desc()` and the options of the fresh metrics
    /// built at every scrape.
    t: Templates,
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
                    "Messages lost before delivery, by reason: evicted (queued for an evicted subscriber), closed (queued for a cancelled or admin-closed subscription), group_overflow (oldest of a full group backlog), group_expired (backlog of a group removed after its idle TTL), dead_letter_invalid (a dead letter that the broker's two headers took over a message limit).",
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

impl BrokerCollector {
    fn new(broker: Broker, per_subscription: bool) -> Self {
        Self {
            broker,
            per_subscription,
            t: Templates::new().expect("valid metric definitions"),
        }
    }

    /// Fresh metrics holding the broker's current values.
    fn snapshot(&self) -> prometheus::Result<Templates> {
        let m = Templates::new()?;
        let stats = self.broker.stats();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        m.published.inc_by(load(&stats.published));
        m.unrouted.inc_by(load(&stats.unrouted));
        m.evictions.inc_by(load(&stats.evictions));
        m.discarded_on_shutdown.inc_by(load(&stats.discarded_on_shutdown));
        m.delivered
            .with_label_values(&[MODE_MULTI])
            .inc_by(load(&stats.delivered_broadcast));
        m.delivered
            .with_label_values(&[MODE_SINGLE])
            .inc_by(load(&stats.delivered_group));
        for (reason, counter) in [
            ("evicted", &stats.dropped_evicted),
            ("closed", &stats.dropped_closed),
            ("group_overflow", &stats.dropped_group_overflow),
            ("group_expired", &stats.dropped_group_expired),
            ("dead_letter_invalid", &stats.dropped_dead_letter_invalid),
        ] {
            m.dropped.with_label_values(&[reason]).inc_by(load(counter));
        }

        let (mut subs, mut queued) = ([0i64; 2], [0i64; 2]);
        for sub in self.broker.subscriptions() {
            let group = sub.consumer_group();
            let mode = usize::from(group.is_some());
            let depth = sub.queue_depth();
            subs[mode] += 1;
            queued[mode] += depth as i64;
            m.fill_ratio.observe(depth as f64 / sub.capacity().max(1) as f64);
            if self.per_subscription {
                m.queue_depth
                    .with_label_values(&[sub.id(), group.unwrap_or("")])
                    .set(depth as i64);
            }
        }
        for (i, mode) in [MODE_MULTI, MODE_SINGLE].into_iter().enumerate() {
            m.subscriptions.with_label_values(&[mode]).set(subs[i]);
            m.queued.with_label_values(&[mode]).set(queued[i]);
        }

        let now = tokio::time::Instant::now();
        for group in self.broker.groups() {
            let s = group.snapshot(now);
            let name = &[group.name()];
            m.group_members.with_label_values(name).set(s.members as i64);
            m.group_backlog.with_label_values(name).set(s.backlog as i64);
            m.group_in_flight.with_label_values(name).set(s.in_flight as i64);
            m.redeliveries.with_label_values(name).inc_by(group.redeliveries());
            m.dead_lettered.with_label_values(name).inc_by(group.dead_lettered());
            m.oldest_unacked
                .with_label_values(name)
                .set(s.oldest_unacked_age.map_or(0.0, |d| d.as_secs_f64()));
        }
        Ok(m)
    }
}

impl Collector for BrokerCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.t.collectors().into_iter().flat_map(|c| c.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match self.snapshot() {
            Ok(m) => m.collectors().into_iter().flat_map(|c| c.collect()).collect(),
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
    broker: Broker,
    connections: Arc<ConnectionStats>,
    incoming: Arc<IncomingLimits>,
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
}

impl ResourceMetrics {
    fn new() -> prometheus::Result<Self> {
        Ok(Self {
            memory_used: IntGauge::new(
                "tinybroker_memory_used_bytes",
                "Bytes charged to the broker's memory budget: every message held for subscribers and groups (once, however many hold it), and requests being received.",
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
}

impl ResourceCollector {
    fn new(broker: Broker, connections: Arc<ConnectionStats>, incoming: Arc<IncomingLimits>) -> Self {
        Self {
            broker,
            connections,
            incoming,
            t: ResourceMetrics::new().expect("valid metric definitions"),
        }
    }

    fn snapshot(&self) -> prometheus::Result<ResourceMetrics> {
        let m = ResourceMetrics::new()?;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let memory = self.broker.memory();
        m.memory_used.set(memory.used() as i64);
        m.memory_limit.set(memory.limit().map_or(0, |l| l as i64));
        m.connections.set(self.connections.open() as i64);
        for reason in Rejection::ALL {
            m.rejected
                .with_label_values(&[reason.label()])
                .inc_by(self.connections.rejected(reason));
        }
        m.accept_errors.inc_by(self.connections.accept_errors());
        let stats = self.broker.stats();
        m.refused
            .with_label_values(&["memory_limit"])
            .inc_by(load(&stats.refused_memory_limit) + load(&self.incoming.refused_memory_limit));
        m.refused
            .with_label_values(&["connection_incoming_limit"])
            .inc_by(load(&self.incoming.refused_connection_limit));
        m.memory_evictions.inc_by(load(&stats.evictions_memory_limit));
        let shutting_down = self.broker.is_shutting_down();
        m.shutting_down.set(i64::from(shutting_down));
        m.shutdown_pending
            .set(if shutting_down { at_risk(&self.broker) as i64 } else { 0 });
        Ok(m)
    }
}

/// What a shutdown can still lose: messages queued for broadcast
/// subscriptions, and everything consumer groups hold: their backlogs and
/// what their members hold (queued for them, or delivered with manual ack
/// and not acked yet: a member closed by the shutdown hands those back to
/// the backlog, which is discarded with them).
fn at_risk(broker: &Broker) -> usize {
    let broadcast: usize = broker
        .subscriptions()
        .iter()
        .filter(|s| s.consumer_group().is_none())
        .map(|s| s.queue_depth())
        .sum();
    let now = tokio::time::Instant::now();
    let groups: usize = broker
        .groups()
        .iter()
        .map(|g| g.snapshot(now))
        .map(|s| s.backlog + s.in_flight)
        .sum();
    broadcast + groups
}

impl Collector for ResourceCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.t.collectors().into_iter().flat_map(|c| c.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match self.snapshot() {
            Ok(m) => m.collectors().into_iter().flat_map(|c| c.collect()).collect(),
            Err(e) => {
                tracing::error!(error = %e, "cannot collect resource metrics");
                Vec::new()
            }
        }
    }
}
