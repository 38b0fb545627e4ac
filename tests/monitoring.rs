//! The shipped alerts and dashboard against live situations (issue 17): the
//! real broker binary, a real Prometheus scraping it every second with
//! `deploy/monitoring/alerts.yaml` loaded (its group interval set to 1 s, the
//! only change), and at the same time, beside healthy traffic: a queue that
//! fills and drains between two scrapes, a slow subscriber that is evicted, a
//! MANUAL group whose member never acks with a 1 h ack deadline and one with
//! a 2 s deadline, a busy MANUAL group of three whose one member never acks
//! while the others do, a memberless group whose backlog grows, and groups
//! removed by their idle TTL (60 s here) with messages left.
//!
//! Through Prometheus's HTTP API it asserts that each alert fires, naming the
//! subscriber or group, within its promise at a 1 s scrape (and not before
//! its threshold), that no other alert fires, that each dashboard panel shows
//! what it is for (the evicted id, the stuck groups, ...), that every
//! dashboard query returns data and every panel has thresholds. It prints
//! how long each took. The same rules at the chart's 30 s scrape interval
//! are shown by `promtool test rules deploy/monitoring/alerts_test.yaml`.
//!
//! The cluster session does the same sums over two replicas (issue 25):
//! two broker processes in cluster mode over one nats-server, one
//! Prometheus scraping both, and known counts made across them (a MANUAL
//! group with a member on each replica, acked through the other replica,
//! nacked, redelivered and dead-lettered; a group holding messages, one
//! overflowing, one without members and then removed after its idle TTL;
//! broadcast deliveries on both). Every consumer-group panel of the
//! dashboard and every group rule of alerts.yaml, evaluated over both
//! replicas, must give the total the clients saw, not twice it (a gauge
//! every replica reports, summed) nor a part of it (a counter each replica
//! keeps for itself, not summed), and must hold for a few seconds on end;
//! a group panel or rule added later without a check here fails it.
//!
//! Ignored by default: they need the `prometheus` server (and nats-server)
//! and take about 90 s and 30 s. `scripts/check-alerts-live.sh` (a CI step)
//! installs Prometheus and runs them.

mod common;

use common::process::{BrokerProcess, ChildGuard};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tonic::transport::{Channel, Endpoint};

/// Upper bound for the whole session.
const SESSION_TIMEOUT: Duration = Duration::from_secs(300);
/// Allowed on top of each promise at a 1 s scrape: the machine is shared.
const SLACK: Duration = Duration::from_secs(5);
/// The rules' and the broker's stall threshold.
const STALL: Duration = Duration::from_secs(45);
/// TINYBROKER_GROUP_IDLE_TTL_SECONDS of the test broker.
const TTL: Duration = Duration::from_secs(60);
/// TINYBROKER_CONSUMER_CAPACITY of the test broker.
const CAPACITY: u64 = 64;
/// Depth the bursty subscriber reaches: over 90 % of CAPACITY.
const BURST_DEPTH: u64 = 58;
/// How often the watcher asks Prometheus.
const POLL: Duration = Duration::from_millis(250);
/// The scrape job's name, as the dashboard's $job selects it.
const JOB: &str = "tinybroker";

fn log(started: Instant, what: &str) {
    println!("[{:6.1}s] {what}", started.elapsed().as_secs_f64());
}

// === Prometheus ===

struct Prometheus {
    addr: SocketAddr,
}

impl Prometheus {
    /// Starts Prometheus on 127.0.0.1, scraping `targets` and evaluating the
    /// shipped rules every second. The guard stops it.
    async fn start(dir: &Path, targets: &[SocketAddr]) -> (Self, ChildGuard) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let rules = std::fs::read_to_string(root.join("deploy/monitoring/alerts.yaml")).unwrap();
        let group_interval = "    interval: 30s\n";
        assert_eq!(
            rules.matches(group_interval).count(),
            1,
            "alerts.yaml has one group interval"
        );
        std::fs::write(
            dir.join("alerts.yaml"),
            rules.replace(group_interval, "    interval: 1s\n"),
        )
        .unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: [{}]\n",
            dir.join("alerts.yaml").display(),
            targets.join(", ")
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        // A free port can be taken between picking and binding: try a few.
        for _ in 0..3 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
            let child = Command::new("prometheus")
                .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("run prometheus (Debian package prometheus; scripts/check-alerts-live.sh installs it)");
            let mut guard = ChildGuard::new(child);
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if guard.child.try_wait().unwrap().is_some() {
                    break;
                }
                if http_get(addr, "/-/ready").await.is_ok_and(|(status, _)| status == 200) {
                    return (Self { addr }, guard);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            guard.kill();
        }
        panic!(
            "prometheus did not start: {}",
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
    }

    async fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = http_get(self.addr, path).await.map_err(|e| e.to_string())?;
        let json: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || json["status"] != "success" {
            return Err(format!("HTTP {status}: {body}"));
        }
        Ok(json["data"].clone())
    }

    /// An instant query's series.
    async fn query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", percent_encode(expr)))
            .await?;
        let result = data["result"]
            .as_array()
            .ok_or_else(|| format!("no result in {data}"))?;
        Ok(result
            .iter()
            .map(|s| Sample {
                labels: labels(&s["metric"]),
                value: s["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN),
            })
            .collect())
    }

    /// The labels of every firing alert.
    async fn firing(&self) -> Result<Vec<HashMap<String, String>>, String> {
        let data = self.api("/api/v1/alerts").await?;
        Ok(data["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["state"] == "firing")
            .map(|a| labels(&a["labels"]))
            .collect())
    }
}

#[derive(Debug, Clone)]
struct Sample {
    labels: HashMap<String, String>,
    value: f64,
}

impl Sample {
    fn has(&self, label: &str, value: &str) -> bool {
        self.labels.get(label).is_some_and(|v| v == value)
    }
}

fn labels(metric: &Value) -> HashMap<String, String> {
    metric
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// HTTP/1.0 GET (no chunked encoding: the body runs to the end).
async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr)).await??;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await??;
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// === the dashboard ===

fn dashboard() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring/dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// (panel title, refId, PromQL) of every target, as written.
fn dashboard_targets() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for panel in dashboard()["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                panel["title"].as_str().unwrap().to_owned(),
                target["refId"].as_str().unwrap().to_owned(),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// Every target, with the Grafana variables filled in as Grafana would for
/// this job and instance at a 1 s scrape.
fn dashboard_queries(instance: &str) -> Vec<(String, String, String)> {
    let fill = |expr: &str| {
        expr.replace("$__rate_interval", "5s")
            .replace("$__interval", "1s")
            .replace("$__range", "5m")
            .replace("$job", JOB)
            .replace("$instance", instance)
    };
    dashboard_targets()
        .into_iter()
        .map(|(title, ref_id, expr)| (title, ref_id, fill(&expr)))
        .collect()
}

/// Panels without a threshold step above the base colour, in their
/// defaults or an override.
fn panels_without_thresholds() -> Vec<String> {
    let steps = |t: &Value| t["steps"].as_array().map_or(0, |s| s.len());
    dashboard()["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] != "row")
        .filter(|p| {
            let config = &p["fieldConfig"];
            let overrides = config["overrides"].as_array().into_iter().flatten();
            let in_overrides = overrides
                .flat_map(|o| o["properties"].as_array().into_iter().flatten())
                .any(|prop| prop["id"] == "thresholds" && steps(&prop["value"]) >= 2);
            steps(&config["defaults"]["thresholds"]) < 2 && !in_overrides
        })
        .map(|p| p["title"].as_str().unwrap_or_default().to_owned())
        .collect()
}

// === what the session watches for ===

type Predicate = Box<dyn Fn(&[Sample]) -> bool + Send + Sync>;

enum Check {
    /// An alert is firing with `label` = `value`.
    Alert {
        name: &'static str,
        label: &'static str,
        value: String,
    },
    /// A dashboard panel's query result satisfies `pred`.
    Panel {
        title: &'static str,
        ref_id: &'static str,
        pred: Predicate,
    },
}

struct Watch {
    what: String,
    start: SystemTime,
    /// Seen earlier than this after `start` is a failure (a threshold).
    earliest: Duration,
    /// The promise at a 1 s scrape and evaluation interval.
    promise: Duration,
    /// The same at 30 s, for the report.
    promise_30s: &'static str,
    check: Check,
    seen: Option<Duration>,
}

fn alert(name: &'static str, label: &'static str, value: &str) -> Check {
    Check::Alert {
        name,
        label,
        value: value.to_owned(),
    }
}

fn panel(title: &'static str, ref_id: &'static str, pred: impl Fn(&[Sample]) -> bool + Send + Sync + 'static) -> Check {
    Check::Panel {
        title,
        ref_id,
        pred: Box::new(pred),
    }
}

fn any_with(label: &'static str, value: &str, min: f64) -> impl Fn(&[Sample]) -> bool + Send + Sync + 'static {
    let value = value.to_owned();
    move |r: &[Sample]| r.iter().any(|s| s.has(label, &value) && s.value >= min)
}

fn total_at_least(min: f64) -> impl Fn(&[Sample]) -> bool + Send + Sync + 'static {
    move |r: &[Sample]| r.iter().map(|s| s.value).sum::<f64>() >= min
}

#[derive(Default)]
struct Watched {
    watches: Vec<Watch>,
    /// (alertname, subscription_id or consumer_group) of every alert seen firing.
    fired: BTreeSet<(String, String)>,
    errors: Vec<String>,
}

impl Watched {
    fn add(
        &mut self,
        what: &str,
        start: SystemTime,
        earliest: Duration,
        promise: Duration,
        promise_30s: &'static str,
        check: Check,
    ) {
        self.watches.push(Watch {
            what: what.to_owned(),
            start,
            earliest,
            promise,
            promise_30s,
            check,
            seen: None,
        });
    }
}

/// Asks Prometheus every [`POLL`] about every watch not seen yet, and notes
/// every firing alert.
async fn watch(prometheus: Arc<Prometheus>, watched: Arc<Mutex<Watched>>, queries: Vec<(String, String, String)>) {
    loop {
        let now = SystemTime::now();
        match prometheus.firing().await {
            Ok(firing) => {
                let mut w = watched.lock().unwrap();
                for labels in &firing {
                    let key = ["subscription_id", "consumer_group", "reason"]
                        .iter()
                        .find_map(|k| labels.get(*k))
                        .cloned()
                        .unwrap_or_default();
                    w.fired.insert((labels["alertname"].clone(), key));
                }
                for watch in w.watches.iter_mut().filter(|w| w.seen.is_none()) {
                    if let Check::Alert { name, label, value } = &watch.check
                        && firing
                            .iter()
                            .any(|l| l["alertname"] == *name && l.get(*label) == Some(value))
                    {
                        watch.seen = Some(now.duration_since(watch.start).unwrap_or_default());
                    }
                }
            }
            Err(e) => watched.lock().unwrap().errors.push(e),
        }
        let pending: Vec<(usize, String)> = {
            let w = watched.lock().unwrap();
            w.watches
                .iter()
                .enumerate()
                .filter(|(_, w)| w.seen.is_none())
                .filter_map(|(i, w)| match &w.check {
                    Check::Panel { title, ref_id, .. } => queries
                        .iter()
                        .find(|(t, r, _)| t == title && r == ref_id)
                        .map(|(_, _, q)| (i, q.clone())),
                    Check::Alert { .. } => None,
                })
                .collect()
        };
        for (i, expr) in pending {
            let now = SystemTime::now();
            let result = prometheus.query(&expr).await;
            let mut w = watched.lock().unwrap();
            match result {
                Ok(samples) => {
                    let watch = &mut w.watches[i];
                    if let Check::Panel { pred, .. } = &watch.check
                        && pred(&samples)
                    {
                        watch.seen = Some(now.duration_since(watch.start).unwrap_or_default());
                    }
                }
                Err(e) => w.errors.push(format!("{expr}: {e}")),
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

// === clients ===

async fn channel(url: &str, narrow: bool) -> Channel {
    let mut endpoint = Endpoint::from_shared(url.to_owned()).unwrap();
    if narrow {
        // A client that stops reading stops the broker's writes soon.
        endpoint = endpoint
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535);
    }
    endpoint.connect().await.unwrap()
}

fn publish(topic: &str, bytes: usize) -> pb::PublishRequest {
    pb::PublishRequest {
        topic: topic.into(),
        payload: vec![b'x'; bytes].into(),
        headers: Default::default(),
    }
}

async fn open(
    client: &mut BrokerClient<Channel>,
    request: pb::OpenSubscriptionRequest,
) -> tonic::Streaming<pb::Message> {
    client.open_subscription(request).await.unwrap().into_inner()
}

fn broadcast(id: &str, pattern: &str) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        topic_patterns: vec![pattern.into()],
        subscription_id: id.into(),
        ..Default::default()
    }
}

fn member(group: &str, pattern: &str, manual: bool, ack_deadline_ms: u32) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        topic_patterns: vec![pattern.into()],
        mode: pb::DeliveryMode::Single as i32,
        consumer_group: group.into(),
        ack_mode: if manual { pb::AckMode::Manual } else { pb::AckMode::Auto } as i32,
        max_in_flight: 8,
        ack_deadline_ms,
        ..Default::default()
    }
}

/// Reads a stream until it ends (a member that receives and never acks, or a
/// healthy subscriber).
fn drain(mut stream: tonic::Streaming<pb::Message>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move { while let Ok(Some(_)) = stream.message().await {} })
}

async fn group_members(admin: &mut AdminClient<Channel>, name: &str) -> Option<u32> {
    let groups = common::groups(admin).await;
    groups.into_iter().find(|g| g.name == name).map(|g| g.members)
}

async fn list_subscriptions(admin: &mut AdminClient<Channel>) -> Vec<pb::SubscriptionInfo> {
    admin
        .list_subscriptions(pb::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
}

async fn queue_depth(admin: &mut AdminClient<Channel>, id: &str) -> Option<u64> {
    common::listed(list_subscriptions(admin).await, id).map(|s| s.queue_depth)
}

/// Polls `check` every 20 ms for up to 20 s.
async fn wait_for<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    wait_for_long(what, Duration::from_secs(20), check).await;
}

/// Polls `check` every 20 ms for up to `limit`.
async fn wait_for_long<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A group that had one member, who left: its start is when it left.
async fn abandoned_group(
    client: &mut BrokerClient<Channel>,
    admin: &mut AdminClient<Channel>,
    name: &str,
) -> SystemTime {
    let stream = open(client, member(name, &format!("jobs.{name}"), false, 0)).await;
    let members = |want: u32| {
        let mut admin = admin.clone();
        async move { group_members(&mut admin, name).await == Some(want) }
    };
    wait_for("the member to join", || members(1)).await;
    drop(stream);
    wait_for("the member to leave", || members(0)).await;
    SystemTime::now()
}

fn temp_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("tinybroker-alerts-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// === the session ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the prometheus server and about 90 s; run by scripts/check-alerts-live.sh"]
async fn alerts_and_dashboard_name_the_slow_consumer_and_the_stuck_groups_in_time() {
    let dir = temp_dir();
    let outcome = tokio::time::timeout(SESSION_TIMEOUT, session(&dir)).await;
    match outcome {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Err(_) => panic!("session timed out after {SESSION_TIMEOUT:?}; logs in {}", dir.display()),
    }
}

async fn session(dir: &Path) {
    let t0 = Instant::now();
    let broker = BrokerProcess::spawn(&[
        ("TINYBROKER_CONSUMER_CAPACITY", CAPACITY.to_string()),
        ("TINYBROKER_GROUP_IDLE_TTL_SECONDS", TTL.as_secs().to_string()),
        ("TINYBROKER_METRICS_PER_SUBSCRIPTION", "true".into()),
        ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1".into()),
    ]);
    let url = broker.url();
    let instance = broker.metrics_addr.to_string();
    log(t0, &format!("broker up: grpc {}, metrics {instance}", broker.grpc_addr));
    let (prometheus, _prometheus_process) = Prometheus::start(dir, &[broker.metrics_addr]).await;
    let prometheus = Arc::new(prometheus);
    log(
        t0,
        &format!("prometheus up on {} (logs in {})", prometheus.addr, dir.display()),
    );
    wait_for("prometheus to scrape the broker", || {
        let p = prometheus.clone();
        async move {
            p.query(&format!("up{{job=\"{JOB}\"}} == 1"))
                .await
                .is_ok_and(|r| !r.is_empty())
        }
    })
    .await;
    log(t0, "prometheus scrapes the broker");

    let queries = dashboard_queries(&instance);
    let watched = Arc::new(Mutex::new(Watched::default()));
    let watcher = tokio::spawn(watch(prometheus.clone(), watched.clone(), queries.clone()));
    let mut client = BrokerClient::new(channel(&url, false).await);
    let mut admin = AdminClient::new(channel(&url, false).await);

    // Healthy traffic, which must set nothing off: a broadcast subscriber and
    // an auto-ack group on a steady 20 messages a second.
    let healthy = [
        drain(open(&mut client, broadcast("healthy-reader", "live.steady")).await),
        drain(open(&mut client, member("healthy", "live.steady", false, 0)).await),
    ];
    let stop = tokio_util::sync::CancellationToken::new();
    let steady = {
        let (mut client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                client.publish(publish("live.steady", 100)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    // Two MANUAL groups whose member receives and never acks: 1 h ack
    // deadline, and 2 s (redelivered every 2 s).
    let mut stuck_since = SystemTime::UNIX_EPOCH;
    for (group, deadline_ms) in [("stuck-long", 3_600_000), ("stuck-short", 2_000)] {
        let topic = format!("jobs.{group}");
        let stream = open(&mut client, member(group, &topic, true, deadline_ms)).await;
        let start = SystemTime::now();
        stuck_since = start;
        for _ in 0..3 {
            client.publish(publish(&topic, 10)).await.unwrap();
        }
        drain(stream);
        let mut w = watched.lock().unwrap();
        w.add(
            &format!("alert TinybrokerConsumerGroupStuck names {group} ({deadline_ms} ms deadline)"),
            start,
            STALL - Duration::from_secs(1),
            STALL + Duration::from_secs(2),
            "<= 105 s",
            alert("TinybrokerConsumerGroupStuck", "consumer_group", group),
        );
        w.add(
            &format!("panel \"Consumer groups, most stalled first\" shows {group} stalled > 45 s"),
            start,
            Duration::ZERO,
            STALL + Duration::from_secs(1),
            "<= 75 s",
            panel(
                "Consumer groups, most stalled first",
                "A",
                any_with("consumer_group", group, 45.0),
            ),
        );
        w.add(
            &format!("panel \"Seconds without progress per group\" shows {group} > 45 s"),
            start,
            Duration::ZERO,
            STALL + Duration::from_secs(1),
            "<= 75 s",
            panel(
                "Seconds without progress per group",
                "A",
                any_with("consumer_group", group, 45.0),
            ),
        );
    }
    {
        let start = stuck_since;
        let mut w = watched.lock().unwrap();
        w.add(
            "panel \"Stuck consumer groups\" counts both",
            start,
            Duration::ZERO,
            STALL + Duration::from_secs(2),
            "<= 105 s",
            panel("Stuck consumer groups", "A", total_at_least(2.0)),
        );
        w.add(
            "panel \"Delivery lag\" p99 of group messages above the old 5 s cap",
            start,
            Duration::ZERO,
            Duration::from_secs(30),
            "n/a",
            panel("Delivery lag", "C", any_with("mode", "single", 5.5)),
        );
        w.add(
            "panel \"Acked and delivered per group\" shows stuck-short's redeliveries",
            start,
            Duration::ZERO,
            Duration::from_secs(10),
            "n/a",
            panel(
                "Acked and delivered per group",
                "A",
                any_with("consumer_group", "stuck-short", 0.01),
            ),
        );
        w.add(
            "panel \"Oldest unacked message age\" shows stuck-long over 30 s",
            start,
            Duration::ZERO,
            Duration::from_secs(32),
            "n/a",
            panel(
                "Oldest unacked message age",
                "A",
                any_with("consumer_group", "stuck-long", 30.0),
            ),
        );
    }
    log(t0, "stuck-long and stuck-short hold messages and never ack");

    // Issue 42: a busy MANUAL group, every member at its max_in_flight and
    // a backlog growing, whose member busy-hung never acks while busy-ok-1
    // and busy-ok-2 ack every 250 ms. Its 10 s ack deadline takes its
    // messages back every 10 s (so its oldest unacked age never passes
    // 10 s), its stall goes on: it alone is named, and the group, which
    // acks, is not stuck.
    let busy_start = SystemTime::now();
    let busy = common::hung::busy_group_at(std::slice::from_ref(&url), "busy", 10_000).await;
    wait_for("busy-hung to hold its max_in_flight", || {
        let mut admin = admin.clone();
        let id = busy.hung.clone();
        async move {
            common::listed(list_subscriptions(&mut admin).await, &id)
                .is_some_and(|s| s.unacked == u64::from(common::hung::MAX_IN_FLIGHT))
        }
    })
    .await;
    watched.lock().unwrap().add(
        "alert TinybrokerConsumerGroupMemberHung names busy-hung (10 s ack deadline, group acking)",
        busy_start,
        STALL - Duration::from_secs(1),
        STALL + Duration::from_secs(2),
        "<= 105 s",
        alert("TinybrokerConsumerGroupMemberHung", "subscription_id", &busy.hung),
    );
    log(t0, "busy-hung holds its messages while busy-ok-1 and busy-ok-2 ack");

    // A memberless group whose backlog grows, and one left with 5 messages:
    // both removed with their backlog after the TTL.
    let left_orphan = abandoned_group(&mut client, &mut admin, "orphan").await;
    let orphan_publisher = {
        let (mut client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                client.publish(publish("jobs.orphan", 10)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let left_expiring = abandoned_group(&mut client, &mut admin, "expiring").await;
    for _ in 0..5 {
        client.publish(publish("jobs.expiring", 10)).await.unwrap();
    }
    for (group, left) in [("orphan", left_orphan), ("expiring", left_expiring)] {
        let mut w = watched.lock().unwrap();
        w.add(
            &format!("alert TinybrokerConsumerGroupWithoutMembers names {group}"),
            left,
            STALL - Duration::from_secs(1),
            STALL + Duration::from_secs(2),
            "<= 105 s",
            alert("TinybrokerConsumerGroupWithoutMembers", "consumer_group", group),
        );
        w.add(
            &format!("panel \"Seconds without members per group\" shows {group} > 45 s"),
            left,
            Duration::ZERO,
            STALL + Duration::from_secs(1),
            "<= 75 s",
            panel(
                "Seconds without members per group",
                "A",
                any_with("consumer_group", group, 45.0),
            ),
        );
        // Removed at the first maintenance tick after the TTL.
        let removed = left + TTL;
        w.add(
            &format!("alert TinybrokerConsumerGroupRemovedWithBacklog names {group}"),
            removed,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            alert("TinybrokerConsumerGroupRemovedWithBacklog", "consumer_group", group),
        );
        w.add(
            &format!("panel \"Groups removed with their messages\" names {group}"),
            removed,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel(
                "Groups removed with their messages (last 15 min)",
                "A",
                any_with("consumer_group", group, 1.0),
            ),
        );
    }
    {
        let mut w = watched.lock().unwrap();
        w.add(
            "panel \"Groups without members, messages waiting\" counts both",
            left_expiring,
            Duration::ZERO,
            STALL + Duration::from_secs(2),
            "<= 105 s",
            panel("Groups without members, messages waiting", "A", total_at_least(2.0)),
        );
        w.add(
            "panel \"Groups removed with messages (last 15 min)\" counts both",
            left_expiring + TTL,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            panel("Groups removed with messages (last 15 min)", "A", total_at_least(2.0)),
        );
        w.add(
            "panel \"Messages lost\" shows group_expired",
            left_orphan + TTL,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            panel(
                "Messages lost (last 15 min)",
                "A",
                any_with("reason", "group_expired", 1.0),
            ),
        );
    }
    log(t0, "orphan (backlog growing) and expiring (5 messages) have no member");

    // A broadcast queue that fills to over 90 % and drains at once, between
    // two scrapes.
    let mut narrow = BrokerClient::new(channel(&url, true).await);
    let bursty = open(&mut narrow, broadcast("bursty", "live.bursty")).await;
    let mut depth = 0;
    let mut published = 0;
    while depth < BURST_DEPTH {
        client.publish(publish("live.bursty", 2048)).await.unwrap();
        published += 1;
        assert!(published < 10_000, "the bursty queue never filled");
        depth = queue_depth(&mut admin, "bursty").await.expect("bursty is open");
    }
    let burst = SystemTime::now();
    drain(bursty);
    wait_for("the bursty queue to drain", || {
        let mut admin = admin.clone();
        async move { queue_depth(&mut admin, "bursty").await == Some(0) }
    })
    .await;
    log(
        t0,
        &format!(
            "bursty filled to {depth}/{CAPACITY} and drained in {:.0} ms",
            burst.elapsed().unwrap().as_secs_f64() * 1000.0
        ),
    );
    {
        let mut w = watched.lock().unwrap();
        w.add(
            "panel \"Queue depth per subscription\" shows bursty's peak",
            burst,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel(
                "Queue depth per subscription (top 20 by peak)",
                "A",
                any_with("subscription_id", "bursty", BURST_DEPTH as f64),
            ),
        );
        w.add(
            "panel \"Queue fill ratio\" counts a queue over 90 % full",
            burst,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Queue fill ratio", "D", total_at_least(1.0)),
        );
    }

    // A slow subscriber that stops reading is evicted.
    let slow = open(&mut narrow, broadcast("slow-1", "live.slow")).await;
    let mut flooded = 0;
    let eviction = loop {
        flooded += 50;
        assert!(flooded < 100_000, "slow-1 was never evicted");
        let requests: Vec<_> = (0..50).map(|_| publish("live.slow", 4096)).collect();
        client.publish_stream(futures::stream::iter(requests)).await.unwrap();
        let evictions = common::evictions(&mut admin).await;
        if let Some(e) = evictions.into_iter().find(|e| e.subscription_id == "slow-1") {
            break e;
        }
    };
    drop(slow);
    let at = eviction.evicted_at.expect("evicted_at");
    let evicted_at = SystemTime::UNIX_EPOCH + Duration::new(at.seconds as u64, at.nanos as u32);
    let peer = eviction.peer_address.clone();
    log(
        t0,
        &format!("slow-1 ({peer}) evicted at depth {}", eviction.queue_depth),
    );
    {
        let mut w = watched.lock().unwrap();
        w.add(
            "alert TinybrokerSubscriptionsEvicted names slow-1",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            alert("TinybrokerSubscriptionsEvicted", "subscription_id", "slow-1"),
        );
        w.add(
            "panel \"Recently evicted subscribers\" names slow-1 and its peer",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Recently evicted subscribers (last 15 min)", "A", {
                let peer = peer.clone();
                move |r: &[Sample]| {
                    r.iter().any(|s| {
                        s.has("subscription_id", "slow-1")
                            && s.has("peer", &peer)
                            && s.has("topic_patterns", "live.slow")
                    })
                }
            }),
        );
        w.add(
            "panel \"Evictions (last 15 min)\" counts it",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Evictions (last 15 min)", "A", total_at_least(1.0)),
        );
        w.add(
            "panel \"Messages lost\" shows evicted",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Messages lost (last 15 min)", "A", any_with("reason", "evicted", 1.0)),
        );
    }

    // Wait until every watch is seen, or one is past its promise.
    let late = loop {
        let (done, late) = {
            let w = watched.lock().unwrap();
            let now = SystemTime::now();
            let late: Vec<String> = w
                .watches
                .iter()
                .filter(|w| w.seen.is_none() && now > w.start + w.promise + SLACK + POLL)
                .map(|w| w.what.clone())
                .collect();
            (w.watches.iter().all(|w| w.seen.is_some()), late)
        };
        if done || !late.is_empty() {
            break late;
        }
        tokio::time::sleep(POLL).await;
    };
    log(t0, "every situation seen (or one is late)");

    // Every dashboard query evaluates and returns data, now that everything
    // happened; the cluster-mode panels (tinybroker_nats_*) have none from
    // this single-node broker, and tests/cluster.rs checks those series.
    let mut no_data = Vec::new();
    for (title, ref_id, expr) in &queries {
        let cluster_only = expr.contains("tinybroker_nats_");
        match prometheus.query(expr).await {
            Ok(r) if !r.is_empty() => {}
            Ok(_) if cluster_only => {}
            Ok(_) => no_data.push(format!("{title} {ref_id}: no data\n    {expr}")),
            Err(e) => no_data.push(format!("{title} {ref_id}: {e}")),
        }
    }
    watcher.abort();
    drop(busy);
    stop.cancel();
    steady.await.unwrap();
    orphan_publisher.await.unwrap();
    for task in healthy {
        task.abort();
    }

    // The report.
    let w = watched.lock().unwrap();
    println!(
        "\n{:<92} {:>10} {:>8} {:>10}",
        "situation → alert / panel", "1 s scrape", "promise", "at 30 s"
    );
    let mut failures = Vec::new();
    for watch in &w.watches {
        let took = watch
            .seen
            .map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()));
        println!(
            "{:<92} {:>10} {:>6.0} s {:>10}",
            watch.what,
            took,
            watch.promise.as_secs_f64(),
            watch.promise_30s
        );
        match watch.seen {
            None => failures.push(format!("never seen: {}", watch.what)),
            Some(d) if d > watch.promise + SLACK => failures.push(format!(
                "{}: after {:.1} s, promised {:?} (+{SLACK:?} slack)",
                watch.what,
                d.as_secs_f64(),
                watch.promise
            )),
            Some(d) if d < watch.earliest => failures.push(format!(
                "{}: already after {:.1} s, before its {:?} threshold",
                watch.what,
                d.as_secs_f64(),
                watch.earliest
            )),
            Some(_) => {}
        }
    }
    failures.extend(late.into_iter().map(|l| format!("late: {l}")));
    let expected: BTreeSet<(String, String)> = [
        ("TinybrokerSubscriptionsEvicted", "slow-1"),
        ("TinybrokerConsumerGroupStuck", "stuck-long"),
        ("TinybrokerConsumerGroupStuck", "stuck-short"),
        ("TinybrokerConsumerGroupWithoutMembers", "orphan"),
        ("TinybrokerConsumerGroupWithoutMembers", "expiring"),
        ("TinybrokerConsumerGroupRemovedWithBacklog", "orphan"),
        ("TinybrokerConsumerGroupRemovedWithBacklog", "expiring"),
        ("TinybrokerConsumerGroupMemberHung", "busy-hung"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    let unexpected: Vec<_> = w.fired.difference(&expected).collect();
    if !unexpected.is_empty() {
        failures.push(format!("alerts that should not have fired: {unexpected:?}"));
    }
    failures.extend(no_data);
    let unthresholded = panels_without_thresholds();
    if !unthresholded.is_empty() {
        failures.push(format!("panels without thresholds: {unthresholded:?}"));
    }
    if !w.errors.is_empty() {
        println!(
            "prometheus API errors while polling (first 5): {:?}",
            &w.errors[..w.errors.len().min(5)]
        );
    }
    drop(w);

    // The log lines the alerts point to.
    let lines = broker.drain_lines().join("\n");
    std::fs::write(dir.join("broker.log"), &lines).unwrap();
    for (needle, field) in [
        ("slow consumer evicted: its queue was full", "subscription_id=slow-1"),
        ("consumer group stalled", r#"consumer_group="stuck-long""#),
        ("consumer group stalled", r#"consumer_group="stuck-short""#),
        ("consumer group stalled", r#"consumer_group="orphan""#),
        (
            "consumer group removed after its idle TTL with no members",
            r#"consumer_group="orphan""#,
        ),
        (
            "consumer group removed after its idle TTL with no members",
            r#"consumer_group="expiring""#,
        ),
    ] {
        if !lines
            .lines()
            .any(|l| l.contains("WARN") && l.contains(needle) && l.contains(field))
        {
            failures.push(format!("no WARN log line {needle:?} with {field}"));
        }
    }
    log(
        t0,
        &format!(
            "session over: {} situations watched, {} dashboard queries, 6 log lines, {} problem(s)",
            watched.lock().unwrap().watches.len(),
            queries.len(),
            failures.len()
        ),
    );
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}\n(broker and prometheus logs in {})",
        failures.len(),
        failures.join("\n"),
        dir.display()
    );
}

// === cluster mode: two replicas, known counts ===

/// TINYBROKER_GROUP_IDLE_TTL_SECONDS of the cluster session's replicas.
const CLUSTER_TTL: Duration = Duration::from_secs(20);
/// The range counter panels are read over in the cluster session: longer
/// than the session, so `rate(x[WHOLE]) * WHOLE` is all that happened.
const WHOLE: &str = "10m";
const WHOLE_SECONDS: f64 = 600.0;
/// How long the cluster session's checks may take to agree with what
/// happened (a heartbeat's gathering, 2 s, then a scrape, 1 s, and room).
const SETTLE: Duration = Duration::from_secs(20);
/// How long every check must hold, evaluated again and again, to count:
/// longer than a heartbeat and a scrape, so a sum that only looks right
/// while one replica's gathering lags behind the other's does not pass.
const STEADY: Duration = Duration::from_secs(4);

/// A dashboard query or a rule's expression as the cluster session reads
/// it: over every instance (Grafana's "All"), counters over [`WHOLE`], and
/// the 45 s thresholds of stalls and memberless groups at 5 s, the 1000
/// messages of a growing backlog at 0 (the thresholds themselves, and how
/// soon each fires, are the single-node session's; here it is how a
/// query adds up the replicas).
fn cluster_fill(expr: &str) -> String {
    expr.replace("$__rate_interval", WHOLE)
        .replace("$__interval", "1s")
        .replace("$__range", WHOLE)
        .replace("$job", JOB)
        .replace("$instance", ".*")
        .replace("> 45", "> 5")
        .replace("> 1000", "> 0")
}

/// Every (alert name, expression) of deploy/monitoring/alerts.yaml.
fn alert_rules() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring/alerts.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut rules = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.trim().strip_prefix("- alert: ") else {
            continue;
        };
        let (at, expr_line) = lines[i + 1..]
            .iter()
            .enumerate()
            .find(|(_, l)| l.trim_start().starts_with("expr:"))
            .unwrap_or_else(|| panic!("{name} has an expr"));
        let at = i + 1 + at;
        let first = expr_line.trim_start().trim_start_matches("expr:").trim();
        let expr = if first == ">-" {
            lines[at + 1..]
                .iter()
                .take_while(|l| indent(l) > indent(expr_line) && !l.trim().is_empty())
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            first.to_owned()
        };
        rules.push((name.to_owned(), expr));
    }
    rules
}

/// Whether a query reads a consumer-group metric, or the drops (group
/// overflow and expiry among them).
fn about_groups(expr: &str) -> bool {
    [
        "tinybroker_consumer_group_",
        "tinybroker_redeliveries_total",
        "tinybroker_dead_lettered_total",
        "tinybroker_recent_group_removal_",
        "tinybroker_messages_dropped_total",
    ]
    .iter()
    .any(|metric| expr.contains(metric))
}

/// One series a check wants: the one whose `label` is `value` ("" for the
/// single series of a stat), its value (times the check's scale) within
/// `lo..=hi`.
struct Want {
    label: &'static str,
    value: String,
    lo: f64,
    hi: f64,
}

fn exactly(label: &'static str, value: &str, n: f64) -> Want {
    Want {
        label,
        value: value.to_owned(),
        lo: n - 0.01,
        hi: n + 0.01,
    }
}

/// A count read through `rate` or `increase`, which extrapolate a little
/// past the last sample: at least `n - 0.5`, at most 10 % above.
fn about(label: &'static str, value: &str, n: f64) -> Want {
    Want {
        label,
        value: value.to_owned(),
        lo: n - 0.5,
        hi: n * 1.1 + 0.5,
    }
}

/// Seconds since `since`, as a gauge refreshed every heartbeat (2 s) and
/// scraped every second shows them (started up to 2 s late).
fn aged(label: &'static str, value: &str, since: Instant) -> Want {
    let seconds = since.elapsed().as_secs_f64();
    Want {
        label,
        value: value.to_owned(),
        lo: seconds - 6.0,
        hi: seconds + 1.5,
    }
}

struct ClusterCheck {
    what: String,
    expr: String,
    /// What each series is multiplied by first ([`WHOLE_SECONDS`] for rates).
    scale: f64,
    /// The wanted series, worked out when checked (ages change).
    wants: Box<dyn Fn() -> Vec<Want> + Send>,
    /// No series but the wanted ones (rules: an alert for no other group).
    only: bool,
    /// Why the last evaluation did not match; None when it did.
    failing: Option<String>,
}

impl ClusterCheck {
    fn judge(&self, samples: &[Sample]) -> Result<(), String> {
        let wants = (self.wants)();
        let shown = || {
            samples
                .iter()
                .map(|s| format!("{:?}={}", s.labels, s.value * self.scale))
                .collect::<Vec<_>>()
                .join(", ")
        };
        for want in &wants {
            let matching: Vec<f64> = samples
                .iter()
                .filter(|s| want.label.is_empty() || s.has(want.label, &want.value))
                .map(|s| s.value * self.scale)
                .collect();
            match matching[..] {
                [v] if (want.lo..=want.hi).contains(&v) => {}
                _ => {
                    return Err(format!(
                        "{}={} wanted once in {:.2}..={:.2}; got [{}]",
                        want.label,
                        want.value,
                        want.lo,
                        want.hi,
                        shown()
                    ));
                }
            }
        }
        if self.only && samples.len() != wants.len() {
            return Err(format!("only {} series wanted; got [{}]", wants.len(), shown()));
        }
        Ok(())
    }
}

/// Evaluates every check, all of them every [`POLL`], until all have held
/// together for [`STEADY`], or [`SETTLE`] passed; what did not match in the
/// last round, with its result.
async fn settle(prometheus: &Prometheus, checks: &mut [ClusterCheck]) -> Vec<String> {
    let deadline = Instant::now() + SETTLE + STEADY;
    let mut holding_since: Option<Instant> = None;
    loop {
        for check in checks.iter_mut() {
            check.failing = match prometheus.query(&check.expr).await {
                Ok(samples) => check.judge(&samples).err(),
                Err(e) => Some(e),
            };
        }
        let failing: Vec<String> = checks
            .iter()
            .filter_map(|c| {
                c.failing
                    .as_ref()
                    .map(|why| format!("{}: {why}\n    {}", c.what, c.expr))
            })
            .collect();
        if !failing.is_empty() {
            holding_since = None;
        } else if holding_since.get_or_insert_with(Instant::now).elapsed() >= STEADY {
            return failing;
        }
        if Instant::now() > deadline {
            return if failing.is_empty() {
                vec![format!("the checks never held together for {STEADY:?}")]
            } else {
                failing
            };
        }
        tokio::time::sleep(POLL).await;
    }
}

/// What the clients of the cluster session saw: the truth the dashboard
/// must add up to.
#[derive(Default)]
struct Seen {
    /// Messages read from group members' streams, every group.
    group_deliveries: std::sync::atomic::AtomicU64,
    /// Of those, the group `counted`'s.
    counted: std::sync::atomic::AtomicU64,
    /// Of `counted`'s, redeliveries (`delivery_attempt` above 1).
    redelivered: std::sync::atomic::AtomicU64,
    /// Acks answered `acked: 1`.
    acked: std::sync::atomic::AtomicU64,
    /// Messages read from broadcast streams (dead letters included).
    broadcast_deliveries: std::sync::atomic::AtomicU64,
    dead_letters: std::sync::atomic::AtomicU64,
}

fn bump(counter: &std::sync::atomic::AtomicU64) {
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn read(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

/// A member of `counted`: acks message i < 12 at once (through the other
/// replica: a forwarded Ack), nacks 12..16 once and acks the redelivery,
/// and nacks 16..20 every time (two attempts: dead-lettered).
fn counted_member(
    mut stream: tonic::Streaming<pb::Message>,
    id: String,
    mut own: BrokerClient<Channel>,
    mut other: BrokerClient<Channel>,
    seen: Arc<Seen>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(Some(m)) = stream.message().await {
            bump(&seen.group_deliveries);
            bump(&seen.counted);
            if m.delivery_attempt > 1 {
                bump(&seen.redelivered);
            }
            let i: u32 = std::str::from_utf8(&m.payload).unwrap().parse().unwrap();
            let ack = i < 12 || (i < 16 && m.delivery_attempt > 1);
            if ack {
                let r = other
                    .ack(pb::AckRequest {
                        subscription_id: id.clone(),
                        sequences: vec![m.sequence],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                for _ in 0..r.acked {
                    bump(&seen.acked);
                }
            } else {
                own.nack(pb::NackRequest {
                    subscription_id: id.clone(),
                    sequences: vec![m.sequence],
                })
                .await
                .unwrap();
            }
        }
    })
}

/// Reads a stream to its end, counting each message into `which` of `seen`.
fn count_into(
    mut stream: tonic::Streaming<pb::Message>,
    seen: Arc<Seen>,
    which: fn(&Seen) -> Vec<&std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(Some(_)) = stream.message().await {
            for counter in which(&seen) {
                bump(counter);
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the prometheus server and nats-server, about 40 s; run by scripts/check-alerts-live.sh"]
async fn dashboard_and_alerts_add_up_two_replicas_to_the_known_totals() {
    let nats = common::nats::NatsCluster::start(1).await;
    let dir = temp_dir();
    let outcome = tokio::time::timeout(SESSION_TIMEOUT, cluster_session(&dir, &nats)).await;
    match outcome {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Err(_) => panic!("session timed out after {SESSION_TIMEOUT:?}; logs in {}", dir.display()),
    }
}

/// A member of group `<group>` on `mon.<group>`, MANUAL.
fn cluster_member(group: &str, max_in_flight: u32, ack_deadline_ms: u32) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        max_in_flight,
        ..member(group, &format!("mon.{group}"), true, ack_deadline_ms)
    }
}

/// Target `ref_id` of the dashboard panel `title`, as written.
fn target(title: &str, ref_id: &str) -> String {
    dashboard_targets()
        .into_iter()
        .find(|(t, r, _)| t == title && r == ref_id)
        .map(|(_, _, expr)| expr)
        .unwrap_or_else(|| panic!("the dashboard has no panel {title:?} {ref_id}"))
}

type Wants = Box<dyn Fn() -> Vec<Want> + Send>;

fn check(what: String, expr: String, scale: f64, only: bool, wants: Wants) -> ClusterCheck {
    ClusterCheck {
        what,
        expr,
        scale,
        wants,
        only,
        failing: Some("not evaluated yet".into()),
    }
}

async fn cluster_session(dir: &Path, nats: &common::nats::NatsCluster) {
    let t0 = Instant::now();
    let mut replicas = Vec::new();
    for id in ["a", "b"] {
        let env = vec![
            ("TINYBROKER_NATS_URL", nats.url(0)),
            ("TINYBROKER_NATS_PREFIX", "mon".to_owned()),
            ("TINYBROKER_NATS_REPLICAS", "1".to_owned()),
            ("TINYBROKER_REPLICA_ID", id.to_owned()),
            ("TINYBROKER_MAX_DELIVERY_ATTEMPTS", "2".to_owned()),
            ("TINYBROKER_GROUP_CAPACITY", "30".to_owned()),
            ("TINYBROKER_GROUP_MAX_BYTES", "1048576".to_owned()),
            ("TINYBROKER_GROUP_IDLE_TTL_SECONDS", CLUSTER_TTL.as_secs().to_string()),
            ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1".to_owned()),
        ];
        let replica = tokio::task::spawn_blocking(move || BrokerProcess::spawn(&env))
            .await
            .unwrap();
        common::wait_serving_at(&replica.url()).await;
        replicas.push(replica);
    }
    let (a, b) = (&replicas[0], &replicas[1]);
    log(t0, &format!("replicas a ({}) and b ({}) serve", a.url(), b.url()));
    let (prometheus, _prometheus_process) = Prometheus::start(dir, &[a.metrics_addr, b.metrics_addr]).await;
    log(
        t0,
        &format!("prometheus up on {} (logs in {})", prometheus.addr, dir.display()),
    );

    let clients = [
        BrokerClient::new(channel(&a.url(), false).await),
        BrokerClient::new(channel(&b.url(), false).await),
    ];
    let admin = AdminClient::new(channel(&a.url(), false).await);
    let seen = Arc::new(Seen::default());

    // The groups, before anything is counted: `counted` (a member on a and
    // one on b), `holding` (a member on each that never acks, 3 in flight
    // each), `overflow` (one member holding 1, a backlog of 30 at most)
    // and `waiting` (its only member leaves).
    let mut tasks = Vec::new();
    for i in 0..2 {
        let mut client = clients[i].clone();
        let (stream, id) = common::open(&mut client, cluster_member("counted", 20, 3_600_000)).await;
        tasks.push(counted_member(
            stream,
            id,
            client.clone(),
            clients[1 - i].clone(),
            seen.clone(),
        ));
        let (stream, _) = common::open(&mut client, cluster_member("holding", 3, 3_600_000)).await;
        tasks.push(count_into(stream, seen.clone(), |s| vec![&s.group_deliveries]));
    }
    let (stream, _) = common::open(&mut clients[0].clone(), cluster_member("overflow", 1, 3_600_000)).await;
    tasks.push(count_into(stream, seen.clone(), |s| vec![&s.group_deliveries]));
    let (stream, _) = common::open(&mut clients[1].clone(), cluster_member("waiting", 1, 0)).await;
    drop(stream);
    wait_for("waiting's member to leave", || {
        let mut admin = admin.clone();
        async move { group_members(&mut admin, "waiting").await == Some(0) }
    })
    .await;
    let waiting_since = Instant::now();
    for client in &clients {
        let (stream, _) = common::open(&mut client.clone(), broadcast("", "mon.live")).await;
        tasks.push(count_into(stream, seen.clone(), |s| vec![&s.broadcast_deliveries]));
    }
    let (stream, _) = common::open(&mut clients[0].clone(), broadcast("", "_dlq.counted")).await;
    tasks.push(count_into(stream, seen.clone(), |s| {
        vec![&s.broadcast_deliveries, &s.dead_letters]
    }));
    // Every group's counters scraped at 0 from both replicas first: a
    // series that first appears above 0 loses its first count to rate().
    wait_for("every group's counters at 0 on both replicas", || {
        let p = &prometheus;
        async move {
            p.query("count by (consumer_group) (tinybroker_consumer_group_delivered_total == 0)")
                .await
                .is_ok_and(|r| r.len() == 4 && r.iter().all(|s| s.value == 2.0))
        }
    })
    .await;
    log(t0, "4 groups, their counters at 0 on both replicas");

    // The known counts, published through both replicas in turn.
    let through = |i: usize| clients[i % 2].clone();
    for i in 0..20 {
        through(i).publish(publish("mon.live", 10)).await.unwrap();
        let mut job = publish("mon.counted", 0);
        job.payload = i.to_string().into_bytes().into();
        through(i).publish(job).await.unwrap();
    }
    let holding_since = Instant::now();
    for i in 0..10 {
        through(i).publish(publish("mon.holding", 10)).await.unwrap();
    }
    let overflow_since = Instant::now();
    for i in 0..35 {
        through(i).publish(publish("mon.overflow", 10)).await.unwrap();
    }
    for i in 0..5 {
        through(i).publish(publish("mon.waiting", 10)).await.unwrap();
    }
    wait_for("the clients to see every delivery, ack and dead letter", || {
        let seen = seen.clone();
        async move {
            read(&seen.counted) == 28
                && read(&seen.acked) == 16
                && read(&seen.dead_letters) == 4
                && read(&seen.group_deliveries) == 28 + 6 + 1
                && read(&seen.broadcast_deliveries) == 2 * 20 + 4
        }
    })
    .await;
    assert_eq!(read(&seen.redelivered), 8, "redeliveries seen by the members");
    log(
        t0,
        "seen by the clients: 35 group deliveries (28 of counted, 8 redelivered), 16 acks, 4 dead letters, 44 broadcast deliveries",
    );
    // Admin's cluster-wide view says the same.
    wait_for("Admin to list the known counts", || {
        let mut admin = admin.clone();
        async move {
            let groups = common::groups(&mut admin).await;
            let g = |name: &str| groups.iter().find(|g| g.name == name).cloned();
            matches!(
                (g("counted"), g("overflow")),
                (Some(c), Some(o)) if (c.redeliveries, c.dead_lettered, o.dropped) == (8, 4, 5)
            )
        }
    })
    .await;

    // Every consumer-group panel and rule, over the two replicas.
    let rules = alert_rules();
    let rule = |name: &str| {
        let (_, expr) = rules
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("alerts.yaml has no rule {name}"));
        cluster_fill(expr)
    };
    let cg = "consumer_group";
    let gauges = |values: [(&'static str, f64); 4]| -> Wants {
        Box::new(move || values.iter().map(|(g, n)| exactly("consumer_group", g, *n)).collect())
    };
    let backlog = [("counted", 0.0), ("holding", 4.0), ("overflow", 29.0), ("waiting", 5.0)];
    let in_flight = [("counted", 0.0), ("holding", 6.0), ("overflow", 1.0), ("waiting", 0.0)];
    let members = [("counted", 2.0), ("holding", 2.0), ("overflow", 1.0), ("waiting", 0.0)];
    let stalled = move || -> Wants {
        Box::new(move || {
            vec![
                exactly("consumer_group", "counted", 0.0),
                aged("consumer_group", "holding", holding_since),
                aged("consumer_group", "overflow", overflow_since),
            ]
        })
    };
    let memberless = move || -> Wants {
        Box::new(move || {
            vec![
                exactly("consumer_group", "counted", 0.0),
                aged("consumer_group", "waiting", waiting_since),
            ]
        })
    };
    let mut checks: Vec<ClusterCheck> = Vec::new();
    let mut checked: BTreeSet<String> = BTreeSet::new();
    let mut add_panel = |title: &str, ref_id: &str, scale: f64, wants: Wants| {
        checked.insert(format!("{title} {ref_id}"));
        let expr = cluster_fill(&target(title, ref_id));
        checks.push(check(format!("panel {title:?} {ref_id}"), expr, scale, false, wants));
    };
    add_panel("Group backlog", "A", 1.0, gauges(backlog));
    add_panel("Group in flight", "A", 1.0, gauges(in_flight));
    add_panel("Group members", "A", 1.0, gauges(members));
    add_panel("Seconds without progress per group", "A", 1.0, stalled());
    add_panel("Oldest unacked message age", "A", 1.0, stalled());
    add_panel("Seconds without members per group", "A", 1.0, memberless());
    add_panel(
        "Acked and delivered per group",
        "A",
        WHOLE_SECONDS,
        Box::new(move || {
            vec![
                about(cg, "counted", 28.0),
                about(cg, "holding", 6.0),
                about(cg, "overflow", 1.0),
            ]
        }),
    );
    add_panel(
        "Acked and delivered per group",
        "B",
        WHOLE_SECONDS,
        Box::new(move || vec![about(cg, "counted", 16.0), exactly(cg, "holding", 0.0)]),
    );
    add_panel(
        "Redeliveries and dead letters",
        "A",
        WHOLE_SECONDS,
        Box::new(move || vec![about(cg, "counted", 8.0), exactly(cg, "holding", 0.0)]),
    );
    add_panel(
        "Redeliveries and dead letters",
        "B",
        WHOLE_SECONDS,
        Box::new(move || vec![about(cg, "counted", 4.0), exactly(cg, "holding", 0.0)]),
    );
    let table = "Consumer groups, most stalled first";
    add_panel(table, "A", 1.0, stalled());
    add_panel(table, "B", 1.0, memberless());
    add_panel(table, "C", 1.0, gauges(backlog));
    add_panel(table, "D", 1.0, gauges(in_flight));
    add_panel(table, "E", 1.0, gauges(members));
    add_panel(table, "F", 1.0, Box::new(move || vec![about(cg, "counted", 8.0)]));
    add_panel(
        "Stuck consumer groups",
        "A",
        1.0,
        Box::new(|| vec![exactly("", "", 2.0)]),
    );
    add_panel(
        "Groups without members, messages waiting",
        "A",
        1.0,
        Box::new(|| vec![exactly("", "", 1.0)]),
    );
    add_panel(
        "Messages lost (last 15 min)",
        "A",
        1.0,
        Box::new(|| vec![about("reason", "group_overflow", 5.0)]),
    );
    add_panel(
        "Dropped messages",
        "A",
        WHOLE_SECONDS,
        Box::new(|| vec![about("reason", "group_overflow", 5.0)]),
    );
    // Not about groups alone, but counters and gauges all the same.
    add_panel(
        "Delivery rate",
        "A",
        WHOLE_SECONDS,
        Box::new(|| vec![about("mode", "multi", 44.0), about("mode", "single", 35.0)]),
    );
    add_panel(
        "Publish rate",
        "A",
        WHOLE_SECONDS,
        Box::new(|| vec![about("", "", 20.0 + 20.0 + 10.0 + 35.0 + 5.0 + 4.0)]),
    );
    add_panel(
        "Open subscriptions",
        "A",
        1.0,
        Box::new(|| vec![exactly("mode", "multi", 3.0), exactly("mode", "single", 5.0)]),
    );
    let mut add_rule = |name: &str, wants: Wants| {
        checked.insert(name.to_owned());
        checks.push(check(format!("rule {name}"), rule(name), 1.0, true, wants));
    };
    add_rule(
        "TinybrokerConsumerGroupStuck",
        Box::new(move || vec![aged(cg, "holding", holding_since), aged(cg, "overflow", overflow_since)]),
    );
    add_rule(
        "TinybrokerConsumerGroupWithoutMembers",
        Box::new(move || vec![aged(cg, "waiting", waiting_since)]),
    );
    add_rule(
        "TinybrokerConsumerGroupBacklogGrowing",
        Box::new(|| vec![exactly(cg, "holding", 4.0), exactly(cg, "overflow", 29.0)]),
    );
    add_rule(
        "TinybrokerMessagesDropped",
        Box::new(|| vec![about("reason", "group_overflow", 5.0)]),
    );
    add_rule(
        "TinybrokerMessagesDeadLettered",
        Box::new(|| vec![about(cg, "counted", 4.0)]),
    );
    // Every clock far enough along that a gauge stuck at 0 reads wrong.
    wait_for("every group clock to pass 8 s", || async {
        [waiting_since, holding_since, overflow_since]
            .iter()
            .all(|since| since.elapsed() > Duration::from_secs(8))
    })
    .await;
    let mut failures = settle(&prometheus, &mut checks).await;
    log(
        t0,
        &format!(
            "{} checks while every group lives: {} failing",
            checks.len(),
            failures.len()
        ),
    );

    // `waiting` is removed with its 5 messages after its idle TTL.
    wait_for_long("waiting to be removed after its idle TTL", CLUSTER_TTL + SETTLE, || {
        let mut admin = admin.clone();
        async move { group_members(&mut admin, "waiting").await.is_none() }
    })
    .await;
    let removed_at = SystemTime::now();
    log(t0, "waiting removed after its idle TTL");
    let mut after: Vec<ClusterCheck> = Vec::new();
    {
        let mut add = |what: String, expr: String, only: bool, wants: Wants| {
            after.push(check(what, expr, 1.0, only, wants));
        };
        let title = "Groups removed with messages (last 15 min)";
        checked.insert(format!("{title} A"));
        add(
            format!("panel {title:?} A"),
            cluster_fill(&target(title, "A")),
            false,
            Box::new(|| vec![exactly("", "", 1.0)]),
        );
        let title = "Groups removed with their messages (last 15 min)";
        checked.insert(format!("{title} A"));
        add(
            format!("panel {title:?} A"),
            cluster_fill(&target(title, "A")),
            true,
            Box::new(move || vec![exactly(cg, "waiting", 5.0)]),
        );
        checked.insert(format!("{title} B"));
        let removed_ms = removed_at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64() * 1000.0;
        add(
            format!("panel {title:?} B"),
            cluster_fill(&target(title, "B")),
            true,
            Box::new(move || {
                vec![Want {
                    label: "consumer_group",
                    value: "waiting".into(),
                    lo: removed_ms - (CLUSTER_TTL + SETTLE).as_secs_f64() * 1000.0,
                    hi: removed_ms,
                }]
            }),
        );
        add(
            "panel \"Messages lost (last 15 min)\" A, after the removal".into(),
            cluster_fill(&target("Messages lost (last 15 min)", "A")),
            false,
            Box::new(|| {
                vec![
                    about("reason", "group_overflow", 5.0),
                    about("reason", "group_expired", 5.0),
                ]
            }),
        );
        checked.insert("TinybrokerConsumerGroupRemovedWithBacklog".into());
        add(
            "rule TinybrokerConsumerGroupRemovedWithBacklog".into(),
            rule("TinybrokerConsumerGroupRemovedWithBacklog"),
            true,
            Box::new(move || vec![exactly(cg, "waiting", 5.0)]),
        );
    }
    failures.extend(settle(&prometheus, &mut after).await);
    log(t0, &format!("{} checks after the removal", after.len()));

    // Issue 42 across replicas: straggle-hung on replica a holds its 2
    // messages and never acks, straggle-ok on b acks each one it gets while
    // a message comes every 200 ms. b counts the acks, a reports the hung
    // member's stall: the rule, over both, names the member once.
    let straggle = |id: &str| pb::OpenSubscriptionRequest {
        subscription_id: id.into(),
        ..cluster_member("straggle", 2, 3_600_000)
    };
    let (stream, _) = common::open(&mut clients[0].clone(), straggle("straggle-hung")).await;
    tasks.push(count_into(stream, seen.clone(), |_| Vec::new()));
    let (mut stream, _) = common::open(&mut clients[1].clone(), straggle("straggle-ok")).await;
    let mut acker = clients[1].clone();
    tasks.push(tokio::spawn(async move {
        while let Ok(Some(m)) = stream.message().await {
            common::ack(&mut acker, "straggle-ok", &[m.sequence]).await;
        }
    }));
    let straggle_since = Instant::now();
    let straggle_publisher = {
        let clients = clients.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let mut client = clients[i % 2].clone();
                if client.publish(publish("mon.straggle", 10)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    wait_for("straggle-hung to hold its 2 messages", || {
        let mut admin = admin.clone();
        async move {
            common::listed(list_subscriptions(&mut admin).await, "straggle-hung").is_some_and(|s| s.unacked == 2)
        }
    })
    .await;
    wait_for("straggle-hung's stall to pass 8 s", || async {
        straggle_since.elapsed() > Duration::from_secs(8)
    })
    .await;
    checked.insert("TinybrokerConsumerGroupMemberHung".into());
    let mut hung = vec![check(
        "rule TinybrokerConsumerGroupMemberHung".into(),
        rule("TinybrokerConsumerGroupMemberHung"),
        1.0,
        true,
        Box::new(move || vec![aged("subscription_id", "straggle-hung", straggle_since)]),
    )];
    failures.extend(settle(&prometheus, &mut hung).await);
    straggle_publisher.abort();
    log(t0, "straggle-hung named once across the replicas");

    // Every group panel and rule was checked.
    for (title, ref_id, expr) in dashboard_targets() {
        if about_groups(&expr) && !checked.contains(&format!("{title} {ref_id}")) {
            failures.push(format!(
                "panel {title:?} {ref_id} reads group metrics and is not checked here"
            ));
        }
    }
    for (name, expr) in &rules {
        if about_groups(expr) && !checked.contains(name) {
            failures.push(format!("rule {name} reads group metrics and is not checked here"));
        }
    }
    for task in tasks {
        task.abort();
    }
    for (id, replica) in ["a", "b"].iter().zip(&replicas) {
        std::fs::write(dir.join(format!("replica-{id}.log")), replica.drain_lines().join("\n")).unwrap();
    }
    log(
        t0,
        &format!(
            "session over: {} checks, {} problem(s)",
            checks.len() + after.len(),
            failures.len()
        ),
    );
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}\n(replica and prometheus logs in {})",
        failures.len(),
        failures.join("\n"),
        dir.display()
    );
}
