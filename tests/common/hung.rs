//! A busy manual-ack group with one hung member, as issue 42 describes it:
//! three members that each hold their `max_in_flight` (messages arrive
//! faster than the group acks them, so a backlog grows), two of which ack
//! what they hold every [`ACK_EVERY`] while the third receives and never
//! acks. Every member's UNACKED reads its `max_in_flight`; only how long
//! each has held its oldest message tells the hung one apart.

use super::{TestBroker, member_request, publish_request};
use std::time::Duration;
use tinybroker::pb::broker_client::BrokerClient;
use tokio::task::JoinHandle;

/// Each member's `max_in_flight`.
pub const MAX_IN_FLIGHT: u32 = 4;
/// How often a healthy member acks what it received since.
pub const ACK_EVERY: Duration = Duration::from_millis(250);
/// Time between two publishes: 40 a second, more than the two healthy
/// members ack (2 x 4 every 250 ms = 32 a second).
const PUBLISH_EVERY: Duration = Duration::from_millis(25);

/// The group's members and publisher, running until dropped.
pub struct HungGroup {
    pub group: String,
    /// `<group>-hung`: receives and never acks.
    pub hung: String,
    /// `<group>-ok-1` and `<group>-ok-2`: ack every [`ACK_EVERY`].
    pub healthy: [String; 2],
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for HungGroup {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts group `group` on `broker` (with the cluster engine its members
/// are spread over the replicas), with the default ack deadline: the hung
/// member joins first, then the two healthy ones, then the publisher
/// starts on topic `<group>.job`.
pub async fn busy_group_with_a_hung_member(broker: &TestBroker, group: &str) -> HungGroup {
    let urls: Vec<String> = (0..broker.replica_count()).map(|i| broker.replica(i).url()).collect();
    busy_group_at(&urls, group, 0).await
}

/// The same on the brokers at `urls` (each client on the next one, in
/// turn), with `ack_deadline_ms` (0: the broker's default).
pub async fn busy_group_at(urls: &[String], group: &str, ack_deadline_ms: u32) -> HungGroup {
    let mut turn = 0;
    let mut next_client = || {
        turn += 1;
        let url = urls[(turn - 1) % urls.len()].clone();
        async move { BrokerClient::connect(url).await.unwrap() }
    };
    let pattern = format!("{group}.>");
    let hung = format!("{group}-hung");
    let healthy = [format!("{group}-ok-1"), format!("{group}-ok-2")];
    let mut tasks = Vec::new();
    for id in std::iter::once(&hung).chain(&healthy) {
        let mut client = next_client().await;
        let request = tinybroker::pb::OpenSubscriptionRequest {
            subscription_id: id.clone(),
            ack_deadline_ms,
            ..member_request(&[&pattern], group, true, MAX_IN_FLIGHT)
        };
        let (mut stream, _) = super::open(&mut client, request).await;
        if *id == hung {
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(_)) = stream.message().await {}
            }));
            continue;
        }
        let id = id.clone();
        tasks.push(tokio::spawn(async move {
            let mut received = Vec::new();
            let mut tick = tokio::time::interval(ACK_EVERY);
            loop {
                tokio::select! {
                    message = stream.message() => match message {
                        Ok(Some(m)) => received.push(m.sequence),
                        _ => return,
                    },
                    _ = tick.tick() => {
                        if !received.is_empty() {
                            super::ack(&mut client, &id, &std::mem::take(&mut received)).await;
                        }
                    }
                }
            }
        }));
    }
    let mut publisher = next_client().await;
    let topic = format!("{group}.job");
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(PUBLISH_EVERY);
        loop {
            tick.tick().await;
            if publisher.publish(publish_request(&topic, "job")).await.is_err() {
                return;
            }
        }
    }));
    HungGroup {
        group: group.to_owned(),
        hung,
        healthy,
        tasks,
    }
}
