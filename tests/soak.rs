//! Soak and fault test against the real broker binary (ignored by default):
//!
//!     cargo test --test soak -- --ignored --nocapture
//!
//! Publishers run continuously (one PublishStream on topics 0 and 1, unary
//! Publish on topics 2 and 3, each message carrying its per-topic number)
//! while `SOAK_SUBSCRIBERS` broadcast subscribers, spread over
//! `SOAK_CONNECTIONS` connections, join and leave at random. Some stall (stop
//! reading, on their own narrow-window connections) and must be evicted;
//! `tinybroker subscribe` processes are SIGKILLed mid-stream, broadcast ones
//! and manual-ack members of two consumer groups (frozen with SIGSTOP first so
//! that they die holding unacked messages, which must go to other members).
//!
//! It runs two rounds on one broker: a warm-up round of `SOAK_WARM_UP_SECONDS`
//! and the main round of `SOAK_SECONDS`. At the end of each: every surviving
//! subscriber got every message published after its subscription was
//! acknowledged, in order, without gaps or duplicates; every group message was
//! acked (redelivery duplicates allowed); only stalled subscribers were
//! evicted; Admin and `/metrics` agree with the survivors and reach zero once
//! they close. After the main round the broker's RSS must be back within
//! `SOAK_RSS_MARGIN_PCT` (default 10 %) plus 2 MiB of its value after the
//! warm-up round (which has already grown the allocator's pools to the
//! workload's size, so what remains is a leak). The figures are printed.
//!
//! Sizing: `SOAK_SECONDS` (60), `SOAK_WARM_UP_SECONDS` (25), `SOAK_ROUNDS`
//! (main rounds, 1),
//! `SOAK_SUBSCRIBERS` (1000), `SOAK_CONNECTIONS`
//! (25), `SOAK_RATE` (messages per second per topic, 10), `SOAK_CAPACITY`
//! (the broker's consumer capacity, 256), `SOAK_STALLS` (20), `SOAK_KILLS`
//! (CLI processes killed per kind, 3), `SOAK_BROKER_ENV` (extra broker
//! environment, `K=V,K=V`, e.g. `MALLOC_ARENA_MAX=2`).

mod common;

use common::process::{BrokerProcess, ChildGuard, metric_sum, spawn_cli_subscriber};
use common::{listed, publish_request, subscribe_request};
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

const TOPICS: usize = 4;
const PAD: usize = 160;
/// Manual-ack consumer groups: (name, pattern, topics it gets).
const GROUPS: [(&str, &str, &[usize]); 2] = [("soak-a", "soak.0", &[0]), ("soak-b", "soak.>", &[0, 1, 2, 3])];

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Settings {
    seconds: u64,
    warm_up_seconds: u64,
    rounds: u64,
    subscribers: usize,
    connections: usize,
    rate: u64,
    capacity: usize,
    stalls: usize,
    kills: usize,
    rss_margin_pct: u64,
    broker_env: Vec<(String, String)>,
}

impl Settings {
    fn from_env() -> Self {
        let broker_env = std::env::var("SOAK_BROKER_ENV")
            .unwrap_or_default()
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        Self {
            seconds: env_or("SOAK_SECONDS", 60),
            warm_up_seconds: env_or("SOAK_WARM_UP_SECONDS", 25),
            rounds: env_or("SOAK_ROUNDS", 1u64).max(1),
            subscribers: env_or("SOAK_SUBSCRIBERS", 1000),
            connections: env_or("SOAK_CONNECTIONS", 25usize).max(1),
            rate: env_or("SOAK_RATE", 10u64).max(1),
            capacity: env_or("SOAK_CAPACITY", 256),
            stalls: env_or("SOAK_STALLS", 20),
            kills: env_or("SOAK_KILLS", 3),
            rss_margin_pct: env_or("SOAK_RSS_MARGIN_PCT", 10),
            broker_env,
        }
    }
}

/// A small deterministic generator (no extra dependency, reproducible runs).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from + 1))
    }
}

/// State shared by every task of the run.
#[derive(Default)]
struct Shared {
    /// Publishes started, per topic: message n of topic t is the (n+1)th.
    started: [AtomicU64; TOPICS],
    opened: AtomicU64,
    delivered: AtomicU64,
    left: AtomicU64,
    kills: AtomicU64,
    errors: Mutex<Vec<String>>,
}

impl Shared {
    fn error(&self, e: String) {
        let mut errors = self.errors.lock();
        if errors.len() < 50 {
            errors.push(e);
        }
    }

    fn marks(&self) -> [u64; TOPICS] {
        std::array::from_fn(|t| self.started[t].load(Ordering::SeqCst))
    }
}

fn payload(t: usize, n: u64) -> String {
    format!("{t}:{n}:{}", "x".repeat(PAD))
}

/// (topic index, number) from a message, checking that topic and payload agree.
fn parse(topic: &str, payload: &[u8]) -> Result<(usize, u64), String> {
    let text = std::str::from_utf8(payload).map_err(|e| format!("payload not UTF-8: {e}"))?;
    let mut parts = text.splitn(3, ':');
    let t: usize = parts.next().and_then(|p| p.parse().ok()).ok_or("no topic index")?;
    let n: u64 = parts.next().and_then(|p| p.parse().ok()).ok_or("no number")?;
    if topic != format!("soak.{t}") {
        return Err(format!("payload of topic {t} arrived on {topic}"));
    }
    Ok((t, n))
}

/// Per-topic order check for one broadcast subscriber.
struct Order {
    /// Publishes started when the subscription was acknowledged.
    marks: [u64; TOPICS],
    /// Next number expected, per topic (None before the first message).
    next: [Option<u64>; TOPICS],
    /// Per topic: concurrent publishers (topics 0-1 and 2-3) are not
    /// ordered against each other, so neither are their sequences.
    last_sequence: [u64; TOPICS],
    received: u64,
}

impl Order {
    fn new(marks: [u64; TOPICS]) -> Self {
        Self {
            marks,
            next: [None; TOPICS],
            last_sequence: [0; TOPICS],
            received: 0,
        }
    }

    fn take(&mut self, t: usize, n: u64, sequence: u64) -> Result<(), String> {
        if sequence <= self.last_sequence[t] {
            return Err(format!(
                "topic {t}: sequence {sequence} after {}",
                self.last_sequence[t]
            ));
        }
        self.last_sequence[t] = sequence;
        match self.next[t] {
            None if n > self.marks[t] => {
                return Err(format!(
                    "first message of topic {t} is #{n}, but #{} was published after the subscription was acknowledged",
                    self.marks[t]
                ));
            }
            Some(expected) if n != expected => {
                return Err(format!(
                    "topic {t}: got #{n}, expected #{expected} (gap, duplicate or reorder)"
                ));
            }
            _ => {}
        }
        self.next[t] = Some(n + 1);
        self.received += 1;
        Ok(())
    }

    /// Has every message of `topics` up to `finals`.
    fn complete(&self, topics: &[usize], finals: &[u64; TOPICS]) -> bool {
        topics
            .iter()
            .all(|&t| self.next[t].map_or(self.marks[t] >= finals[t], |next| next >= finals[t]))
    }
}

/// The id the broker gave a subscription, from its response's metadata.
fn subscription_id<T>(response: &tonic::Response<T>) -> Option<String> {
    Some(
        response
            .metadata()
            .get("tinybroker-subscription-id")?
            .to_str()
            .ok()?
            .to_owned(),
    )
}

struct Plan {
    channel: Channel,
    pattern: String,
    topics: Vec<usize>,
    lifetime: Duration,
    stall_after: Option<Duration>,
}

enum Outcome {
    Left,
    Survivor(tonic::Streaming<pb::Message>, String),
    Stalled(tonic::Streaming<pb::Message>, String),
    Failed,
}

struct Ctl {
    shared: Arc<Shared>,
    /// Churn stops: subscribers stop leaving and read to the end.
    stop: CancellationToken,
    /// Final per-topic counts, once publishing has stopped.
    finals: tokio::sync::watch::Receiver<Option<[u64; TOPICS]>>,
    /// Everything is checked: stalled subscribers hand back their streams.
    end: CancellationToken,
}

async fn subscriber(ctl: Arc<Ctl>, plan: Plan) -> Outcome {
    let shared = &ctl.shared;
    let mut client = BrokerClient::new(plan.channel);
    let request = subscribe_request(&[plan.pattern.as_str()]);
    let response = match tokio::time::timeout(Duration::from_secs(30), client.open_subscription(request)).await {
        Ok(Ok(r)) => r,
        other => {
            shared.error(format!("subscribe {}: {other:?}", plan.pattern));
            return Outcome::Failed;
        }
    };
    let marks = shared.marks();
    let id = subscription_id(&response).unwrap_or_default();
    shared.opened.fetch_add(1, Ordering::Relaxed);
    let mut stream = response.into_inner();
    let mut order = Order::new(marks);
    let started = tokio::time::Instant::now();
    let leave_at = started + plan.lifetime;
    let stall_at = plan.stall_after.map(|d| started + d);
    let mut finals = ctl.finals.clone();
    let mut draining = false;
    loop {
        if draining
            && let Some(f) = *finals.borrow()
            && order.complete(&plan.topics, &f)
        {
            shared.delivered.fetch_add(order.received, Ordering::Relaxed);
            return Outcome::Survivor(stream, id);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(leave_at), if !draining && !ctl.stop.is_cancelled() => {
                shared.delivered.fetch_add(order.received, Ordering::Relaxed);
                shared.left.fetch_add(1, Ordering::Relaxed);
                return Outcome::Left;
            }
            _ = tokio::time::sleep_until(stall_at.unwrap_or(leave_at)), if stall_at.is_some() => {
                // Stop reading (the stream is handed back unread); the
                // broker must evict this subscription.
                shared.delivered.fetch_add(order.received, Ordering::Relaxed);
                return Outcome::Stalled(stream, id);
            }
            _ = ctl.stop.cancelled(), if !draining && stall_at.is_none() => draining = true,
            _ = finals.changed(), if draining => {}
            m = stream.message() => match m {
                Ok(Some(m)) => {
                    let checked = parse(&m.topic, &m.payload).and_then(|(t, n)| order.take(t, n, m.sequence));
                    if let Err(e) = checked {
                        shared.error(format!("subscriber {id} ({}): {e}", plan.pattern));
                        return Outcome::Failed;
                    }
                }
                Ok(None) => {
                    shared.error(format!(
                        "live subscriber {id} ({}) was evicted after {} messages although it kept reading",
                        plan.pattern, order.received
                    ));
                    return Outcome::Failed;
                }
                Err(status) => {
                    shared.error(format!("subscriber {id}: {status:?}"));
                    return Outcome::Failed;
                }
            }
        }
    }
}

/// An open subscription: its stream and its id.
type Open = (tonic::Streaming<pb::Message>, String);

/// What group members (in-test and CLI) received: (topic, n) -> attempts seen.
type GroupLog = Arc<Mutex<BTreeMap<(usize, u64), Vec<u32>>>>;

/// An in-test manual-ack member: acks every message; hands its stream back
/// at the end so that Admin can be checked with it still open.
async fn member(
    ctl: Arc<Ctl>,
    channel: Channel,
    group: &'static str,
    pattern: &'static str,
    log: GroupLog,
) -> Option<Open> {
    let mut client = BrokerClient::new(channel);
    let request = common::member_request(&[pattern], group, true, 0);
    let response = tokio::time::timeout(Duration::from_secs(30), client.open_subscription(request))
        .await
        .ok()?
        .ok()?;
    let id = subscription_id(&response)?;
    let mut stream = response.into_inner();
    loop {
        let m = tokio::select! {
            _ = ctl.end.cancelled() => return Some((stream, id)),
            m = stream.message() => m,
        };
        let m = match m {
            Ok(Some(m)) => m,
            other => {
                ctl.shared
                    .error(format!("group member {id} of {group}: stream ended: {other:?}"));
                return None;
            }
        };
        match parse(&m.topic, &m.payload) {
            Ok(key) => log.lock().entry(key).or_default().push(m.delivery_attempt),
            Err(e) => ctl.shared.error(format!("group {group}: {e}")),
        }
        let ack = pb::AckRequest {
            subscription_id: id.clone(),
            sequences: vec![m.sequence],
        };
        match tokio::time::timeout(Duration::from_secs(10), client.ack(ack)).await {
            Ok(Ok(r)) if r.get_ref().acked == 1 => {}
            other => ctl.shared.error(format!("ack of {} by {id}: {other:?}", m.sequence)),
        }
    }
}

async fn admin_subscriptions(mut admin: AdminClient<Channel>) -> Vec<pb::SubscriptionInfo> {
    tokio::time::timeout(
        Duration::from_secs(20),
        admin.list_subscriptions(pb::ListSubscriptionsRequest {}),
    )
    .await
    .expect("ListSubscriptions in time")
    .expect("ListSubscriptions")
    .into_inner()
    .subscriptions
}

/// Every consumer group as Admin lists them; none when the call fails (for
/// a poll, which asks again).
async fn groups_or_empty(mut admin: AdminClient<Channel>) -> Vec<pb::ConsumerGroupInfo> {
    admin
        .list_consumer_groups(pb::ListConsumerGroupsRequest {})
        .await
        .map(|r| r.into_inner().groups)
        .unwrap_or_default()
}

/// Waits until `id` is listed by Admin (or, with `present` false, no longer
/// is) and `also` holds for it; false after `limit`.
async fn wait_listed(
    admin: &AdminClient<Channel>,
    id: &str,
    present: bool,
    limit: Duration,
    also: impl Fn(&pb::SubscriptionInfo) -> bool,
) -> bool {
    poll_until(limit, || {
        let (admin, also) = (admin.clone(), &also);
        async move {
            match listed(admin_subscriptions(admin).await, id) {
                Some(info) => present && also(&info),
                None => !present,
            }
        }
    })
    .await
}

/// Polls `check` every 50 ms until it holds; false after `limit`.
async fn poll_until<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads what a killed CLI printed (`--json`): (topic, n, attempt,
/// sequence) per line, up to the end of its output.
async fn cli_lines(child: &mut ChildGuard) -> Vec<(usize, u64, u32, u64)> {
    let Some(rx) = child.stdout.take() else {
        return Vec::new();
    };
    let lines = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::task::spawn_blocking(move || rx.iter().collect::<Vec<String>>()),
    )
    .await
    .expect("the killed CLI's output ends")
    .expect("reader");
    lines
        .into_iter()
        .filter_map(|line| {
            let v: serde_json::Value = serde_json::from_str(&line).ok()?;
            let (t, n) = parse(v["topic"].as_str()?, v["payload"].as_str()?.as_bytes()).ok()?;
            Some((t, n, v["delivery_attempt"].as_u64()? as u32, v["sequence"].as_u64()?))
        })
        .collect()
}

/// Adds what a killed CLI member printed to its group's log.
async fn log_cli_deliveries(child: &mut ChildGuard, log: &GroupLog) {
    for (t, n, attempt, _) in cli_lines(child).await {
        log.lock().entry((t, n)).or_default().push(attempt);
    }
}

/// Broadcast CLI subscribers on `soak.*`, each SIGKILLed mid-stream; what
/// they printed must be in order without gaps, and they must be reaped.
async fn kill_broadcast_clis(ctl: Arc<Ctl>, url: String, admin_channel: Channel, kills: usize, seed: u64) {
    let mut rng = Rng(seed);
    let admin = AdminClient::new(admin_channel);
    for k in 0..kills {
        tokio::time::sleep(rng.millis(1000, 4000)).await;
        if ctl.stop.is_cancelled() {
            return;
        }
        let id = format!("cli-b-{k}");
        let mut child = spawn_cli_subscriber(&url, &["soak.*", "--json", "--id", &id]);
        if !wait_listed(&admin, &id, true, Duration::from_secs(20), |_| true).await {
            ctl.shared.error(format!("{id} never subscribed"));
            return;
        }
        let marks = ctl.shared.marks();
        tokio::time::sleep(rng.millis(1000, 4000)).await;
        child.kill();
        ctl.shared.kills.fetch_add(1, Ordering::Relaxed);
        let mut order = Order::new(marks);
        // Subscribed before `marks` was read: nothing published since was missed.
        for (t, n, _, seq) in cli_lines(&mut child).await {
            if let Err(e) = order.take(t, n, seq) {
                ctl.shared.error(format!("{id}: {e}"));
                break;
            }
        }
        if order.received == 0 {
            ctl.shared.error(format!("{id} printed nothing before it was killed"));
        }
        if !wait_listed(&admin, &id, false, Duration::from_secs(30), |_| true).await {
            ctl.shared.error(format!("killed {id} was not reaped within 30 s"));
        }
    }
}

/// Manual-ack CLI members of `group`: each is frozen (SIGSTOP) until the
/// broker has streamed it 3 more messages it therefore cannot ack, then
/// SIGKILLed; those must be redelivered to the other members.
async fn kill_group_clis(
    ctl: Arc<Ctl>,
    url: String,
    admin_channel: Channel,
    (group, pattern): (&'static str, &'static str),
    kills: usize,
    log: GroupLog,
    seed: u64,
) -> u64 {
    let mut rng = Rng(seed);
    let admin = AdminClient::new(admin_channel);
    let mut stranded = 0;
    for k in 0..kills {
        tokio::time::sleep(rng.millis(500, 3000)).await;
        if ctl.stop.is_cancelled() {
            break;
        }
        let id = format!("cli-{group}-{k}");
        let mut child = spawn_cli_subscriber(
            &url,
            &[pattern, "--group", group, "--manual-ack", "--json", "--id", &id],
        );
        if !wait_listed(&admin, &id, true, Duration::from_secs(20), |_| true).await {
            ctl.shared.error(format!("{id} never joined"));
            break;
        }
        tokio::time::sleep(rng.millis(500, 3000)).await;
        if ctl.stop.is_cancelled() {
            // Publishing is over: nothing more would reach it while frozen.
            child.kill();
            log_cli_deliveries(&mut child, &log).await;
            break;
        }
        child.signal("STOP");
        let before = listed(admin_subscriptions(admin.clone()).await, &id).map_or(0, |s| s.delivered);
        let streamed = wait_listed(&admin, &id, true, Duration::from_secs(20), |s| {
            s.delivered >= before + 3
        })
        .await;
        // Publishing may end while it waits (a short round, a slow machine):
        // then nothing more could reach it, which is no fault.
        if !streamed && !ctl.stop.is_cancelled() {
            ctl.shared.error(format!("{id}: nothing streamed to it while frozen"));
        }
        stranded += 3;
        child.kill();
        ctl.shared.kills.fetch_add(1, Ordering::Relaxed);
        log_cli_deliveries(&mut child, &log).await;
        if !wait_listed(&admin, &id, false, Duration::from_secs(30), |_| true).await {
            ctl.shared
                .error(format!("killed member {id} was not reaped within 30 s"));
        }
    }
    stranded
}

async fn metrics(addr: std::net::SocketAddr) -> String {
    tokio::time::timeout(Duration::from_secs(20), common::scrape(addr))
        .await
        .expect("/metrics in time")
}

async fn connect(url: &str, narrow: bool) -> Channel {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .expect("url")
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10));
    if narrow {
        // A subscriber that stops reading stops the broker's writes after
        // 64 KiB, so its queue fills and it is evicted.
        endpoint = endpoint
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535);
    }
    tokio::time::timeout(Duration::from_secs(20), endpoint.connect())
        .await
        .expect("connect in time")
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak test: minutes long; run with --ignored (sized by SOAK_* variables)"]
async fn soak() {
    let settings = Settings::from_env();
    let limit = Duration::from_secs((settings.seconds + 200) * settings.rounds + settings.warm_up_seconds + 200);
    tokio::time::timeout(limit, run(settings))
        .await
        .expect("the soak test timed out");
}

async fn run(s: Settings) {
    let run_started = Instant::now();
    let broker = start_broker(&s);
    let pid = broker.guard.pid();
    let rss_start = broker.rss_kib();
    let channels = open_channels(&broker.url(), s.connections).await;
    let mut stalled_so_far = HashSet::new();
    let warm_up = Duration::from_secs(s.warm_up_seconds);
    let warm = round(&s, &broker, &channels, warm_up, &mut stalled_so_far, 1).await;
    let rss_before = broker.rss_kib();
    println!("soak: broker pid {pid}: RSS {rss_start} KiB at start, {rss_before} KiB after a warm-up round: {warm}");
    // More main rounds (`SOAK_ROUNDS`) show whether what remains grows.
    let mut main = None;
    for r in 0..s.rounds {
        let figures = round(
            &s,
            &broker,
            &channels,
            Duration::from_secs(s.seconds),
            &mut stalled_so_far,
            2 + r,
        )
        .await;
        if r + 1 < s.rounds {
            println!(
                "soak: main round {}: {figures}; RSS after it {} KiB",
                r + 1,
                broker.rss_kib()
            );
        }
        main = Some(figures);
    }
    let main = main.expect("at least one main round");
    check_rss_returns(&s, &broker, (rss_start, rss_before), &main, run_started).await;
}

/// Starts the broker binary, sized for `SOAK_SUBSCRIBERS` and
/// `SOAK_CAPACITY`, with `SOAK_BROKER_ENV` on top.
fn start_broker(s: &Settings) -> BrokerProcess {
    let mut env = vec![
        // `tinybroker started` (which names the ports) is logged at INFO.
        ("RUST_LOG".to_owned(), "warn,tinybroker::server=info".to_owned()),
        ("TINYBROKER_CONSUMER_CAPACITY".to_owned(), s.capacity.to_string()),
        ("TINYBROKER_METRICS_PER_SUBSCRIPTION".to_owned(), "false".to_owned()),
        (
            "TINYBROKER_MAX_SUBSCRIPTIONS".to_owned(),
            (s.subscribers * 2 + 100).to_string(),
        ),
    ];
    env.extend(s.broker_env.iter().cloned());
    BrokerProcess::spawn(&env)
}

/// Opens the connections every round shares: one for Admin, `connections`
/// for live subscribers and four narrow ones for stalled subscribers.
async fn open_channels(url: &str, connections: usize) -> Channels {
    let admin = connect(url, false).await;
    let mut live = Vec::new();
    for _ in 0..connections {
        live.push(connect(url, false).await);
    }
    let mut stall = Vec::new();
    for _ in 0..4 {
        stall.push(connect(url, true).await);
    }
    Channels {
        url: url.to_owned(),
        admin,
        live,
        stall,
    }
}

/// After the main rounds: waits up to 10 s for the broker's RSS to return
/// within `SOAK_RSS_MARGIN_PCT` plus 2 MiB of its value after the warm-up
/// round, prints the run's figures, then asserts that it did.
async fn check_rss_returns(
    s: &Settings,
    broker: &BrokerProcess,
    (rss_start, rss_before): (u64, u64),
    main: &Figures,
    run_started: Instant,
) {
    let pid = broker.guard.pid();
    let allowed = rss_before + rss_before * s.rss_margin_pct / 100 + 2048;
    let settled = poll_until(Duration::from_secs(10), || async {
        common::process::rss_kib(pid) <= allowed
    })
    .await;
    let rss_after = broker.rss_kib();
    let m = metrics(broker.metrics_addr).await;
    println!(
        "soak: main round: {main}\nsoak: {:.0} s in all; broker totals: published {}, delivered {}, evictions {}; \
         broker RSS KiB: start {rss_start}, before {rss_before}, peak {}, after {rss_after} (allowed {allowed}){}",
        run_started.elapsed().as_secs_f64(),
        metric_sum(&m, "tinybroker_messages_published_total"),
        metric_sum(&m, "tinybroker_messages_delivered_total"),
        metric_sum(&m, "tinybroker_evictions_total"),
        main.peak_rss,
        if s.broker_env.is_empty() {
            String::new()
        } else {
            format!("; broker env {:?}", s.broker_env)
        },
    );
    assert!(
        settled,
        "broker RSS did not return: {rss_after} KiB after, {rss_before} KiB before (allowed {allowed})"
    );
}

struct Channels {
    url: String,
    admin: Channel,
    live: Vec<Channel>,
    stall: Vec<Channel>,
}

/// What one round did.
struct Figures {
    seconds: f64,
    opened: u64,
    left: u64,
    survived: usize,
    stalled: usize,
    kills: u64,
    finals: [u64; TOPICS],
    checked: u64,
    group_messages: u64,
    redelivered: usize,
    peak_rss: u64,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0} s, subscribers opened {} ({} left early, {} survived, {} stalled and evicted), \
             CLI processes SIGKILLed {}, published per topic {:?}, deliveries checked {}, \
             group messages {} (redeliveries seen {}), peak RSS {} KiB",
            self.seconds,
            self.opened,
            self.left,
            self.survived,
            self.stalled,
            self.kills,
            self.finals,
            self.checked,
            self.group_messages,
            self.redelivered,
            self.peak_rss
        )
    }
}

/// One round of the soak: churn, stalls, kills for `run_for`, then every
/// check. The broker is left with no subscription open.
async fn round(
    s: &Settings,
    broker: &BrokerProcess,
    channels: &Channels,
    run_for: Duration,
    stalled_so_far: &mut HashSet<String>,
    seed: u64,
) -> Figures {
    let r = Round::new(s, broker, channels, seed);
    let sampler = r.sample_peak_rss();
    let mut groups = r.start_group_members_and_cli_killers().await;
    r.wait_for_group_members_to_join().await;
    let broadcast_killer = r.start_killing_broadcast_clis();
    let publishers = r.start_publishers().await;
    let mut subscribers = r.start_churning_subscribers(run_for);
    subscribers.replace_leavers_for(run_for).await;

    let finals = r.stop_churn_and_publishing(publishers).await;
    let stranded = wait_for_cli_killers(broadcast_killer, &mut groups.killers).await;
    let mut ended = subscribers.wait_for_survivors().await;

    r.wait_for_groups_to_drain().await;
    let group_tally = r.check_group_deliveries(&groups.logs, &finals, stranded).await;
    let members = r.end_members(groups.members).await;
    let expected = r.check_admin_listing(&ended, &members).await;
    r.check_metrics_and_evictions(&expected, &ended, stalled_so_far).await;
    check_evicted_streams_end_cleanly(&mut ended.stalled).await;
    let (survived, stalled) = (ended.survivors.len(), ended.stalled_ids().len());
    r.check_everything_closes(ended, members).await;

    let peak_rss = sampler.stop().await;
    r.check_no_errors();
    r.figures(survived, stalled, finals, group_tally, peak_rss)
}

/// What the steps of one round share.
struct Round<'a> {
    s: &'a Settings,
    broker: &'a BrokerProcess,
    channels: &'a Channels,
    seed: u64,
    started: Instant,
    ctl: Arc<Ctl>,
    /// Sends the final per-topic counts to `ctl.finals`.
    finals: tokio::sync::watch::Sender<Option<[u64; TOPICS]>>,
    admin: AdminClient<Channel>,
}

/// The RSS sampler of a round and the peak it has seen.
struct RssSampler {
    peak: Arc<AtomicU64>,
    end: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    /// Stops sampling (if `Ctl::end` has not already) and returns the peak.
    async fn stop(self) -> u64 {
        self.end.cancel();
        self.task.await.expect("sampler");
        self.peak.load(Ordering::Relaxed)
    }
}

/// The consumer groups' side of a round.
struct Groups {
    /// The in-test members: each hands back its open stream at `Ctl::end`.
    members: JoinSet<Option<Open>>,
    /// Per group (in `GROUPS` order): what its members received.
    logs: Vec<GroupLog>,
    /// Per group: the CLI member killer, returning how many messages it
    /// stranded on killed members.
    killers: JoinSet<u64>,
}

/// The two publishers of a round.
struct Publishers {
    stream: tokio::task::JoinHandle<()>,
    unary: tokio::task::JoinHandle<()>,
}

/// How the broadcast subscribers of a round ended, once publishing stopped.
struct Ended {
    /// Read every message up to the final counts; still open.
    survivors: Vec<Open>,
    /// Stopped reading (and must have been evicted); unread.
    stalled: Vec<Open>,
}

impl Ended {
    fn stalled_ids(&self) -> HashSet<String> {
        self.stalled.iter().map(|(_, id)| id.clone()).collect()
    }
}

/// What the group checks counted.
struct GroupTally {
    messages: u64,
    redelivered: usize,
}

impl<'a> Round<'a> {
    fn new(s: &'a Settings, broker: &'a BrokerProcess, channels: &'a Channels, seed: u64) -> Self {
        let started = Instant::now();
        let (finals, finals_rx) = tokio::sync::watch::channel(None);
        Self {
            s,
            broker,
            channels,
            seed,
            started,
            ctl: Arc::new(Ctl {
                shared: Arc::new(Shared::default()),
                stop: CancellationToken::new(),
                finals: finals_rx,
                end: CancellationToken::new(),
            }),
            finals,
            admin: AdminClient::new(channels.admin.clone()),
        }
    }

    /// Samples the broker's RSS every 250 ms until `Ctl::end`, keeping the
    /// peak.
    fn sample_peak_rss(&self) -> RssSampler {
        let pid = self.broker.guard.pid();
        let peak = Arc::new(AtomicU64::new(self.broker.rss_kib()));
        let task = {
            let (peak, end) = (peak.clone(), self.ctl.end.clone());
            tokio::spawn(async move {
                while !end.is_cancelled() {
                    peak.fetch_max(common::process::rss_kib(pid), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            })
        };
        RssSampler {
            peak,
            end: self.ctl.end.clone(),
            task,
        }
    }

    /// Starts two in-test manual-ack members of each consumer group (on one
    /// connection of their own) and, per group, the task that SIGKILLs CLI
    /// members.
    async fn start_group_members_and_cli_killers(&self) -> Groups {
        let group_channel = connect(&self.channels.url, false).await;
        let mut groups = Groups {
            members: JoinSet::new(),
            logs: Vec::new(),
            killers: JoinSet::new(),
        };
        for (i, &(group, pattern, _)) in GROUPS.iter().enumerate() {
            let log: GroupLog = Arc::default();
            for _ in 0..2 {
                groups.members.spawn(member(
                    self.ctl.clone(),
                    group_channel.clone(),
                    group,
                    pattern,
                    log.clone(),
                ));
            }
            groups.killers.spawn(kill_group_clis(
                self.ctl.clone(),
                self.channels.url.clone(),
                self.channels.admin.clone(),
                (group, pattern),
                self.s.kills,
                log.clone(),
                0x9e37_79b9 + i as u64 + 7 * self.seed,
            ));
            groups.logs.push(log);
        }
        groups
    }

    /// Waits up to 30 s for both in-test members of every group to join. A
    /// group exists once a member has joined: publishing starts after that,
    /// so that every group message has somewhere to go.
    async fn wait_for_group_members_to_join(&self) {
        let joined = poll_until(Duration::from_secs(30), || {
            let admin = self.admin.clone();
            async move {
                let groups = groups_or_empty(admin).await;
                GROUPS
                    .iter()
                    .all(|(name, _, _)| groups.iter().any(|g| g.name == *name && g.members >= 2))
            }
        })
        .await;
        assert!(joined, "the in-test group members did not join");
    }

    /// Starts the task that SIGKILLs broadcast CLI subscribers mid-stream.
    fn start_killing_broadcast_clis(&self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(kill_broadcast_clis(
            self.ctl.clone(),
            self.channels.url.clone(),
            self.channels.admin.clone(),
            self.s.kills,
            0x1234_5678 + self.seed,
        ))
    }

    /// Starts the publishers, each on a connection of its own, at
    /// `SOAK_RATE` messages per second per topic: a PublishStream on topics
    /// 0 and 1, unary Publish on 2 and 3.
    async fn start_publishers(&self) -> Publishers {
        let period = Duration::from_micros(1_000_000 / self.s.rate);
        let url = &self.channels.url;
        let stream = tokio::spawn(publish_on_a_stream(self.ctl.clone(), connect(url, false).await, period));
        let unary = tokio::spawn(publish_unary(self.ctl.clone(), connect(url, false).await, period));
        Publishers { stream, unary }
    }

    /// Opens `SOAK_SUBSCRIBERS` broadcast subscribers over the live
    /// connections, each to leave after a random lifetime; a few
    /// (`SOAK_STALLS` in all) stall on the narrow connections instead.
    fn start_churning_subscribers(&self, run_for: Duration) -> Subscribers<'a> {
        let mut planner = Planner::new(self.s, self.channels, run_for, self.seed);
        let mut tasks = JoinSet::new();
        for _ in 0..self.s.subscribers {
            tasks.spawn(subscriber(self.ctl.clone(), planner.plan()));
        }
        Subscribers {
            ctl: self.ctl.clone(),
            planner,
            tasks,
            outcomes: Vec::new(),
        }
    }

    /// Stops churn, the killers and the publishers; once the publishers have
    /// returned, sends the final per-topic counts to the subscribers (which
    /// then read up to them) and returns them.
    async fn stop_churn_and_publishing(&self, publishers: Publishers) -> [u64; TOPICS] {
        self.ctl.stop.cancel();
        publishers.stream.await.expect("stream publisher");
        publishers.unary.await.expect("unary publisher");
        let finals = self.ctl.shared.marks();
        self.finals.send(Some(finals)).expect("finals");
        finals
    }

    /// Waits up to 60 s for every group message to be acked: no backlog and
    /// nothing in flight in any group.
    async fn wait_for_groups_to_drain(&self) {
        let groups_done = poll_until(Duration::from_secs(60), || {
            let admin = self.admin.clone();
            async move {
                let groups = groups_or_empty(admin).await;
                groups.len() == GROUPS.len() && groups.iter().all(|g| g.backlog == 0 && g.in_flight == 0)
            }
        })
        .await;
        assert!(groups_done, "consumer groups did not drain");
    }

    /// Checks that every message published to a group's topics reached it
    /// (redelivered ones may arrive twice), that none was dropped or
    /// dead-lettered, and that each message stranded on a killed CLI member
    /// was redelivered.
    async fn check_group_deliveries(&self, logs: &[GroupLog], finals: &[u64; TOPICS], stranded: u64) -> GroupTally {
        let groups = common::groups(&mut self.admin.clone()).await;
        let mut group_messages = 0;
        let mut redelivered_seen = 0;
        for ((name, _, topics), log) in GROUPS.iter().zip(logs) {
            let log = log.lock();
            for &t in *topics {
                for n in 0..finals[t] {
                    if !log.contains_key(&(t, n)) {
                        self.ctl
                            .shared
                            .error(format!("group {name}: soak.{t} #{n} was never delivered"));
                    }
                }
                group_messages += finals[t];
            }
            redelivered_seen += log.values().flatten().filter(|a| **a > 1).count();
            let info = groups.iter().find(|g| g.name == *name).expect("group listed");
            assert_eq!((info.dropped, info.dead_lettered), (0, 0), "{info:?}");
        }
        assert!(
            redelivered_seen as u64 >= stranded,
            "{stranded} messages were stranded on killed members, only {redelivered_seen} redeliveries seen"
        );
        GroupTally {
            messages: group_messages,
            redelivered: redelivered_seen,
        }
    }

    /// Ends the round's tasks (`Ctl::end`: the RSS sampler stops, in-test
    /// members stop reading) and returns the members' streams, still open.
    async fn end_members(&self, mut members: JoinSet<Option<Open>>) -> Vec<Open> {
        self.ctl.end.cancel();
        let mut member_streams = Vec::new();
        while let Some(done) = members.join_next().await {
            if let Some(m) = done.expect("member task") {
                member_streams.push(m);
            }
        }
        member_streams
    }

    /// Checks that Admin lists exactly the survivors and the in-test members
    /// (so no stalled subscriber is left unevicted); returns their ids.
    async fn check_admin_listing(&self, ended: &Ended, members: &[Open]) -> BTreeSet<String> {
        let mut expected: BTreeSet<String> = ended.survivors.iter().map(|(_, id)| id.clone()).collect();
        expected.extend(members.iter().map(|(_, id)| id.clone()));
        let listed: BTreeSet<String> = admin_subscriptions(self.admin.clone())
            .await
            .into_iter()
            .map(|s| s.subscription_id)
            .collect();
        let stalled_ids = ended.stalled_ids();
        if listed != expected {
            let extra: Vec<_> = listed.difference(&expected).collect();
            let missing: Vec<_> = expected.difference(&listed).collect();
            let extra_stalled = extra.iter().filter(|id| stalled_ids.contains(id.as_str())).count();
            panic!(
                "Admin lists {} subscriptions, expected {}: {} extra ({extra_stalled} stalled but not evicted) {:?}, missing {:?}",
                listed.len(),
                expected.len(),
                extra.len(),
                &extra[..extra.len().min(5)],
                &missing[..missing.len().min(5)]
            );
        }
        expected
    }

    /// Checks /metrics and Admin's evictions against the round: the
    /// subscription gauge counts `expected`; every subscriber stalled this
    /// round was evicted, and nothing evicted was not stalled (this round
    /// or an earlier one, whose evictions Admin may still list); the
    /// eviction counter counts every stall so far.
    async fn check_metrics_and_evictions(
        &self,
        expected: &BTreeSet<String>,
        ended: &Ended,
        stalled_so_far: &mut HashSet<String>,
    ) {
        let m = metrics(self.broker.metrics_addr).await;
        assert_eq!(metric_sum(&m, "tinybroker_subscriptions"), expected.len() as f64);
        let evictions = common::evictions(&mut self.admin.clone()).await;
        let stalled_ids = ended.stalled_ids();
        stalled_so_far.extend(stalled_ids.iter().cloned());
        let evicted: HashSet<String> = evictions.iter().map(|e| e.subscription_id.clone()).collect();
        for id in &evicted {
            assert!(stalled_so_far.contains(id), "{id} was evicted but never stalled");
        }
        for id in &stalled_ids {
            assert!(evicted.contains(id), "stalled {id} was not evicted");
        }
        assert_eq!(
            metric_sum(&m, "tinybroker_evictions_total"),
            stalled_so_far.len() as f64
        );
    }

    /// Closes every stream still open (survivors, members, evicted ones) and
    /// waits up to 30 s for Admin and /metrics to show no subscription and
    /// no group member left.
    async fn check_everything_closes(&self, ended: Ended, members: Vec<Open>) {
        let Ended { survivors, stalled } = ended;
        drop(survivors);
        drop(members);
        drop(stalled);
        let empty = poll_until(Duration::from_secs(30), || {
            let admin = self.admin.clone();
            let addr = self.broker.metrics_addr;
            async move {
                if !admin_subscriptions(admin).await.is_empty() {
                    return false;
                }
                let m = metrics(addr).await;
                metric_sum(&m, "tinybroker_subscriptions") == 0.0
                    && metric_sum(&m, "tinybroker_consumer_group_members") == 0.0
            }
        })
        .await;
        assert!(empty, "subscriptions or group members left over after everyone closed");
    }

    /// Asserts that no task of the round reported an error.
    fn check_no_errors(&self) {
        let errors = self.ctl.shared.errors.lock().clone();
        assert!(errors.is_empty(), "soak errors: {errors:#?}");
    }

    /// What the round did, for the report.
    fn figures(
        &self,
        survived: usize,
        stalled: usize,
        finals: [u64; TOPICS],
        groups: GroupTally,
        peak_rss: u64,
    ) -> Figures {
        let shared = &self.ctl.shared;
        Figures {
            seconds: self.started.elapsed().as_secs_f64(),
            opened: shared.opened.load(Ordering::Relaxed),
            left: shared.left.load(Ordering::Relaxed),
            survived,
            stalled,
            kills: shared.kills.load(Ordering::Relaxed),
            finals,
            checked: shared.delivered.load(Ordering::Relaxed),
            group_messages: groups.messages,
            redelivered: groups.redelivered,
            peak_rss,
        }
    }
}

/// Publishes to topics 0 and 1 through one PublishStream, both every
/// `period`, until churn stops; then checks that it accepted them all.
async fn publish_on_a_stream(ctl: Arc<Ctl>, channel: Channel, period: Duration) {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let mut client = BrokerClient::new(channel);
    let call = tokio::spawn(async move {
        client
            .publish_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map(|r| r.into_inner())
    });
    let mut tick = tokio::time::interval(period);
    while !ctl.stop.is_cancelled() {
        tick.tick().await;
        for t in 0..2 {
            let n = ctl.shared.started[t].fetch_add(1, Ordering::SeqCst);
            if tx
                .send(publish_request(&format!("soak.{t}"), &payload(t, n)))
                .await
                .is_err()
            {
                ctl.shared.error("the publish stream ended early".into());
                return;
            }
        }
    }
    drop(tx);
    match tokio::time::timeout(Duration::from_secs(30), call).await {
        Ok(Ok(Ok(r))) => {
            let sent: u64 = (0..2).map(|t| ctl.shared.started[t].load(Ordering::SeqCst)).sum();
            if r.accepted != sent {
                ctl.shared
                    .error(format!("PublishStream accepted {} of {sent}", r.accepted));
            }
        }
        other => ctl.shared.error(format!("PublishStream: {other:?}")),
    }
}

/// Publishes to topics 2 and 3 with unary Publish calls, both every
/// `period`, until churn stops.
async fn publish_unary(ctl: Arc<Ctl>, channel: Channel, period: Duration) {
    let mut client = BrokerClient::new(channel);
    let mut tick = tokio::time::interval(period);
    while !ctl.stop.is_cancelled() {
        tick.tick().await;
        for t in 2..4 {
            let n = ctl.shared.started[t].fetch_add(1, Ordering::SeqCst);
            let request = publish_request(&format!("soak.{t}"), &payload(t, n));
            match tokio::time::timeout(Duration::from_secs(10), client.publish(request)).await {
                Ok(Ok(_)) => {}
                other => {
                    ctl.shared.error(format!("Publish #{n} to soak.{t}: {other:?}"));
                    return;
                }
            }
        }
    }
}

/// Plans each new subscriber of a round: its connection, pattern, lifetime,
/// and whether (and when) it stalls.
struct Planner<'a> {
    s: &'a Settings,
    channels: &'a Channels,
    run_for: Duration,
    rng: Rng,
    /// One subscriber in this many stalls (until `SOAK_STALLS` have).
    stall_every: u64,
    spawned: u64,
    stalled_planned: usize,
}

impl<'a> Planner<'a> {
    fn new(s: &'a Settings, channels: &'a Channels, run_for: Duration, seed: u64) -> Self {
        Self {
            s,
            channels,
            run_for,
            rng: Rng(0xdead_beef ^ seed),
            stall_every: s
                .subscribers
                .checked_div(s.stalls)
                .map_or(u64::MAX, |n| n.max(1) as u64),
            spawned: 0,
            stalled_planned: 0,
        }
    }

    fn plan(&mut self) -> Plan {
        self.spawned += 1;
        let rng = &mut self.rng;
        let wildcard = rng.below(10) == 0;
        let t = rng.below(TOPICS as u64) as usize;
        let (pattern, topics) = if wildcard {
            ("soak.*".to_owned(), (0..TOPICS).collect())
        } else {
            (format!("soak.{t}"), vec![t])
        };
        let stall = self.stalled_planned < self.s.stalls && self.spawned.is_multiple_of(self.stall_every);
        if stall {
            self.stalled_planned += 1;
        }
        let (live_channels, stall_channels) = (&self.channels.live, &self.channels.stall);
        Plan {
            channel: if stall {
                stall_channels[self.spawned as usize % stall_channels.len()].clone()
            } else {
                live_channels[self.spawned as usize % live_channels.len()].clone()
            },
            // Stalled ones subscribe to everything, so they fill up sooner.
            pattern: if stall { "soak.*".to_owned() } else { pattern },
            topics: if stall { (0..TOPICS).collect() } else { topics },
            lifetime: if stall {
                self.run_for * 10
            } else {
                rng.millis(2_000, self.run_for.as_millis() as u64 * 2)
            },
            stall_after: stall.then(|| rng.millis(500, 3_000)),
        }
    }
}

/// The broadcast subscribers of a round: the tasks still running and the
/// outcomes of those that ended other than by leaving.
struct Subscribers<'a> {
    ctl: Arc<Ctl>,
    planner: Planner<'a>,
    tasks: JoinSet<Outcome>,
    outcomes: Vec<Outcome>,
}

impl Subscribers<'_> {
    /// For `run_for`, replaces every subscriber that leaves with a new one.
    async fn replace_leavers_for(&mut self, run_for: Duration) {
        let churn_until = tokio::time::Instant::now() + run_for;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(churn_until) => break,
                done = self.tasks.join_next() => match done {
                    Some(Ok(Outcome::Left)) => {
                        self.tasks.spawn(subscriber(self.ctl.clone(), self.planner.plan()));
                    }
                    Some(Ok(outcome)) => self.outcomes.push(outcome),
                    Some(Err(e)) => panic!("subscriber task: {e}"),
                    None => break,
                }
            }
        }
    }

    /// Once publishing has stopped: waits up to 120 s for every subscriber
    /// to end (survivors once they have read everything) and sorts out the
    /// survivors and the stalled ones.
    async fn wait_for_survivors(mut self) -> Ended {
        while let Some(done) = tokio::time::timeout(Duration::from_secs(120), self.tasks.join_next())
            .await
            .expect("survivors read everything within 120 s")
        {
            self.outcomes.push(done.expect("subscriber task"));
        }
        let mut ended = Ended {
            survivors: Vec::new(),
            stalled: Vec::new(),
        };
        for outcome in self.outcomes {
            match outcome {
                Outcome::Survivor(stream, id) => ended.survivors.push((stream, id)),
                Outcome::Stalled(stream, id) => ended.stalled.push((stream, id)),
                Outcome::Left | Outcome::Failed => {}
            }
        }
        ended
    }
}

/// Waits for the CLI killers (broadcast and per group) to finish; returns
/// how many messages were stranded on killed group members.
async fn wait_for_cli_killers(broadcast: tokio::task::JoinHandle<()>, groups: &mut JoinSet<u64>) -> u64 {
    broadcast.await.expect("broadcast killer");
    let mut stranded = 0;
    while let Some(done) = groups.join_next().await {
        stranded += done.expect("group killer");
    }
    stranded
}

/// Reads every evicted (stalled) stream to its end: each must still end
/// cleanly, with OK status and no error. All are read at once: stalled
/// streams share their connections' window, so reading one at a time could
/// wait on another's unread data.
async fn check_evicted_streams_end_cleanly(stalled: &mut [Open]) {
    let drains = stalled.iter_mut().map(|(stream, id)| async move {
        let mut read = 0;
        loop {
            match stream.message().await {
                Ok(Some(_)) => read += 1,
                Ok(None) => return Ok(()),
                Err(status) => {
                    return Err(format!(
                        "evicted {id} ended with {status:?} after {read} buffered messages"
                    ));
                }
            }
        }
    });
    let drained = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(drains))
        .await
        .expect("evicted streams end within 30 s once read");
    for result in drained {
        result.unwrap_or_else(|e| panic!("{e}"));
    }
}
