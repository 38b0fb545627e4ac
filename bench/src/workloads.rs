//! The workloads and how one run of one of them goes against one system.
//!
//! A messaging run: start the server fresh, open the subscribers (each on
//! its own connection, confirmed by the server), open the publisher, then
//! publish `messages` messages under the flow-control window (and, for the
//! latency workload, at a steady rate), wait until every live subscriber has
//! everything (or nothing moves for a while), and read the counters.

use crate::measure::{Domain, Flow, Percentiles, Recorder, Signal, StallWatch, Tally, new_histogram, payload};
use crate::systems::{Binaries, Kind, Server, TinybrokerEnv, within};
use crate::{nats, redis_pubsub, tb};
use anyhow::{Context, Result, bail};
use bytes::Bytes;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Pattern every subscriber of a messaging workload uses.
pub const PATTERN: &str = "bench.*";
/// Topic of the published messages.
pub const TOPIC: &str = "bench.data";
/// Subscriptions per connection in the idle workload.
pub const IDLE_PER_CONN: usize = 100;
/// How long the receivers may make no progress after publishing ends
/// before what is missing counts as lost.
const QUIET_LIMIT: Duration = Duration::from_secs(3);

/// Settings shared by every run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub bins: Binaries,
    /// Flow-control window, in messages.
    pub window: u64,
    /// tinybroker's per-subscription queue capacity.
    pub consumer_capacity: usize,
}

#[derive(Debug, Clone, Copy)]
pub enum Spec {
    FanOut {
        subs: usize,
        size: usize,
        messages: u64,
    },
    Latency {
        subs: usize,
        size: usize,
        rate: u64,
        messages: u64,
    },
    Group {
        members: usize,
        size: usize,
        messages: u64,
    },
    /// `live` subscribers, plus one that never reads when `stalled`.
    Stalled {
        live: usize,
        size: usize,
        messages: u64,
        stalled: bool,
    },
    Idle {
        subs: usize,
    },
}

/// One contender in a workload: a system, and for tinybroker groups the ack mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    pub kind: Kind,
    pub manual_ack: bool,
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, self.manual_ack) {
            (Kind::Tinybroker, true) => f.write_str("tinybroker MANUAL ack"),
            (k, _) => write!(f, "{k}"),
        }
    }
}

/// A workload: an id for `--only`, a label for the table, and its contenders.
#[derive(Debug, Clone)]
pub struct Case {
    pub id: String,
    pub label: String,
    pub spec: Spec,
    pub variants: Vec<Variant>,
}

fn v(kind: Kind) -> Variant {
    Variant {
        kind,
        manual_ack: false,
    }
}

fn size_label(size: usize) -> String {
    if size >= 1024 && size.is_multiple_of(1024) {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    }
}

/// Every workload, with message counts derived from `messages` (the 1→3
/// count): 1→30 gets a tenth, 4 KiB payloads a quarter, the latency run at
/// most 5 s worth, and the stalled run at least enough to force an eviction.
pub fn cases(messages: u64, idle_subs: usize, with_redis: bool) -> Vec<Case> {
    let mut out = Vec::new();
    let fan_peers = |redis: bool| {
        let mut p = vec![v(Kind::Tinybroker), v(Kind::Nats)];
        if redis {
            p.push(v(Kind::Redis));
        }
        p
    };
    for subs in [3usize, 30] {
        for size in [16usize, 256, 4096] {
            let mut n = if subs == 30 { messages / 10 } else { messages };
            if size == 4096 {
                n /= 4;
            }
            out.push(Case {
                id: format!("fanout-{subs}-{size}"),
                label: format!("fan-out 1→{subs}, {}", size_label(size)),
                spec: Spec::FanOut {
                    subs,
                    size,
                    messages: n.max(100),
                },
                variants: fan_peers(with_redis),
            });
        }
    }
    let rate = 20_000;
    out.push(Case {
        id: "latency".into(),
        label: "latency at 20k msg/s, 1→3, 256 B".into(),
        spec: Spec::Latency {
            subs: 3,
            size: 256,
            rate,
            // 15 s: a p999 is the 0.1 % slowest, and a few scheduling
            // hiccups of this shared machine decide it in a short run.
            messages: messages.min(rate * 15).max(100),
        },
        variants: fan_peers(with_redis),
    });
    out.push(Case {
        id: "group".into(),
        label: "group of 3, 256 B".into(),
        spec: Spec::Group {
            members: 3,
            size: 256,
            messages: messages.max(100),
        },
        variants: vec![
            v(Kind::Tinybroker),
            Variant {
                kind: Kind::Tinybroker,
                manual_ack: true,
            },
            v(Kind::Nats),
        ],
    });
    // The stalled run is compared with the same run without the stalled subscriber.
    for stalled in [false, true] {
        out.push(Case {
            id: if stalled { "stalled" } else { "stalled-baseline" }.into(),
            label: if stalled {
                "2 live + 1 stalled, 256 B"
            } else {
                "2 live, none stalled (baseline), 256 B"
            }
            .into(),
            spec: Spec::Stalled {
                live: 2,
                size: 256,
                messages: messages.max(20_000),
                stalled,
            },
            variants: vec![v(Kind::Tinybroker), v(Kind::Nats)],
        });
    }
    out.push(Case {
        id: "idle".into(),
        label: format!("{idle_subs} idle subscriptions"),
        spec: Spec::Idle { subs: idle_subs },
        variants: vec![v(Kind::Tinybroker), v(Kind::Nats)],
    });
    out
}

/// Everything one run measured.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    pub published_per_s: Option<f64>,
    pub delivered_per_s: Option<f64>,
    /// Delivered/s per live subscriber (broadcast workloads).
    pub per_subscriber_per_s: Option<f64>,
    pub latency: Option<Percentiles>,
    pub lost: u64,
    pub dup: u64,
    /// The contract says these messages must arrive, and some did not.
    pub violation: Option<String>,
    pub peak_rss_kib: u64,
    pub cpu_percent: f64,
    pub rss_per_sub_bytes: Option<f64>,
    /// Each group member's share of the deliveries.
    pub split: Option<Vec<f64>>,
    /// tinybroker evicted the stalled subscriber / NATS flagged a slow consumer.
    pub stalled_flagged: Option<bool>,
    /// Things worth a line under the table (ended streams, stalls).
    pub remarks: Vec<String>,
}

pub async fn run(case: &Case, variant: Variant, settings: &Settings) -> Result<RunResult> {
    match case.spec {
        Spec::Idle { subs } => run_idle(variant.kind, subs, settings).await,
        _ => run_messaging(case.spec, variant, settings).await,
    }
}

fn tinybroker_env(settings: &Settings, subs: usize, per_sub_metrics: bool) -> TinybrokerEnv {
    TinybrokerEnv {
        consumer_capacity: settings.consumer_capacity,
        max_subscriptions: (subs + 1000).max(10_000),
        metrics_per_subscription: per_sub_metrics,
    }
}

enum Publisher {
    Tb(tb::Publisher),
    Nats(nats::Publisher),
    Redis(redis_pubsub::Publisher),
}

impl Publisher {
    async fn new(kind: Kind, server: &Server) -> Result<Publisher> {
        Ok(match kind {
            Kind::Tinybroker => Publisher::Tb(tb::Publisher::new(server, TOPIC).await?),
            Kind::Nats => Publisher::Nats(nats::Publisher::new(server, TOPIC).await?),
            Kind::Redis => Publisher::Redis(redis_pubsub::Publisher::new(server, TOPIC).await?),
        })
    }

    /// Hands over one message; fails if that is not done by `deadline`.
    async fn send(&mut self, p: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        match self {
            Publisher::Tb(x) => x.send(p, deadline).await,
            Publisher::Nats(x) => x.send(p, deadline).await,
            Publisher::Redis(x) => x.send(p, deadline).await,
        }
    }

    async fn finish(self, sent: u64) -> Result<()> {
        match self {
            Publisher::Tb(x) => x.finish(sent).await,
            Publisher::Nats(x) => x.finish(sent).await,
            Publisher::Redis(x) => x.finish(sent).await,
        }
    }
}

async fn subscribe(
    variant: Variant,
    server: &Server,
    group_member: Option<usize>,
    rec: Recorder,
    stop: CancellationToken,
) -> Result<JoinHandle<Tally>> {
    match (variant.kind, group_member) {
        (Kind::Tinybroker, None) => tb::subscribe(server, PATTERN, tb::Mode::Broadcast, rec, stop).await,
        (Kind::Tinybroker, Some(member)) => {
            let mode = tb::Mode::Group {
                manual: variant.manual_ack,
                member,
            };
            tb::subscribe(server, PATTERN, mode, rec, stop).await
        }
        (Kind::Nats, None) => nats::subscribe(server, PATTERN, None, rec, stop).await,
        (Kind::Nats, Some(_)) => nats::subscribe(server, PATTERN, Some(nats::QUEUE_GROUP), rec, stop).await,
        (Kind::Redis, None) => redis_pubsub::subscribe(server, PATTERN, rec, stop).await,
        (Kind::Redis, Some(_)) => bail!("Redis pub/sub has no consumer groups"),
    }
}

async fn run_messaging(spec: Spec, variant: Variant, settings: &Settings) -> Result<RunResult> {
    let kind = variant.kind;
    let (live, size, messages, rate, group, stalled) = match spec {
        Spec::FanOut { subs, size, messages } => (subs, size, messages, None, false, false),
        Spec::Latency {
            subs,
            size,
            rate,
            messages,
        } => (subs, size, messages, Some(rate), false, false),
        Spec::Group {
            members,
            size,
            messages,
        } => (members, size, messages, None, true, false),
        Spec::Stalled {
            live,
            size,
            messages,
            stalled,
        } => (live, size, messages, None, false, stalled),
        Spec::Idle { .. } => unreachable!("idle runs are not messaging runs"),
    };
    let server = Server::start(kind, &settings.bins, &tinybroker_env(settings, live + 1, true)).await?;
    let signal = Arc::new(Signal::default());
    let stop = CancellationToken::new();
    // Cancel the receivers however this function ends.
    let _stop_guard = stop.clone().drop_guard();

    let domains: Vec<Arc<Domain>> = if group {
        vec![Domain::new(messages, live, signal.clone())]
    } else {
        (0..live).map(|_| Domain::new(messages, 1, signal.clone())).collect()
    };
    let mut receivers = Vec::with_capacity(live);
    for i in 0..live {
        let domain = if group { &domains[0] } else { &domains[i] };
        let member = group.then_some(i);
        let rec = Recorder::new(domain.clone());
        receivers.push(
            subscribe(variant, &server, member, rec, stop.clone())
                .await
                .with_context(|| format!("opening subscriber {i}"))?,
        );
    }
    let _stalled = if stalled {
        Some(match kind {
            Kind::Tinybroker => tb::stalled(&server, PATTERN).await?,
            Kind::Nats => nats::stalled(&server, PATTERN).await?,
            Kind::Redis => bail!("the stalled workload has no Redis variant"),
        })
    } else {
        None
    };
    let mut publisher = Publisher::new(kind, &server).await?;
    let mut flow = Flow::new(domains.clone(), settings.window, signal.clone());
    let mut remarks = Vec::new();

    let before = server.stats()?;
    let watch = rate.is_some().then(StallWatch::start);
    let t0 = Instant::now();
    let mut sent = 0u64;
    // Every hand-over must finish within NET_LIMIT; the deadline is moved
    // on every DEADLINE_EVERY messages rather than read per message.
    const DEADLINE_EVERY: u64 = 1024;
    const NET_LIMIT: Duration = Duration::from_secs(10);
    let mut deadline = tokio::time::Instant::now();
    while sent < messages {
        if sent.is_multiple_of(DEADLINE_EVERY) {
            deadline = tokio::time::Instant::now() + NET_LIMIT;
        }
        if let Some(rate) = rate {
            let due = t0 + Duration::from_nanos(sent * 1_000_000_000 / rate);
            if due > Instant::now() {
                tokio::time::sleep_until(due.into()).await;
            }
        }
        if let Err(s) = flow.admit(sent).await {
            remarks.push(format!(
                "publisher stopped at message {}: the slowest live subscriber stayed at {} for 10 s",
                s.sent, s.progress
            ));
            break;
        }
        publisher.send(payload(sent, size), deadline).await?;
        sent += 1;
    }
    publisher.finish(sent).await?;
    let published_in = t0.elapsed();

    // Wait until every live domain has everything, or nothing moves.
    let total = || domains.iter().map(|d| d.unique()).sum::<u64>();
    let mut last = (total(), Instant::now());
    while !domains.iter().all(|d| d.complete() || d.dead()) {
        let now = total();
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > QUIET_LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let after = server.stats()?;
    if let Some(stalls) = watch.and_then(StallWatch::finish) {
        let (nap, threshold) = (StallWatch::NAP.as_micros(), StallWatch::THRESHOLD.as_millis());
        remarks.push(if stalls.count == 0 {
            format!("a bench thread sleeping {nap} µs at a time never woke over {threshold} ms late")
        } else {
            format!(
                "a bench thread sleeping {nap} µs at a time woke over {threshold} ms late {} times \
                 (at worst {:.1} ms late): this machine left a ready thread of the bench waiting \
                 that long, whatever the server did",
                stalls.count,
                stalls.longest.as_secs_f64() * 1e3
            )
        });
    }
    stop.cancel();
    let mut tallies = Vec::with_capacity(receivers.len());
    for r in receivers {
        tallies.push(within(Duration::from_secs(20), "stopping a receiver", r).await??);
    }

    // Was the stalled subscriber dealt with?
    let stalled_flagged = if stalled {
        Some(stalled_flagged(&server).await?)
    } else {
        None
    };

    let mut hist = new_histogram();
    for t in &tallies {
        hist.add(&t.latency_ns).context("merging latency histograms")?;
        if let Some(why) = &t.ended {
            remarks.push(format!("a live subscriber's {why}"));
        }
    }
    let unique: u64 = domains.iter().map(|d| d.unique()).sum();
    let lost: u64 = domains.iter().map(|d| d.lost()).sum();
    let dup: u64 = domains.iter().map(|d| d.dup()).sum();
    let last_at = tallies.iter().filter_map(|t| t.last_at).max();
    let delivered_per_s = last_at.map(|l| unique as f64 / l.duration_since(t0).as_secs_f64());
    let received: u64 = tallies.iter().map(|t| t.received).sum();
    let split = (group && received > 0).then(|| tallies.iter().map(|t| t.received as f64 / received as f64).collect());

    // What the contract (docs/contract.md, Delivery) says must arrive.
    let violation = if kind != Kind::Tinybroker {
        None
    } else if lost > 0 {
        Some(format!("{lost} messages lost"))
    } else if group && !variant.manual_ack && dup > 0 {
        Some(format!("{dup} duplicates in AUTO ack (exactly once expected)"))
    } else if !group && dup > 0 {
        Some(format!("{dup} duplicates in broadcast"))
    } else {
        None
    };

    Ok(RunResult {
        published_per_s: Some(sent as f64 / published_in.as_secs_f64()),
        delivered_per_s,
        per_subscriber_per_s: (!group).then(|| delivered_per_s.map(|d| d / live as f64)).flatten(),
        latency: Percentiles::of(&hist),
        lost,
        dup,
        violation,
        peak_rss_kib: after.peak_rss_kib,
        cpu_percent: after.cpu_percent_since(&before),
        rss_per_sub_bytes: None,
        split,
        stalled_flagged,
        remarks,
    })
}

/// tinybroker: the eviction counter moved; NATS: `/varz` counts a slow consumer.
/// Either may lag the run a little, so it is polled for a moment.
async fn stalled_flagged(server: &Server) -> Result<bool> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let flagged = match server.kind {
            Kind::Tinybroker => tb::evictions(server).await? > 0,
            Kind::Nats => nats::varz_number(server, "slow_consumers").await? > 0,
            Kind::Redis => false,
        };
        if flagged || Instant::now() > deadline {
            return Ok(flagged);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run_idle(kind: Kind, subs: usize, settings: &Settings) -> Result<RunResult> {
    let server = Server::start(kind, &settings.bins, &tinybroker_env(settings, subs, false)).await?;
    let count = async |server: &Server| -> Result<u64> {
        match kind {
            Kind::Tinybroker => tb::subscriptions(server).await,
            _ => nats::varz_number(server, "subscriptions").await,
        }
    };
    let base = count(&server).await?;
    let before = server.stats()?;
    let opened = within(Duration::from_secs(120), "opening the idle subscriptions", async {
        match kind {
            Kind::Tinybroker => tb::idle(&server, subs, IDLE_PER_CONN).await,
            Kind::Nats => nats::idle(&server, subs, IDLE_PER_CONN).await,
            Kind::Redis => bail!("the idle workload has no Redis variant"),
        }
    })
    .await??;
    // The server really holds them all before RSS is read.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = count(&server).await?;
        if n >= base + subs as u64 {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{kind} reports {} of {subs} idle subscriptions after 30 s",
                n.saturating_sub(base)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = server.stats()?;
    drop(opened);
    let grown = after.rss_kib.saturating_sub(before.rss_kib) as f64 * 1024.0;
    Ok(RunResult {
        peak_rss_kib: after.peak_rss_kib,
        cpu_percent: after.cpu_percent_since(&before),
        rss_per_sub_bytes: Some(grown / subs as f64),
        ..Default::default()
    })
}
