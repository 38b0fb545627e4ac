//! Issue 42: a hung member inside a busy manual-ack group, in the metrics.
//! Every member of the group holds its `max_in_flight` unacked, so
//! `tinybroker_subscription_unacked` cannot tell them apart; the hung
//! member's `tinybroker_subscription_oldest_unacked_age_seconds` and
//! `tinybroker_subscription_stalled_seconds` grow past the acking ones'.
//! A real broker and real gRPC clients, on the engine `TB_ENGINE` picks (in
//! cluster mode each replica reports the members it serves).

mod common;

use common::hung::{MAX_IN_FLIGHT, busy_group_with_a_hung_member};
use common::*;
use std::collections::HashMap;
use std::time::Duration;
use tinybroker::config::Config;

/// The value of `metric` for each member of `group`, from every replica's
/// /metrics (each member is reported by the replica serving it, once).
async fn per_member(broker: &TestBroker, metric: &str, group: &str) -> HashMap<String, f64> {
    let mut values = HashMap::new();
    for i in 0..broker.replica_count() {
        let text = scrape(broker.replica(i).metrics_addr).await;
        for line in text.lines().filter(|l| l.starts_with(&format!("{metric}{{"))) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            if !series.contains(&format!("consumer_group=\"{group}\"")) {
                continue;
            }
            let id = series
                .split("subscription_id=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or_else(|| panic!("no subscription_id in {line}"));
            let previous = values.insert(id.to_owned(), value.parse().unwrap());
            assert!(previous.is_none(), "{id} reported twice for {metric}");
        }
    }
    values
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_members_oldest_unacked_age_and_stall_outgrow_the_acking_members() {
    timeout(async {
        let broker = start().await;
        let scene = busy_group_with_a_hung_member(&broker, "busy").await;
        let mut last = (HashMap::new(), HashMap::new(), HashMap::new());
        let mut seen = false;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline {
            let oldest = per_member(&broker, "tinybroker_subscription_oldest_unacked_age_seconds", "busy").await;
            let stalled = per_member(&broker, "tinybroker_subscription_stalled_seconds", "busy").await;
            let unacked = per_member(&broker, "tinybroker_subscription_unacked", "busy").await;
            let healthy_max = |m: &HashMap<String, f64>| {
                scene
                    .healthy
                    .iter()
                    .map(|id| m.get(id).copied().unwrap_or(f64::NAN))
                    .fold(0.0, f64::max)
            };
            let hung = |m: &HashMap<String, f64>| m.get(&scene.hung).copied().unwrap_or(0.0);
            // Busy: every member holds its max_in_flight, so the count of
            // unacked messages names no one.
            let busy = unacked.len() == 3 && unacked.values().all(|&n| n == f64::from(MAX_IN_FLIGHT));
            seen = busy
                && oldest.len() == 3
                && stalled.len() == 3
                && hung(&oldest) > 3.0
                && hung(&oldest) > 3.0 * healthy_max(&oldest)
                && hung(&stalled) > 3.0
                && healthy_max(&stalled) < 2.0;
            last = (oldest, stalled, unacked);
            if seen {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(
            seen,
            "the hung member's series never outgrew the others' (oldest unacked, stalled, unacked): {last:#?}"
        );
        eprintln!("oldest unacked, stalled, unacked per member: {last:?}");
    })
    .await
}

/// TINYBROKER_METRICS_PER_SUBSCRIPTION=false: no per-member series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_member_series_are_off_with_per_subscription_metrics() {
    timeout(async {
        let broker = start_with(Config {
            metrics_per_subscription: false,
            ..config()
        })
        .await;
        let scene = busy_group_with_a_hung_member(&broker, "quiet").await;
        wait_until("the hung member to hold its messages", || async {
            listed(broker.subscriptions().await, &scene.hung).is_some_and(|s| s.unacked == u64::from(MAX_IN_FLIGHT))
        })
        .await;
        for i in 0..broker.replica_count() {
            let text = scrape(broker.replica(i).metrics_addr).await;
            for metric in [
                "tinybroker_subscription_unacked{",
                "tinybroker_subscription_oldest_unacked_age_seconds{",
                "tinybroker_subscription_stalled_seconds{",
            ] {
                assert!(!text.contains(metric), "{metric} in\n{text}");
            }
        }
    })
    .await
}
