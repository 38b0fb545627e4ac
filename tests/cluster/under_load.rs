//! Failure behaviour under load: steady publishers and MANUAL members that
//! join again whenever their stream ends, each keeping a ledger of what it
//! saw and settled, while the NATS server leading the group's stream is
//! killed, or the replica processes are restarted one by one. Every
//! Publish that returned OK is acked by some member in the end; one that
//! failed says UNAVAILABLE; none hangs.

use crate::common;
use crate::common::nats::NatsCluster;
use crate::common::*;
use crate::{publish_n, replicas, service, spawn_replica, wait_serving};
use std::time::Duration;
use tinybroker::pb;
use tonic::Code;

/// What the MANUAL members of a fault test saw and settled, shared by
/// their tasks.
#[derive(Default)]
struct Ledger {
    /// Every delivery: (sequence, delivery_attempt, member, payload).
    deliveries: Vec<(u64, u32, usize, String)>,
    /// Sequence → how many Acks answered it as acked (more than one: an ack
    /// that did not reach JetStream, then a redelivery acked again).
    acked: std::collections::HashMap<u64, u32>,
    /// Acks that did not settle their message: it had gone back to the
    /// group meanwhile (unknown), or the call failed.
    unsettled_acks: usize,
    /// How often each member (re)joined.
    joins: Vec<usize>,
}

type SharedLedger = std::sync::Arc<parking_lot::Mutex<Ledger>>;

fn ledger(members: usize) -> SharedLedger {
    std::sync::Arc::new(parking_lot::Mutex::new(Ledger {
        joins: vec![0; members],
        ..Default::default()
    }))
}

/// A channel to `url`, or None when nothing accepts there within 1 s.
async fn try_channel(url: &str) -> Option<tonic::transport::Channel> {
    tonic::transport::Endpoint::from_shared(url.to_owned())
        .ok()?
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .ok()
}

/// MANUAL member number `member`: joins through `url` (a replica, or the
/// Service front), again whenever its stream ends, and acks each message
/// `ack_after` after it came, on the same connection (so it holds a few
/// unacked messages at any time).
fn spawn_manual_member(
    url: String,
    request: pb::OpenSubscriptionRequest,
    member: usize,
    ack_after: Duration,
    ledger: SharedLedger,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            let Some(channel) = try_channel(&url).await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut client = pb::broker_client::BrokerClient::new(channel);
            let mut stream = match client.open_subscription(request.clone()).await {
                Ok(response) => response.into_inner(),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            ledger.lock().joins[member] += 1;
            loop {
                let next = tokio::select! {
                    next = stream.message() => next,
                    _ = stop.cancelled() => return,
                };
                let Ok(Some(m)) = next else { break };
                let payload = String::from_utf8_lossy(&m.payload).into_owned();
                ledger
                    .lock()
                    .deliveries
                    .push((m.sequence, m.delivery_attempt, member, payload));
                let (mut client, ledger) = (client.clone(), ledger.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(ack_after).await;
                    let request = pb::AckRequest {
                        subscription_id: m.subscription_id,
                        sequences: vec![m.sequence],
                    };
                    let answer = tokio::time::timeout(Duration::from_secs(5), client.ack(request)).await;
                    let mut ledger = ledger.lock();
                    match answer {
                        Ok(Ok(r)) if r.get_ref().acked == 1 => *ledger.acked.entry(m.sequence).or_default() += 1,
                        _ => ledger.unsettled_acks += 1,
                    }
                });
            }
        }
    })
}

/// Longest a Publish may take before the test calls it hung: the engine
/// retries a group's store for 10 s, and one JetStream ack waits 5 s.
const PUBLISH_LIMIT: Duration = Duration::from_secs(20);

/// What one publisher of a fault test got back.
#[derive(Default, Debug)]
struct PublishLog {
    /// (sequence, payload) of each Publish that returned OK.
    ok: Vec<(u64, String)>,
    /// (code, message, payload) of each that failed.
    failed: Vec<(Code, String, String)>,
    /// Publishes that got no answer within [`PUBLISH_LIMIT`].
    hung: usize,
    slowest: Duration,
}

/// Publishes `<tag>-<n>` to `topic` through `url` every `every` until
/// `stop`; after a failure it connects again (through a Service front,
/// that is to a live replica).
fn spawn_publisher(
    url: String,
    topic: &'static str,
    tag: String,
    every: Duration,
    log: std::sync::Arc<parking_lot::Mutex<PublishLog>>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut n = 0u64;
        while !stop.is_cancelled() {
            let Some(channel) = try_channel(&url).await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let mut client = pb::broker_client::BrokerClient::new(channel);
            while !stop.is_cancelled() {
                n += 1;
                let payload = format!("{tag}-{n}");
                let started = std::time::Instant::now();
                let answer =
                    tokio::time::timeout(PUBLISH_LIMIT, client.publish(publish_request(topic, &payload))).await;
                let took = started.elapsed();
                let went_through = {
                    let mut log = log.lock();
                    log.slowest = log.slowest.max(took);
                    match answer {
                        Ok(Ok(r)) => {
                            log.ok.push((r.into_inner().sequence, payload));
                            true
                        }
                        Ok(Err(status)) => {
                            log.failed.push((status.code(), status.message().to_owned(), payload));
                            false
                        }
                        Err(_) => {
                            log.hung += 1;
                            false
                        }
                    }
                };
                if !went_through {
                    break;
                }
                tokio::time::sleep(every).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// Waits up to `limit` until every sequence in `published` was acked by
/// some member; the ones still missing (empty: none).
async fn wait_all_acked(ledger: &SharedLedger, published: &[(u64, String)], limit: Duration) -> Vec<(u64, String)> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let missing: Vec<(u64, String)> = {
            let ledger = ledger.lock();
            published
                .iter()
                .filter(|(s, _)| !ledger.acked.contains_key(s))
                .cloned()
                .collect()
        };
        if missing.is_empty() || tokio::time::Instant::now() >= deadline {
            return missing;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The counts a fault test prints: (deliveries, sequences delivered more
/// than once, sequences acked more than once, redeliveries seen).
fn ledger_counts(ledger: &Ledger) -> (usize, usize, usize, usize) {
    let mut per_sequence = std::collections::HashMap::<u64, usize>::new();
    for (s, ..) in &ledger.deliveries {
        *per_sequence.entry(*s).or_default() += 1;
    }
    (
        ledger.deliveries.len(),
        per_sequence.values().filter(|&&n| n > 1).count(),
        ledger.acked.values().filter(|&&n| n > 1).count(),
        ledger.deliveries.iter().filter(|(_, a, ..)| *a > 1).count(),
    )
}

/// What a missing message went through, for the failure message.
fn history(ledger: &Ledger, sequence: u64) -> Vec<(u32, usize)> {
    ledger
        .deliveries
        .iter()
        .filter(|(s, ..)| *s == sequence)
        .map(|(_, a, m, _)| (*a, *m))
        .collect()
}

/// The group stream of `prefix` as server `i`'s /jsz reports it: (name,
/// leader, replicas as (name, current, offline), consumer leader).
async fn group_stream(nats: &NatsCluster, i: usize, prefix: &str) -> Option<GroupStream> {
    let jsz = nats.monitor(i, "/jsz?streams=true&consumers=true").await?;
    let group_prefix = format!("{prefix}_g_");
    for account in jsz["account_details"].as_array()? {
        for stream in account["stream_detail"].as_array().into_iter().flatten() {
            let name = stream["name"].as_str().unwrap_or_default();
            if !name.starts_with(&group_prefix) {
                continue;
            }
            let cluster = &stream["cluster"];
            let replicas = cluster["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    (
                        r["name"].as_str().unwrap_or_default().to_owned(),
                        r["current"] == true,
                        r["offline"] == true,
                    )
                })
                .collect();
            let consumer_leader = stream["consumer_detail"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["name"] == "members")
                .and_then(|c| c["cluster"]["leader"].as_str())
                .unwrap_or_default()
                .to_owned();
            return Some(GroupStream {
                name: name.to_owned(),
                leader: cluster["leader"].as_str().unwrap_or_default().to_owned(),
                replicas,
                consumer_leader,
            });
        }
    }
    None
}

/// A group's stream as /jsz shows it (name and consumer leader are only
/// printed).
#[derive(Debug)]
#[allow(dead_code)]
struct GroupStream {
    name: String,
    leader: String,
    replicas: Vec<(String, bool, bool)>,
    consumer_leader: String,
}

/// SIGKILL of the NATS server leading a MANUAL group's stream, mid-run:
/// three replicas on three servers, a member and a steady publisher on
/// each. Every Publish that returned OK is acked by some member in the
/// end (duplicates allowed and counted); a Publish that failed meanwhile
/// failed with UNAVAILABLE, none hung; with the server back the cluster is
/// whole and every member gets work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_group_streams_nats_leader_loses_no_acknowledged_publish() {
    let mut nats = NatsCluster::start(3).await;
    rejoin_timeout(async {
        let brokers = replicas(&nats, 3, "jskill").await;
        let ledger = ledger(3);
        let stop_members = tokio_util::sync::CancellationToken::new();
        let mut request = member_request(&["work.*"], "crunch", true, 16);
        request.ack_deadline_ms = 2000;
        let mut members = Vec::new();
        for (i, broker) in brokers.iter().enumerate() {
            members.push(spawn_manual_member(
                broker.url(),
                request.clone(),
                i,
                Duration::from_millis(100),
                ledger.clone(),
                stop_members.clone(),
            ));
        }
        wait_until("three members in the group", || async {
            brokers[0].group("crunch").await.is_some_and(|g| g.members == 3)
        })
        .await;
        let stream = loop {
            if let Some(s) = group_stream(&nats, 0, "jskill").await.filter(|s| !s.leader.is_empty()) {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let leader = nats.index_of(&stream.leader).expect("a server of the cluster leads");
        eprintln!("jskill: {stream:?}: SIGKILL of server {leader} (replica r{leader} is connected to it)");

        let logs: Vec<_> = (0..3)
            .map(|_| std::sync::Arc::new(parking_lot::Mutex::new(PublishLog::default())))
            .collect();
        let stop_publishing = tokio_util::sync::CancellationToken::new();
        let publishers: Vec<_> = brokers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                spawn_publisher(
                    b.url(),
                    "work.item",
                    format!("via-r{i}"),
                    Duration::from_millis(20),
                    logs[i].clone(),
                    stop_publishing.clone(),
                )
            })
            .collect();
        let ok_count = |logs: &[std::sync::Arc<parking_lot::Mutex<PublishLog>>]| -> Vec<usize> {
            logs.iter().map(|l| l.lock().ok.len()).collect()
        };
        wait_until("every publisher to get 20 messages through", || async {
            ok_count(&logs).iter().all(|&n| n >= 20)
        })
        .await;
        nats.kill(leader);
        let killed_at = std::time::Instant::now();
        let before = ok_count(&logs);
        let survivor = (leader + 1) % 3;
        wait_until("a new leader of the group's stream", || async {
            group_stream(&nats, survivor, "jskill")
                .await
                .is_some_and(|s| !s.leader.is_empty() && s.leader != stream.leader)
        })
        .await;
        eprintln!("jskill: a new stream leader after {:?}", killed_at.elapsed());
        // Publishing goes on until each publisher got 30 more through
        // after the kill (its replica moved to another server meanwhile).
        wait_until("every publisher to get 30 more through after the kill", || async {
            ok_count(&logs)
                .iter()
                .zip(&before)
                .all(|(&now, &then)| now >= then + 30)
        })
        .await;
        stop_publishing.cancel();
        for p in publishers {
            p.await.unwrap();
        }
        let published: Vec<(u64, String)> = logs.iter().flat_map(|l| l.lock().ok.clone()).collect();
        let missing = wait_all_acked(&ledger, &published, Duration::from_secs(15)).await;
        let failed: Vec<(Code, String, String)> = logs.iter().flat_map(|l| l.lock().failed.clone()).collect();
        let hung: usize = logs.iter().map(|l| l.lock().hung).sum();
        let slowest = logs.iter().map(|l| l.lock().slowest).max().unwrap_or_default();
        {
            let ledger = ledger.lock();
            let (deliveries, delivered_twice, acked_twice, redeliveries) = ledger_counts(&ledger);
            // A Publish that failed may still have been stored (its ack
            // lost): counted, allowed.
            let delivered: std::collections::HashSet<&str> =
                ledger.deliveries.iter().map(|(.., p)| p.as_str()).collect();
            let failed_but_delivered = failed.iter().filter(|(_, _, p)| delivered.contains(p.as_str())).count();
            eprintln!(
                "jskill: published OK {}, failed {} ({:?}), hung {hung}, slowest publish {slowest:?}; \
                 deliveries {deliveries}, acked {} distinct, delivered more than once {delivered_twice}, \
                 acked more than once {acked_twice}, redeliveries {redeliveries}, acks that settled nothing {}, \
                 failed publishes delivered anyway {failed_but_delivered}; missing {}",
                published.len(),
                failed.len(),
                failed
                    .iter()
                    .map(|(c, m, _)| format!("{c:?}: {m}"))
                    .collect::<std::collections::BTreeSet<_>>(),
                ledger.acked.len(),
                ledger.unsettled_acks,
                missing.len(),
            );
            assert!(
                missing.is_empty(),
                "{} messages published OK were never acked: {:?}",
                missing.len(),
                missing
                    .iter()
                    .take(10)
                    .map(|(s, p)| (s, p, history(&ledger, *s)))
                    .collect::<Vec<_>>()
            );
        }
        assert_eq!(hung, 0, "no Publish may hang over a failover");
        assert!(
            failed.iter().all(|(code, _, _)| *code == Code::Unavailable),
            "a failed Publish says UNAVAILABLE: {failed:?}"
        );

        // The server back: the cluster is whole, the stream has every
        // replica current, and every replica's member gets work again.
        nats.restart(leader).await;
        wait_until("the group's stream to have all three replicas current", || async {
            match group_stream(&nats, leader, "jskill").await {
                Some(s) if !s.leader.is_empty() => {
                    let Some(l) = nats.index_of(&s.leader) else {
                        return false;
                    };
                    group_stream(&nats, l, "jskill")
                        .await
                        .is_some_and(|s| s.replicas.len() == 2 && s.replicas.iter().all(|(_, c, o)| *c && !*o))
                }
                _ => false,
            }
        })
        .await;
        for broker in &brokers {
            wait_serving(broker).await;
        }
        let seen_before: Vec<usize> = {
            let ledger = ledger.lock();
            (0..3)
                .map(|m| ledger.deliveries.iter().filter(|d| d.2 == m).count())
                .collect()
        };
        let mut after = Vec::new();
        for broker in &brokers {
            after.extend(
                publish_n(broker, "work.item", 20)
                    .await
                    .into_iter()
                    .map(|s| (s, String::new())),
            );
        }
        let missing = wait_all_acked(&ledger, &after, Duration::from_secs(10)).await;
        assert!(missing.is_empty(), "after the restart, never acked: {missing:?}");
        let got: Vec<usize> = {
            let ledger = ledger.lock();
            (0..3)
                .map(|m| ledger.deliveries.iter().filter(|d| d.2 == m).count() - seen_before[m])
                .collect()
        };
        eprintln!("jskill: after the restart, 60 published, deliveries per member {got:?}");
        assert!(
            got.iter().all(|&n| n > 0),
            "every replica's member gets work again: {got:?}"
        );
        stop_members.cancel();
        for m in members {
            let _ = m.await;
        }
    })
    .await;
}

/// A rolling restart of three replica processes (each replaced by a new
/// one with a new id, then SIGTERMed: a graceful shutdown) under a steady
/// publisher and a MANUAL group whose three members join again through
/// the Service front whenever their stream ends, plus a broadcast
/// subscriber. No group message published OK is lost: with an ack
/// deadline (and so `ack_wait`) of 60 s, a message a stopping replica
/// does not hand back would come back only after the test's deadline. A
/// failed Publish says UNAVAILABLE, and the subscriber is back on a live
/// replica after each round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_a_publisher_loses_no_manual_group_message() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let prefix = "rollgrp";
        let mut live: Vec<(String, common::process::BrokerProcess)> = Vec::new();
        for i in 0..3 {
            let id = format!("r{i}");
            live.push((id.clone(), spawn_replica(&nats, i, &id, prefix).await));
        }
        let addr_of = |p: &common::process::BrokerProcess| -> std::net::SocketAddr { p.grpc_addr.parse().unwrap() };
        let backends = std::sync::Arc::new(parking_lot::Mutex::new(
            live.iter().map(|(_, p)| addr_of(p)).collect::<Vec<_>>(),
        ));
        let front = format!("http://{}", service(backends.clone()).await);

        let ledger = ledger(3);
        let stop_members = tokio_util::sync::CancellationToken::new();
        let mut request = member_request(&["orders.*"], "fulfil", true, 8);
        request.ack_deadline_ms = 60_000;
        let members: Vec<_> = (0..3)
            .map(|i| {
                spawn_manual_member(
                    front.clone(),
                    request.clone(),
                    i,
                    Duration::from_millis(150),
                    ledger.clone(),
                    stop_members.clone(),
                )
            })
            .collect();
        let group_members = |url: String| async move {
            let mut admin = pb::admin_client::AdminClient::new(try_channel(&url).await?);
            let groups = admin
                .list_consumer_groups(pb::ListConsumerGroupsRequest {})
                .await
                .ok()?
                .into_inner()
                .groups;
            groups.into_iter().find(|g| g.name == "fulfil").map(|g| g.members)
        };
        wait_until("three members in the group", || {
            let members = group_members(live[0].1.url());
            async move { members.await == Some(3) }
        })
        .await;

        let client = tinybroker::client::Client::connect(&front).await.unwrap();
        let mut subscriber = client.subscriber(subscribe_request(&["config.>"]), true);
        let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
        subscriber.on_event(move |e| {
            let _ = events_tx.send(format!("{e}"));
        });
        subscriber.open().await.unwrap();

        let log = std::sync::Arc::new(parking_lot::Mutex::new(PublishLog::default()));
        let stop_publishing = tokio_util::sync::CancellationToken::new();
        let publisher = spawn_publisher(
            front.clone(),
            "orders.new",
            "order".into(),
            Duration::from_millis(20),
            log.clone(),
            stop_publishing.clone(),
        );
        let ok_count = || log.lock().ok.len();
        wait_until("the publisher to get 30 through", || async { ok_count() >= 30 }).await;
        // What each stopping replica said it handed back, from its log.
        let mut handed_back = Vec::new();
        for round in 3..6 {
            let (_, mut leaving) = live.remove(0);
            let id = format!("r{round}");
            let fresh = spawn_replica(&nats, round % 3, &id, prefix).await;
            backends.lock().push(addr_of(&fresh));
            live.push((id, fresh));
            backends.lock().retain(|a| *a != addr_of(&leaving));
            let before = ok_count();
            leaving.guard.signal("TERM");
            let status = common::process::exit_status(&mut leaving.guard, Duration::from_secs(20)).await;
            assert!(
                status.success(),
                "round {round}: the replica stopped cleanly: {status:?}"
            );
            handed_back.push(
                leaving
                    .drain_lines()
                    .iter()
                    .find(|l| l.contains("handed back"))
                    .map(|l| common::process::field(l, "handed_back"))
                    .unwrap_or_else(|| "0".into()),
            );
            // The broadcast subscriber is back on a live replica: it gets
            // a marker of this round.
            let mut marker_publisher =
                pb::broker_client::BrokerClient::new(try_channel(&live[0].1.url()).await.expect("a live replica"));
            let marker = format!("round-{round}");
            loop {
                marker_publisher
                    .publish(publish_request("config.flags", &marker))
                    .await
                    .unwrap();
                match tokio::time::timeout(Duration::from_millis(300), subscriber.next()).await {
                    Ok(Ok(Some(m))) if m.payload == marker.as_bytes() => break,
                    Ok(Ok(Some(_))) | Err(_) => continue,
                    Ok(other) => panic!("{marker}: the subscriber gave up: {other:?}"),
                }
            }
            let ids: Vec<String> = live.iter().map(|(id, _)| id.clone()).collect();
            wait_until("the members and the subscriber on live replicas", || {
                let (url, ids) = (live[0].1.url(), ids.clone());
                async move {
                    let listing = common::subscriptions(&url).await;
                    let members = listing.iter().filter(|s| s.consumer_group == "fulfil").count();
                    let broadcast = listing.iter().filter(|s| s.consumer_group.is_empty()).count();
                    (members, broadcast) == (3, 1) && listing.iter().all(|s| ids.contains(&s.replica_id))
                }
            })
            .await;
            wait_until("the publisher to get 20 more through", || async {
                ok_count() >= before + 20
            })
            .await;
        }
        stop_publishing.cancel();
        publisher.await.unwrap();
        let published = log.lock().ok.clone();
        let missing = wait_all_acked(&ledger, &published, Duration::from_secs(15)).await;
        {
            let log = log.lock();
            let ledger = ledger.lock();
            let (deliveries, delivered_twice, acked_twice, redeliveries) = ledger_counts(&ledger);
            eprintln!(
                "rollgrp: published OK {}, failed {} ({:?}), hung {}, slowest publish {:?}; member joins {:?}; \
             handed back at each shutdown {handed_back:?}; \
             deliveries {deliveries}, acked {} distinct, delivered more than once {delivered_twice}, \
             acked more than once {acked_twice}, redeliveries {redeliveries}, acks that settled nothing {}; missing {}",
                log.ok.len(),
                log.failed.len(),
                log.failed
                    .iter()
                    .map(|(c, m, _)| format!("{c:?}: {m}"))
                    .collect::<std::collections::BTreeSet<_>>(),
                log.hung,
                log.slowest,
                ledger.joins,
                ledger.acked.len(),
                ledger.unsettled_acks,
                missing.len(),
            );
            assert!(
                missing.is_empty(),
                "{} messages published OK were never acked: {:?}",
                missing.len(),
                missing
                    .iter()
                    .take(10)
                    .map(|(s, p)| (s, p, history(&ledger, *s)))
                    .collect::<Vec<_>>()
            );
            assert_eq!(log.hung, 0, "no Publish may hang over a rolling restart");
            assert!(
                log.failed.iter().all(|(code, _, _)| *code == Code::Unavailable),
                "a failed Publish says UNAVAILABLE: {:?}",
                log.failed
            );
        }
        let mut seen = Vec::new();
        while let Ok(e) = events.try_recv() {
            seen.push(e);
        }
        assert!(seen.iter().any(|e| e.contains("shutting down")), "{seen:#?}");
        stop_members.cancel();
        for m in members {
            let _ = m.await;
        }
    })
    .await;
}
