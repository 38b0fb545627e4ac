//! The workloads and how one run of one of them goes against one system.
//!
//! A messaging run: start the server fresh, open the subscribers (each on
//! its own connection, confirmed by the server), open the publisher, then
//! publish `messages` messages under the flow-control window (and, for the
//! latency workload, at a steady rate), wait until every live subscriber has
//! everything (or nothing moves for a while), and read the counters.

use crate::cluster::{self, NatsCluster};
use crate::measure::{Domain, Flow, Percentiles, Recorder, Signal, StallWatch, Tally, new_histogram, payload};
use crate::systems::{Binaries, Kind, ProcStats, Server, TinybrokerEnv, http_get, prom_with_label, within};
use crate::{nats, redis_pubsub, tb};
use anyhow::{Context, Result, bail};
use bytes::Bytes;
use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Pattern every subscriber of a messaging workload uses.
pub const PATTERN: &str = "bench.*";
/// Topic of the published messages.
pub const TOPIC: &str = "bench.data";
/// Subscriptions per connection in the idle workloads.
pub const IDLE_PER_CONN: usize = 100;
/// Subscribers per connection in the wide fan-out workloads.
pub const WIDE_PER_CONN: usize = 50;
/// Least server CPU a run must use for a CPU-per-delivery figure: 5 clock
/// ticks of 10 ms, so the figure is within ±20 % from the ticks alone.
const MIN_CPU_S: f64 = 0.05;
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
    /// Watches the server over each messaging run's measured window (the
    /// performance guard's counters); none in the comparison runs.
    pub probe: Option<Arc<dyn Probe>>,
}

/// Something that counts what the server does over a run's measured window:
/// `start` just before the first message is published, `stop` once the last
/// has arrived (or nothing moved for a while). Both are given the server's pid.
pub trait Probe: fmt::Debug + Send + Sync {
    fn start(&self, pid: u32) -> Result<()>;
    fn stop(&self, pid: u32) -> Result<()>;
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
    /// A consumer group of `members`; at `rate` msg/s, or as fast as the
    /// window lets it.
    Group {
        members: usize,
        size: usize,
        rate: Option<u64>,
        messages: u64,
    },
    /// `live` subscribers, plus one that never reads when `stalled`.
    Stalled {
        live: usize,
        size: usize,
        messages: u64,
        stalled: bool,
    },
    /// `subs` broadcast subscribers sharing connections, `per_conn` on each,
    /// one publisher at `rate` msg/s (`None`: as fast as the window lets it).
    Wide {
        subs: usize,
        per_conn: usize,
        size: usize,
        rate: Option<u64>,
        messages: u64,
    },
    /// A cluster of `nodes` (issue 15): tinybroker replicas over as many
    /// NATS servers, or those NATS servers used directly. One publisher on
    /// the first node, `subs` subscribers spread over the nodes (subscriber
    /// i on node i % nodes), each on its own connection; at `rate` msg/s
    /// (the latency run) or as fast as the window lets it.
    ///
    /// With `group`, the `subs` are the members of one consumer group
    /// (member i on node i % nodes) instead of broadcast subscribers: for
    /// tinybroker a MANUAL cluster-wide group (a JetStream WorkQueue stream
    /// under it), for NATS a JetStream WorkQueue memory stream with one
    /// durable pull consumer shared by the members, published to with
    /// JetStream's publish-and-await-ack.
    ///
    /// With `group` and `nats_queue`, the NATS peer is a core-NATS queue
    /// group instead (`queue_subscribe`, member i on server i % nodes,
    /// at-most-once: what it drops is counted, not failed), and tinybroker's
    /// group takes the variant's ack mode (AUTO for `cluster-group-auto`).
    Cluster {
        nodes: usize,
        subs: usize,
        size: usize,
        rate: Option<u64>,
        messages: u64,
        group: bool,
        nats_queue: bool,
    },
    /// `subs` idle subscriptions, `per_conn` per connection. With
    /// `beyond_connections` the connections are opened (and counted by the
    /// server) before the first RSS reading, so only the subscriptions' own
    /// cost is measured; without, the connections' cost is spread over them.
    Idle {
        subs: usize,
        per_conn: usize,
        beyond_connections: bool,
    },
}

/// One contender in a workload: a system, and for tinybroker groups the ack mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    pub kind: Kind,
    pub manual_ack: bool,
    /// tinybroker: subscriptions on `Session` streams (one per connection)
    /// instead of an `OpenSubscription` stream each.
    pub session: bool,
    /// tinybroker, with `session`: the batched forms ("Batches: many
    /// messages per gRPC message"): the publisher sends `SessionPublish`
    /// batches of what is ready on a session of its own, the subscribers'
    /// sessions ask for `deliveries` events (`tinybroker-batch: 1`), and a
    /// MANUAL member acks what one read brought in one `SessionAck`.
    pub batch: bool,
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, self.manual_ack, self.session, self.batch) {
            (Kind::Tinybroker, true, false, _) => f.write_str("tinybroker MANUAL ack"),
            (Kind::Tinybroker, true, true, false) => f.write_str("tinybroker session, MANUAL ack in-band"),
            (Kind::Tinybroker, false, true, false) => f.write_str("tinybroker session"),
            (Kind::Tinybroker, true, true, true) => f.write_str("tinybroker session-batch, MANUAL ack in-band"),
            (Kind::Tinybroker, false, true, true) => f.write_str("tinybroker session-batch"),
            (k, _, _, _) => write!(f, "{k}"),
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
        session: false,
        batch: false,
    }
}

/// tinybroker on sessions.
fn session(manual_ack: bool) -> Variant {
    Variant {
        kind: Kind::Tinybroker,
        manual_ack,
        session: true,
        batch: false,
    }
}

/// tinybroker on sessions, with batches both ways (`session-batch`).
pub fn session_batch(manual_ack: bool) -> Variant {
    Variant {
        kind: Kind::Tinybroker,
        manual_ack,
        session: true,
        batch: true,
    }
}

fn size_label(size: usize) -> String {
    if size >= 1024 && size.is_multiple_of(1024) {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    }
}

/// The sizes of a run, from the command line.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Messages of the 1→3 fan-out and the group runs.
    pub messages: u64,
    /// Subscriptions of the idle runs.
    pub idle_subs: usize,
    /// Subscribers of the wide fan-out runs.
    pub wide_subs: usize,
    /// Rate of the paced wide fan-out run, messages per second.
    pub wide_rate: u64,
    /// Length of the paced wide fan-out run.
    pub wide_seconds: u64,
    /// Messages of the unthrottled wide fan-out run.
    pub wide_messages: u64,
    /// Rate and length of the cluster latency run.
    pub cluster_rate: u64,
    pub cluster_seconds: u64,
}

/// Every workload, with message counts derived from `messages` (the 1→3
/// count): 1→30 gets a tenth, 4 KiB payloads a quarter, the latency run at
/// most 15 s worth, and the stalled run at least enough to force an eviction.
pub fn cases(scale: &Scale, with_redis: bool) -> Vec<Case> {
    let Scale {
        messages,
        idle_subs,
        wide_subs,
        wide_rate,
        wide_seconds,
        wide_messages,
        cluster_rate,
        cluster_seconds,
    } = *scale;
    let mut out = Vec::new();
    let fan_peers = |redis: bool| {
        let mut p = vec![v(Kind::Tinybroker), session_batch(false), v(Kind::Nats)];
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
            rate: None,
            messages: messages.max(100),
        },
        variants: vec![
            v(Kind::Tinybroker),
            Variant {
                kind: Kind::Tinybroker,
                manual_ack: true,
                session: false,
                batch: false,
            },
            session(true),
            session_batch(false),
            session_batch(true),
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
    // Wide fan-out: many subscribers sharing few connections, the shape of
    // an invalidation event fanned out to every replica (issue 16).
    let wide_conns = wide_subs.div_ceil(WIDE_PER_CONN);
    out.push(Case {
        id: "wide-paced".into(),
        label: format!("wide 1→{wide_subs} ({wide_conns} conns), {wide_rate} msg/s for {wide_seconds} s, 256 B"),
        spec: Spec::Wide {
            subs: wide_subs,
            per_conn: WIDE_PER_CONN,
            size: 256,
            rate: Some(wide_rate.max(1)),
            messages: (wide_rate * wide_seconds).max(1),
        },
        variants: vec![v(Kind::Tinybroker), session(false), session_batch(false), v(Kind::Nats)],
    });
    out.push(Case {
        id: "wide-max".into(),
        label: format!("wide 1→{wide_subs} ({wide_conns} conns), unthrottled, 256 B"),
        spec: Spec::Wide {
            subs: wide_subs,
            per_conn: WIDE_PER_CONN,
            size: 256,
            rate: None,
            messages: wide_messages.max(1),
        },
        variants: vec![v(Kind::Tinybroker), session(false), session_batch(false), v(Kind::Nats)],
    });
    out.push(Case {
        id: "idle".into(),
        label: format!("{idle_subs} idle subscriptions"),
        spec: Spec::Idle {
            subs: idle_subs,
            per_conn: IDLE_PER_CONN,
            beyond_connections: false,
        },
        variants: vec![v(Kind::Tinybroker), session(false), v(Kind::Nats)],
    });
    out.push(Case {
        id: format!("idle-{IDLE_PER_CONN}"),
        label: format!("{idle_subs} idle subscriptions, {IDLE_PER_CONN}/conn, beyond the connections"),
        spec: Spec::Idle {
            subs: idle_subs,
            per_conn: IDLE_PER_CONN,
            beyond_connections: true,
        },
        variants: vec![v(Kind::Tinybroker), session(false), v(Kind::Nats)],
    });
    // Cluster mode (issue 15): 3 replicas over a 3-server NATS cluster
    // against that NATS cluster used directly.
    for subs in [3usize, 30] {
        out.push(Case {
            id: format!("{CLUSTER_PREFIX}fanout-{subs}"),
            label: format!("cluster of {CLUSTER_NODES}: fan-out 1→{subs}, 256 B"),
            spec: Spec::Cluster {
                nodes: CLUSTER_NODES,
                subs,
                size: 256,
                rate: None,
                messages: (if subs == 30 { messages / 10 } else { messages }).max(100),
                group: false,
                nats_queue: false,
            },
            variants: vec![v(Kind::Tinybroker), v(Kind::Nats)],
        });
    }
    out.push(Case {
        id: format!("{CLUSTER_PREFIX}latency"),
        label: format!(
            "cluster of {CLUSTER_NODES}: latency at {}k msg/s for {cluster_seconds} s, 1→{CLUSTER_NODES}, 256 B",
            cluster_rate as f64 / 1000.0
        ),
        spec: Spec::Cluster {
            nodes: CLUSTER_NODES,
            subs: CLUSTER_NODES,
            size: 256,
            rate: Some(cluster_rate.max(1)),
            messages: (cluster_rate * cluster_seconds).max(100),
            group: false,
            nats_queue: false,
        },
        variants: vec![v(Kind::Tinybroker), v(Kind::Nats)],
    });
    // A MANUAL consumer group of 3, one member per node. Every publish
    // waits for JetStream's store ack (R3) on both sides, so a tenth of the
    // 1→3 count is plenty (and keeps --quick short).
    out.push(Case {
        id: format!("{CLUSTER_PREFIX}group"),
        label: format!("cluster of {CLUSTER_NODES}: group of {CLUSTER_NODES} (MANUAL ack), 256 B"),
        spec: Spec::Cluster {
            nodes: CLUSTER_NODES,
            subs: CLUSTER_NODES,
            size: 256,
            rate: None,
            messages: (messages / 10).max(100),
            group: true,
            nats_queue: false,
        },
        variants: vec![
            Variant {
                kind: Kind::Tinybroker,
                manual_ack: true,
                session: false,
                batch: false,
            },
            v(Kind::Nats),
        ],
    });
    // An AUTO consumer group of 3, one member per replica, against a core
    // NATS queue group of 3, one member per server (issue 47 point 3).
    // tinybroker's cluster groups still run over JetStream (a store ack per
    // publish, R3), so its peer here is the cheaper, at-most-once system.
    // The same count as `cluster-group`, so both rows read alike.
    out.push(Case {
        id: format!("{CLUSTER_PREFIX}group-auto"),
        label: format!("cluster of {CLUSTER_NODES}: group of {CLUSTER_NODES} (AUTO ack) vs a NATS queue group, 256 B"),
        spec: Spec::Cluster {
            nodes: CLUSTER_NODES,
            subs: CLUSTER_NODES,
            size: 256,
            rate: None,
            messages: (messages / 10).max(100),
            group: true,
            nats_queue: true,
        },
        variants: vec![v(Kind::Tinybroker), v(Kind::Nats)],
    });
    out
}

/// Ids of the cluster workloads start with this (`--only cluster`).
pub const CLUSTER_PREFIX: &str = "cluster-";
/// Replicas and NATS servers of the cluster workloads.
pub const CLUSTER_NODES: usize = 3;
/// Targets of issue 15 on this machine (the gateway's overhead, not scale-out).
pub const CLUSTER_THROUGHPUT_TARGET: f64 = 0.6;
pub const CLUSTER_P99_TARGET: f64 = 2.0;

/// Everything one run measured.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// Messages published in the measured window.
    pub published: u64,
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
    /// Server CPU seconds per million deliveries.
    pub cpu_s_per_m: Option<f64>,
    /// The kernel's share of that CPU (system time), 0 to 1.
    pub kernel_share: Option<f64>,
    pub rss_per_sub_bytes: Option<f64>,
    /// Each group member's share of the deliveries.
    pub split: Option<Vec<f64>>,
    /// tinybroker evicted the stalled subscriber / NATS flagged a slow consumer.
    pub stalled_flagged: Option<bool>,
    /// Things worth a line under the table (ended streams, stalls).
    pub remarks: Vec<String>,
    /// Cluster runs: each process's CPU per published message, in µs.
    pub cpu_parts: Vec<(String, f64)>,
}

pub async fn run(case: &Case, variant: Variant, settings: &Settings) -> Result<RunResult> {
    match case.spec {
        Spec::Idle {
            subs,
            per_conn,
            beyond_connections,
        } => run_idle(variant, subs, per_conn, beyond_connections, settings).await,
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
    /// `session-batch`: `SessionPublish` batches of what is ready.
    TbBatch(tb::BatchPublisher),
    Nats(nats::Publisher),
    /// The NATS peer of a cluster-wide group: JetStream publishes, their
    /// acks awaited in order with a window ([`nats::JsPublisher`]).
    NatsJs(nats::JsPublisher),
    Redis(redis_pubsub::Publisher),
}

impl Publisher {
    async fn new(variant: Variant, server: &Server) -> Result<Publisher> {
        Ok(match variant.kind {
            Kind::Tinybroker if variant.batch => Publisher::TbBatch(tb::BatchPublisher::new(server, TOPIC).await?),
            Kind::Tinybroker => Publisher::Tb(tb::Publisher::new(server, TOPIC).await?),
            Kind::Nats => Publisher::Nats(nats::Publisher::new(server, TOPIC).await?),
            Kind::Redis => Publisher::Redis(redis_pubsub::Publisher::new(server, TOPIC).await?),
        })
    }

    /// Hands over one message; fails if that is not done by `deadline`.
    async fn send(&mut self, p: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        match self {
            Publisher::Tb(x) => x.send(p, deadline).await,
            Publisher::TbBatch(x) => x.send(p, deadline).await,
            Publisher::Nats(x) => x.send(p, deadline).await,
            Publisher::NatsJs(x) => x.send(p, deadline).await,
            Publisher::Redis(x) => x.send(p, deadline).await,
        }
    }

    async fn finish(self, sent: u64) -> Result<()> {
        match self {
            Publisher::Tb(x) => x.finish(sent).await,
            Publisher::TbBatch(x) => x.finish(sent).await,
            Publisher::Nats(x) => x.finish(sent).await,
            Publisher::NatsJs(x) => x.finish().await,
            Publisher::Redis(x) => x.finish(sent).await,
        }
    }
}

async fn subscribe(
    variant: Variant,
    server: &Server,
    group_member: Option<usize>,
    sync: &[String],
    rec: Recorder,
    stop: CancellationToken,
) -> Result<JoinHandle<Tally>> {
    match (variant.kind, group_member) {
        (Kind::Tinybroker, None) if variant.session => {
            tb::subscribe_session(server, PATTERN, tb::Mode::Broadcast, rec, stop, variant.batch).await
        }
        (Kind::Tinybroker, None) => tb::subscribe(server, PATTERN, tb::Mode::Broadcast, rec, stop).await,
        (Kind::Tinybroker, Some(member)) => {
            let mode = tb::Mode::Group {
                manual: variant.manual_ack,
                member,
            };
            match variant.session {
                true => tb::subscribe_session(server, PATTERN, mode, rec, stop, variant.batch).await,
                false => tb::subscribe(server, PATTERN, mode, rec, stop).await,
            }
        }
        (Kind::Nats, None) => nats::subscribe(server, PATTERN, None, sync, rec, stop).await,
        (Kind::Nats, Some(_)) => nats::subscribe(server, PATTERN, Some(nats::QUEUE_GROUP), sync, rec, stop).await,
        (Kind::Redis, None) => redis_pubsub::subscribe(server, PATTERN, rec, stop).await,
        (Kind::Redis, Some(_)) => bail!("Redis pub/sub has no consumer groups"),
    }
}

/// Opens the subscribers of one shared connection (the `c`th).
async fn open_shared(
    variant: Variant,
    server: &Server,
    c: usize,
    share: Vec<Recorder>,
    stop: CancellationToken,
) -> Result<Vec<JoinHandle<Tally>>> {
    match variant.kind {
        Kind::Tinybroker if variant.session => {
            tb::subscribe_session_shared(server, PATTERN, share, stop, variant.batch).await
        }
        Kind::Tinybroker => tb::subscribe_shared(server, PATTERN, share, stop).await,
        Kind::Nats => nats::subscribe_shared(server, PATTERN, share, stop).await,
        Kind::Redis => bail!("the shared-connection workloads have no Redis variant"),
    }
    .with_context(|| format!("opening the subscribers of connection {c}"))
}

/// The processes of one messaging run and where its clients connect:
/// one server, or a cluster (tinybroker replicas over a NATS cluster, or
/// the NATS cluster itself). Fields drop in order: the replicas before the
/// NATS servers under them.
struct Topology {
    /// NATS cluster peer: what its subscribers sync through.
    responders: Option<nats::Responders>,
    /// The servers clients connect to: the one server, or the replicas;
    /// empty for the NATS cluster peer, whose clients use `nats`.
    front: Vec<Server>,
    nats: Option<NatsCluster>,
}

impl Topology {
    async fn single(kind: Kind, settings: &Settings, env: &TinybrokerEnv) -> Result<Topology> {
        Ok(Topology {
            responders: None,
            front: vec![Server::start(kind, &settings.bins, env).await?],
            nats: None,
        })
    }

    async fn cluster(kind: Kind, nodes: usize, settings: &Settings, env: &TinybrokerEnv) -> Result<Topology> {
        let bin = settings
            .bins
            .nats_cluster
            .as_deref()
            .context("the cluster workloads need a nats-server 2.10 (--nats-cluster-bin)")?;
        let nats = NatsCluster::start(bin, &settings.bins.log_dir, nodes).await?;
        match kind {
            Kind::Tinybroker => Ok(Topology {
                responders: None,
                front: cluster::start_replicas(&settings.bins, env, &nats, nodes).await?,
                nats: Some(nats),
            }),
            Kind::Nats => Ok(Topology {
                responders: Some(nats::Responders::start(&nats.servers).await?),
                front: Vec::new(),
                nats: Some(nats),
            }),
            Kind::Redis => bail!("the cluster workloads have no Redis variant"),
        }
    }

    /// The servers clients connect to.
    fn entry(&self) -> &[Server] {
        match (&self.nats, self.front.is_empty()) {
            (Some(nats), true) => &nats.servers,
            _ => &self.front,
        }
    }

    /// Where the publisher connects: the first server (or replica).
    fn publisher(&self) -> &Server {
        &self.entry()[0]
    }

    /// Where subscriber `i` connects (server i % servers), and for the NATS
    /// cluster peer the responder subjects of the other servers, which it
    /// makes a round trip through before the run.
    fn subscriber(&self, i: usize) -> (&Server, Vec<String>) {
        let entry = self.entry();
        let k = i % entry.len();
        let sync = self
            .responders
            .as_ref()
            .map(|r| {
                (0..entry.len())
                    .filter(|&m| m != k)
                    .map(|m| r.subject(m).to_owned())
                    .collect()
            })
            .unwrap_or_default();
        (&entry[k], sync)
    }

    /// Every process of the system under test, named for the notes (`r0`…
    /// for replicas, `n0`… for NATS servers of a cluster).
    fn processes(&self) -> Vec<(String, &Server)> {
        let cluster = self.nats.is_some();
        let mut all: Vec<(String, &Server)> = self
            .front
            .iter()
            .enumerate()
            .map(|(i, s)| (if cluster { format!("r{i}") } else { s.kind.to_string() }, s))
            .collect();
        if let Some(nats) = &self.nats {
            all.extend(nats.servers.iter().enumerate().map(|(i, s)| (format!("n{i}"), s)));
        }
        all
    }

    fn stats(&self) -> Result<Vec<ProcStats>> {
        self.processes().iter().map(|(_, s)| s.stats()).collect()
    }

    /// Cluster runs where a subscriber fell short: how far each one got and
    /// on which server, and what each replica's `/metrics` says (saved beside
    /// its log), for the diagnosis.
    async fn shortfall(&self, domains: &[Arc<Domain>]) -> String {
        let names: Vec<String> = self.processes().into_iter().map(|(n, _)| n).collect();
        let progress: Vec<String> = domains
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let k = i % self.entry().len();
                format!(
                    "subscriber {i} on {}: {} of {}",
                    names[k],
                    d.unique(),
                    d.unique() + d.lost()
                )
            })
            .collect();
        let mut text = format!("short: {}", progress.join(", "));
        for (name, server) in self.processes() {
            let (Kind::Tinybroker, Some(http)) = (server.kind, server.http) else {
                continue;
            };
            match http_get(http, "/metrics").await {
                Ok((_, metrics)) => {
                    let _ = std::fs::write(server.log().with_extension("metrics"), &metrics);
                    let sum = |m: &str| crate::systems::prom_sum(&metrics, m);
                    let _ = write!(
                        text,
                        "; {name}: published {}, delivered {}, queued {}, NATS connected {}, reconnects {}",
                        sum("tinybroker_messages_published_total"),
                        sum("tinybroker_messages_delivered_total"),
                        sum("tinybroker_queued_messages"),
                        sum("tinybroker_nats_connected"),
                        sum("tinybroker_nats_reconnects_total"),
                    );
                }
                Err(e) => {
                    let _ = write!(text, "; {name}: no /metrics ({e:#})");
                }
            }
        }
        text
    }

    /// Cluster runs: what the servers counted as lost on the way (NATS
    /// dropping messages to a slow connection, tinybroker evictions).
    async fn losses_counted(&self) -> Result<Option<String>> {
        if self.nats.is_none() {
            return Ok(None);
        }
        let mut parts = Vec::new();
        for (name, server) in self.processes() {
            match server.kind {
                Kind::Tinybroker => {
                    let http = server.http.context("a replica without a metrics address")?;
                    let (_, text) = http_get(http, "/metrics").await?;
                    let slow = prom_with_label(
                        &text,
                        "tinybroker_messages_dropped_total",
                        "reason=\"nats_slow_consumer\"",
                    );
                    let evicted = crate::systems::prom_sum(&text, "tinybroker_evictions_total");
                    if slow > 0.0 || evicted > 0.0 {
                        parts.push(format!(
                            "{name}: {slow} dropped by NATS as a slow consumer, {evicted} evictions"
                        ));
                    }
                }
                _ => {
                    let slow = nats::varz_number(server, "slow_consumers").await?;
                    if slow > 0 {
                        parts.push(format!("{name}: {slow} slow consumers"));
                    }
                }
            }
        }
        Ok((!parts.is_empty()).then(|| parts.join("; ")))
    }
}

async fn run_messaging(spec: Spec, variant: Variant, settings: &Settings) -> Result<RunResult> {
    let kind = variant.kind;
    // `per_conn`: subscribers sharing one connection (1: each its own).
    let (live, per_conn, size, messages, rate, group, stalled) = match spec {
        Spec::FanOut { subs, size, messages } => (subs, 1, size, messages, None, false, false),
        Spec::Latency {
            subs,
            size,
            rate,
            messages,
        } => (subs, 1, size, messages, Some(rate), false, false),
        Spec::Group {
            members,
            size,
            rate,
            messages,
        } => (members, 1, size, messages, rate, true, false),
        Spec::Stalled {
            live,
            size,
            messages,
            stalled,
        } => (live, 1, size, messages, None, false, stalled),
        Spec::Wide {
            subs,
            per_conn,
            size,
            rate,
            messages,
        } => (subs, per_conn.max(1), size, messages, rate, false, false),
        Spec::Cluster {
            subs,
            size,
            rate,
            messages,
            group,
            ..
        } => (subs, 1, size, messages, rate, group, false),
        Spec::Idle { .. } => unreachable!("idle runs are not messaging runs"),
    };
    let env = tinybroker_env(settings, live + 1, true);
    let topology = match spec {
        Spec::Cluster { nodes, .. } => Topology::cluster(kind, nodes, settings, &env).await?,
        _ => Topology::single(kind, settings, &env).await?,
    };
    let server = topology.publisher();
    let signal = Arc::new(Signal::default());
    let stop = CancellationToken::new();
    // Cancel the receivers however this function ends.
    let _stop_guard = stop.clone().drop_guard();

    let domains: Vec<Arc<Domain>> = if group {
        vec![Domain::new(messages, live, signal.clone())]
    } else {
        (0..live).map(|_| Domain::new(messages, 1, signal.clone())).collect()
    };
    // A consumer group over a NATS cluster: for the NATS peer, JetStream's
    // stream and consumer, made before the members join.
    let cluster_group = group && topology.nats.is_some();
    // The NATS peer of a cluster group over JetStream (not a queue group).
    let js_peer = cluster_group && kind == Kind::Nats && !matches!(spec, Spec::Cluster { nats_queue: true, .. });
    if js_peer {
        nats::js_group_setup(server, TOPIC, topology.entry().len()).await?;
    }
    let mut receivers = Vec::with_capacity(live);
    if per_conn > 1 {
        // Broadcast subscribers sharing connections: the connections are
        // opened at once, the subscriptions on each one after the other.
        // (Futures built in a plain loop: made by a closure, they would
        // trip rustc's check that the whole run is `Send`.)
        let mut connections = Vec::new();
        for (c, share) in domains.chunks(per_conn).enumerate() {
            let share: Vec<Recorder> = share.iter().map(|d| Recorder::new(d.clone())).collect();
            connections.push(open_shared(variant, server, c, share, stop.clone()));
        }
        let opened = within(
            Duration::from_secs(120),
            "opening the subscribers",
            futures::future::try_join_all(connections),
        )
        .await??;
        receivers.extend(opened.into_iter().flatten());
    } else {
        for i in 0..live {
            let domain = if group { &domains[0] } else { &domains[i] };
            let member = group.then_some(i);
            let rec = Recorder::new(domain.clone());
            let (at, sync) = topology.subscriber(i);
            let opened = if js_peer {
                nats::js_member(at, rec, stop.clone()).await
            } else {
                subscribe(variant, at, member, &sync, rec, stop.clone()).await
            };
            receivers.push(opened.with_context(|| format!("opening subscriber {i}"))?);
        }
    }
    let _stalled = if stalled {
        Some(match kind {
            Kind::Tinybroker => tb::stalled(server, PATTERN).await?,
            Kind::Nats => nats::stalled(server, PATTERN).await?,
            Kind::Redis => bail!("the stalled workload has no Redis variant"),
        })
    } else {
        None
    };
    let mut publisher = if js_peer {
        Publisher::NatsJs(nats::JsPublisher::new(server, TOPIC).await?)
    } else {
        Publisher::new(variant, server).await?
    };
    let mut flow = Flow::new(domains.clone(), settings.window, signal.clone());
    let mut remarks = Vec::new();

    if let Some(probe) = &settings.probe {
        probe.start(server.pid()).context("starting the probe")?;
    }
    let before = topology.stats()?;
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
    let after = topology.stats()?;
    if let Some(probe) = &settings.probe {
        probe.stop(server.pid()).context("stopping the probe")?;
    }
    if topology.nats.is_some() && domains.iter().any(|d| !d.complete()) {
        remarks.push(topology.shortfall(&domains).await);
    }
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
        Some(stalled_flagged(server).await?)
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

    // A cluster group: what tinybroker's hubs redelivered (a duplicate is
    // allowed only as a redelivery).
    if cluster_group && kind == Kind::Tinybroker {
        let mut redelivered = 0.0;
        for replica in &topology.front {
            if let Some(http) = replica.http {
                let (_, text) = http_get(http, "/metrics").await?;
                redelivered += crate::systems::prom_sum(&text, "tinybroker_redeliveries_total");
            }
        }
        remarks.push(format!(
            "{dup} duplicates, {redelivered} redeliveries counted by the replicas"
        ));
    }
    // Cluster runs: what the servers say they dropped on the way.
    let counted = topology.losses_counted().await?;
    if let Some(c) = &counted {
        remarks.push(format!("counted by the servers: {c}"));
    }
    let processes = topology.processes();
    if topology.nats.is_some() {
        let names: Vec<&str> = processes.iter().map(|(n, _)| n.as_str()).collect();
        remarks.push(format!(
            "CPU and peak RSS are the sums over {} ({})",
            names.join(", "),
            if kind == Kind::Tinybroker {
                "the replicas and the NATS servers under them"
            } else {
                "the NATS servers"
            }
        ));
    }
    // Per process only when the run used enough CPU for 10 ms ticks to say
    // something per process (a second in all).
    let cpu_total: f64 = before.iter().zip(&after).map(|(b, a)| a.cpu_seconds_since(b)).sum();
    let cpu_parts = if topology.nats.is_some() && sent > 0 && cpu_total >= 1.0 {
        processes
            .iter()
            .zip(before.iter().zip(&after))
            .map(|((name, _), (b, a))| (name.clone(), a.cpu_seconds_since(b) / sent as f64 * 1e6))
            .collect()
    } else {
        Vec::new()
    };
    let (before, after) = match (ProcStats::sum(&before), ProcStats::sum(&after)) {
        (Some(b), Some(a)) => (b, a),
        _ => bail!("no server process to read"),
    };

    // What the contract (docs/contract.md, Delivery) says must arrive.
    let violation = if kind != Kind::Tinybroker {
        None
    } else if lost > 0 {
        Some(match &counted {
            Some(c) => format!("{lost} messages lost ({c})"),
            None => format!("{lost} messages lost"),
        })
    } else if group && !variant.manual_ack && dup > 0 {
        Some(format!("{dup} duplicates in AUTO ack (exactly once expected)"))
    } else if !group && dup > 0 {
        Some(format!("{dup} duplicates in broadcast"))
    } else {
        None
    };

    let server_cpu_s = after.cpu_seconds_since(&before);
    Ok(RunResult {
        published: sent,
        published_per_s: Some(sent as f64 / published_in.as_secs_f64()),
        delivered_per_s,
        per_subscriber_per_s: (!group).then(|| delivered_per_s.map(|d| d / live as f64)).flatten(),
        latency: Percentiles::of(&hist),
        lost,
        dup,
        violation,
        peak_rss_kib: after.peak_rss_kib,
        cpu_percent: after.cpu_percent_since(&before),
        // Under MIN_CPU_S the clock ticks are too coarse to say anything.
        cpu_s_per_m: (unique > 0 && server_cpu_s >= MIN_CPU_S).then(|| server_cpu_s / (unique as f64 / 1e6)),
        kernel_share: (server_cpu_s >= MIN_CPU_S)
            .then(|| after.kernel_share_since(&before))
            .flatten(),
        rss_per_sub_bytes: None,
        split,
        stalled_flagged,
        remarks,
        cpu_parts,
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

/// Idle subscriptions: RSS growth per subscription. See [`Spec::Idle`].
async fn run_idle(
    variant: Variant,
    subs: usize,
    per_conn: usize,
    beyond_connections: bool,
    settings: &Settings,
) -> Result<RunResult> {
    let kind = variant.kind;
    // The run beyond the connections keeps the server's default (per-subscription
    // metrics on): what a subscription costs a user as shipped.
    let env = tinybroker_env(settings, subs, beyond_connections);
    let server = Server::start(kind, &settings.bins, &env).await?;
    let conns = subs.div_ceil(per_conn.max(1));
    // tinybroker's subscriptions are counted through the Admin API there
    // (its `/metrics` has a series per subscription).
    let admin = match (beyond_connections, kind) {
        (true, Kind::Tinybroker) => Some(tb::Admin::connect(&server).await?),
        _ => None,
    };
    let admin = admin.as_ref();
    let base = gauge(&server, Gauge::Subscriptions, admin).await?;
    let mut before = server.stats()?;
    let opened = within(Duration::from_secs(120), "opening the idle subscriptions", async {
        if !beyond_connections {
            return match kind {
                Kind::Tinybroker if variant.session => tb::idle_sessions(&server, subs, per_conn).await,
                Kind::Tinybroker => tb::idle(&server, subs, per_conn).await,
                Kind::Nats => nats::idle(&server, subs, per_conn).await,
                Kind::Redis => bail!("the idle workload has no Redis variant"),
            };
        }
        let base_conns = gauge(&server, Gauge::Connections, admin).await?;
        enum Conns {
            Tb(Vec<tinybroker::pb::broker_client::BrokerClient<tonic::transport::Channel>>),
            Nats(Vec<async_nats::Client>),
        }
        let clients = match kind {
            Kind::Tinybroker => Conns::Tb(tb::idle_connections(&server, conns).await?),
            Kind::Nats => Conns::Nats(nats::idle_connections(&server, conns).await?),
            Kind::Redis => bail!("the idle workload has no Redis variant"),
        };
        wait_for(&server, Gauge::Connections, base_conns + conns as u64, admin).await?;
        tokio::time::sleep(SETTLE).await;
        before = server.stats()?;
        match clients {
            Conns::Tb(c) if variant.session => tb::idle_on_sessions(c, subs, per_conn).await,
            Conns::Tb(c) => tb::idle_on(c, subs, per_conn).await,
            Conns::Nats(c) => nats::idle_on(c, subs, per_conn).await,
        }
    })
    .await??;
    // The server really holds them all before RSS is read.
    wait_for(&server, Gauge::Subscriptions, base + subs as u64, admin).await?;
    if beyond_connections {
        tokio::time::sleep(SETTLE).await;
    }
    let after = server.stats()?;
    drop(opened);
    let grown = after.rss_kib as f64 - before.rss_kib as f64;
    Ok(RunResult {
        peak_rss_kib: after.peak_rss_kib,
        cpu_percent: after.cpu_percent_since(&before),
        rss_per_sub_bytes: Some(grown * 1024.0 / subs as f64),
        ..Default::default()
    })
}

/// How long a server is left alone before an RSS reading of the run beyond
/// the connections (its last replies may still be on their way out).
const SETTLE: Duration = Duration::from_millis(300);

/// What a server counts of its clients.
#[derive(Debug, Clone, Copy)]
enum Gauge {
    Subscriptions,
    Connections,
}

/// The server's own count (tinybroker's `/metrics`, or its Admin API when
/// given; NATS's `/varz`).
async fn gauge(server: &Server, gauge: Gauge, admin: Option<&tb::Admin>) -> Result<u64> {
    match (server.kind, gauge) {
        (Kind::Tinybroker, Gauge::Subscriptions) => match admin {
            Some(admin) => admin.subscriptions().await,
            None => tb::subscriptions(server).await,
        },
        (Kind::Tinybroker, Gauge::Connections) => tb::connections(server).await,
        (_, Gauge::Subscriptions) => nats::varz_number(server, "subscriptions").await,
        (_, Gauge::Connections) => nats::varz_number(server, "connections").await,
    }
}

/// Polls the server until it counts at least `want`, for 30 s at most.
async fn wait_for(server: &Server, what: Gauge, want: u64, admin: Option<&tb::Admin>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = gauge(server, what, admin).await?;
        if n >= want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{} reports {n} {what:?} after 30 s, {want} expected", server.kind);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_and_idle_cases_follow_the_scale() {
        let scale = Scale {
            messages: 3000,
            idle_subs: 1000,
            wide_subs: 100,
            wide_rate: 200,
            wide_seconds: 2,
            wide_messages: 500,
            cluster_rate: 5000,
            cluster_seconds: 1,
        };
        let cases = cases(&scale, false);
        let find = |id: &str| cases.iter().find(|c| c.id == id).map(|c| c.spec);
        assert!(matches!(
            find("wide-paced"),
            Some(Spec::Wide {
                subs: 100,
                per_conn: WIDE_PER_CONN,
                size: 256,
                rate: Some(200),
                messages: 400
            })
        ));
        assert!(matches!(
            find("wide-max"),
            Some(Spec::Wide {
                rate: None,
                messages: 500,
                ..
            })
        ));
        assert!(matches!(
            find("idle-100"),
            Some(Spec::Idle {
                subs: 1000,
                per_conn: 100,
                beyond_connections: true
            })
        ));
        // `--only wide` picks both wide runs and nothing else.
        let wide: Vec<&str> = cases
            .iter()
            .filter(|c| c.id.contains("wide") || c.label.contains("wide"))
            .map(|c| c.id.as_str())
            .collect();
        assert_eq!(wide, ["wide-paced", "wide-max"]);
        // `--only cluster` picks the five cluster runs and nothing else.
        let clustered: Vec<&Case> = cases
            .iter()
            .filter(|c| c.id.contains("cluster") || c.label.contains("cluster"))
            .collect();
        let ids: Vec<&str> = clustered.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "cluster-fanout-3",
                "cluster-fanout-30",
                "cluster-latency",
                "cluster-group",
                "cluster-group-auto"
            ]
        );
        assert!(
            clustered
                .iter()
                .all(|c| matches!(c.spec, Spec::Cluster { nodes: 3, .. }))
        );
        assert!(matches!(
            clustered[1].spec,
            Spec::Cluster {
                subs: 30,
                rate: None,
                messages: 300,
                ..
            }
        ));
        assert!(matches!(
            clustered[2].spec,
            Spec::Cluster {
                subs: 3,
                rate: Some(5000),
                messages: 5000,
                group: false,
                ..
            }
        ));
        assert!(matches!(
            clustered[3].spec,
            Spec::Cluster {
                subs: 3,
                rate: None,
                messages: 300,
                group: true,
                ..
            }
        ));
        assert!(
            clustered[3]
                .variants
                .iter()
                .any(|v| v.kind == Kind::Tinybroker && v.manual_ack)
        );
        // The AUTO group against a NATS queue group: same size, no MANUAL.
        assert!(matches!(
            clustered[4].spec,
            Spec::Cluster {
                subs: 3,
                rate: None,
                messages: 300,
                group: true,
                nats_queue: true,
                ..
            }
        ));
        assert!(
            clustered[4]
                .variants
                .iter()
                .all(|v| !v.manual_ack && !v.session && !v.batch)
        );
        assert_eq!(clustered[4].variants.len(), 2);
        // `--only cluster-group` picks both groups.
        let groups: Vec<&str> = ids.iter().copied().filter(|id| id.contains("cluster-group")).collect();
        assert_eq!(groups, ["cluster-group", "cluster-group-auto"]);
    }
}
