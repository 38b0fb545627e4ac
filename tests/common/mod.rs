//! Test harness: starts a real broker on ephemeral 127.0.0.1 ports and hands
//! out generated tonic clients.

#![allow(dead_code)]

pub mod nats;
pub mod process;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tinybroker::config::{Config, Limits};
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

pub struct TestBroker {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
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
/// the embedded single-node engine). Suites that state the contract
/// (`tests/contract/`) run against whichever is picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestEngine {
    Memory,
}

pub fn test_engine() -> TestEngine {
    match std::env::var("TB_ENGINE").as_deref() {
        Err(_) | Ok("" | "memory") => TestEngine::Memory,
        Ok(other) => panic!("TB_ENGINE={other:?}: this tree has one engine, memory"),
    }
}

pub async fn start_with(config: Config) -> TestBroker {
    match test_engine() {
        TestEngine::Memory => start_embedded(config).await,
    }
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
    }
}

impl TestBroker {
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    pub async fn channel(&self) -> Channel {
        Endpoint::from_shared(self.url()).unwrap().connect().await.unwrap()
    }

    /// A channel whose HTTP/2 windows are large enough that the broker can
    /// push everything a test publishes without the client reading.
    pub async fn wide_channel(&self) -> Channel {
        Endpoint::from_shared(self.url())
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
        Endpoint::from_shared(self.url())
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

    /// Every open subscription as the Admin API lists it.
    pub async fn subscriptions(&self) -> Vec<pb::SubscriptionInfo> {
        subscriptions(&self.url()).await
    }

    /// The consumer group `name` as the Admin API lists it.
    pub async fn group(&self, name: &str) -> Option<pb::ConsumerGroupInfo> {
        groups(&mut self.admin().await)
            .await
            .into_iter()
            .find(|g| g.name == name)
    }

    /// Begins shutdown (as SIGTERM would).
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Triggers shutdown and waits for `server::run` to return.
    pub async fn stop(mut self) {
        self.trigger_shutdown();
        self.join().await;
    }

    pub async fn join(&mut self) {
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }

    pub async fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.metrics_addr, path).await
    }
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
