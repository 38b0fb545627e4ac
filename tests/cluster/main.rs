//! Cluster mode (docs/contract.md, "Cluster mode"): tinybroker replicas on
//! ephemeral ports over a real 3-node NATS cluster (tests/common/nats.rs),
//! each replica connected to a different NATS server first, with the stock
//! tonic clients. Without a nats-server >= 2.10 the tests fail, saying how
//! to install one (`.ci/run` does).
//!
//! - [`startup`]: what makes a replica serve, or refuse to: NATS absent
//!   then present, a NATS server too old, the message limit against NATS's
//!   max_payload, cluster mode from the environment;
//! - [`broadcast`]: broadcast across replicas: fan-out, subscription ids,
//!   core NATS carrying publishes only while another replica listens;
//! - [`groups`]: consumer groups across replicas: sharing the work, the
//!   group table, a group's stream refused or failing, idle TTL, a full
//!   backlog;
//! - [`redelivery`]: a group's messages handed back: Ack and Nack from any
//!   replica, Nacks and expired deadlines handed to another member,
//!   attempts counted on, dead letters;
//! - [`failover`]: a replica or its NATS server going away: streams ended
//!   and ids freed, another NATS server, rolling restarts under a
//!   broadcast subscriber, a killed replica's unacked messages, a
//!   SIGTERMed replica's acknowledged broadcasts (its outbox emptied, or
//!   what it could not hand to NATS counted);
//! - [`under_load`]: failure behaviour under load: a NATS stream leader
//!   killed and a rolling restart of replica processes, each under steady
//!   publishers and MANUAL members, no message published OK lost.

#[path = "../common/mod.rs"]
mod common;

mod broadcast;
mod failover;
mod groups;
mod redelivery;
mod startup;
mod under_load;

use common::nats::NatsCluster;
use common::*;
use std::time::Duration;
use tinybroker::config::Config;
use tinybroker::pb;
use tonic_health::pb::health_check_response::ServingStatus;

/// A replica named `id` connected to `urls` (its first server first).
fn replica_config(urls: Vec<String>, id: &str, prefix: &str) -> Config {
    common::replica_config(config(), urls, id, prefix, 3)
}

/// The URLs of `nats`, server `first` first.
fn urls_from(nats: &NatsCluster, first: usize) -> Vec<String> {
    let mut urls = nats.urls();
    urls.rotate_left(first);
    urls
}

async fn serving_status(broker: &TestBroker) -> Option<ServingStatus> {
    serving_status_at(&broker.url()).await
}

async fn wait_serving(broker: &TestBroker) {
    wait_serving_at(&broker.url()).await;
}

/// `n` replicas over `nats`, replica i connected to server i first, all
/// SERVING.
async fn replicas(nats: &NatsCluster, n: usize, prefix: &str) -> Vec<TestBroker> {
    replicas_with(nats, n, prefix, |_| {}).await
}

/// [`replicas`], each replica's configuration changed by `tweak` first.
async fn replicas_with(nats: &NatsCluster, n: usize, prefix: &str, tweak: impl Fn(&mut Config)) -> Vec<TestBroker> {
    let mut brokers = Vec::new();
    for i in 0..n {
        let mut config = replica_config(urls_from(nats, i % nats.len()), &format!("r{i}"), prefix);
        tweak(&mut config);
        brokers.push(start_with(config).await);
    }
    for broker in &brokers {
        wait_serving(broker).await;
    }
    brokers
}

/// A replica process (`tinybroker serve`, as a pod runs it) named `id`,
/// connected to server `first` of `nats` first, with a 2 s shutdown grace.
async fn spawn_replica(nats: &NatsCluster, first: usize, id: &str, prefix: &str) -> common::process::BrokerProcess {
    spawn_replica_with(nats, first, id, prefix, &[]).await
}

/// [`spawn_replica`] with the variables of `extra` set too.
async fn spawn_replica_with(
    nats: &NatsCluster,
    first: usize,
    id: &str,
    prefix: &str,
    extra: &[(&str, &str)],
) -> common::process::BrokerProcess {
    let mut env = vec![
        ("TINYBROKER_NATS_URL".to_owned(), urls_from(nats, first).join(",")),
        ("TINYBROKER_NATS_PREFIX".to_owned(), prefix.to_owned()),
        ("TINYBROKER_REPLICA_ID".to_owned(), id.to_owned()),
        ("TINYBROKER_SHUTDOWN_GRACE_SECONDS".to_owned(), "2".to_owned()),
    ];
    env.extend(extra.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())));
    let replica = tokio::task::spawn_blocking(move || common::process::BrokerProcess::spawn(&env))
        .await
        .unwrap();
    wait_until("the replica process to be SERVING", || async {
        serving_status_at(&replica.url()).await == Some(ServingStatus::Serving)
    })
    .await;
    replica
}

/// Publishes `n` messages to `topic` through `broker`; their sequences.
async fn publish_n(broker: &TestBroker, topic: &str, n: usize) -> Vec<u64> {
    let mut client = broker.client().await;
    let mut sequences = Vec::new();
    for i in 0..n {
        let r = client
            .publish(publish_request(topic, &format!("m{i}")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_groups, 1, "the group's stream took it");
        sequences.push(r.sequence);
    }
    sequences
}

/// Waits until `broker`'s Admin lists the one group with `n` members.
async fn wait_members(broker: &TestBroker, n: u32) {
    wait_until(&format!("the group to have {n} members"), || async move {
        groups(&mut broker.admin().await)
            .await
            .first()
            .is_some_and(|g| g.members == n)
    })
    .await;
}

/// The next message of `stream`, within 10 s.
async fn next_message(stream: &mut tonic::Streaming<pb::Message>, what: &str) -> pb::Message {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within 10 s"))
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: the stream ended"))
}

/// The group stream of `prefix` as server `i`'s /jsz reports it: the
/// messages it holds, and its consumer's messages delivered and not acked.
async fn group_stream_state(nats: &NatsCluster, i: usize, prefix: &str) -> Option<(u64, u64)> {
    let jsz = nats.monitor(i, "/jsz?streams=true&consumers=true").await?;
    let group_prefix = format!("{prefix}_g_");
    let stream = jsz["account_details"]
        .as_array()?
        .iter()
        .flat_map(|a| a["stream_detail"].as_array().into_iter().flatten())
        .find(|s| s["name"].as_str().unwrap_or_default().starts_with(&group_prefix))?;
    let unacked = stream["consumer_detail"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "members")?["num_ack_pending"]
        .as_u64()?;
    Some((stream["state"]["messages"].as_u64()?, unacked))
}

/// A stand-in for a Kubernetes Service: each new connection goes to the next
/// backend that accepts it.
async fn service(backends: std::sync::Arc<parking_lot::Mutex<Vec<std::net::SocketAddr>>>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut next = 0usize;
        while let Ok((mut inbound, _)) = listener.accept().await {
            let candidates = backends.lock().clone();
            let mut outbound = None;
            for i in 0..candidates.len() {
                let backend = candidates[(next + i) % candidates.len()];
                if let Ok(stream) = tokio::net::TcpStream::connect(backend).await {
                    next = next + i + 1;
                    outbound = Some(stream);
                    break;
                }
            }
            if let Some(mut outbound) = outbound {
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        }
    });
    addr
}
