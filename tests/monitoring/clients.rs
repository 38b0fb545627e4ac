//! The broker clients both sessions use: channels, requests, streams
//! drained in the background, Admin listings, and waits.

use crate::common;
use std::time::{Duration, Instant, SystemTime};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tonic::transport::{Channel, Endpoint};

pub async fn channel(url: &str, narrow: bool) -> Channel {
    let mut endpoint = Endpoint::from_shared(url.to_owned()).unwrap();
    if narrow {
        // A client that stops reading stops the broker's writes soon.
        endpoint = endpoint
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535);
    }
    endpoint.connect().await.unwrap()
}

pub fn publish(topic: &str, bytes: usize) -> pb::PublishRequest {
    pb::PublishRequest {
        topic: topic.into(),
        payload: vec![b'x'; bytes].into(),
        headers: Default::default(),
    }
}

pub async fn open(
    client: &mut BrokerClient<Channel>,
    request: pb::OpenSubscriptionRequest,
) -> tonic::Streaming<pb::Message> {
    client.open_subscription(request).await.unwrap().into_inner()
}

pub fn broadcast(id: &str, pattern: &str) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        topic_patterns: vec![pattern.into()],
        subscription_id: id.into(),
        ..Default::default()
    }
}

pub fn member(group: &str, pattern: &str, manual: bool, ack_deadline_ms: u32) -> pb::OpenSubscriptionRequest {
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
pub fn drain(mut stream: tonic::Streaming<pb::Message>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move { while let Ok(Some(_)) = stream.message().await {} })
}

pub async fn group_members(admin: &mut AdminClient<Channel>, name: &str) -> Option<u32> {
    let groups = common::groups(admin).await;
    groups.into_iter().find(|g| g.name == name).map(|g| g.members)
}

pub async fn list_subscriptions(admin: &mut AdminClient<Channel>) -> Vec<pb::SubscriptionInfo> {
    admin
        .list_subscriptions(pb::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
}

pub async fn queue_depth(admin: &mut AdminClient<Channel>, id: &str) -> Option<u64> {
    common::listed(list_subscriptions(admin).await, id).map(|s| s.queue_depth)
}

/// Polls `check` every 20 ms for up to 20 s.
pub async fn wait_for<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    wait_for_long(what, Duration::from_secs(20), check).await;
}

/// Polls `check` every 20 ms for up to `limit`.
pub async fn wait_for_long<F, Fut>(what: &str, limit: Duration, mut check: F)
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
pub async fn abandoned_group(
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
