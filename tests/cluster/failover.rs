//! A replica or its NATS server going away: a replica shutting down ends
//! its streams and frees their ids; one whose NATS server dies moves to
//! another and keeps receiving, counting what NATS dropped meanwhile; a
//! rolling restart moves broadcast subscribers to live replicas; a killed
//! replica's unacked group messages go to a member on another; a replica
//! SIGTERMed right after a burst sends every broadcast it acknowledged, or,
//! cut off from NATS, counts those it could not hand over.

use crate::common;
use crate::common::nats::NatsCluster;
use crate::common::process::metric_sum;
use crate::common::*;
use crate::{next_message, publish_n, replica_config, replicas, service, urls_from, wait_serving};
use std::time::Duration;
use tinybroker::pb;
use tonic::Code;

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

/// A replica SIGTERMed right after its publisher's last acknowledged batch
/// of broadcasts: a subscriber on another replica (open before the burst)
/// gets every acknowledged message, in order, with its sequence, none
/// missing. Catches a shutdown that flushes the NATS client without first
/// emptying the replica's outbox (`src/cluster/outbox.rs`) into it: what
/// was still queued there dies with the process. So that plenty is still
/// queued at the SIGTERM: two session batches of 16,384 (a batch takes at
/// most the outbox's whole room, 4,096, and goes in whole), their messages
/// alternating between two topics so that each is a NATS message of its
/// own (runs of one), which the sender hands to the client more slowly
/// than the shutdown reaches the flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigtermed_replica_sends_every_acknowledged_broadcast_before_it_exits() {
    use crate::common::session::TestSession;
    use tinybroker::pb::session_event::Event;
    const BATCHES: usize = 2;
    /// Four times the outbox's room.
    const BATCH: usize = 16384;
    const TOTAL: usize = BATCHES * BATCH;
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let prefix = "leaving";
        let mut leaving = crate::spawn_replica_with(
            &nats,
            0,
            "leaving",
            prefix,
            &[("TINYBROKER_MAX_BATCH_MESSAGES", &BATCH.to_string())],
        )
        .await;
        let mut config = replica_config(urls_from(&nats, 1), "staying", prefix);
        config.limits.consumer_capacity = TOTAL;
        let staying = start_with(config).await;
        wait_serving(&staying).await;
        // Open before the burst: the leaving replica has taken this
        // replica's "some" when the headers arrive.
        let (mut stream, _) = subscribe(&mut staying.client().await, &["burst.*"]).await;
        let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let reader = tokio::spawn({
            let received = received.clone();
            async move {
                let mut got = Vec::with_capacity(TOTAL);
                // Until everything came, or nothing more did for 10 s.
                while got.len() < TOTAL {
                    match tokio::time::timeout(Duration::from_secs(10), stream.message()).await {
                        Ok(Ok(Some(m))) => got.push((m.sequence, String::from_utf8(m.payload.to_vec()).unwrap())),
                        _ => break,
                    }
                    received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                got
            }
        });

        let channel = tonic::transport::Endpoint::from_shared(leaving.url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut session = TestSession::start(&mut pb::broker_client::BrokerClient::new(channel)).await;
        for b in 0..BATCHES {
            let messages = (b * BATCH..(b + 1) * BATCH)
                .map(|i| publish_request(&format!("burst.{}", i % 2), &i.to_string()))
                .collect();
            session.publish(b as u64, messages);
        }
        let mut acknowledged = Vec::with_capacity(TOTAL);
        for b in 0..BATCHES {
            let answer = match session.event().await {
                Event::Published(p) => p,
                other => panic!("expected batch {b}'s answer, got {other:?}"),
            };
            assert_eq!(
                (answer.id, answer.accepted as usize, answer.rejected.len()),
                (b as u64, BATCH, 0),
                "batch {b} accepted whole: {answer:?}"
            );
            let first = answer.first_sequence;
            acknowledged.extend((0..BATCH).map(|k| (first + k as u64, (b * BATCH + k).to_string())));
        }
        // At once: `kill` as a command would give the sender milliseconds.
        // SAFETY: kill(2) on the pid of a child this test holds (not yet reaped).
        let killed = unsafe { libc::kill(leaving.guard.pid() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(killed, 0, "SIGTERM sent");
        let in_transit = TOTAL - received.load(std::sync::atomic::Ordering::Relaxed);
        let status = common::process::exit_status(&mut leaving.guard, Duration::from_secs(20)).await;
        assert!(status.success(), "the SIGTERMed replica exits 0: {status:?}");

        let got = reader.await.unwrap();
        eprintln!("{in_transit} of {TOTAL} acknowledged messages not yet received at the SIGTERM");
        let first_wrong = got.iter().zip(&acknowledged).position(|(g, a)| g != a);
        assert!(
            got.len() == TOTAL && first_wrong.is_none(),
            "the other replica's subscriber got {} of {TOTAL} acknowledged messages; first out of place: {:?}, \
             last received: {:?}",
            got.len(),
            first_wrong.map(|i| (i, &got[i], &acknowledged[i])),
            got.last()
        );
    })
    .await;
}

/// A replica cut off from NATS (its connection blackholed) and SIGTERMed
/// with its outbox full of acknowledged broadcasts cannot hand them to
/// NATS: it says how many it lost, counts them in
/// `tinybroker_messages_discarded_on_shutdown_total`, and exits within its
/// grace period and a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sigtermed_replica_cut_off_from_nats_counts_the_broadcasts_it_could_not_send() {
    use crate::common::process::field;
    use crate::common::proxy::{Proxy, addr_of};
    use crate::common::session::TestSession;
    use tinybroker::pb::session_event::Event;
    /// Batches of the largest size sent at once, more than the client's
    /// queue (2,048 NATS messages, here one a message: the subjects
    /// alternate), its socket and the outbox (4,096) take together.
    const BATCHES: u64 = 64;
    const BATCH: usize = 1024;
    const GRACE: Duration = Duration::from_secs(2);
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let prefix = "cutoff";
        let proxy = Proxy::start(addr_of(&nats.url(0))).await;
        let mut leaving =
            crate::spawn_replica_with(&nats, 0, "leaving", prefix, &[("TINYBROKER_NATS_URL", &proxy.url())]).await;
        let staying = start_with(replica_config(urls_from(&nats, 1), "staying", prefix)).await;
        wait_serving(&staying).await;
        let (mut stream, _) = subscribe(&mut staying.client().await, &["burst.*"]).await;
        // The leaving replica sends broadcasts on core NATS: it knows the
        // staying one listens.
        let mut client = tinybroker::pb::broker_client::BrokerClient::new(
            tonic::transport::Endpoint::from_shared(leaving.url())
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
        client.publish(publish_request("burst.0", "first")).await.unwrap();
        assert_eq!(
            next_message(&mut stream, "the first broadcast").await.payload,
            "first".as_bytes()
        );

        proxy.blackhole();
        let mut session = TestSession::start(&mut client).await;
        let payload = "x".repeat(512);
        for b in 0..BATCHES {
            let messages = (0..BATCH)
                .map(|i| publish_request(&format!("burst.{}", i % 2), &payload))
                .collect();
            session.publish(b, messages);
        }
        // Every batch answered: accepted while the outbox had room, then
        // UNAVAILABLE once the replica found NATS unreachable.
        let (mut accepted, mut refused) = (0, 0);
        for b in 0..BATCHES {
            let answer = match session.event().await {
                Event::Published(p) => p,
                other => panic!("expected batch {b}'s answer, got {other:?}"),
            };
            accepted += answer.accepted as usize;
            refused += answer.rejected.len();
            assert!(
                answer.rejected.iter().all(|r| r.code == Code::Unavailable as u32),
                "refused only as NATS is unreachable: {:?}",
                answer.rejected.first()
            );
        }
        assert!(
            refused > 0,
            "the outbox filled up: {accepted} accepted, none refused (more batches needed)"
        );

        let sigterm = std::time::Instant::now();
        leaving.guard.signal("TERM");
        let (warn, _) = common::process::line_containing(
            &leaving.log,
            "broadcast messages for the other replicas",
            GRACE + Duration::from_secs(10),
        )
        .await;
        let unsent: u64 = field(&warn, "unsent_broadcasts").parse().unwrap();
        assert!(warn.contains("WARN"), "{warn}");
        // A batch waited for room (1,024 of 4,096) until it was refused:
        // more than the rest of the room was held, by messages queued or
        // taken by the sender, and nothing reached NATS since. And no more
        // than the room (each batch fits in it): a message holds its room
        // until its run is handed to the client.
        assert!(
            unsent > (4096 - BATCH) as u64 && unsent <= 4096,
            "{unsent} of {accepted} accepted messages counted as not handed to NATS: {warn}"
        );
        // /metrics answers a little longer when something was discarded.
        let text = scrape(leaving.metrics_addr).await;
        assert_eq!(
            metric_sum(&text, "tinybroker_messages_discarded_on_shutdown_total"),
            unsent as f64,
            "the counter holds what the WARN said"
        );
        let status = common::process::exit_status(&mut leaving.guard, GRACE + Duration::from_secs(10)).await;
        let took = sigterm.elapsed();
        assert!(status.success(), "the SIGTERMed replica exits 0: {status:?}");
        eprintln!("{accepted} accepted, {refused} refused, {unsent} not handed to NATS; exited {took:?} after SIGTERM");
    })
    .await;
}
