//! The cluster session: two broker processes in cluster mode over one
//! nats-server, one Prometheus scraping both, and known counts made across
//! them. Every consumer-group panel of the dashboard and every group rule
//! of alerts.yaml, evaluated over both replicas, must give the total the
//! clients saw, not twice it nor a part of it, and hold it for a few
//! seconds on end.

use crate::clients::*;
use crate::common;
use crate::common::process::BrokerProcess;
use crate::dashboard::{alert_rules, dashboard_targets, target};
use crate::prometheus::Prometheus;
use crate::sums::*;
use crate::{SESSION_TIMEOUT, log, temp_dir};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tonic::transport::Channel;

/// TINYBROKER_GROUP_IDLE_TTL_SECONDS of the cluster session's replicas.
pub const CLUSTER_TTL: Duration = Duration::from_secs(20);

/// What the clients of the cluster session saw: the truth the dashboard
/// must add up to.
#[derive(Default)]
pub struct Seen {
    /// Messages read from group members' streams, every group.
    pub group_deliveries: std::sync::atomic::AtomicU64,
    /// Of those, the group `counted`'s.
    pub counted: std::sync::atomic::AtomicU64,
    /// Of `counted`'s, redeliveries (`delivery_attempt` above 1).
    pub redelivered: std::sync::atomic::AtomicU64,
    /// Acks answered `acked: 1`.
    pub acked: std::sync::atomic::AtomicU64,
    /// Messages read from broadcast streams (dead letters included).
    pub broadcast_deliveries: std::sync::atomic::AtomicU64,
    pub dead_letters: std::sync::atomic::AtomicU64,
}

pub fn bump(counter: &std::sync::atomic::AtomicU64) {
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

pub fn read(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

/// A member of `counted`: acks message i < 12 at once (through the other
/// replica: a forwarded Ack), nacks 12..16 once and acks the redelivery,
/// and nacks 16..20 every time (two attempts: dead-lettered).
pub fn counted_member(
    mut stream: tonic::Streaming<pb::Message>,
    id: String,
    mut own: BrokerClient<Channel>,
    mut other: BrokerClient<Channel>,
    seen: Arc<Seen>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(Some(m)) = stream.message().await {
            bump(&seen.group_deliveries);
            bump(&seen.counted);
            if m.delivery_attempt > 1 {
                bump(&seen.redelivered);
            }
            let i: u32 = std::str::from_utf8(&m.payload).unwrap().parse().unwrap();
            let ack = i < 12 || (i < 16 && m.delivery_attempt > 1);
            if ack {
                let r = other
                    .ack(pb::AckRequest {
                        subscription_id: id.clone(),
                        sequences: vec![m.sequence],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                for _ in 0..r.acked {
                    bump(&seen.acked);
                }
            } else {
                own.nack(pb::NackRequest {
                    subscription_id: id.clone(),
                    sequences: vec![m.sequence],
                })
                .await
                .unwrap();
            }
        }
    })
}

/// Reads a stream to its end, counting each message into `which` of `seen`.
pub fn count_into(
    mut stream: tonic::Streaming<pb::Message>,
    seen: Arc<Seen>,
    which: fn(&Seen) -> Vec<&std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(Some(_)) = stream.message().await {
            for counter in which(&seen) {
                bump(counter);
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the prometheus server and nats-server, about 40 s; run by scripts/check-alerts-live.sh"]
async fn dashboard_and_alerts_add_up_two_replicas_to_the_known_totals() {
    let nats = common::nats::NatsCluster::start(1).await;
    let dir = temp_dir();
    let outcome = tokio::time::timeout(SESSION_TIMEOUT, cluster_session(&dir, &nats)).await;
    match outcome {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Err(_) => panic!("session timed out after {SESSION_TIMEOUT:?}; logs in {}", dir.display()),
    }
}

/// A member of group `<group>` on `mon.<group>`, MANUAL.
pub fn cluster_member(group: &str, max_in_flight: u32, ack_deadline_ms: u32) -> pb::OpenSubscriptionRequest {
    pb::OpenSubscriptionRequest {
        max_in_flight,
        ..member(group, &format!("mon.{group}"), true, ack_deadline_ms)
    }
}

pub async fn cluster_session(dir: &Path, nats: &common::nats::NatsCluster) {
    let t0 = Instant::now();
    let mut replicas = Vec::new();
    for id in ["a", "b"] {
        let env = vec![
            ("TINYBROKER_NATS_URL", nats.url(0)),
            ("TINYBROKER_NATS_PREFIX", "mon".to_owned()),
            ("TINYBROKER_NATS_REPLICAS", "1".to_owned()),
            ("TINYBROKER_REPLICA_ID", id.to_owned()),
            ("TINYBROKER_MAX_DELIVERY_ATTEMPTS", "2".to_owned()),
            ("TINYBROKER_GROUP_CAPACITY", "30".to_owned()),
            ("TINYBROKER_GROUP_MAX_BYTES", "1048576".to_owned()),
            ("TINYBROKER_GROUP_IDLE_TTL_SECONDS", CLUSTER_TTL.as_secs().to_string()),
            ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1".to_owned()),
        ];
        let replica = tokio::task::spawn_blocking(move || BrokerProcess::spawn(&env))
            .await
            .unwrap();
        common::wait_serving_at(&replica.url()).await;
        replicas.push(replica);
    }
    let (a, b) = (&replicas[0], &replicas[1]);
    log(t0, &format!("replicas a ({}) and b ({}) serve", a.url(), b.url()));
    let (prometheus, _prometheus_process) = Prometheus::start(dir, &[a.metrics_addr, b.metrics_addr]).await;
    log(
        t0,
        &format!("prometheus up on {} (logs in {})", prometheus.addr, dir.display()),
    );

    let clients = [
        BrokerClient::new(channel(&a.url(), false).await),
        BrokerClient::new(channel(&b.url(), false).await),
    ];
    let admin = AdminClient::new(channel(&a.url(), false).await);
    let seen = Arc::new(Seen::default());

    // The groups, before anything is counted: `counted` (a member on a and
    // one on b), `holding` (a member on each that never acks, 3 in flight
    // each), `overflow` (one member holding 1, a backlog of 30 at most)
    // and `waiting` (its only member leaves).
    let mut tasks = Vec::new();
    for i in 0..2 {
        let mut client = clients[i].clone();
        let (stream, id) = common::open(&mut client, cluster_member("counted", 20, 3_600_000)).await;
        tasks.push(counted_member(
            stream,
            id,
            client.clone(),
            clients[1 - i].clone(),
            seen.clone(),
        ));
        let (stream, _) = common::open(&mut client, cluster_member("holding", 3, 3_600_000)).await;
        tasks.push(count_into(stream, seen.clone(), |s| vec![&s.group_deliveries]));
    }
    let (stream, _) = common::open(&mut clients[0].clone(), cluster_member("overflow", 1, 3_600_000)).await;
    tasks.push(count_into(stream, seen.clone(), |s| vec![&s.group_deliveries]));
    let (stream, _) = common::open(&mut clients[1].clone(), cluster_member("waiting", 1, 0)).await;
    drop(stream);
    wait_for("waiting's member to leave", || {
        let mut admin = admin.clone();
        async move { group_members(&mut admin, "waiting").await == Some(0) }
    })
    .await;
    let waiting_since = Instant::now();
    for client in &clients {
        let (stream, _) = common::open(&mut client.clone(), broadcast("", "mon.live")).await;
        tasks.push(count_into(stream, seen.clone(), |s| vec![&s.broadcast_deliveries]));
    }
    let (stream, _) = common::open(&mut clients[0].clone(), broadcast("", "_dlq.counted")).await;
    tasks.push(count_into(stream, seen.clone(), |s| {
        vec![&s.broadcast_deliveries, &s.dead_letters]
    }));
    // Every group's counters scraped at 0 from both replicas first: a
    // series that first appears above 0 loses its first count to rate().
    wait_for("every group's counters at 0 on both replicas", || {
        let p = &prometheus;
        async move {
            p.query("count by (consumer_group) (tinybroker_consumer_group_delivered_total == 0)")
                .await
                .is_ok_and(|r| r.len() == 4 && r.iter().all(|s| s.value == 2.0))
        }
    })
    .await;
    log(t0, "4 groups, their counters at 0 on both replicas");

    // The known counts, published through both replicas in turn.
    let through = |i: usize| clients[i % 2].clone();
    for i in 0..20 {
        through(i).publish(publish("mon.live", 10)).await.unwrap();
        let mut job = publish("mon.counted", 0);
        job.payload = i.to_string().into_bytes().into();
        through(i).publish(job).await.unwrap();
    }
    let holding_since = Instant::now();
    for i in 0..10 {
        through(i).publish(publish("mon.holding", 10)).await.unwrap();
    }
    let overflow_since = Instant::now();
    for i in 0..35 {
        through(i).publish(publish("mon.overflow", 10)).await.unwrap();
    }
    for i in 0..5 {
        through(i).publish(publish("mon.waiting", 10)).await.unwrap();
    }
    wait_for("the clients to see every delivery, ack and dead letter", || {
        let seen = seen.clone();
        async move {
            read(&seen.counted) == 28
                && read(&seen.acked) == 16
                && read(&seen.dead_letters) == 4
                && read(&seen.group_deliveries) == 28 + 6 + 1
                && read(&seen.broadcast_deliveries) == 2 * 20 + 4
        }
    })
    .await;
    assert_eq!(read(&seen.redelivered), 8, "redeliveries seen by the members");
    log(
        t0,
        "seen by the clients: 35 group deliveries (28 of counted, 8 redelivered), 16 acks, 4 dead letters, 44 broadcast deliveries",
    );
    // Admin's cluster-wide view says the same.
    wait_for("Admin to list the known counts", || {
        let mut admin = admin.clone();
        async move {
            let groups = common::groups(&mut admin).await;
            let g = |name: &str| groups.iter().find(|g| g.name == name).cloned();
            matches!(
                (g("counted"), g("overflow")),
                (Some(c), Some(o)) if (c.redeliveries, c.dead_lettered, o.dropped) == (8, 4, 5)
            )
        }
    })
    .await;

    // Every consumer-group panel and rule, over the two replicas.
    let rules = alert_rules();
    let rule = |name: &str| {
        let (_, expr) = rules
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("alerts.yaml has no rule {name}"));
        cluster_fill(expr)
    };
    let cg = "consumer_group";
    let gauges = |values: [(&'static str, f64); 4]| -> Wants {
        Box::new(move || values.iter().map(|(g, n)| exactly("consumer_group", g, *n)).collect())
    };
    let backlog = [("counted", 0.0), ("holding", 4.0), ("overflow", 29.0), ("waiting", 5.0)];
    let in_flight = [("counted", 0.0), ("holding", 6.0), ("overflow", 1.0), ("waiting", 0.0)];
    let members = [("counted", 2.0), ("holding", 2.0), ("overflow", 1.0), ("waiting", 0.0)];
    let stalled = move || -> Wants {
        Box::new(move || {
            vec![
                exactly("consumer_group", "counted", 0.0),
                aged("consumer_group", "holding", holding_since),
                aged("consumer_group", "overflow", overflow_since),
            ]
        })
    };
    let memberless = move || -> Wants {
        Box::new(move || {
            vec![
                exactly("consumer_group", "counted", 0.0),
                aged("consumer_group", "waiting", waiting_since),
            ]
        })
    };
    let mut checks: Vec<ClusterCheck> = Vec::new();
    let mut checked: BTreeSet<String> = BTreeSet::new();
    let mut add_panel = |title: &str, ref_id: &str, scale: f64, wants: Wants| {
        checked.insert(format!("{title} {ref_id}"));
        let expr = cluster_fill(&target(title, ref_id));
        checks.push(check(format!("panel {title:?} {ref_id}"), expr, scale, false, wants));
    };
    add_panel("Group backlog", "A", 1.0, gauges(backlog));
    add_panel("Group in flight", "A", 1.0, gauges(in_flight));
    add_panel("Group members", "A", 1.0, gauges(members));
    add_panel("Seconds without progress per group", "A", 1.0, stalled());
    add_panel("Oldest unacked message age", "A", 1.0, stalled());
    add_panel("Seconds without members per group", "A", 1.0, memberless());
    add_panel(
        "Acked and delivered per group",
        "A",
        WHOLE_SECONDS,
        Box::new(move || {
            vec![
                about(cg, "counted", 28.0),
                about(cg, "holding", 6.0),
                about(cg, "overflow", 1.0),
            ]
        }),
    );
    add_panel(
        "Acked and delivered per group",
        "B",
        WHOLE_SECONDS,
        Box::new(move || vec![about(cg, "counted", 16.0), exactly(cg, "holding", 0.0)]),
    );
    add_panel(
        "Redeliveries and dead letters",
        "A",
        WHOLE_SECONDS,
        Box::new(move || vec![about(cg, "counted", 8.0), exactly(cg, "holding", 0.0)]),
    );
    add_panel(
        "Redeliveries and dead letters",
        "B",
        WHOLE_SECONDS,
        Box::new(move || vec![about(cg, "counted", 4.0), exactly(cg, "holding", 0.0)]),
    );
    let table = "Consumer groups, most stalled first";
    add_panel(table, "A", 1.0, stalled());
    add_panel(table, "B", 1.0, memberless());
    add_panel(table, "C", 1.0, gauges(backlog));
    add_panel(table, "D", 1.0, gauges(in_flight));
    add_panel(table, "E", 1.0, gauges(members));
    add_panel(table, "F", 1.0, Box::new(move || vec![about(cg, "counted", 8.0)]));
    add_panel(
        "Stuck consumer groups",
        "A",
        1.0,
        Box::new(|| vec![exactly("", "", 2.0)]),
    );
    add_panel(
        "Groups without members, messages waiting",
        "A",
        1.0,
        Box::new(|| vec![exactly("", "", 1.0)]),
    );
    add_panel(
        "Messages lost (last 15 min)",
        "A",
        1.0,
        Box::new(|| vec![about("reason", "group_overflow", 5.0)]),
    );
    add_panel(
        "Dropped messages",
        "A",
        WHOLE_SECONDS,
        Box::new(|| vec![about("reason", "group_overflow", 5.0)]),
    );
    // Not about groups alone, but counters and gauges all the same.
    add_panel(
        "Delivery rate",
        "A",
        WHOLE_SECONDS,
        Box::new(|| vec![about("mode", "multi", 44.0), about("mode", "single", 35.0)]),
    );
    add_panel(
        "Publish rate",
        "A",
        WHOLE_SECONDS,
        Box::new(|| vec![about("", "", 20.0 + 20.0 + 10.0 + 35.0 + 5.0 + 4.0)]),
    );
    add_panel(
        "Open subscriptions",
        "A",
        1.0,
        Box::new(|| vec![exactly("mode", "multi", 3.0), exactly("mode", "single", 5.0)]),
    );
    let mut add_rule = |name: &str, wants: Wants| {
        checked.insert(name.to_owned());
        checks.push(check(format!("rule {name}"), rule(name), 1.0, true, wants));
    };
    add_rule(
        "TinybrokerConsumerGroupStuck",
        Box::new(move || vec![aged(cg, "holding", holding_since), aged(cg, "overflow", overflow_since)]),
    );
    add_rule(
        "TinybrokerConsumerGroupWithoutMembers",
        Box::new(move || vec![aged(cg, "waiting", waiting_since)]),
    );
    add_rule(
        "TinybrokerConsumerGroupBacklogGrowing",
        Box::new(|| vec![exactly(cg, "holding", 4.0), exactly(cg, "overflow", 29.0)]),
    );
    add_rule(
        "TinybrokerMessagesDropped",
        Box::new(|| vec![about("reason", "group_overflow", 5.0)]),
    );
    add_rule(
        "TinybrokerMessagesDeadLettered",
        Box::new(|| vec![about(cg, "counted", 4.0)]),
    );
    // Every clock far enough along that a gauge stuck at 0 reads wrong.
    wait_for("every group clock to pass 8 s", || async {
        [waiting_since, holding_since, overflow_since]
            .iter()
            .all(|since| since.elapsed() > Duration::from_secs(8))
    })
    .await;
    let mut failures = settle(&prometheus, &mut checks).await;
    log(
        t0,
        &format!(
            "{} checks while every group lives: {} failing",
            checks.len(),
            failures.len()
        ),
    );

    // `waiting` is removed with its 5 messages after its idle TTL.
    wait_for_long("waiting to be removed after its idle TTL", CLUSTER_TTL + SETTLE, || {
        let mut admin = admin.clone();
        async move { group_members(&mut admin, "waiting").await.is_none() }
    })
    .await;
    let removed_at = SystemTime::now();
    log(t0, "waiting removed after its idle TTL");
    let mut after: Vec<ClusterCheck> = Vec::new();
    {
        let mut add = |what: String, expr: String, only: bool, wants: Wants| {
            after.push(check(what, expr, 1.0, only, wants));
        };
        let title = "Groups removed with messages (last 15 min)";
        checked.insert(format!("{title} A"));
        add(
            format!("panel {title:?} A"),
            cluster_fill(&target(title, "A")),
            false,
            Box::new(|| vec![exactly("", "", 1.0)]),
        );
        let title = "Groups removed with their messages (last 15 min)";
        checked.insert(format!("{title} A"));
        add(
            format!("panel {title:?} A"),
            cluster_fill(&target(title, "A")),
            true,
            Box::new(move || vec![exactly(cg, "waiting", 5.0)]),
        );
        checked.insert(format!("{title} B"));
        let removed_ms = removed_at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64() * 1000.0;
        add(
            format!("panel {title:?} B"),
            cluster_fill(&target(title, "B")),
            true,
            Box::new(move || {
                vec![Want {
                    label: "consumer_group",
                    value: "waiting".into(),
                    lo: removed_ms - (CLUSTER_TTL + SETTLE).as_secs_f64() * 1000.0,
                    hi: removed_ms,
                }]
            }),
        );
        add(
            "panel \"Messages lost (last 15 min)\" A, after the removal".into(),
            cluster_fill(&target("Messages lost (last 15 min)", "A")),
            false,
            Box::new(|| {
                vec![
                    about("reason", "group_overflow", 5.0),
                    about("reason", "group_expired", 5.0),
                ]
            }),
        );
        checked.insert("TinybrokerConsumerGroupRemovedWithBacklog".into());
        add(
            "rule TinybrokerConsumerGroupRemovedWithBacklog".into(),
            rule("TinybrokerConsumerGroupRemovedWithBacklog"),
            true,
            Box::new(move || vec![exactly(cg, "waiting", 5.0)]),
        );
    }
    failures.extend(settle(&prometheus, &mut after).await);
    log(t0, &format!("{} checks after the removal", after.len()));

    // Issue 42 across replicas: straggle-hung on replica a holds its 2
    // messages and never acks, straggle-ok on b acks each one it gets while
    // a message comes every 200 ms. b counts the acks, a reports the hung
    // member's stall: the rule, over both, names the member once.
    let straggle = |id: &str| pb::OpenSubscriptionRequest {
        subscription_id: id.into(),
        ..cluster_member("straggle", 2, 3_600_000)
    };
    let (stream, _) = common::open(&mut clients[0].clone(), straggle("straggle-hung")).await;
    tasks.push(count_into(stream, seen.clone(), |_| Vec::new()));
    let (mut stream, _) = common::open(&mut clients[1].clone(), straggle("straggle-ok")).await;
    let mut acker = clients[1].clone();
    tasks.push(tokio::spawn(async move {
        while let Ok(Some(m)) = stream.message().await {
            common::ack(&mut acker, "straggle-ok", &[m.sequence]).await;
        }
    }));
    let straggle_since = Instant::now();
    let straggle_publisher = {
        let clients = clients.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let mut client = clients[i % 2].clone();
                if client.publish(publish("mon.straggle", 10)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    wait_for("straggle-hung to hold its 2 messages", || {
        let mut admin = admin.clone();
        async move {
            common::listed(list_subscriptions(&mut admin).await, "straggle-hung").is_some_and(|s| s.unacked == 2)
        }
    })
    .await;
    wait_for("straggle-hung's stall to pass 8 s", || async {
        straggle_since.elapsed() > Duration::from_secs(8)
    })
    .await;
    checked.insert("TinybrokerConsumerGroupMemberHung".into());
    let mut hung = vec![check(
        "rule TinybrokerConsumerGroupMemberHung".into(),
        rule("TinybrokerConsumerGroupMemberHung"),
        1.0,
        true,
        Box::new(move || vec![aged("subscription_id", "straggle-hung", straggle_since)]),
    )];
    failures.extend(settle(&prometheus, &mut hung).await);
    straggle_publisher.abort();
    log(t0, "straggle-hung named once across the replicas");

    // Every group panel and rule was checked.
    for (title, ref_id, expr) in dashboard_targets() {
        if about_groups(&expr) && !checked.contains(&format!("{title} {ref_id}")) {
            failures.push(format!(
                "panel {title:?} {ref_id} reads group metrics and is not checked here"
            ));
        }
    }
    for (name, expr) in &rules {
        if about_groups(expr) && !checked.contains(name) {
            failures.push(format!("rule {name} reads group metrics and is not checked here"));
        }
    }
    for task in tasks {
        task.abort();
    }
    for (id, replica) in ["a", "b"].iter().zip(&replicas) {
        std::fs::write(dir.join(format!("replica-{id}.log")), replica.drain_lines().join("\n")).unwrap();
    }
    log(
        t0,
        &format!(
            "session over: {} checks, {} problem(s)",
            checks.len() + after.len(),
            failures.len()
        ),
    );
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}\n(replica and prometheus logs in {})",
        failures.len(),
        failures.join("\n"),
        dir.display()
    );
}
