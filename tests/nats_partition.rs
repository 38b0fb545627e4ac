//! Partitioned inside NATS (docs/contract.md, "Cluster mode", "Partitioned
//! inside NATS"): three replicas `a`, `b`, `c`, each on its own server of a
//! 3-node NATS cluster whose routes all go through proxies of the test
//! (`common/proxy.rs`, [`common::proxy::RouteProxies`]), group state kept
//! 3 times (`TINYBROKER_NATS_REPLICAS=3`). The test cuts `c`'s server off
//! from the other two (blackhole: nothing crosses, nothing is reset; or
//! reset: every route is reset, and so is every new one) while group
//! messages are published through `a` and through `c`, then heals.
//!
//! `c`'s own server still answers it throughout, so only a probe that
//! reaches beyond that server notices. Asserted, with margins: `c` is
//! NOT_SERVING within 5 s of the cut, and Publish (to a group and to
//! broadcast subscribers) and OpenSubscription on it are then UNAVAILABLE
//! naming NATS at once; `a` and `b` serve throughout; every group message
//! a Publish answered OK (through either replica) reaches a member;
//! a message is delivered at most once per ack deadline of the cut and
//! once more, and each extra delivery is a redelivery in the group's
//! record; `c` serves again after the heal.
//!
//! Run with `--nocapture` for the measured times and counts.

mod common;

use common::nats::NatsCluster;
use common::proxy::Mode;
use common::traffic::*;
use common::*;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tinybroker::pb;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::health_check_response::ServingStatus;

/// The contract's bound on noticing.
const BOUND: Duration = Duration::from_secs(5);
/// What the test allows above it (a loaded 2-core machine, debug build).
const MARGIN: Duration = Duration::from_millis(1500);
/// How long the cut lasts: past the time stream leaders take to leave
/// the cut-off server (5 to 8 s here) and the members' ack deadline.
const CUT_FOR: Duration = Duration::from_secs(15);
/// What each group member may hold unacked.
const MAX_IN_FLIGHT: u32 = 8;
/// The group members' ack deadline.
const ACK_DEADLINE: Duration = Duration::from_secs(4);
/// Everything the test does, bounded.
const WHOLE_TEST: Duration = Duration::from_secs(150);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_cut_off_from_its_cluster_by_a_partition_loses_nothing_acknowledged() {
    partitioned(Mode::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_whose_routes_are_reset_loses_nothing_acknowledged() {
    partitioned(Mode::Reset).await;
}

async fn partitioned(cut: Mode) {
    let nats = NatsCluster::start_routed(3).await;
    let body = async {
        let prefix = format!("natscut{}", unique());
        let start_replica =
            |i: usize, id: &'static str| start_with(replica_config(config(), vec![nats.url(i)], id, &prefix, 3));
        let a = start_replica(0, "a").await;
        let b = start_replica(1, "b").await;
        let c = start_replica(2, "c").await;
        for replica in [&a, &b, &c] {
            wait_serving_at(&replica.url()).await;
        }
        let (mut ca, mut cc) = (a.client().await, c.client().await);

        // A MANUAL group with a member on a and one on c.
        let (on_a, on_c): (Got, Got) = Default::default();
        // Every delivery, to either member, in order of arrival at each.
        let delivered =
            || -> Vec<(String, Instant)> { on_a.lock().iter().chain(on_c.lock().iter()).cloned().collect() };
        for (client, replica, got) in [(&mut ca, &a, &on_a), (&mut cc, &c, &on_c)] {
            let request = pb::OpenSubscriptionRequest {
                ack_deadline_ms: ACK_DEADLINE.as_millis() as u32,
                ..member_request(&["cut.g.>"], "cutters", true, MAX_IN_FLIGHT)
            };
            let (s, id) = open(client, request).await;
            receive(s, got.clone(), Some((replica.client().await, id)));
        }
        wait_until("both members to be listed", || async {
            a.group("cutters").await.is_some_and(|g| g.members == 2)
        })
        .await;

        // Group publishers through a and through c.
        let stop = CancellationToken::new();
        let (through_a, through_c): (Arc<Mutex<Sent>>, Arc<Mutex<Sent>>) = Default::default();
        let every = Duration::from_millis(50);
        tokio::spawn(publisher(
            a.client().await,
            "cut.g.a",
            every,
            stop.clone(),
            through_a.clone(),
        ));
        tokio::spawn(publisher(
            c.client().await,
            "cut.g.c",
            every,
            stop.clone(),
            through_c.clone(),
        ));
        wait_until("the first group messages through a and c to be delivered", || async {
            let got = delivered();
            got.iter().filter(|(t, _)| t.starts_with("cut.g.a.")).count() >= 5
                && got.iter().filter(|(t, _)| t.starts_with("cut.g.c.")).count() >= 5
        })
        .await;

        // The cut: c's server loses its routes; c's own connection to it
        // is untouched.
        let cut_at = Instant::now();
        nats.isolate(2, cut).await;
        let to_not_serving = wait_status(&c.url(), ServingStatus::NotServing, cut_at, BOUND + MARGIN).await;

        // Everything on c is UNAVAILABLE at once, naming NATS.
        let mut answers = Vec::new();
        let (s, took) = refused(cc.publish(publish_request("cut.g.x", "x"))).await;
        assert_unavailable_naming_nats("a group Publish", &s, took);
        answers.push(took);
        let (s, took) = refused(cc.publish(publish_request("cut.b.x", "x"))).await;
        assert_unavailable_naming_nats("a broadcast Publish", &s, took);
        answers.push(took);
        let (s, took) = refused(cc.open_subscription(subscribe_request(&["cut.b.>"]))).await;
        assert_unavailable_naming_nats("a broadcast OpenSubscription", &s, took);
        answers.push(took);
        let (s, took) =
            refused(cc.open_subscription(member_request(&["cut.g.>"], "cutters", true, MAX_IN_FLIGHT))).await;
        assert_unavailable_naming_nats("a member's OpenSubscription", &s, took);
        answers.push(took);

        // a and b serve throughout the cut.
        while cut_at.elapsed() < CUT_FOR {
            for (name, replica) in [("a", &a), ("b", &b)] {
                assert_eq!(
                    serving_status_at(&replica.url()).await,
                    Some(ServingStatus::Serving),
                    "{name} serves while c's NATS server is cut off ({:?} into the cut)",
                    cut_at.elapsed()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let accepted_by_a_during = through_a.lock().ok.iter().filter(|(_, at)| *at > cut_at).count();

        let healed_at = Instant::now();
        nats.heal();
        let to_serving = wait_status(&c.url(), ServingStatus::Serving, healed_at, Duration::from_secs(40)).await;
        let resumed = through_c.lock().ok.len();
        wait_until("c to accept group publishes again", || async {
            through_c.lock().ok.len() >= resumed + 5
        })
        .await;
        stop.cancel();

        // Nothing a Publish acknowledged is lost: every message answered
        // OK reaches a member (a redelivery of what was cut off with c's
        // member comes after the ack deadline).
        let accepted: Vec<String> = [("a", &through_a), ("c", &through_c)]
            .iter()
            .flat_map(|(via, sent)| {
                let ok: Vec<String> = sent.lock().ok.iter().map(|(n, _)| format!("cut.g.{via}.{n}")).collect();
                ok
            })
            .collect();
        let missing = |got: &[(String, Instant)]| -> Vec<String> {
            accepted
                .iter()
                .filter(|topic| !got.iter().any(|(t, _)| t == *topic))
                .cloned()
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(45);
        loop {
            let lost = missing(&delivered());
            if lost.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {} group messages answered OK never reached a member ({:?} cut): {lost:?}",
                lost.len(),
                accepted.len(),
                cut
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }

        // Duplicates are bounded: a message whose ack was lost with c's
        // server (or with a consumer leader's change around the heal) is
        // delivered again after an ack deadline, each at most once per ack
        // deadline of the cut and once more after it.
        let mut times: HashMap<String, usize> = HashMap::new();
        for (topic, _) in delivered() {
            *times.entry(topic).or_default() += 1;
        }
        let extra: usize = times.values().map(|n| n - 1).sum();
        let twice = times.values().filter(|n| **n > 1).count();
        let at_most = 2 + (CUT_FOR.as_millis() / ACK_DEADLINE.as_millis()) as usize;
        for (topic, n) in times.iter().filter(|(_, n)| **n > 1) {
            let at = |got: &Got| -> Vec<String> {
                got.lock()
                    .iter()
                    .filter(|(t, _)| t == topic)
                    .map(|(_, at)| format!("{:+.2}", at.duration_since(cut_at).as_secs_f64()))
                    .collect()
            };
            let (to_a, to_c) = (at(&on_a), at(&on_c));
            eprintln!(
                "{topic} delivered {n} times, to a at {to_a:?} and to c at {to_c:?} s from the cut (healed at {:+.2})",
                healed_at.duration_since(cut_at).as_secs_f64()
            );
            assert!(*n <= at_most, "{topic} was delivered {n} times, more than {at_most}");
        }
        // Counted: every delivery beyond a message's first is a
        // redelivery in the group's record (the listing gathers every
        // replica's counts every 2 s).
        let counted_by = Instant::now() + Duration::from_secs(10);
        let redelivered = loop {
            let counted = a.group("cutters").await.expect("the group is listed").redeliveries;
            if counted as usize >= extra || Instant::now() >= counted_by {
                break counted;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(
            redelivered as usize >= extra,
            "{extra} extra deliveries, {redelivered} counted as redeliveries in the group's record"
        );

        // Group publishes through c that were refused said so, naming NATS.
        let refusals = through_c.lock().refused.clone();
        for (n, _, _, s) in &refusals {
            assert_eq!(s.code(), tonic::Code::Unavailable, "group message {n} through c: {s:?}");
            assert!(s.message().contains("NATS"), "group message {n} through c: {s:?}");
        }
        let slowest_refusal = refusals.iter().map(|(_, _, took, _)| *took).max().unwrap_or_default();
        let slowest = answers.iter().max().copied().unwrap_or_default();
        eprintln!(
            "{cut:?}: c NOT_SERVING {:.2} s after the cut; UNAVAILABLE answers in at most {:.0} ms; group publishes: {} accepted through a ({accepted_by_a_during} during the cut), {} through c, {} refused through c (slowest refusal {:.2} s); lost 0; {twice} messages delivered more than once ({extra} extra deliveries, {redelivered} counted as redelivered); c SERVING {:.2} s after the heal",
            to_not_serving.as_secs_f64(),
            slowest.as_secs_f64() * 1000.0,
            through_a.lock().ok.len(),
            through_c.lock().ok.len(),
            refusals.len(),
            slowest_refusal.as_secs_f64(),
            to_serving.as_secs_f64()
        );
        assert!(accepted_by_a_during > 0, "a accepted group publishes during the cut");
    };
    tokio::time::timeout(WHOLE_TEST, body).await.expect("test timed out");
}

/// The other side of noticing: a NATS server that dies is no partition for
/// a replica on another server, although no other replica answers its
/// pings (it is alone) and the streams the dead server led elect new
/// leaders for seconds. The server killed leads the replicas bucket's
/// stream, or else most of the buckets' streams (NATS's choice; printed). The replica stays
/// SERVING throughout and keeps publishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_that_dies_is_no_partition_for_a_replica_on_another() {
    let mut nats = NatsCluster::start(3).await;
    let body = async {
        let prefix = format!("natsdies{}", unique());
        let replica = start_with(replica_config(config(), vec![nats.url(1)], "alone", &prefix, 3)).await;
        wait_serving_at(&replica.url()).await;
        let mut client = replica.client().await;

        // Which server leads each of the buckets' streams.
        let jsz = nats.monitor(1, "/jsz?accounts=true&streams=true").await.expect("/jsz");
        let mut led = [0usize; 3];
        let mut leaders = Vec::new();
        for account in jsz["account_details"].as_array().into_iter().flatten() {
            for stream in account["stream_detail"].as_array().into_iter().flatten() {
                let name = stream["name"].as_str().unwrap_or_default();
                if name.starts_with(&format!("KV_{prefix}_")) {
                    let leader = stream["cluster"]["leader"].as_str().unwrap_or_default().to_owned();
                    if let Some(i) = nats.index_of(&leader) {
                        led[i] += 1;
                    }
                    leaders.push((name.to_owned(), leader));
                }
            }
        }
        // The leader of the replicas bucket's stream (written to by every
        // heartbeat) if it is another server, else the one leading most.
        let replicas_stream = format!("KV_{prefix}_replicas");
        let victim = leaders
            .iter()
            .find(|(name, _)| *name == replicas_stream)
            .and_then(|(_, leader)| nats.index_of(leader))
            .filter(|&i| i != 1)
            .unwrap_or(if led[0] >= led[2] { 0 } else { 2 });
        eprintln!("the buckets' stream leaders: {leaders:?}; killing server {victim}");

        nats.kill(victim);
        let killed_at = Instant::now();
        let mut n = 0;
        while killed_at.elapsed() < Duration::from_secs(12) {
            assert_eq!(
                serving_status_at(&replica.url()).await,
                Some(ServingStatus::Serving),
                "the replica on a live server serves {:?} after another server died",
                killed_at.elapsed()
            );
            n += 1;
            client
                .publish(publish_request(&format!("alive.{n}"), "x"))
                .await
                .unwrap_or_else(|s| panic!("a publish {:?} after another server died: {s:?}", killed_at.elapsed()));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(WHOLE_TEST, body).await.expect("test timed out");
}
