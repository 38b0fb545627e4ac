//! Clients that vanish without closing: `tinybroker subscribe` processes
//! killed with SIGKILL. Their subscriptions are reaped, and a killed
//! manual-ack group member's unacked messages go to another member.

mod common;

use common::process::spawn_cli_subscriber;
use common::*;
use std::time::Duration;
use tinybroker::pb;

/// Waits (off the runtime) for a line from a child's stdout.
async fn next_line(rx: std::sync::mpsc::Receiver<String>) -> (String, std::sync::mpsc::Receiver<String>) {
    tokio::task::spawn_blocking(move || {
        let line = rx.recv_timeout(Duration::from_secs(20)).expect("a line from the CLI");
        (line, rx)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_subscriber_process_is_reaped() {
    timeout(async {
        let broker = start().await;
        let mut child = spawn_cli_subscriber(&broker.url(), &["faults.>", "--id", "doomed"]);
        wait_until("the CLI subscription to be listed", || async {
            listed(broker.subscriptions().await, "doomed").is_some()
        })
        .await;
        let mut client = broker.client().await;
        client.publish(publish_request("faults.a", "alive")).await.unwrap();
        let (line, _rx) = next_line(child.stdout.take().unwrap()).await;
        assert_eq!(line, "alive");

        child.kill();
        wait_until("the killed subscriber's subscription to be reaped", || async {
            listed(broker.subscriptions().await, "doomed").is_none()
        })
        .await;
        let m = scrape(broker.metrics_addr).await;
        assert_eq!(common::process::metric_sum(&m, "tinybroker_subscriptions"), 0.0, "{m}");
        let routed = client
            .publish(publish_request("faults.a", "after"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(routed.matched_subscriptions, 0);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_manual_member_s_unacked_messages_go_to_another_member() {
    timeout(async {
        let broker = start().await;
        let mut cli = spawn_cli_subscriber(
            &broker.url(),
            &[
                "work",
                "--group",
                "workers",
                "--manual-ack",
                "--json",
                "--id",
                "cli-member",
            ],
        );
        wait_until("the CLI member to join", || async {
            listed(broker.subscriptions().await, "cli-member").is_some()
        })
        .await;
        // Frozen, the CLI cannot ack what the broker streams to it; its
        // socket still takes the bytes, so the messages are in flight.
        cli.signal("STOP");
        let mut publisher = broker.client().await;
        let mut sequences = Vec::new();
        for i in 0..5 {
            let r = publisher
                .publish(publish_request("work", &format!("job-{i}")))
                .await
                .unwrap();
            sequences.push(r.into_inner().sequence);
        }
        wait_until("the five jobs to be streamed to the frozen member", || async {
            listed(broker.subscriptions().await, "cli-member").is_some_and(|s| s.delivered == 5)
        })
        .await;
        assert_eq!(broker.group("workers").await.unwrap().in_flight, 5);

        // A second member (an in-test client) joins; everything is held by
        // the frozen one, so it gets nothing until the CLI dies.
        let mut client = broker.client().await;
        let (mut stream, id) = open(&mut client, member_request(&["work"], "workers", true, 10)).await;
        cli.kill();
        wait_until("the killed member to be reaped", || async {
            listed(broker.subscriptions().await, "cli-member").is_none()
        })
        .await;
        let mut redelivered = Vec::new();
        for _ in 0..5 {
            let m = tokio::time::timeout(Duration::from_secs(20), stream.message())
                .await
                .expect("a redelivery within 20 s")
                .unwrap()
                .expect("the stream stays open");
            assert_eq!(m.delivery_attempt, 2, "{m:?}");
            assert_eq!(m.consumer_group, "workers");
            redelivered.push(m.sequence);
        }
        redelivered.sort_unstable();
        assert_eq!(redelivered, sequences);
        let ack = client
            .ack(pb::AckRequest {
                subscription_id: id,
                sequences: redelivered,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((ack.acked, ack.unknown), (5, 0));
        let group = broker.group("workers").await.unwrap();
        assert_eq!((group.members, group.in_flight, group.backlog), (1, 0, 0), "{group:?}");
        assert_eq!(group.redeliveries, 5);
    })
    .await
}
