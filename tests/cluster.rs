//! Cluster mode (docs/contract.md, "Cluster mode"): tinybroker replicas on
//! ephemeral ports over a real 3-node NATS cluster (tests/common/nats.rs),
//! each replica connected to a different NATS server first, with the stock
//! tonic clients. Without a nats-server >= 2.10 the tests fail, saying how
//! to install one (`.ci/run` does).

mod common;

use common::nats::NatsCluster;
use common::process::metric_sum;
use common::*;
use std::time::Duration;
use tinybroker::config::Config;
use tinybroker::pb;
use tonic::Code;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_published_on_one_replica_reaches_subscribers_on_every_replica() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 3, "fanout").await;
        let mut streams = Vec::new();
        for broker in &brokers {
            let mut client = broker.client().await;
            streams.push(subscribe(&mut client, &["deploy.*", "deploy.>"]).await.0);
        }
        let mut publisher = brokers[0].client().await;
        let mut sequences = Vec::new();
        for i in 0..20 {
            let r = publisher
                .publish(publish_request("deploy.web", &format!("m{i}")))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.matched_subscriptions, 1, "this replica's own subscriber");
            sequences.push(r.sequence);
        }
        assert!(sequences.windows(2).all(|w| w[0] < w[1]), "increasing: {sequences:?}");
        for (i, stream) in streams.iter_mut().enumerate() {
            for (n, sequence) in sequences.iter().enumerate() {
                let m = tokio::time::timeout(Duration::from_secs(10), stream.message())
                    .await
                    .unwrap_or_else(|_| panic!("replica {i}: message {n} never came"))
                    .unwrap()
                    .unwrap();
                assert_eq!(
                    (m.topic.as_str(), &m.payload[..], m.sequence),
                    ("deploy.web", format!("m{n}").as_bytes(), *sequence),
                    "replica {i}: in order, once, with the publisher's sequence"
                );
            }
        }
        // A second replica's publishes get sequences of their own, never
        // one the first handed out.
        let r = brokers[1]
            .client()
            .await
            .publish(publish_request("deploy.api", "x"))
            .await
            .unwrap()
            .into_inner();
        assert!(!sequences.contains(&r.sequence));
        for stream in &mut streams {
            let m = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .expect("the second replica's message")
                .unwrap()
                .unwrap();
            assert_eq!((m.topic.as_str(), m.sequence), ("deploy.api", r.sequence));
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_ids_are_unique_in_the_cluster_and_close_works_from_any_replica() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "ids").await;
        let mut on_0 = brokers[0].client().await;
        let mut request = subscribe_request(&["orders.>"]);
        request.subscription_id = "billing".into();
        let mut stream = on_0.open_subscription(request.clone()).await.unwrap().into_inner();

        let mut on_1 = brokers[1].client().await;
        let err = on_1
            .open_subscription(request.clone())
            .await
            .expect_err("a second 'billing'");
        assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
        assert!(err.message().contains("billing"), "{}", err.message());

        // Admin on the other replica lists it, naming its replica.
        let listed = listed(brokers[1].subscriptions().await, "billing").expect("listed cluster-wide");
        assert_eq!(listed.replica_id, "r0");

        // Ack for a broadcast subscription served elsewhere: forwarded, all unknown.
        let ack = on_1
            .ack(pb::AckRequest {
                subscription_id: "billing".into(),
                sequences: vec![1, 2],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((ack.acked, ack.unknown), (0, 2));

        // CloseSubscription through the replica that does not serve it.
        brokers[1]
            .admin()
            .await
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: "billing".into(),
            })
            .await
            .unwrap();
        let end = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .unwrap();
        assert!(matches!(end, Ok(None)), "the stream ends cleanly: {end:?}");
        let missing = brokers[1]
            .admin()
            .await
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: "nobody".into(),
            })
            .await
            .err()
            .unwrap();
        assert_eq!(missing.code(), Code::NotFound, "{missing:?}");

        // Once closed, the id is free again anywhere.
        wait_until("the id to be released", || {
            let mut on_1 = on_1.clone();
            let request = request.clone();
            async move { on_1.open_subscription(request).await.is_ok() }
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nats_a_replica_is_not_serving_and_says_why_then_serves_when_nats_comes() {
    let mut nats = NatsCluster::start(1).await;
    rejoin_timeout(async {
        nats.stop(0).await;
        let mut config = replica_config(nats.urls(), "alone", "late");
        if let Some(c) = config.cluster.as_mut() {
            c.nats_replicas = 1;
        }
        let broker = start_with(config).await;
        wait_until("health NOT_SERVING", || async {
            serving_status(&broker).await == Some(ServingStatus::NotServing)
        })
        .await;
        let err = broker
            .client()
            .await
            .publish(publish_request("a.b", "x"))
            .await
            .expect_err("refused while NATS is down");
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        assert!(err.message().contains("NATS"), "{}", err.message());
        let (_, metrics) = broker.http_get("/metrics").await;
        assert_eq!(metric_sum(&metrics, "tinybroker_nats_connected"), 0.0, "{metrics}");

        nats.restart(0).await;
        wait_serving(&broker).await;
        let info = broker
            .admin()
            .await
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(info.cluster_mode);
        assert_eq!(info.replica_id, "alone");
        assert!(!info.nats_server.is_empty());
        let (_, metrics) = broker.http_get("/metrics").await;
        assert_eq!(metric_sum(&metrics, "tinybroker_nats_connected"), 1.0, "{metrics}");
    })
    .await;
}

/// Whether a publish on `broker` to `topic` goes out on core NATS, seen by
/// `raw`, a plain NATS subscriber of the prefix's `interest.>`. A publish
/// to [`MARKER_TOPIC`] follows it: its group's JetStream publish goes out on
/// the replica's one NATS connection after the probe's core NATS copy, if
/// there is one, so the probe's copy is seen before the marker or not at
/// all (no wait for silence).
async fn goes_out_on_core_nats(broker: &TestBroker, raw: &mut async_nats::Subscriber, topic: &str) -> bool {
    use futures::StreamExt;
    let mut client = broker.client().await;
    client.publish(publish_request(topic, "probe")).await.unwrap();
    let marker = client
        .publish(publish_request(MARKER_TOPIC, "marker"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(marker.matched_groups, 1, "the marker's group took it");
    let probe_subject = format!("interest.m.{topic}");
    let mut seen = false;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), raw.next())
            .await
            .expect("the marker's JetStream publish on NATS within 10 s")
            .expect("the raw subscription is open");
        if m.subject.as_str() == probe_subject {
            seen = true;
        } else if m.subject.starts_with("interest.g.") {
            return seen;
        }
    }
}

/// The topic of [`goes_out_on_core_nats`]'s marker, taken by a consumer
/// group (a JetStream publish).
const MARKER_TOPIC: &str = "marker.probe";

/// Waits (at most 20 s) until `broker`'s publishes stay off core NATS.
async fn wait_off_core_nats(broker: &TestBroker, raw: &mut async_nats::Subscriber, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while goes_out_on_core_nats(broker, raw, "jobs.idle").await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_nats_carries_publishes_only_while_another_replica_has_a_broadcast_subscriber() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "interest").await;
        let raw_client = async_nats::connect(nats.url(2).as_str()).await.unwrap();
        let mut raw = raw_client.subscribe("interest.>").await.unwrap();
        raw_client.flush().await.unwrap();
        // The markers' group, with a member on r0 (not a broadcast
        // subscriber: it leaves r0's publishes off core NATS).
        let (_markers, _) = open(
            &mut brokers[0].client().await,
            member_request(&[MARKER_TOPIC], "markers", false, 64),
        )
        .await;
        // No broadcast subscriber anywhere: once r1 said so, r0's publishes
        // stay off core NATS.
        wait_off_core_nats(&brokers[0], &mut raw, "r0 to stop sending on core NATS").await;
        for round in 0..2 {
            // The first broadcast subscriber on r1 after none: r0's next
            // publish reaches it, sent right after the response headers.
            let (mut stream, id) = subscribe(&mut brokers[1].client().await, &["jobs.>"]).await;
            let r = brokers[0]
                .client()
                .await
                .publish(publish_request("jobs.build", &format!("round {round}")))
                .await
                .unwrap()
                .into_inner();
            let m = next_message(
                &mut stream,
                &format!("round {round}: the first message after the subscription opened"),
            )
            .await;
            assert_eq!(
                (m.topic.as_str(), m.sequence),
                ("jobs.build", r.sequence),
                "round {round}"
            );
            assert!(
                goes_out_on_core_nats(&brokers[0], &mut raw, "jobs.busy").await,
                "round {round}: with a subscriber on r1, r0 sends on core NATS"
            );
            // Closed: r1 says "none" again within a few heartbeats.
            brokers[1]
                .admin()
                .await
                .close_subscription(pb::CloseSubscriptionRequest { subscription_id: id })
                .await
                .unwrap();
            drop(stream);
            wait_off_core_nats(
                &brokers[0],
                &mut raw,
                &format!("round {round}: r0 to stop sending on core NATS again"),
            )
            .await;
        }
    })
    .await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_members_on_three_replicas_share_the_work_each_message_once() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 3, "share").await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (i, broker) in brokers.iter().enumerate() {
            let mut client = broker.client().await;
            let mut stream = client
                .open_subscription(member_request(&["jobs.*"], "workers", false, 4))
                .await
                .unwrap()
                .into_inner();
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(m)) = stream.message().await {
                    let _ = tx.send((i, m.sequence, m.consumer_group.clone()));
                }
            }));
        }
        // A second group member asking for other patterns is refused, from
        // any replica.
        let err = brokers[2]
            .client()
            .await
            .open_subscription(member_request(&["jobs.>"], "workers", false, 4))
            .await
            .expect_err("other patterns");
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        let sent = publish_n(&brokers[0], "jobs.build", 60).await;
        let mut got = std::collections::HashMap::new();
        let mut by_member = [0usize; 3];
        while got.len() < sent.len() {
            let (i, seq, group) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("every message delivered")
                .unwrap();
            assert_eq!(group, "workers");
            assert!(got.insert(seq, i).is_none(), "sequence {seq} delivered twice");
            by_member[i] += 1;
        }
        let mut keys: Vec<u64> = got.keys().copied().collect();
        keys.sort();
        assert_eq!(keys, sent);
        assert!(
            by_member.iter().all(|&n| n > 0),
            "every replica's member got work: {by_member:?}"
        );
        // JetStream was told: every message acked, so the work-queue
        // stream holds none (unacked, they would come again after ack_wait).
        wait_until("JetStream to have every delivered message acked", || async {
            group_stream_state(&nats, 0, "share").await == Some((0, 0))
        })
        .await;
        // So nothing more can come (no duplicates later): the members were
        // handed the 60 and no more, and none waits in a queue.
        let groups = groups(&mut brokers[1].admin().await).await;
        assert_eq!(groups.len(), 1, "{groups:?}");
        assert_eq!((groups[0].name.as_str(), groups[0].members), ("workers", 3));
        assert_eq!(
            (groups[0].backlog, groups[0].in_flight, groups[0].redeliveries),
            (0, 0, 0),
            "{groups:?}"
        );
        let members: Vec<_> = brokers[1]
            .subscriptions()
            .await
            .into_iter()
            .filter(|s| s.consumer_group == "workers")
            .collect();
        assert_eq!(members.len(), 3, "{members:?}");
        let handed: u64 = members.iter().map(|s| s.delivered + s.queue_depth).sum();
        assert_eq!(handed, 60, "each message handed to a member once: {members:?}");
        // Every replica's group gauges give the cluster-wide value.
        for broker in &brokers {
            wait_until("cluster-wide group gauges", || async {
                let (_, metrics) = broker.http_get("/metrics").await;
                common::process::metric_with_label(
                    &metrics,
                    "tinybroker_consumer_group_members",
                    "consumer_group=\"workers\"",
                ) == Some(3.0)
            })
            .await;
        }
        for task in tasks {
            task.abort();
        }
    })
    .await;
}

/// A group's first member, on one replica, sees a message published on
/// another replica right after its OpenSubscription answered: the new
/// group is known cluster-wide by then, not when the table's watch brings
/// it (docs/contract.md, Cluster mode). Eight new groups, each joined on
/// one replica and published to at once on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_takes_a_message_published_on_another_replica_right_after_its_first_join() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        // Eight groups' streams, each reserving its byte budget on every
        // server: a small budget, so they fit the test servers' memory.
        let brokers = replicas_with(&nats, 2, "newgroup", |c| c.limits.group_max_bytes = 1 << 20).await;
        let mut joiner = brokers[0].client().await;
        let mut publisher = brokers[1].client().await;
        let mut missed = Vec::new();
        for i in 0..8 {
            let topic = format!("fresh.{i}");
            let (mut member, _) = open(
                &mut joiner,
                member_request(&[topic.as_str()], &format!("g{i}"), false, 4),
            )
            .await;
            let r = publisher
                .publish(publish_request(&topic, "right away"))
                .await
                .unwrap()
                .into_inner();
            if r.matched_groups != 1 {
                missed.push(i);
                continue;
            }
            let m = next_message(&mut member, "the message published right after the join").await;
            assert_eq!(m.sequence, r.sequence);
        }
        assert!(missed.is_empty(), "groups that missed the first message: {missed:?}");
    })
    .await;
}

/// A PublishStream whose group store fails for good (the group's stream
/// deleted under it, no member to make it again) ends with UNAVAILABLE
/// once the store's retries run out: `accepted` counts only the messages
/// before it, and the message says how many sent after it reached
/// subscribers anyway (their stores overlapped with its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_group_store_fails_ends_counting_only_what_was_stored() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let mut config = replica_config(urls_from(&nats, 0), "r0", "gone");
        if let Some(c) = config.cluster.as_mut() {
            c.nats_replicas = 1;
        }
        let broker = start_with(config).await;
        wait_serving(&broker).await;
        let mut client = broker.client().await;
        let (member, _) = open(&mut client, member_request(&["gone.>"], "g", false, 4)).await;
        drop(member);
        wait_members(&broker, 0).await;
        // A broadcast subscriber sees what reached subscribers.
        let (mut watcher, _) = open(&mut client, subscribe_request(&["gone.>"])).await;
        let js = async_nats::jetstream::new(async_nats::connect(nats.url(0).as_str()).await.unwrap());
        let names: Vec<String> = futures::StreamExt::collect(futures::StreamExt::filter_map(
            js.stream_names(),
            |n| async move { n.ok() },
        ))
        .await;
        let group_stream = names
            .iter()
            .find(|n| n.starts_with("gone_g_"))
            .expect("the group's stream");
        js.delete_stream(group_stream).await.unwrap();

        let requests: Vec<_> = (0..3).map(|i| publish_request("gone.x", &format!("m{i}"))).collect();
        let status = client
            .publish_stream(futures::stream::iter(requests))
            .await
            .expect_err("the group's store fails");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        for needed in [
            "consumer group \"g\"",
            "the 2 messages sent after it",
            "0 earlier messages",
        ] {
            assert!(status.message().contains(needed), "{needed} in {:?}", status.message());
        }
        for i in 0..3 {
            let m = next_message(&mut watcher, "a message routed before its store failed").await;
            assert_eq!(m.payload, format!("m{i}").into_bytes());
        }
    })
    .await;
}

/// Each group's stream reserves its byte budget on every server it is on:
/// a group beyond what the NATS servers' JetStream memory holds is refused
/// with RESOURCE_EXHAUSTED naming the budget's variable (not UNAVAILABLE,
/// as for an outage), and the groups already there go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_beyond_the_nats_servers_memory_is_refused_naming_the_budget() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        // 100 MiB per group on each of the 3 servers (256 MB each): two fit.
        let mut config = replica_config(urls_from(&nats, 0), "r0", "nomem");
        config.limits.group_max_bytes = 100 << 20;
        let broker = start_with(config).await;
        wait_serving(&broker).await;
        let mut client = broker.client().await;
        let (mut a, _) = open(&mut client, member_request(&["mem.a"], "a", false, 4)).await;
        let (_b, _) = open(&mut client, member_request(&["mem.b"], "b", false, 4)).await;
        let refused = client
            .open_subscription(member_request(&["mem.c"], "c", false, 4))
            .await
            .expect_err("a third group does not fit");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        for needed in ["\"c\"", "TINYBROKER_GROUP_MAX_BYTES=104857600", "max_memory_store"] {
            assert!(
                refused.message().contains(needed),
                "{needed} in {:?}",
                refused.message()
            );
        }
        let sent = publish_n(&broker, "mem.a", 1).await;
        assert_eq!(
            next_message(&mut a, "a message to a group that fitted").await.sequence,
            sent[0]
        );
        // The refused group is not left in the table: a publish to its
        // topic matches no group at once (it would wait 10 s for a stream
        // that is not there, then fail).
        let r = tokio::time::timeout(Duration::from_secs(2), client.publish(publish_request("mem.c", "x")))
            .await
            .expect("a publish to the refused group's topic answers at once")
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_groups, 0);
        assert!(groups(&mut broker.admin().await).await.iter().all(|g| g.name != "c"));
    })
    .await;
}

/// A replica started while a group exists routes to it from its very first
/// accepted publish: it reads the group table before it serves (a publish
/// loop from the moment it starts takes the first one it accepts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_later_knows_the_groups_from_its_first_publish() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let first = replicas(&nats, 1, "late").await;
        let mut client = first[0].client().await;
        let mut member = client
            .open_subscription(member_request(&["late.*"], "early", false, 16))
            .await
            .unwrap()
            .into_inner();
        let late = start_with(replica_config(urls_from(&nats, 1), "late", "late")).await;
        // Connect as soon as the listener answers, then publish until the
        // replica accepts one.
        let channel = loop {
            if let Ok(channel) = tonic::transport::Endpoint::from_shared(late.url())
                .unwrap()
                .connect()
                .await
            {
                break channel;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let mut publisher = pb::broker_client::BrokerClient::new(channel);
        let mut refused = 0;
        let accepted = loop {
            match publisher.publish(publish_request("late.job", "first")).await {
                Ok(response) => break response.into_inner(),
                Err(status) => {
                    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                    refused += 1;
                }
            }
        };
        eprintln!("the late replica refused {refused} publishes before its first");
        assert_eq!(
            accepted.matched_groups, 1,
            "the first accepted publish reaches the group"
        );
        let m = tokio::time::timeout(Duration::from_secs(10), member.message())
            .await
            .expect("the group's member gets it")
            .unwrap()
            .unwrap();
        assert_eq!((m.sequence, &m.payload[..]), (accepted.sequence, &b"first"[..]));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_ack_from_any_replica_redelivery_backlog_and_dead_letters() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut config = replica_config(urls_from(&nats, 0), "m0", "manual");
        config.limits.max_delivery_attempts = 2;
        let m0 = start_with(config).await;
        let mut config = replica_config(urls_from(&nats, 1), "m1", "manual");
        config.limits.max_delivery_attempts = 2;
        let m1 = start_with(config).await;
        wait_serving(&m0).await;
        wait_serving(&m1).await;

        // The group exists once its first member opens; a backlog waits
        // while no member is connected.
        let mut request = member_request(&["orders.*"], "billing", true, 8);
        request.ack_deadline_ms = 1000;
        request.subscription_id = "biller".into();
        drop(m0.client().await.open_subscription(request.clone()).await.unwrap());
        wait_until("the first member to be gone", || async {
            listed(m0.subscriptions().await, "biller").is_none()
        })
        .await;
        let sent = publish_n(&m1, "orders.new", 3).await;
        let mut member = m0
            .client()
            .await
            .open_subscription(request.clone())
            .await
            .unwrap()
            .into_inner();
        let first = next_message(&mut member, "the backlog").await;
        assert_eq!(first.sequence, sent[0]);
        let second = next_message(&mut member, "the backlog").await;
        let third = next_message(&mut member, "the backlog").await;
        assert_eq!((second.sequence, third.sequence), (sent[1], sent[2]));

        // Ack through the replica that does not serve the member.
        let ack = m1
            .client()
            .await
            .ack(pb::AckRequest {
                subscription_id: "biller".into(),
                sequences: vec![first.sequence, 999],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((ack.acked, ack.unknown), (1, 1));
        // Nack: redelivered at once, attempt 2.
        let nack = m1
            .client()
            .await
            .nack(pb::NackRequest {
                subscription_id: "biller".into(),
                sequences: vec![second.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((nack.requeued, nack.unknown), (1, 0));
        // The nacked one comes again at once; the third, unacked past its
        // 1 s deadline, too: both on their second (last) attempt.
        // The dead letters, and the markers that end them (below).
        let (mut dlq, _) = subscribe(&mut m1.client().await, &["_dlq.billing", "marker.*"]).await;
        let mut again = std::collections::BTreeMap::new();
        for _ in 0..2 {
            let m = next_message(&mut member, "a redelivery").await;
            again.insert(m.sequence, m.delivery_attempt);
        }
        assert_eq!(
            again,
            std::collections::BTreeMap::from([(second.sequence, 2), (third.sequence, 2)])
        );
        let ack = m0
            .client()
            .await
            .ack(pb::AckRequest {
                subscription_id: "biller".into(),
                sequences: vec![third.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ack.acked, 1);
        // The second is not acked: past its deadline on its last attempt, it
        // is dead-lettered, once, seen by a subscriber on the other replica.
        let letter = next_message(&mut dlq, "the dead letter").await;
        assert_eq!(
            letter.headers.get("tinybroker-original-topic").map(String::as_str),
            Some("orders.new")
        );
        assert_eq!(
            letter.headers.get("tinybroker-delivery-attempts").map(String::as_str),
            Some("2")
        );
        assert_eq!(&letter.payload[..], b"m1");
        // One dead letter, not one per replica. Once the group's stream
        // holds nothing, no replica can dead-letter the message again (it
        // publishes the letter before it acks the message away); a marker
        // published through each replica then comes after any letter that
        // replica published, on the same path: the next two messages are
        // the markers.
        wait_until("the dead-lettered message to leave the group's stream", || async {
            group_stream_state(&nats, 0, "manual").await == Some((0, 0))
        })
        .await;
        for (replica, marker) in [(&m0, "marker.m0"), (&m1, "marker.m1")] {
            replica
                .client()
                .await
                .publish(publish_request(marker, "end"))
                .await
                .unwrap();
        }
        let mut next: Vec<String> = Vec::new();
        for _ in 0..2 {
            next.push(next_message(&mut dlq, "a marker").await.topic);
        }
        next.sort();
        assert_eq!(next, ["marker.m0", "marker.m1"], "one dead letter, not one per replica");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_shutting_down_ends_its_streams_and_frees_their_ids() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut brokers = replicas(&nats, 2, "shutdown").await;
        let mut request = subscribe_request(&["jobs.>"]);
        request.subscription_id = "worker-7".into();
        let response = brokers[0]
            .client()
            .await
            .open_subscription(request.clone())
            .await
            .unwrap();
        let mut stream = response.into_inner();
        let leaving = brokers.remove(0);
        leaving.stop().await;
        let end = tokio::time::timeout(Duration::from_secs(10), stream.message()).await;
        assert!(matches!(end, Ok(Ok(None)) | Ok(Err(_))), "the stream ended: {end:?}");
        // The client library re-subscribes elsewhere with the same id.
        let mut on_1 = brokers[0].client().await;
        let started = std::time::Instant::now();
        let _reopened = loop {
            match on_1.open_subscription(request.clone()).await {
                Ok(stream) => break stream,
                Err(e) if started.elapsed() < Duration::from_secs(20) => {
                    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("the id was never freed: {e:?}"),
            }
        };
        let again = on_1.open_subscription(request).await.expect_err("open already");
        assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    })
    .await;
}

/// A replica whose NATS server dies moves to another and receives again, in
/// order; what another replica published meanwhile, which core NATS kept
/// for nobody, is counted there as dropped by NATS
/// (`reason="nats_slow_consumer"`), exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_its_nats_server_a_replica_moves_to_another_and_keeps_receiving() {
    let mut nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "failover").await;
        let mut subscriber = brokers[0].client().await;
        let (mut stream, _) = subscribe(&mut subscriber, &["metrics.>"]).await;
        let mut publisher = brokers[1].client().await;
        // Replica 0 counts replica 1's messages from the first it gets.
        let first = publisher
            .publish(publish_request("metrics.cpu", "before"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            next_message(&mut stream, "the first message").await.sequence,
            first.sequence
        );
        // Replica 1 publishes about 5,000 messages a second on a stream
        // while replica 0 loses its server (it is connected to server 0
        // first) and moves to another. Publishes through one replica have
        // consecutive sequences: what replica 0 misses is plain to see.
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let producing = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for _ in 0..5 {
                        i += 1;
                        if tx.send(publish_request("metrics.cpu", &format!("m{i}"))).await.is_err() {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        });
        let publishing = tokio::spawn(async move {
            publisher
                .publish_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map(|r| r.into_inner())
        });
        nats.kill(0);
        wait_until("replica 0 to reconnect", || async {
            let (_, metrics) = brokers[0].http_get("/metrics").await;
            metric_sum(&metrics, "tinybroker_nats_reconnects_total") >= 1.0
                && metric_sum(&metrics, "tinybroker_nats_connected") == 1.0
        })
        .await;
        wait_serving(&brokers[0]).await;
        // Core NATS keeps nothing for a replica while it moves; once its
        // interest is known again, messages arrive: 200 of them, then the
        // stream ends, and everything up to its last message arrives.
        let mut received = Vec::new();
        while received.len() < 200 {
            let m = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .expect("messages after the failover")
                .unwrap()
                .unwrap();
            received.push(m.sequence);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        producing.await.unwrap();
        let sent = publishing.await.unwrap().expect("the publish stream");
        while received.last() != Some(&sent.last_sequence) {
            let m = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .expect("the stream's last message")
                .unwrap()
                .unwrap();
            received.push(m.sequence);
        }
        assert_eq!(sent.last_sequence - sent.first_sequence + 1, sent.accepted);
        assert!(
            received.windows(2).all(|w| w[0] < w[1]),
            "in order, none twice: {received:?}"
        );
        assert!(
            received
                .iter()
                .all(|s| (sent.first_sequence..=sent.last_sequence).contains(s))
        );
        let lost = sent.accepted - received.len() as u64;
        assert!(
            lost > 0,
            "some of the {} messages were published while replica 0 moved",
            sent.accepted
        );
        // Every one of them is counted on replica 0, as NATS dropped it.
        wait_until("replica 0 to count the messages NATS dropped on the way", || async {
            let (_, metrics) = brokers[0].http_get("/metrics").await;
            common::process::metric_with_label(
                &metrics,
                "tinybroker_messages_dropped_total",
                "reason=\"nats_slow_consumer\"",
            ) == Some(lost as f64)
        })
        .await;
        eprintln!(
            "failover: {} published, {} received, {lost} dropped by NATS and counted",
            sent.accepted,
            received.len()
        );
    })
    .await;
}

/// The real binary, as a pod runs it: a message limit above what NATS
/// carries stops the replica when it connects, with one line naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_limit_above_the_nats_max_payload_stops_the_replica() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let mut replica = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", nats.url(0).as_str()),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_REPLICA_ID", "too-big"),
            ("TINYBROKER_MAX_MESSAGE_BYTES", "4194304"),
        ]);
        // async-nats logs the server's max_payload too, on its own
        // schedule: wait for the replica's own line, which names the variable.
        let line = replica.line_containing("TINYBROKER_MAX_MESSAGE_BYTES=4194304");
        assert!(line.contains("max_payload"), "{line}");
        assert!(line.contains("1048576"), "{line}");
        let status = tokio::task::spawn_blocking(move || replica.wait_exit()).await.unwrap();
        assert!(!status.success(), "{status:?}");
    })
    .await;
}

/// Debian 12's nats-server (2.9.10): `TB_OLD_NATS_SERVER`, or
/// `/usr/sbin/nats-server` when it is older than 2.10. Panics, saying how to
/// install it, when there is none.
fn old_nats_server() -> std::path::PathBuf {
    let path = std::env::var_os("TB_OLD_NATS_SERVER")
        .filter(|p| !p.is_empty())
        .map_or_else(|| std::path::PathBuf::from("/usr/sbin/nats-server"), Into::into);
    let version = std::process::Command::new(&path)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    assert!(
        version
            .as_ref()
            .is_some_and(|v| v.contains("v2.9.") || v.contains("v2.8.")),
        "this test needs a nats-server older than 2.10 at {} (apt-get install nats-server on Debian 12, \
         or TB_OLD_NATS_SERVER=<path>; .ci/run installs it); found {version:?}",
        path.display()
    );
    path
}

/// API.md, "Cluster mode": a NATS server older than 2.10 makes the replica
/// exit when it connects, with one line naming the version it found and
/// 2.10 (not a JetStream decode error, retried for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_older_than_2_10_stops_the_replica_naming_both_versions() {
    let old = old_nats_server();
    timeout(async {
        let port = common::process::free_port();
        let dir = std::env::temp_dir().join(format!("tb-old-nats-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).unwrap();
        let _nats = common::process::ChildGuard::spawn(std::process::Command::new(&old).args([
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-sd",
            dir.to_str().unwrap(),
        ]));
        wait_until("the old nats-server to accept connections", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
        })
        .await;
        let url = format!("nats://127.0.0.1:{port}");
        let mut replica = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", url.as_str()),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_REPLICA_ID", "old-nats"),
        ]);
        let line = replica.line_containing("2.9.");
        assert!(line.contains("ERROR"), "{line}");
        assert!(line.contains("2.10"), "{line}");
        let status = tokio::task::spawn_blocking(move || {
            let status = replica.wait_exit();
            (status, replica.drain_lines())
        })
        .await
        .unwrap();
        assert!(!status.0.success(), "{status:?}");
        assert!(
            status.1.iter().all(|l| !l.contains("untagged enum")),
            "no JetStream decode error: {:#?}",
            status.1
        );
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await;
}

/// API.md, "Cluster mode": with TINYBROKER_MAX_MESSAGE_BYTES unset, default
/// NATS (max_payload 1 MiB) and default tinybroker work together without a
/// warning: the replica takes the largest message max_payload carries once
/// encoded, says the figure at INFO once, and GetBrokerInfo reports it; a
/// message of that size reaches a subscriber and a group member on the
/// other replica, one byte more is refused naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_message_limit_is_what_the_nats_max_payload_carries() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let prefix = format!("limit{}", unique());
        let spawn = |id: &str| {
            common::process::BrokerProcess::spawn(&[
                ("TINYBROKER_NATS_URL", nats.url(0).as_str()),
                ("TINYBROKER_NATS_PREFIX", prefix.as_str()),
                ("TINYBROKER_NATS_REPLICAS", "1"),
                ("TINYBROKER_REPLICA_ID", id),
            ])
        };
        let a = spawn("limit-a");
        let b = spawn("limit-b");
        let mut said = Vec::new();
        for replica in [&a, &b] {
            let mut lines = replica.before_start.clone();
            lines.push(replica.started.clone());
            loop {
                let line = replica.line_containing("");
                let serving = line.contains("SERVING");
                lines.push(line);
                if serving {
                    break;
                }
            }
            // async-nats says max_payload when it connects too.
            let payload_lines: Vec<&String> = lines
                .iter()
                .filter(|l| l.contains("max_payload") && l.contains("tinybroker"))
                .collect();
            assert_eq!(payload_lines.len(), 1, "one line about max_payload: {lines:#?}");
            assert!(payload_lines[0].contains("INFO"), "{}", payload_lines[0]);
            assert!(lines.iter().all(|l| !l.contains("WARN")), "no warning: {lines:#?}");
            said.push(common::process::field(payload_lines[0], "max_message_bytes"));
        }
        let connect = |url: String| async move {
            tonic::transport::Endpoint::from_shared(url)
                .unwrap()
                .connect()
                .await
                .unwrap()
        };
        let (channel_a, channel_b) = (connect(a.url()).await, connect(b.url()).await);
        let info = pb::admin_client::AdminClient::new(channel_a.clone())
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        let limit = info.limits.unwrap().max_message_bytes as usize;
        assert_eq!(
            said,
            [limit.to_string(), limit.to_string()],
            "the figure said is the one in force"
        );
        assert!(limit < 1 << 20 && limit > (1 << 20) - 4096, "{limit}");

        let mut subscriber = pb::broker_client::BrokerClient::new(channel_b.clone());
        let mut broadcast = subscriber
            .open_subscription(subscribe_request(&["big.*"]))
            .await
            .unwrap()
            .into_inner();
        let mut member = subscriber
            .open_subscription(member_request(&["big.*"], "bigs", false, 4))
            .await
            .unwrap()
            .into_inner();
        let mut publisher = pb::broker_client::BrokerClient::new(channel_a);
        // The other replica's subscription is known once a message reaches it.
        loop {
            publisher.publish(publish_request("big.probe", "probe")).await.unwrap();
            if tokio::time::timeout(Duration::from_millis(500), broadcast.message())
                .await
                .is_ok()
            {
                break;
            }
        }
        let largest = pb::PublishRequest {
            topic: "big.one".into(),
            payload: vec![7u8; limit].into(),
            headers: Default::default(),
        };
        let sent = publisher.publish(largest.clone()).await.unwrap().into_inner();
        for (what, stream) in [("broadcast", &mut broadcast), ("group member", &mut member)] {
            loop {
                let m = stream.message().await.unwrap().expect(what);
                if m.sequence == sent.sequence {
                    assert_eq!(m.payload.len(), limit, "{what}");
                    break;
                }
            }
        }
        let over = pb::PublishRequest {
            payload: vec![7u8; limit + 1].into(),
            ..largest
        };
        let refused = publisher.publish(over).await.unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains(&limit.to_string()), "{refused:?}");
    })
    .await;
}

/// The real binary's environment turns cluster mode on: GetBrokerInfo and
/// the log say so, and an unknown-variable warning names none of the
/// cluster variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_turns_cluster_mode_on() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let replica = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", nats.url(0).as_str()),
            ("TINYBROKER_NATS_PREFIX", "envtest"),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_REPLICA_ID", "pod-a"),
        ]);
        assert!(
            replica.before_start.iter().all(|l| !l.contains("unknown")),
            "{:#?}",
            replica.before_start
        );
        replica.line_containing("SERVING");
        let channel = tonic::transport::Endpoint::from_shared(replica.url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let info = pb::admin_client::AdminClient::new(channel)
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(info.cluster_mode);
        assert_eq!(info.replica_id, "pod-a");
        assert!(info.nats_server.contains(':'), "{}", info.nats_server);
    })
    .await;
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

/// A rolling restart (the replica serving the subscriber stopped as on
/// SIGTERM, a new one started) under a broadcast subscriber that uses the
/// client library through one Service address: each time it is back on a
/// live replica and receives what is published after it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_moves_broadcast_subscribers_to_live_replicas() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut live: Vec<(String, TestBroker)> = replicas(&nats, 2, "rolling")
            .await
            .into_iter()
            .enumerate()
            .map(|(i, b)| (format!("r{i}"), b))
            .collect();
        let backends = std::sync::Arc::new(parking_lot::Mutex::new(
            live.iter().map(|(_, b)| b.grpc_addr).collect::<Vec<_>>(),
        ));
        let addr = service(backends.clone()).await;
        let client = tinybroker::client::Client::connect(&format!("http://{addr}"))
            .await
            .unwrap();
        let mut subscriber = client.subscriber(subscribe_request(&["config.>"]), true);
        let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
        subscriber.on_event(move |e| {
            let _ = events_tx.send(format!("{e}"));
        });
        subscriber.open().await.unwrap();
        for round in 2..4 {
            let listing = live[0].1.subscriptions().await;
            assert_eq!(listing.len(), 1, "{listing:?}");
            let serving = listing[0].replica_id.clone();
            let index = live
                .iter()
                .position(|(id, _)| *id == serving)
                .expect("a live replica serves it");
            let (_, leaving) = live.remove(index);
            backends.lock().retain(|a| *a != leaving.grpc_addr);
            let id = format!("r{round}");
            let fresh = start_with(replica_config(urls_from(&nats, round % 3), &id, "rolling")).await;
            wait_serving(&fresh).await;
            backends.lock().push(fresh.grpc_addr);
            live.push((id, fresh));
            leaving.stop().await;
            // Publish on a live replica until the subscriber has a message
            // of this round: then it re-subscribed on a live replica.
            let mut publisher = live[0].1.client().await;
            let marker = format!("round-{round}");
            loop {
                publisher
                    .publish(publish_request("config.flags", &marker))
                    .await
                    .unwrap();
                match tokio::time::timeout(Duration::from_millis(300), subscriber.next()).await {
                    Ok(Ok(Some(m))) if m.payload == marker.as_bytes() => break,
                    Ok(Ok(Some(_))) | Err(_) => continue,
                    Ok(other) => panic!("{marker}: the subscriber gave up: {other:?}"),
                }
            }
            let listing = live[0].1.subscriptions().await;
            assert_eq!(listing.len(), 1, "{marker}: one subscription: {listing:?}");
            assert!(
                live.iter().any(|(id, _)| *id == listing[0].replica_id),
                "{marker}: on a live replica: {listing:?}"
            );
        }
        let mut seen = Vec::new();
        while let Ok(e) = events.try_recv() {
            seen.push(e);
        }
        assert!(
            seen.iter().filter(|e| e.contains("shutting down")).count() >= 2,
            "{seen:#?}"
        );
    })
    .await;
}

/// A replica killed (SIGKILL) while its MANUAL member holds messages: they
/// are redelivered to a member on another replica by the group's ack
/// deadline, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_unacked_group_messages_go_to_another_member() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut doomed = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", urls_from(&nats, 0).join(",").as_str()),
            ("TINYBROKER_NATS_PREFIX", "killed"),
            ("TINYBROKER_REPLICA_ID", "doomed"),
        ]);
        doomed.line_containing("SERVING");
        let survivor = start_with(replica_config(urls_from(&nats, 1), "survivor", "killed")).await;
        wait_serving(&survivor).await;
        let channel = tonic::transport::Endpoint::from_shared(doomed.url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut request = member_request(&["tasks.*"], "crunchers", true, 16);
        request.ack_deadline_ms = 2000;
        let mut on_doomed = pb::broker_client::BrokerClient::new(channel)
            .open_subscription(request.clone())
            .await
            .unwrap()
            .into_inner();
        let sent = publish_n(&survivor, "tasks.x", 5).await;
        for _ in 0..5 {
            next_message(&mut on_doomed, "held by the doomed member").await;
        }
        let mut on_survivor = survivor
            .client()
            .await
            .open_subscription(request)
            .await
            .unwrap()
            .into_inner();
        doomed.guard.kill();
        let mut got = std::collections::BTreeSet::new();
        while got.len() < sent.len() {
            let m = next_message(&mut on_survivor, "a redelivery after the kill").await;
            assert!(m.delivery_attempt >= 2, "{m:?}");
            got.insert(m.sequence);
        }
        assert_eq!(got.into_iter().collect::<Vec<_>>(), sent);
    })
    .await;
}

// === failure behaviour under load (issue 15) ===

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

/// A replica process (`tinybroker serve`, as a pod runs it) named `id`,
/// connected to server `first` of `nats` first, with a 2 s shutdown grace.
async fn spawn_replica(nats: &NatsCluster, first: usize, id: &str, prefix: &str) -> common::process::BrokerProcess {
    let env = vec![
        ("TINYBROKER_NATS_URL", urls_from(nats, first).join(",")),
        ("TINYBROKER_NATS_PREFIX", prefix.to_owned()),
        ("TINYBROKER_REPLICA_ID", id.to_owned()),
        ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "2".to_owned()),
    ];
    let replica = tokio::task::spawn_blocking(move || common::process::BrokerProcess::spawn(&env))
        .await
        .unwrap();
    wait_until("the replica process to be SERVING", || async {
        serving_status_at(&replica.url()).await == Some(ServingStatus::Serving)
    })
    .await;
    replica
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

/// The group streams of `prefix` that server `i` reports: (name, messages).
async fn group_streams(nats: &NatsCluster, i: usize, prefix: &str) -> Option<Vec<(String, u64)>> {
    let jsz = nats.monitor(i, "/jsz?streams=true").await?;
    let group_prefix = format!("{prefix}_g_");
    let mut names = Vec::new();
    for account in jsz["account_details"].as_array()? {
        for stream in account["stream_detail"].as_array().into_iter().flatten() {
            let name = stream["name"].as_str().unwrap_or_default();
            if name.starts_with(&group_prefix) {
                names.push((
                    name.to_owned(),
                    stream["state"]["messages"].as_u64().unwrap_or_default(),
                ));
            }
        }
    }
    Some(names)
}

/// A group that has had no member on any replica for its idle TTL is
/// removed cluster-wide, as in single-node mode: gone from every replica's
/// listing, its stream and consumer deleted with what they held (counted
/// as `group_expired` by the replica that removed it), and its name free
/// for other patterns. Within the TTL it is listed with its backlog; a
/// group with a member stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memberless_group_is_removed_cluster_wide_after_its_idle_ttl() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        const TTL: Duration = Duration::from_secs(3);
        let brokers = replicas_with(&nats, 2, "idle", |c| c.limits.group_idle_ttl = TTL).await;
        let mut busy = brokers[1]
            .client()
            .await
            .open_subscription(member_request(&["busy.*"], "busy", false, 4))
            .await
            .unwrap()
            .into_inner();
        let mut member = brokers[0]
            .client()
            .await
            .open_subscription(member_request(&["idle.*"], "idle", true, 4))
            .await
            .unwrap()
            .into_inner();
        publish_n(&brokers[1], "idle.x", 1).await;
        next_message(&mut member, "the message it leaves unacked").await;
        // Before it leaves: no replica can see the group memberless earlier.
        let left_at = std::time::Instant::now();
        drop(member);
        wait_until("the member to be gone", || async {
            brokers[1].group("idle").await.is_some_and(|g| g.members == 0)
        })
        .await;
        publish_n(&brokers[1], "idle.x", 2).await;
        // Within the TTL: listed without members, its three messages kept
        // in its stream (the busy group's is empty).
        let within = brokers[0].group("idle").await.expect("listed within its TTL");
        let mut streams = group_streams(&nats, 0, "idle").await.unwrap_or_default();
        streams.sort_by_key(|(_, messages)| *messages);
        assert!(left_at.elapsed() < TTL, "checked within the TTL");
        assert_eq!(within.members, 0, "{within:?}");
        assert_eq!(
            streams.iter().map(|(_, m)| *m).collect::<Vec<_>>(),
            [0, 3],
            "{streams:?}"
        );

        // Its memberless gauge counts up on some replica meanwhile.
        wait_until("a memberless gauge of the idle group above 0", || async {
            for broker in &brokers {
                let (_, metrics) = broker.http_get("/metrics").await;
                let gauge = common::process::metric_with_label(
                    &metrics,
                    "tinybroker_consumer_group_memberless_seconds",
                    "consumer_group=\"idle\"",
                );
                if gauge.is_some_and(|s| s > 0.0) {
                    return true;
                }
            }
            false
        })
        .await;
        wait_until("the idle group gone from every replica's listing", || async {
            for broker in &brokers {
                if broker.group("idle").await.is_some() {
                    return false;
                }
            }
            true
        })
        .await;
        let removed_after = left_at.elapsed();
        eprintln!("idle: removed {removed_after:?} after its last member left (TTL {TTL:?})");
        assert!(removed_after >= TTL, "not before its TTL: {removed_after:?}");
        wait_until("its stream deleted", || async {
            group_streams(&nats, 0, "idle").await.is_some_and(|s| s.len() == 1)
        })
        .await;
        let expired = dropped_total(&brokers, "group_expired").await;
        eprintln!("idle: dropped as group_expired (all replicas): {expired}");
        assert_eq!(expired, 3.0, "what it held is dropped and counted");
        // The group with a member is still there.
        let busy_info = brokers[0].group("busy").await.expect("a group with a member stays");
        assert_eq!(busy_info.members, 1);
        // A publish to its topic matches no group now, at once.
        let started = std::time::Instant::now();
        let r = brokers[0]
            .client()
            .await
            .publish(publish_request("idle.x", "after"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_groups, 0);
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        // The name is free: a member with other patterns creates it anew,
        // and gets none of the old messages.
        let mut reborn = brokers[1]
            .client()
            .await
            .open_subscription(member_request(&["other.*"], "idle", false, 4))
            .await
            .expect("the name is free again")
            .into_inner();
        let fresh = publish_n(&brokers[0], "other.y", 1).await;
        let m = next_message(&mut reborn, "the new group's first message").await;
        assert_eq!(m.sequence, fresh[0]);
        // The busy member still gets its messages.
        let sent = publish_n(&brokers[0], "busy.z", 1).await;
        assert_eq!(
            next_message(&mut busy, "the busy group's message").await.sequence,
            sent[0]
        );
    })
    .await;
}

/// A full group backlog on a 3-server NATS cluster (R3 streams): the oldest
/// messages are dropped, and every one of them is counted once, by the
/// replica whose publish dropped it, while two replicas publish into the
/// full backlog at once: published = backlog + dropped, in Admin and in the
/// metrics. The member that comes back gets the newest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_group_backlog_drops_the_oldest_and_counts_each_once_across_replicas() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas_with(&nats, 2, "full", |c| c.limits.group_capacity = 4).await;
        let mut client = brokers[0].client().await;
        let first = client
            .open_subscription(member_request(&["work"], "slow", false, 1))
            .await
            .unwrap()
            .into_inner();
        drop(first);
        wait_members(&brokers[1], 0).await;
        let mut admin = brokers[1].admin().await;

        // Two replicas publish 20 each at the same time into a backlog of 4:
        // one a message at a time, the other on a PublishStream (its
        // stores overlap, and each refused one is retried after the others
        // were sent).
        let (a, b) = tokio::join!(
            publish_n(&brokers[0], "work", 20),
            publish_many(&brokers[1], "work", 20)
        );
        // The backlog is read from the consumer, whose server may apply the
        // last stored messages a moment after the publish was acked.
        let last = std::sync::Arc::new(std::sync::Mutex::new(None));
        let waited = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let g = groups(&mut admin.clone()).await.remove(0);
                if g.backlog == 4 {
                    break;
                }
                *last.lock().unwrap() = Some(g);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "timed out waiting for the backlog to read 4 (publishes: {a:?} and {b:?}); last read: {:?}",
            last.lock().unwrap()
        );
        let g = groups(&mut admin).await.remove(0);
        assert_eq!(g.dropped, 36, "every message dropped is counted once: {g:?}");
        let counted = dropped_total(&brokers, "group_overflow").await;
        assert_eq!(counted, 36.0, "group_overflow summed over the replicas");

        // The member back gets the 4 kept, and they are the newest: each is
        // among the last 4 its replica published (a publish into the full
        // backlog always drops the oldest, so a message with 4 of its own
        // replica's after it is gone).
        let mut member = brokers[1]
            .client()
            .await
            .open_subscription(member_request(&["work"], "slow", false, 10))
            .await
            .unwrap()
            .into_inner();
        let mut kept = Vec::new();
        for _ in 0..4 {
            kept.push(next_message(&mut member, "a kept message").await.sequence);
        }
        for seq in &kept {
            let newest = [&a[a.len() - 4..], &b[b.len() - 4..]];
            assert!(
                newest.iter().any(|last| last.contains(seq)),
                "{seq} is among the newest: kept {kept:?}, a {a:?}, b {b:?}"
            );
        }
        // Nothing beyond the 4 kept: a message published now is the
        // member's next (the group hands its stream's messages out in
        // order, to its one member).
        let marker = publish_n(&brokers[0], "work", 1).await[0];
        assert_eq!(
            next_message(&mut member, "the message after the kept ones")
                .await
                .sequence,
            marker,
            "nothing beyond the 4 kept"
        );
    })
    .await;
}

/// A Nack goes to another member of the same replica when one has room, as
/// in single-node mode, not back to the one that nacked it: two MANUAL
/// members on one replica, each given one message, so the hand-out turn is
/// back at the first; it nacks, and the second gets the message (attempt 2)
/// while the first gets nothing more. (Through JetStream, the replica's turn
/// would give it to the first again.) The first's late Ack is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_goes_to_another_member_on_the_same_replica() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "nackhere").await;
        let mut client = brokers[0].client().await;
        let (mut first, first_id) = open(&mut client, member_request(&["job"], "w", true, 4)).await;
        let (mut second, second_id) = open(&mut client, member_request(&["job"], "w", true, 4)).await;
        wait_members(&brokers[1], 2).await;
        let sent = publish_n(&brokers[1], "job", 2).await;
        let a = next_message(&mut first, "the first member's message").await;
        let b = next_message(&mut second, "the second member's message").await;
        assert_eq!([a.sequence, b.sequence].iter().filter(|s| sent.contains(s)).count(), 2);
        let r = brokers[1]
            .client()
            .await
            .nack(pb::NackRequest {
                subscription_id: first_id.clone(),
                sequences: vec![a.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.requeued, r.unknown), (1, 0));
        let again = next_message(&mut second, "the nacked message, at the other member").await;
        assert_eq!((again.sequence, again.delivery_attempt), (a.sequence, 2));
        assert_eq!(again.subscription_id, second_id);
        let late = ack(&mut client, &first_id, &[a.sequence]).await;
        assert_eq!(late, (0, 1), "a late ack from the old holder");
        let ok = ack(&mut client, &second_id, &[a.sequence, b.sequence]).await;
        assert_eq!(ok, (2, 0));
        let g = groups(&mut brokers[1].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.redeliveries, g.backlog), (0, 1, 0), "{g:?}");
        // The group holds nothing, so nothing more can come: the member
        // that nacked was handed its one message and no other.
        let f = listed(brokers[0].subscriptions().await, &first_id).unwrap();
        assert_eq!(
            (f.delivered, f.queue_depth),
            (1, 0),
            "nothing more for the member that nacked: {f:?}"
        );
        drop(first);
    })
    .await;
}

/// A Nack by the only member of a group on its replica hands the message
/// to a member on another replica, as in single-node mode another member
/// gets it first (docs/contract.md, Cluster mode): not back through
/// JetStream to whichever pull comes first, the nacking member's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_goes_to_a_member_on_another_replica_when_none_here_has_room() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "nackthere").await;
        let mut clients = [brokers[0].client().await, brokers[1].client().await];
        let (mut s0, id0) = open(&mut clients[0], member_request(&["job"], "w", true, 8)).await;
        let (mut s1, id1) = open(&mut clients[1], member_request(&["job"], "w", true, 8)).await;
        let ids = [id0, id1];
        wait_members(&brokers[0], 2).await;
        const N: usize = 6;
        let sent = publish_n(&brokers[0], "job", N).await;
        // Each first delivery is nacked by the member that got it; the
        // second must reach the other member.
        let mut first_at = std::collections::HashMap::new();
        let mut second_at = std::collections::HashMap::new();
        while second_at.len() < N {
            let (m, member) = tokio::select! {
                m = next_message(&mut s0, "a delivery") => (m, 0),
                m = next_message(&mut s1, "a delivery") => (m, 1),
            };
            assert!(sent.contains(&m.sequence), "{m:?}");
            match m.delivery_attempt {
                1 => {
                    assert!(first_at.insert(m.sequence, member).is_none(), "{m:?}");
                    let r = clients[member]
                        .nack(pb::NackRequest {
                            subscription_id: ids[member].clone(),
                            sequences: vec![m.sequence],
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    assert_eq!((r.requeued, r.unknown), (1, 0));
                }
                2 => {
                    assert!(second_at.insert(m.sequence, member).is_none(), "{m:?}");
                    assert_eq!(ack(&mut clients[member], &ids[member], &[m.sequence]).await, (1, 0));
                }
                n => panic!("attempt {n} of {m:?}"),
            }
        }
        for seq in &sent {
            assert_ne!(
                first_at[seq], second_at[seq],
                "message {seq} came back to the member that nacked it: first {first_at:?}, second {second_at:?}"
            );
        }
        let g = groups(&mut brokers[1].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.redeliveries, g.backlog), (0, N as u64, 0), "{g:?}");
    })
    .await;
}

/// A message whose ack deadline passed goes to another member with room,
/// as in single-node mode, not back through JetStream to whichever member
/// pulls first (the late one included): four messages held by a member
/// that never acks all reach the member that joined after them, attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_hands_the_message_to_another_member() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "deadline").await;
        let mut client = brokers[0].client().await;
        let mut request = member_request(&["slow"], "w", true, 4);
        request.ack_deadline_ms = 1_000;
        let (mut late, late_id) = open(&mut client, request).await;
        let sent = publish_n(&brokers[1], "slow", 4).await;
        for seq in &sent {
            let m = next_message(&mut late, "a message for the member that never acks").await;
            assert_eq!((m.sequence, m.delivery_attempt), (*seq, 1));
        }
        let (mut other, other_id) = open(&mut client, member_request(&["slow"], "w", true, 8)).await;
        let mut again = Vec::new();
        while again.len() < sent.len() {
            let m = next_message(&mut other, "a message whose deadline passed").await;
            assert_eq!(m.delivery_attempt, 2, "{m:?}");
            assert_eq!(ack(&mut client, &other_id, &[m.sequence]).await, (1, 0));
            again.push(m.sequence);
        }
        again.sort_unstable();
        assert_eq!(again, sent);
        let g = groups(&mut brokers[1].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.redeliveries, g.backlog), (0, 4, 0), "{g:?}");
        // Every message is acked and the group holds nothing more: the
        // member that let its deadlines pass was handed the 4 first
        // attempts and nothing came back to it.
        let l = listed(brokers[0].subscriptions().await, &late_id).unwrap();
        assert_eq!(
            (l.delivered, l.queue_depth, l.unacked),
            (4, 0, 0),
            "nothing came back to the member that let its deadlines pass: {l:?}"
        );
        drop(late);
    })
    .await;
}

/// A full group backlog whose every message is with a member has nothing
/// older to drop for a new message: the new one is dropped, and counted
/// (docs/contract.md, Cluster mode). Once the member acks, the group takes
/// messages again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_backlog_held_by_members_drops_the_new_message_and_counts_it() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut config = replica_config(urls_from(&nats, 0), "r0", "held");
        config.limits.group_capacity = 2;
        let broker = start_with(config).await;
        wait_serving(&broker).await;
        let mut client = broker.client().await;
        let (mut member, id) = open(&mut client, member_request(&["work"], "busy", true, 2)).await;
        let held = publish_n(&broker, "work", 2).await;
        let got = [
            next_message(&mut member, "the first").await.sequence,
            next_message(&mut member, "the second").await.sequence,
        ];
        assert_eq!(got.to_vec(), held);

        // Both stored messages are with the member: the third is dropped.
        publish_n(&broker, "work", 1).await;
        let g = groups(&mut broker.admin().await).await.remove(0);
        assert_eq!((g.dropped, g.in_flight), (1, 2), "{g:?}");
        assert_eq!(dropped_total([&broker], "group_overflow").await, 1.0);

        assert_eq!(ack(&mut client, &id, &held).await, (2, 0));
        let next = publish_n(&broker, "work", 1).await;
        assert_eq!(
            next_message(&mut member, "a message after the acks").await.sequence,
            next[0]
        );
    })
    .await;
}

/// A message handed to another member (a Nack) and later given back through
/// JetStream (no member had room) keeps counting its attempts: JetStream's
/// count is one behind, and `delivery_attempt` and
/// `TINYBROKER_MAX_DELIVERY_ATTEMPTS` must not repeat or stretch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_keep_counting_after_a_hand_over_and_a_redelivery_through_jetstream() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas_with(&nats, 1, "attempts", |c| c.limits.max_delivery_attempts = 3).await;
        let mut client = brokers[0].client().await;
        let (mut dlq, _) = subscribe(&mut client, &["_dlq.w"]).await;
        let (mut a, a_id) = open(&mut client, member_request(&["job"], "w", true, 1)).await;
        let (mut b, b_id) = open(&mut client, member_request(&["job"], "w", true, 1)).await;
        wait_members(&brokers[0], 2).await;
        let nack = |id: String, sequence: u64| {
            let mut client = client.clone();
            async move {
                let r = client
                    .nack(pb::NackRequest {
                        subscription_id: id,
                        sequences: vec![sequence],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!((r.requeued, r.unknown), (1, 0));
            }
        };
        let first = publish_n(&brokers[0], "job", 1).await[0];
        // Whichever member got it first (x) nacks it: the other (y) has room.
        let (mut x, x_id, mut y, y_id) = tokio::select! {
            m = next_message(&mut a, "the first delivery, at a") => {
                assert_eq!((m.sequence, m.delivery_attempt), (first, 1));
                (a, a_id, b, b_id)
            }
            m = next_message(&mut b, "the first delivery, at b") => {
                assert_eq!((m.sequence, m.delivery_attempt), (first, 1));
                (b, b_id, a, a_id)
            }
        };
        nack(x_id.clone(), first).await;
        let m = next_message(&mut y, "the nacked message, at the other member").await;
        assert_eq!((m.sequence, m.delivery_attempt), (first, 2), "handed over");
        // x is busy with another message, y nacks: no member has room, so it
        // goes back through JetStream (which delivered it once so far).
        let second = publish_n(&brokers[0], "job", 1).await[0];
        let m = next_message(&mut x, "the second message").await;
        assert_eq!(m.sequence, second);
        nack(y_id.clone(), first).await;
        let m = next_message(&mut y, "the message, redelivered through JetStream").await;
        assert_eq!(
            (m.sequence, m.delivery_attempt),
            (first, 3),
            "the third attempt, not JetStream's second delivery"
        );
        let js = async_nats::jetstream::new(async_nats::connect(nats.url(0).as_str()).await.unwrap());
        let bucket = js.get_key_value("attempts_attempts").await.unwrap();
        let entries = || async {
            use futures::StreamExt;
            bucket.keys().await.unwrap().count().await
        };
        assert_eq!(
            entries().await,
            1,
            "what ran ahead of JetStream's count, written before the nak"
        );
        // That was the last allowed attempt: a Nack dead-letters it.
        nack(y_id.clone(), first).await;
        let letter = next_message(&mut dlq, "the dead letter").await;
        assert_eq!(
            letter.headers.get("tinybroker-delivery-attempts").map(String::as_str),
            Some("3"),
            "{letter:?}"
        );
        wait_until("the dead-lettered message's entry to be removed", || async {
            entries().await == 0
        })
        .await;
        assert_eq!(ack(&mut client, &x_id, &[second]).await, (1, 0));
        // The group holds nothing now, so nothing more can come: no fourth
        // attempt. y was handed the second and third, x the first and the
        // other message.
        let g = groups(&mut brokers[0].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.backlog, g.dead_lettered), (0, 0, 1), "{g:?}");
        let listing = brokers[0].subscriptions().await;
        let handed = |id: &str| {
            let s = listed(listing.clone(), id).unwrap();
            (s.delivered, s.queue_depth)
        };
        assert_eq!(handed(&y_id), (2, 0), "no fourth attempt");
        assert_eq!(handed(&x_id), (2, 0));
        drop((x, y));
    })
    .await;
}
