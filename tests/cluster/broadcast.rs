//! Broadcast across replicas: a message published on one replica reaches
//! subscribers on every replica, in order, with the publisher's sequence;
//! subscription ids are unique cluster-wide and a subscription can be
//! closed from any replica; core NATS carries a replica's publishes only
//! while another replica has a broadcast subscriber.

use crate::common::nats::NatsCluster;
use crate::common::*;
use crate::{next_message, replicas};
use std::time::Duration;
use tinybroker::pb;
use tonic::Code;

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
