//! Cluster mode as a new user breaks it: two replicas under one id, a NATS
//! server without JetStream or with too few servers for the replica count,
//! and a NATS server that restarts and forgets everything it kept in memory.
//! Each must fail loudly (a line naming what to change, logged once) or
//! recover, never serve silently deaf.

mod common;

use common::nats::NatsCluster;
use common::process::{BrokerProcess, ChildGuard, free_port, metric_with_label};
use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tinybroker::config::Config;
use tinybroker::pb;
use tonic_health::pb::health_check_response::ServingStatus;

fn replica_env(nats_url: &str, id: &str, prefix: &str) -> Vec<(&'static str, String)> {
    vec![
        ("TINYBROKER_NATS_URL", nats_url.to_owned()),
        ("TINYBROKER_NATS_PREFIX", prefix.to_owned()),
        ("TINYBROKER_NATS_REPLICAS", "1".to_owned()),
        ("TINYBROKER_REPLICA_ID", id.to_owned()),
        ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1".to_owned()),
    ]
}

async fn spawn(env: Vec<(&'static str, String)>) -> BrokerProcess {
    tokio::task::spawn_blocking(move || BrokerProcess::spawn(&env))
        .await
        .unwrap()
}

/// Lines of `replica`'s log that arrive within `wait`.
async fn lines_for(replica: &BrokerProcess, wait: Duration) -> Vec<String> {
    tokio::time::sleep(wait).await;
    replica.drain_lines()
}

/// README's mistake: two replicas started with the same id (the host name,
/// by default) on one NATS. The second says so, naming the variable, the id
/// and the first's pid, and exits; the first serves on, and logged no
/// warning at start (no "no connection" line although NATS answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_replica_with_the_same_id_refuses_to_serve_naming_the_variable() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let first = spawn(replica_env(&nats.url(0), "same-id", "dup")).await;
        wait_serving_at(&first.url()).await;
        let first_pid = first.guard.pid();
        let mut second = spawn(replica_env(&nats.url(0), "same-id", "dup")).await;
        let line = second.line_containing("is already in use by another live replica");
        assert!(
            line.contains("TINYBROKER_REPLICA_ID=\\\"same-id\\\"")
                || line.contains("TINYBROKER_REPLICA_ID=\"same-id\""),
            "{line}"
        );
        assert!(
            line.contains(&format!("pid {first_pid}")),
            "names the other replica: {line}"
        );
        let status = tokio::task::spawn_blocking(move || second.wait_exit()).await.unwrap();
        assert!(!status.success(), "{status:?}");

        assert_eq!(serving_status_at(&first.url()).await, Some(ServingStatus::Serving));
        let quiet = first.drain_lines();
        assert!(
            !quiet.iter().chain(&first.before_start).any(|l| l.contains("WARN")),
            "the first replica started without a warning: {quiet:#?}"
        );
    })
    .await;
}

/// A replica killed outright (no goodbye) and started again under its id,
/// as a StatefulSet pod is: its old entry is not renewed, so it is taken
/// over and the new process serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_and_restarted_under_its_id_takes_it_over() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let mut first = spawn(replica_env(&nats.url(0), "pod-0", "restart")).await;
        wait_serving_at(&first.url()).await;
        first.guard.kill();
        let again = spawn(replica_env(&nats.url(0), "pod-0", "restart")).await;
        let started = Instant::now();
        wait_serving_at(&again.url()).await;
        assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
        let line = again.line_containing("replica id taken over");
        assert!(line.contains("pod-0"), "{line}");
    })
    .await;
}

/// A lone nats-server, as its defaults start it: no JetStream, or JetStream
/// and the default TINYBROKER_NATS_REPLICAS=3. The replica says what to
/// change, once, and stays NOT_SERVING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_refusals_are_said_once_naming_what_to_change() {
    let binary = NatsCluster::binary();
    timeout(async {
        for (jetstream, replicas, needle) in [(false, "1", "-js"), (true, "3", "TINYBROKER_NATS_REPLICAS=1")] {
            let port = free_port();
            let store = std::env::temp_dir().join(format!("tb-js-{}-{port}", std::process::id()));
            let mut command = Command::new(&binary);
            command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
            if jetstream {
                command.args(["-js", "-sd", &store.display().to_string()]);
            }
            let _server = ChildGuard::new(
                command
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("spawn nats-server"),
            );
            let url = format!("nats://127.0.0.1:{port}");
            let mut env = replica_env(&url, "lonely", "lone");
            env.retain(|(k, _)| *k != "TINYBROKER_NATS_REPLICAS");
            env.push(("TINYBROKER_NATS_REPLICAS", replicas.to_owned()));
            let replica = spawn(env).await;
            let line = replica.line_containing(needle);
            assert!(line.contains("WARN"), "{line}");
            // Retried every second: said once, not at every retry.
            let later = lines_for(&replica, Duration::from_secs(4)).await;
            let again: Vec<&String> = later.iter().filter(|l| l.contains(needle)).collect();
            assert!(again.is_empty(), "said again: {again:#?}");
            assert!(
                !later.iter().any(|l| l.contains("max_payload")),
                "the max_payload margin is said once at most: {later:#?}"
            );
            assert_eq!(serving_status_at(&replica.url()).await, Some(ServingStatus::NotServing));
            let _ = std::fs::remove_dir_all(&store);
        }
    })
    .await;
}

/// A replica named `id` of one NATS server at `url`.
fn config_for(url: String, id: &str, prefix: &str) -> Config {
    replica_config(config(), vec![url], id, prefix, 1)
}

/// The memory-storage NATS server restarts and forgets every stream and
/// bucket: within 10 s of it answering again the replica serves every RPC
/// (a group publish reaches a member that joins after, a broadcast
/// subscriber keeps receiving, a subscription id still open is still
/// ALREADY_EXISTS), and the group messages lost with NATS are counted
/// as `nats_state_lost`: the backlog and the messages the member held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_lone_nats_server_restarts_the_replica_rebuilds_and_counts_the_loss() {
    let nats = NatsCluster::start(1).await;
    lost_state_rebuilt(nats, 1).await;
}

/// The same when every server of a 3-node JetStream cluster restarts: its
/// meta layer brings the streams back, empty (memory storage), which is a
/// loss as silent as a missing stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_whole_nats_cluster_restarts_the_replica_rebuilds_and_counts_the_loss() {
    let nats = NatsCluster::start(3).await;
    lost_state_rebuilt(nats, 3).await;
}

async fn lost_state_rebuilt(mut nats: NatsCluster, replicas: usize) {
    rejoin_timeout(async {
        let mut config = config_for(nats.url(0), "r0", "lost");
        if let Some(c) = config.cluster.as_mut() {
            c.nats_replicas = replicas;
            c.nats_urls = nats.urls();
        }
        // Two groups at the default 128 MiB would reserve all of each
        // server's 256 MB of JetStream memory, and a whole restart then
        // leaves the buckets uncreated: /healthz 503 "stream not found"
        // for good (docs/cluster-notes.md, "A JetStream memory budget
        // that group streams fill").
        config.limits.group_max_bytes = 64 << 20;
        let broker = start_with(config).await;
        wait_serving_at(&broker.url()).await;
        let mut client = broker.client().await;
        let (mut broadcast, _) = open(
            &mut client,
            pb::OpenSubscriptionRequest {
                subscription_id: "watcher".into(),
                ..subscribe_request(&["lost.>"])
            },
        )
        .await;
        let (mut member, _) = open(&mut client, member_request(&["lost.>"], "workers", true, 2)).await;
        publish_many(&broker, "lost.a", 5).await;
        for _ in 0..2 {
            let m = tokio::time::timeout(TEST_TIMEOUT, member.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(m.consumer_group, "workers");
        }
        for _ in 0..5 {
            tokio::time::timeout(TEST_TIMEOUT, broadcast.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
        // A group with no member anywhere, 4 messages in its backlog.
        let (idle_member, _) = open(&mut client, member_request(&["idle.>"], "idle", false, 0)).await;
        drop(idle_member);
        wait_until("the idle group to have no member", || async {
            broker.group("idle").await.is_some_and(|g| g.members == 0)
        })
        .await;
        publish_many(&broker, "idle.x", 4).await;
        // 2 held by the member, 3 in the backlog, as the replica sees it;
        // the held ones unacked for a while; the idle group's 4.
        wait_until(
            "the backlog gauge to read 3 and the oldest unacked age to grow",
            || async {
                let text = scrape(broker.metrics_addr).await;
                let group = "consumer_group=\"workers\"";
                metric_with_label(&text, "tinybroker_consumer_group_backlog", group) == Some(3.0)
                    && metric_with_label(&text, "tinybroker_consumer_group_backlog", "consumer_group=\"idle\"")
                        == Some(4.0)
                    && metric_with_label(&text, "tinybroker_consumer_group_oldest_unacked_age_seconds", group)
                        .is_some_and(|age| age > 0.0)
            },
        )
        .await;

        if replicas == 1 {
            nats.stop(0).await;
            nats.restart(0).await;
        } else {
            nats.restart_all().await;
        }
        let back = Instant::now();
        // Serving again, and every RPC works.
        wait_until("a group publish to succeed after the restart", || async {
            serving_status_at(&broker.url()).await == Some(ServingStatus::Serving)
                && broker
                    .client()
                    .await
                    .publish(publish_request("lost.b", "after"))
                    .await
                    .is_ok()
        })
        .await;
        // The first member's held messages are forgotten (lost with NATS):
        // it has room again, as has a member joining now.
        let (mut late, _) = open(&mut client, member_request(&["lost.>"], "workers", true, 8)).await;
        let m = tokio::select! {
            m = member.message() => m,
            m = late.message() => m,
        };
        assert_eq!(&m.unwrap().expect("the group's message").payload[..], b"after");
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "rebuilt in {:?}",
            back.elapsed()
        );
        let m = tokio::time::timeout(TEST_TIMEOUT, broadcast.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(&m.payload[..], b"after");
        let again = client
            .open_subscription(pb::OpenSubscriptionRequest {
                subscription_id: "watcher".into(),
                ..subscribe_request(&["lost.>"])
            })
            .await
            .expect_err("the id is claimed again");
        assert_eq!(again.code(), tonic::Code::AlreadyExists, "{again:?}");
        // Every group's loss is counted once and listed with the group, the
        // memberless one's too (`tinybroker groups` shows `dropped`).
        assert_eq!(broker.dropped_total("nats_state_lost").await, 9.0);
        let workers = broker.group("workers").await.map(|g| g.dropped);
        assert_eq!(workers, Some(5), "the backlog of 3 and the 2 held");
        let dropped = broker.group("idle").await.map(|g| g.dropped);
        assert_eq!(dropped, Some(4), "the memberless group's backlog");
    })
    .await;
}

/// Counters count what happened on their own replica, so that `sum by`
/// over the replicas is the truth: 10 group messages to a MANUAL member on
/// each of two replicas, each acked through the member's own replica, read
/// 10 delivered and 10 acked in all, each replica its member's share;
/// the gauges are the cluster's on both (2 members, nothing in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_counters_summed_over_replicas_are_the_clusters_totals() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let r0 = start_with(config_for(nats.url(0), "r0", "sums")).await;
        let r1 = start_with(config_for(nats.url(0), "r1", "sums")).await;
        wait_serving_at(&r0.url()).await;
        wait_serving_at(&r1.url()).await;
        let mut c0 = r0.client().await;
        let mut c1 = r1.client().await;
        let (mut m0, id0) = open(&mut c0, member_request(&["sums.>"], "g", true, 64)).await;
        let (mut m1, id1) = open(&mut c1, member_request(&["sums.>"], "g", true, 64)).await;
        wait_until("both members to be listed", || async {
            r0.group("g").await.is_some_and(|g| g.members == 2)
        })
        .await;
        publish_many(&r0, "sums.a", 10).await;
        // Each member acks what it gets, through its own replica.
        let (mut got0, mut got1) = (0u32, 0u32);
        while got0 + got1 < 10 {
            tokio::select! {
                m = m0.message() => {
                    let m = m.unwrap().expect("a message");
                    assert_eq!(ack(&mut c0, &id0, &[m.sequence]).await, (1, 0));
                    got0 += 1;
                }
                m = m1.message() => {
                    let m = m.unwrap().expect("a message");
                    assert_eq!(ack(&mut c1, &id1, &[m.sequence]).await, (1, 0));
                    got1 += 1;
                }
            }
        }
        let label = "consumer_group=\"g\"";
        let read = |text: &str, name: &str| metric_with_label(text, name, label).unwrap_or(0.0);
        wait_until("the acks to be counted", || async {
            let (t0, t1) = (scrape(r0.metrics_addr).await, scrape(r1.metrics_addr).await);
            read(&t0, "tinybroker_consumer_group_acked_total") + read(&t1, "tinybroker_consumer_group_acked_total")
                == 10.0
                && [&t0, &t1].iter().all(|t| {
                    read(t, "tinybroker_consumer_group_in_flight") == 0.0
                        && read(t, "tinybroker_consumer_group_members") == 2.0
                })
        })
        .await;
        let (t0, t1) = (scrape(r0.metrics_addr).await, scrape(r1.metrics_addr).await);
        for (text, got) in [(&t0, got0), (&t1, got1)] {
            assert_eq!(
                read(text, "tinybroker_consumer_group_delivered_total"),
                f64::from(got),
                "{text}"
            );
            assert_eq!(
                read(text, "tinybroker_consumer_group_acked_total"),
                f64::from(got),
                "{text}"
            );
            assert_eq!(read(text, "tinybroker_redeliveries_total"), 0.0, "{text}");
            assert_eq!(
                read(text, "tinybroker_consumer_group_members"),
                2.0,
                "cluster-wide gauge: {text}"
            );
        }
    })
    .await;
}
