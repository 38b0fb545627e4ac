//! Cluster mode: what NATS losing its memory costs each consumer group,
//! counted once over the replicas. A file of its own: its NATS restart,
//! run beside tests/cluster_failures.rs's own (a 3-node JetStream cluster
//! restarted whole), held that cluster's health past its harness's wait.

mod common;

use common::process::metric_with_label;
use common::*;

/// Two replicas over one NATS server that restarts and forgets its memory:
/// every group in the table has what it lost counted once, cluster-wide, in
/// `dropped_total{reason="nats_state_lost"}` and in the `dropped` that
/// ListConsumerGroups gives it: a group whose member (on replica b) held 2
/// with 3 in its backlog, and one with no member anywhere and 4 in its
/// backlog (once counted by no replica at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_groups_loss_with_nats_is_counted_once_over_two_replicas() {
    rejoin_timeout(async {
        let mut broker = start_cluster(config()).await;
        let mut on_b = broker.client_on(1).await;
        let (mut member, _) = open(&mut on_b, member_request(&["held.>"], "workers", true, 2)).await;
        let (idle_member, _) = open(&mut on_b, member_request(&["idle.>"], "idle", false, 0)).await;
        drop(idle_member);
        wait_until("the idle group to have no member", || async {
            broker.group("idle").await.is_some_and(|g| g.members == 0)
        })
        .await;
        publish_many(&broker, "held.x", 5).await;
        publish_many(&broker, "idle.x", 4).await;
        for _ in 0..2 {
            tokio::time::timeout(TEST_TIMEOUT, member.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
        // Both replicas' gauges (the last gathering, which a loss is counted
        // from) have the backlogs.
        for i in 0..2 {
            let replica = broker.replica(i);
            wait_until("each replica to see both backlogs", || async {
                let (_, text) = replica.http_get("/metrics").await;
                metric_with_label(&text, "tinybroker_consumer_group_backlog", "consumer_group=\"workers\"") == Some(3.0)
                    && metric_with_label(&text, "tinybroker_consumer_group_backlog", "consumer_group=\"idle\"")
                        == Some(4.0)
            })
            .await;
        }
        let nats = broker.nats_mut().expect("start_cluster's NATS server");
        nats.stop(0).await;
        nats.restart(0).await;
        wait_until("both groups' losses to be counted", || async {
            broker.dropped_total("nats_state_lost").await >= 9.0
        })
        .await;
        wait_until("both replicas to serve a group publish again", || async {
            let mut ok = true;
            for i in 0..2 {
                ok &= broker
                    .client_on(i)
                    .await
                    .publish(publish_request("nothing.here", "x"))
                    .await
                    .is_ok();
            }
            ok && broker.is_serving().await
        })
        .await;
        assert_eq!(broker.dropped_total("nats_state_lost").await, 9.0, "once each");
        let workers = broker.group("workers").await.map(|g| g.dropped);
        assert_eq!(workers, Some(5), "the backlog of 3 and the 2 held");
        let idle = broker.group("idle").await.map(|g| g.dropped);
        assert_eq!(idle, Some(4), "the memberless group's backlog");
    })
    .await;
}
