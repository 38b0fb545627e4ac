//! The single-node session: the real broker binary, a Prometheus scraping
//! it every second with the shipped rules, and at the same time, beside
//! healthy traffic, each situation an alert or a panel is for; each alert
//! and panel must show it within its promise (and not before its
//! threshold), no other alert fire, every dashboard query return data and
//! every panel have thresholds.

use crate::clients::*;
use crate::common;
use crate::common::process::BrokerProcess;
use crate::dashboard::{dashboard_queries, panels_without_thresholds};
use crate::prometheus::{Prometheus, Sample};
use crate::watch::*;
use crate::{JOB, POLL, SESSION_TIMEOUT, log, temp_dir};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Allowed on top of each promise at a 1 s scrape: the machine is shared.
pub const SLACK: Duration = Duration::from_secs(5);
/// The rules' and the broker's stall threshold.
pub const STALL: Duration = Duration::from_secs(45);
/// TINYBROKER_GROUP_IDLE_TTL_SECONDS of the test broker.
pub const TTL: Duration = Duration::from_secs(60);
/// TINYBROKER_CONSUMER_CAPACITY of the test broker.
pub const CAPACITY: u64 = 64;
/// Depth the bursty subscriber reaches: over 90 % of CAPACITY.
pub const BURST_DEPTH: u64 = 58;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the prometheus server and about 90 s; run by scripts/check-alerts-live.sh"]
async fn alerts_and_dashboard_name_the_slow_consumer_and_the_stuck_groups_in_time() {
    let dir = temp_dir();
    let outcome = tokio::time::timeout(SESSION_TIMEOUT, session(&dir)).await;
    match outcome {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Err(_) => panic!("session timed out after {SESSION_TIMEOUT:?}; logs in {}", dir.display()),
    }
}

/// The session, step by step: each situation is set off in turn, with the
/// alerts and panels it must show added to the watch list as it starts,
/// while the watcher asks Prometheus about them all.
async fn session(dir: &Path) {
    let t0 = Instant::now();
    let broker = start_the_broker();
    let url = broker.url();
    let instance = broker.metrics_addr.to_string();
    log(t0, &format!("broker up: grpc {}, metrics {instance}", broker.grpc_addr));
    let (prometheus, _prometheus_process) = start_prometheus_scraping(dir, &broker, t0).await;

    let queries = dashboard_queries(&instance);
    let watched = Arc::new(Mutex::new(Watched::default()));
    let watcher = tokio::spawn(watch(prometheus.clone(), watched.clone(), queries.clone()));
    let mut client = BrokerClient::new(channel(&url, false).await);
    let mut admin = AdminClient::new(channel(&url, false).await);
    let stop = tokio_util::sync::CancellationToken::new();

    let healthy = healthy_traffic(&mut client, &stop).await;
    two_groups_whose_member_never_acks(&mut client, &watched).await;
    log(t0, "stuck-long and stuck-short hold messages and never ack");
    let busy = a_busy_group_whose_one_member_never_acks(&url, &admin, &watched).await;
    log(t0, "busy-hung holds its messages while busy-ok-1 and busy-ok-2 ack");
    let orphan_publisher = two_groups_without_members(&mut client, &mut admin, &watched, &stop).await;
    log(t0, "orphan (backlog growing) and expiring (5 messages) have no member");
    let mut narrow = BrokerClient::new(channel(&url, true).await);
    a_queue_that_fills_and_drains_between_two_scrapes(&mut client, &mut narrow, &mut admin, &watched, t0).await;
    a_slow_subscriber_that_is_evicted(&mut client, &mut narrow, &mut admin, &watched, t0).await;

    let late = until_every_watch_is_seen_or_one_is_late(&watched).await;
    log(t0, "every situation seen (or one is late)");
    let no_data = dashboard_queries_without_data(&prometheus, &queries).await;
    watcher.abort();
    drop(busy);
    stop.cancel();
    healthy.steady.await.unwrap();
    orphan_publisher.await.unwrap();
    for task in healthy.readers {
        task.abort();
    }

    let mut failures = the_report(&watched.lock().unwrap(), late, no_data);
    failures.extend(missing_log_lines(&broker, dir));
    log(
        t0,
        &format!(
            "session over: {} situations watched, {} dashboard queries, 6 log lines, {} problem(s)",
            watched.lock().unwrap().watches.len(),
            queries.len(),
            failures.len()
        ),
    );
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}\n(broker and prometheus logs in {})",
        failures.len(),
        failures.join("\n"),
        dir.display()
    );
}

/// The real broker binary, its per-subscription metrics on, its queues of
/// [`CAPACITY`] messages, its groups removed after [`TTL`] without members.
fn start_the_broker() -> BrokerProcess {
    BrokerProcess::spawn(&[
        ("TINYBROKER_CONSUMER_CAPACITY", CAPACITY.to_string()),
        ("TINYBROKER_GROUP_IDLE_TTL_SECONDS", TTL.as_secs().to_string()),
        ("TINYBROKER_METRICS_PER_SUBSCRIPTION", "true".into()),
        ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1".into()),
    ])
}

/// A Prometheus scraping `broker`, once it has scraped it.
async fn start_prometheus_scraping(
    dir: &Path,
    broker: &BrokerProcess,
    t0: Instant,
) -> (Arc<Prometheus>, common::process::ChildGuard) {
    let (prometheus, prometheus_process) = Prometheus::start(dir, &[broker.metrics_addr]).await;
    let prometheus = Arc::new(prometheus);
    log(
        t0,
        &format!("prometheus up on {} (logs in {})", prometheus.addr, dir.display()),
    );
    wait_for("prometheus to scrape the broker", || {
        let p = prometheus.clone();
        async move {
            p.query(&format!("up{{job=\"{JOB}\"}} == 1"))
                .await
                .is_ok_and(|r| !r.is_empty())
        }
    })
    .await;
    log(t0, "prometheus scrapes the broker");
    (prometheus, prometheus_process)
}

/// What [`healthy_traffic`] runs until the session stops it.
struct Healthy {
    /// The broadcast subscriber's and the group member's readers.
    readers: [tokio::task::JoinHandle<()>; 2],
    /// The publisher, until `stop`.
    steady: tokio::task::JoinHandle<()>,
}

/// Healthy traffic, which must set nothing off: a broadcast subscriber and
/// an auto-ack group on a steady 20 messages a second.
async fn healthy_traffic(client: &mut BrokerClient<Channel>, stop: &CancellationToken) -> Healthy {
    let readers = [
        drain(open(client, broadcast("healthy-reader", "live.steady")).await),
        drain(open(client, member("healthy", "live.steady", false, 0)).await),
    ];
    let steady = {
        let (mut client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                client.publish(publish("live.steady", 100)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    Healthy { readers, steady }
}

/// Two MANUAL groups whose member receives and never acks: 1 h ack
/// deadline, and 2 s (redelivered every 2 s).
async fn two_groups_whose_member_never_acks(client: &mut BrokerClient<Channel>, watched: &Mutex<Watched>) {
    let mut stuck_since = SystemTime::UNIX_EPOCH;
    for (group, deadline_ms) in [("stuck-long", 3_600_000), ("stuck-short", 2_000)] {
        let topic = format!("jobs.{group}");
        let stream = open(client, member(group, &topic, true, deadline_ms)).await;
        let start = SystemTime::now();
        stuck_since = start;
        for _ in 0..3 {
            client.publish(publish(&topic, 10)).await.unwrap();
        }
        drain(stream);
        let mut w = watched.lock().unwrap();
        w.add(
            &format!("alert TinybrokerConsumerGroupStuck names {group} ({deadline_ms} ms deadline)"),
            start,
            STALL - Duration::from_secs(1),
            STALL + Duration::from_secs(2),
            "<= 105 s",
            alert("TinybrokerConsumerGroupStuck", "consumer_group", group),
        );
        w.add(
            &format!("panel \"Consumer groups, most stalled first\" shows {group} stalled > 45 s"),
            start,
            Duration::ZERO,
            STALL + Duration::from_secs(1),
            "<= 75 s",
            panel(
                "Consumer groups, most stalled first",
                "A",
                any_with("consumer_group", group, 45.0),
            ),
        );
        w.add(
            &format!("panel \"Seconds without progress per group\" shows {group} > 45 s"),
            start,
            Duration::ZERO,
            STALL + Duration::from_secs(1),
            "<= 75 s",
            panel(
                "Seconds without progress per group",
                "A",
                any_with("consumer_group", group, 45.0),
            ),
        );
    }
    {
        let start = stuck_since;
        let mut w = watched.lock().unwrap();
        w.add(
            "panel \"Stuck consumer groups\" counts both",
            start,
            Duration::ZERO,
            STALL + Duration::from_secs(2),
            "<= 105 s",
            panel("Stuck consumer groups", "A", total_at_least(2.0)),
        );
        w.add(
            "panel \"Delivery lag\" p99 of group messages above the old 5 s cap",
            start,
            Duration::ZERO,
            Duration::from_secs(30),
            "n/a",
            panel("Delivery lag", "C", any_with("mode", "single", 5.5)),
        );
        w.add(
            "panel \"Acked and delivered per group\" shows stuck-short's redeliveries",
            start,
            Duration::ZERO,
            Duration::from_secs(10),
            "n/a",
            panel(
                "Acked and delivered per group",
                "A",
                any_with("consumer_group", "stuck-short", 0.01),
            ),
        );
        w.add(
            "panel \"Oldest unacked message age\" shows stuck-long over 30 s",
            start,
            Duration::ZERO,
            Duration::from_secs(32),
            "n/a",
            panel(
                "Oldest unacked message age",
                "A",
                any_with("consumer_group", "stuck-long", 30.0),
            ),
        );
    }
}

/// A busy MANUAL group, every member at its max_in_flight and a backlog
/// growing, whose member busy-hung never acks while busy-ok-1 and
/// busy-ok-2 ack every 250 ms. Its 10 s ack deadline takes its messages
/// back every 10 s (so its oldest unacked age never passes 10 s), its stall
/// goes on: it alone is named, and the group, which acks, is not stuck.
async fn a_busy_group_whose_one_member_never_acks(
    url: &str,
    admin: &AdminClient<Channel>,
    watched: &Mutex<Watched>,
) -> common::hung::HungGroup {
    let busy_start = SystemTime::now();
    let busy = common::hung::busy_group_at(&[url.to_owned()], "busy", 10_000).await;
    wait_for("busy-hung to hold its max_in_flight", || {
        let mut admin = admin.clone();
        let id = busy.hung.clone();
        async move {
            common::listed(list_subscriptions(&mut admin).await, &id)
                .is_some_and(|s| s.unacked == u64::from(common::hung::MAX_IN_FLIGHT))
        }
    })
    .await;
    watched.lock().unwrap().add(
        "alert TinybrokerConsumerGroupMemberHung names busy-hung (10 s ack deadline, group acking)",
        busy_start,
        STALL - Duration::from_secs(1),
        STALL + Duration::from_secs(2),
        "<= 105 s",
        alert("TinybrokerConsumerGroupMemberHung", "subscription_id", &busy.hung),
    );
    busy
}

/// A memberless group whose backlog grows, and one left with 5 messages:
/// both removed with their backlog after the TTL. The first's publisher,
/// until `stop`.
async fn two_groups_without_members(
    client: &mut BrokerClient<Channel>,
    admin: &mut AdminClient<Channel>,
    watched: &Mutex<Watched>,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let left_orphan = abandoned_group(client, admin, "orphan").await;
    let orphan_publisher = {
        let (mut client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                client.publish(publish("jobs.orphan", 10)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let left_expiring = abandoned_group(client, admin, "expiring").await;
    for _ in 0..5 {
        client.publish(publish("jobs.expiring", 10)).await.unwrap();
    }
    for (group, left) in [("orphan", left_orphan), ("expiring", left_expiring)] {
        let mut w = watched.lock().unwrap();
        w.add(
            &format!("alert TinybrokerConsumerGroupWithoutMembers names {group}"),
            left,
            STALL - Duration::from_secs(1),
            STALL + Duration::from_secs(2),
            "<= 105 s",
            alert("TinybrokerConsumerGroupWithoutMembers", "consumer_group", group),
        );
        w.add(
            &format!("panel \"Seconds without members per group\" shows {group} > 45 s"),
            left,
            Duration::ZERO,
            STALL + Duration::from_secs(1),
            "<= 75 s",
            panel(
                "Seconds without members per group",
                "A",
                any_with("consumer_group", group, 45.0),
            ),
        );
        // Removed at the first maintenance tick after the TTL.
        let removed = left + TTL;
        w.add(
            &format!("alert TinybrokerConsumerGroupRemovedWithBacklog names {group}"),
            removed,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            alert("TinybrokerConsumerGroupRemovedWithBacklog", "consumer_group", group),
        );
        w.add(
            &format!("panel \"Groups removed with their messages\" names {group}"),
            removed,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel(
                "Groups removed with their messages (last 15 min)",
                "A",
                any_with("consumer_group", group, 1.0),
            ),
        );
    }
    {
        let mut w = watched.lock().unwrap();
        w.add(
            "panel \"Groups without members, messages waiting\" counts both",
            left_expiring,
            Duration::ZERO,
            STALL + Duration::from_secs(2),
            "<= 105 s",
            panel("Groups without members, messages waiting", "A", total_at_least(2.0)),
        );
        w.add(
            "panel \"Groups removed with messages (last 15 min)\" counts both",
            left_expiring + TTL,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            panel("Groups removed with messages (last 15 min)", "A", total_at_least(2.0)),
        );
        w.add(
            "panel \"Messages lost\" shows group_expired",
            left_orphan + TTL,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            panel(
                "Messages lost (last 15 min)",
                "A",
                any_with("reason", "group_expired", 1.0),
            ),
        );
    }
    orphan_publisher
}

/// A broadcast queue that fills to over 90 % and drains at once, between
/// two scrapes.
async fn a_queue_that_fills_and_drains_between_two_scrapes(
    client: &mut BrokerClient<Channel>,
    narrow: &mut BrokerClient<Channel>,
    admin: &mut AdminClient<Channel>,
    watched: &Mutex<Watched>,
    t0: Instant,
) {
    let bursty = open(narrow, broadcast("bursty", "live.bursty")).await;
    let mut depth = 0;
    let mut published = 0;
    while depth < BURST_DEPTH {
        client.publish(publish("live.bursty", 2048)).await.unwrap();
        published += 1;
        assert!(published < 10_000, "the bursty queue never filled");
        depth = queue_depth(admin, "bursty").await.expect("bursty is open");
    }
    let burst = SystemTime::now();
    drain(bursty);
    wait_for("the bursty queue to drain", || {
        let mut admin = admin.clone();
        async move { queue_depth(&mut admin, "bursty").await == Some(0) }
    })
    .await;
    log(
        t0,
        &format!(
            "bursty filled to {depth}/{CAPACITY} and drained in {:.0} ms",
            burst.elapsed().unwrap().as_secs_f64() * 1000.0
        ),
    );
    {
        let mut w = watched.lock().unwrap();
        w.add(
            "panel \"Queue depth per subscription\" shows bursty's peak",
            burst,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel(
                "Queue depth per subscription (top 20 by peak)",
                "A",
                any_with("subscription_id", "bursty", BURST_DEPTH as f64),
            ),
        );
        w.add(
            "panel \"Queue fill ratio\" counts a queue over 90 % full",
            burst,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Queue fill ratio", "D", total_at_least(1.0)),
        );
    }
}

/// A slow subscriber that stops reading is evicted.
async fn a_slow_subscriber_that_is_evicted(
    client: &mut BrokerClient<Channel>,
    narrow: &mut BrokerClient<Channel>,
    admin: &mut AdminClient<Channel>,
    watched: &Mutex<Watched>,
    t0: Instant,
) {
    let slow = open(narrow, broadcast("slow-1", "live.slow")).await;
    let mut flooded = 0;
    let eviction = loop {
        flooded += 50;
        assert!(flooded < 100_000, "slow-1 was never evicted");
        let requests: Vec<_> = (0..50).map(|_| publish("live.slow", 4096)).collect();
        client.publish_stream(futures::stream::iter(requests)).await.unwrap();
        let evictions = common::evictions(admin).await;
        if let Some(e) = evictions.into_iter().find(|e| e.subscription_id == "slow-1") {
            break e;
        }
    };
    drop(slow);
    let at = eviction.evicted_at.expect("evicted_at");
    let evicted_at = SystemTime::UNIX_EPOCH + Duration::new(at.seconds as u64, at.nanos as u32);
    let peer = eviction.peer_address.clone();
    log(
        t0,
        &format!("slow-1 ({peer}) evicted at depth {}", eviction.queue_depth),
    );
    {
        let mut w = watched.lock().unwrap();
        w.add(
            "alert TinybrokerSubscriptionsEvicted names slow-1",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(2),
            "<= 60 s",
            alert("TinybrokerSubscriptionsEvicted", "subscription_id", "slow-1"),
        );
        w.add(
            "panel \"Recently evicted subscribers\" names slow-1 and its peer",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Recently evicted subscribers (last 15 min)", "A", {
                let peer = peer.clone();
                move |r: &[Sample]| {
                    r.iter().any(|s| {
                        s.has("subscription_id", "slow-1")
                            && s.has("peer", &peer)
                            && s.has("topic_patterns", "live.slow")
                    })
                }
            }),
        );
        w.add(
            "panel \"Evictions (last 15 min)\" counts it",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Evictions (last 15 min)", "A", total_at_least(1.0)),
        );
        w.add(
            "panel \"Messages lost\" shows evicted",
            evicted_at,
            Duration::ZERO,
            Duration::from_secs(1),
            "<= 30 s",
            panel("Messages lost (last 15 min)", "A", any_with("reason", "evicted", 1.0)),
        );
    }
}

/// Waits until every watch is seen, or one is past its promise; the late
/// ones.
async fn until_every_watch_is_seen_or_one_is_late(watched: &Mutex<Watched>) -> Vec<String> {
    loop {
        let (done, late) = {
            let w = watched.lock().unwrap();
            let now = SystemTime::now();
            let late: Vec<String> = w
                .watches
                .iter()
                .filter(|w| w.seen.is_none() && now > w.start + w.promise + SLACK + POLL)
                .map(|w| w.what.clone())
                .collect();
            (w.watches.iter().all(|w| w.seen.is_some()), late)
        };
        if done || !late.is_empty() {
            return late;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Every dashboard query evaluates and returns data, now that everything
/// happened; the cluster-mode panels (tinybroker_nats_*) have none from
/// this single-node broker, and tests/cluster/ checks those series. Those
/// that do not.
async fn dashboard_queries_without_data(prometheus: &Prometheus, queries: &[(String, String, String)]) -> Vec<String> {
    let mut no_data = Vec::new();
    for (title, ref_id, expr) in queries {
        let cluster_only = expr.contains("tinybroker_nats_");
        match prometheus.query(expr).await {
            Ok(r) if !r.is_empty() => {}
            Ok(_) if cluster_only => {}
            Ok(_) => no_data.push(format!("{title} {ref_id}: no data\n    {expr}")),
            Err(e) => no_data.push(format!("{title} {ref_id}: {e}")),
        }
    }
    no_data
}

/// The report: how long each watch took, beside its promise; the problems
/// found: a watch never seen, seen late or before its threshold, late
/// ones, alerts that should not have fired, dashboard queries without
/// data, panels without thresholds.
fn the_report(w: &Watched, late: Vec<String>, no_data: Vec<String>) -> Vec<String> {
    println!(
        "\n{:<92} {:>10} {:>8} {:>10}",
        "situation → alert / panel", "1 s scrape", "promise", "at 30 s"
    );
    let mut failures = Vec::new();
    for watch in &w.watches {
        let took = watch
            .seen
            .map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()));
        println!(
            "{:<92} {:>10} {:>6.0} s {:>10}",
            watch.what,
            took,
            watch.promise.as_secs_f64(),
            watch.promise_30s
        );
        match watch.seen {
            None => failures.push(format!("never seen: {}", watch.what)),
            Some(d) if d > watch.promise + SLACK => failures.push(format!(
                "{}: after {:.1} s, promised {:?} (+{SLACK:?} slack)",
                watch.what,
                d.as_secs_f64(),
                watch.promise
            )),
            Some(d) if d < watch.earliest => failures.push(format!(
                "{}: already after {:.1} s, before its {:?} threshold",
                watch.what,
                d.as_secs_f64(),
                watch.earliest
            )),
            Some(_) => {}
        }
    }
    failures.extend(late.into_iter().map(|l| format!("late: {l}")));
    let expected: BTreeSet<(String, String)> = [
        ("TinybrokerSubscriptionsEvicted", "slow-1"),
        ("TinybrokerConsumerGroupStuck", "stuck-long"),
        ("TinybrokerConsumerGroupStuck", "stuck-short"),
        ("TinybrokerConsumerGroupWithoutMembers", "orphan"),
        ("TinybrokerConsumerGroupWithoutMembers", "expiring"),
        ("TinybrokerConsumerGroupRemovedWithBacklog", "orphan"),
        ("TinybrokerConsumerGroupRemovedWithBacklog", "expiring"),
        ("TinybrokerConsumerGroupMemberHung", "busy-hung"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    let unexpected: Vec<_> = w.fired.difference(&expected).collect();
    if !unexpected.is_empty() {
        failures.push(format!("alerts that should not have fired: {unexpected:?}"));
    }
    failures.extend(no_data);
    let unthresholded = panels_without_thresholds();
    if !unthresholded.is_empty() {
        failures.push(format!("panels without thresholds: {unthresholded:?}"));
    }
    if !w.errors.is_empty() {
        println!(
            "prometheus API errors while polling (first 5): {:?}",
            &w.errors[..w.errors.len().min(5)]
        );
    }
    failures
}

/// The log lines the alerts point to, those missing.
fn missing_log_lines(broker: &BrokerProcess, dir: &Path) -> Vec<String> {
    let mut failures = Vec::new();
    let lines = broker.drain_lines().join("\n");
    std::fs::write(dir.join("broker.log"), &lines).unwrap();
    for (needle, field) in [
        ("slow consumer evicted: its queue was full", "subscription_id=slow-1"),
        ("consumer group stalled", r#"consumer_group="stuck-long""#),
        ("consumer group stalled", r#"consumer_group="stuck-short""#),
        ("consumer group stalled", r#"consumer_group="orphan""#),
        (
            "consumer group removed after its idle TTL with no members",
            r#"consumer_group="orphan""#,
        ),
        (
            "consumer group removed after its idle TTL with no members",
            r#"consumer_group="expiring""#,
        ),
    ] {
        if !lines
            .lines()
            .any(|l| l.contains("WARN") && l.contains(needle) && l.contains(field))
        {
            failures.push(format!("no WARN log line {needle:?} with {field}"));
        }
    }
    failures
}
