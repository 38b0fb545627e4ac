//! Cluster mode: what NATS losing its memory costs each consumer group,
//! counted once over the replicas, whether the group had members or none,
//! over a lone NATS server and over a 3-node cluster restarted whole.

mod common;

use common::nats::NatsCluster;
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

/// The case over one NATS server: a group whose only member left
/// holds 10 messages, 6 its MANUAL member had unacked when it left (handed
/// back to JetStream, awaiting redelivery) and 4 published since; NATS is
/// killed (-9) and a fresh one starts on the same port. The 10 are counted
/// once over the two replicas, and listed with the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memberless_groups_backlog_lost_with_a_lone_nats_server_is_counted_once() {
    memberless_backlog_lost(NatsCluster::start(1).await, 1).await;
}

/// The same over a 3-node JetStream cluster killed whole (-9) and started
/// again: its meta layer brings the group's stream back, empty, and both
/// replicas rebuild; still counted once, not by each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memberless_groups_backlog_lost_with_a_whole_nats_cluster_is_counted_once() {
    memberless_backlog_lost(NatsCluster::start(3).await, 3).await;
}

async fn memberless_backlog_lost(mut nats: NatsCluster, nats_replicas: usize) {
    rejoin_timeout(async {
        let prefix = format!("memberless{}", unique());
        // Each replica on a server of its own (with three).
        let a = start_with(replica_config(config(), nats.urls(), "a", &prefix, nats_replicas)).await;
        let mut urls = nats.urls();
        urls.rotate_left(nats_replicas - 1);
        let b = start_with(replica_config(config(), urls, "b", &prefix, nats_replicas)).await;
        let replicas = [&a, &b];
        for replica in replicas {
            wait_until("both replicas to serve", || replica.is_serving()).await;
        }
        let (mut on_b, mut on_a) = (b.client().await, a.client().await);
        let (mut member, _) = open(&mut on_b, member_request(&["idle.>"], "idle", true, 6)).await;
        publish_to(&mut on_a, "idle.x", 6).await;
        for _ in 0..6 {
            tokio::time::timeout(TEST_TIMEOUT, member.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
        // It leaves with the 6 unacked: back to JetStream, for whoever
        // joins next.
        drop(member);
        wait_until("the group to have no member", || async {
            a.group("idle")
                .await
                .is_some_and(|g| g.members == 0 && g.in_flight == 0)
        })
        .await;
        publish_to(&mut on_a, "idle.x", 4).await;
        // What a loss is counted from: each replica's last gathering.
        for replica in replicas {
            wait_until("each replica to see the memberless group's 10", || async {
                let (_, text) = replica.http_get("/metrics").await;
                metric_with_label(&text, "tinybroker_consumer_group_backlog", "consumer_group=\"idle\"") == Some(10.0)
            })
            .await;
        }
        let before = dropped_total(replicas, "nats_state_lost").await;
        nats.kill_and_restart_all().await;
        wait_until("the loss to be counted", || async {
            dropped_total(replicas, "nats_state_lost").await >= before + 10.0
        })
        .await;
        // Both replicas rebuilt (a group publish works through each) before
        // the count is read: the later one must not count it again.
        wait_until("both replicas to serve a group publish again", || async {
            let mut ok = true;
            for replica in replicas {
                ok &= replica.is_serving().await
                    && replica
                        .client()
                        .await
                        .publish(publish_request("idle.after", "x"))
                        .await
                        .is_ok();
            }
            ok
        })
        .await;
        wait_until("both replicas to list the group again", || async {
            // A replica still rebuilding refuses Admin with UNAVAILABLE:
            // not listing it yet (seen once in CI right after the
            // publishes went through).
            listing(&a, "idle").await.is_some() && listing(&b, "idle").await.is_some()
        })
        .await;
        assert_eq!(
            dropped_total(replicas, "nats_state_lost").await - before,
            10.0,
            "counted once over the replicas"
        );
        for replica in replicas {
            let listed = replica.group("idle").await.expect("the group is still in the table");
            assert_eq!(listed.dropped, 10, "the dropped ListConsumerGroups shows: {listed:?}");
        }
    })
    .await;
}

/// Publishes `n` messages to `topic` through `client`, one by one.
async fn publish_to(
    client: &mut tinybroker::pb::broker_client::BrokerClient<tonic::transport::Channel>,
    topic: &str,
    n: usize,
) {
    for i in 0..n {
        client.publish(publish_request(topic, &i.to_string())).await.unwrap();
    }
}

/// Group `name` as `broker` lists it now; None when it does not, or does
/// not answer Admin (yet).
async fn listing(broker: &TestBroker, name: &str) -> Option<tinybroker::pb::ConsumerGroupInfo> {
    let mut admin = tinybroker::pb::admin_client::AdminClient::connect(broker.url())
        .await
        .ok()?;
    let listed = admin
        .list_consumer_groups(tinybroker::pb::ListConsumerGroupsRequest {})
        .await
        .ok()?;
    listed.into_inner().groups.into_iter().find(|g| g.name == name)
}
