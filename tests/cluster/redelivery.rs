//! A group's messages handed back across replicas: MANUAL Ack and Nack
//! through any replica, redelivery after a deadline and the dead letter
//! (one, not one per replica); a Nack or an expired deadline hands the
//! message to another member with room, on the same replica or another,
//! as in single-node mode; attempts keep counting after a hand-over and a
//! redelivery through JetStream.

use crate::common::nats::NatsCluster;
use crate::common::*;
use crate::{
    group_stream_state, next_message, publish_n, replica_config, replicas, replicas_with, urls_from, wait_members,
    wait_serving,
};
use tinybroker::pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_ack_from_any_replica_redelivery_backlog_and_dead_letters() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut config = replica_config(urls_from(&nats, 0), "m0", "manual");
        config.limits.max_delivery_attempts = 2;
        let m0 = start_with(config).await;
        let mut config = replica_config(urls_from(&nats, 1), "m1", "manual");
        config.limits.max_delivery_attempts = 2;
        let m1 = start_with(config).await;
        wait_serving(&m0).await;
        wait_serving(&m1).await;

        // The group exists once its first member opens; a backlog waits
        // while no member is connected.
        let mut request = member_request(&["orders.*"], "billing", true, 8);
        request.ack_deadline_ms = 1000;
        request.subscription_id = "biller".into();
        drop(m0.client().await.open_subscription(request.clone()).await.unwrap());
        wait_until("the first member to be gone", || async {
            listed(m0.subscriptions().await, "biller").is_none()
        })
        .await;
        let sent = publish_n(&m1, "orders.new", 3).await;
        let mut member = m0
            .client()
            .await
            .open_subscription(request.clone())
            .await
            .unwrap()
            .into_inner();
        let first = next_message(&mut member, "the backlog").await;
        assert_eq!(first.sequence, sent[0]);
        let second = next_message(&mut member, "the backlog").await;
        let third = next_message(&mut member, "the backlog").await;
        assert_eq!((second.sequence, third.sequence), (sent[1], sent[2]));

        // Ack through the replica that does not serve the member.
        let ack = m1
            .client()
            .await
            .ack(pb::AckRequest {
                subscription_id: "biller".into(),
                sequences: vec![first.sequence, 999],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((ack.acked, ack.unknown), (1, 1));
        // Nack: redelivered at once, attempt 2.
        let nack = m1
            .client()
            .await
            .nack(pb::NackRequest {
                subscription_id: "biller".into(),
                sequences: vec![second.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((nack.requeued, nack.unknown), (1, 0));
        // The nacked one comes again at once; the third, unacked past its
        // 1 s deadline, too: both on their second (last) attempt.
        // The dead letters, and the markers that end them (below).
        let (mut dlq, _) = subscribe(&mut m1.client().await, &["_dlq.billing", "marker.*"]).await;
        let mut again = std::collections::BTreeMap::new();
        for _ in 0..2 {
            let m = next_message(&mut member, "a redelivery").await;
            again.insert(m.sequence, m.delivery_attempt);
        }
        assert_eq!(
            again,
            std::collections::BTreeMap::from([(second.sequence, 2), (third.sequence, 2)])
        );
        let ack = m0
            .client()
            .await
            .ack(pb::AckRequest {
                subscription_id: "biller".into(),
                sequences: vec![third.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ack.acked, 1);
        // The second is not acked: past its deadline on its last attempt, it
        // is dead-lettered, once, seen by a subscriber on the other replica.
        let letter = next_message(&mut dlq, "the dead letter").await;
        assert_eq!(
            letter.headers.get("tinybroker-original-topic").map(String::as_str),
            Some("orders.new")
        );
        assert_eq!(
            letter.headers.get("tinybroker-delivery-attempts").map(String::as_str),
            Some("2")
        );
        assert_eq!(&letter.payload[..], b"m1");
        // One dead letter, not one per replica. Once the group's stream
        // holds nothing, no replica can dead-letter the message again (it
        // publishes the letter before it acks the message away); a marker
        // published through each replica then comes after any letter that
        // replica published, on the same path: the next two messages are
        // the markers.
        wait_until("the dead-lettered message to leave the group's stream", || async {
            group_stream_state(&nats, 0, "manual").await == Some((0, 0))
        })
        .await;
        for (replica, marker) in [(&m0, "marker.m0"), (&m1, "marker.m1")] {
            replica
                .client()
                .await
                .publish(publish_request(marker, "end"))
                .await
                .unwrap();
        }
        let mut next: Vec<String> = Vec::new();
        for _ in 0..2 {
            next.push(next_message(&mut dlq, "a marker").await.topic);
        }
        next.sort();
        assert_eq!(next, ["marker.m0", "marker.m1"], "one dead letter, not one per replica");
    })
    .await;
}

/// A Nack goes to another member of the same replica when one has room, as
/// in single-node mode, not back to the one that nacked it: two MANUAL
/// members on one replica, each given one message, so the hand-out turn is
/// back at the first; it nacks, and the second gets the message (attempt 2)
/// while the first gets nothing more. (Through JetStream, the replica's turn
/// would give it to the first again.) The first's late Ack is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_goes_to_another_member_on_the_same_replica() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "nackhere").await;
        let mut client = brokers[0].client().await;
        let (mut first, first_id) = open(&mut client, member_request(&["job"], "w", true, 4)).await;
        let (mut second, second_id) = open(&mut client, member_request(&["job"], "w", true, 4)).await;
        wait_members(&brokers[1], 2).await;
        let sent = publish_n(&brokers[1], "job", 2).await;
        let a = next_message(&mut first, "the first member's message").await;
        let b = next_message(&mut second, "the second member's message").await;
        assert_eq!([a.sequence, b.sequence].iter().filter(|s| sent.contains(s)).count(), 2);
        let r = brokers[1]
            .client()
            .await
            .nack(pb::NackRequest {
                subscription_id: first_id.clone(),
                sequences: vec![a.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.requeued, r.unknown), (1, 0));
        let again = next_message(&mut second, "the nacked message, at the other member").await;
        assert_eq!((again.sequence, again.delivery_attempt), (a.sequence, 2));
        assert_eq!(again.subscription_id, second_id);
        let late = ack(&mut client, &first_id, &[a.sequence]).await;
        assert_eq!(late, (0, 1), "a late ack from the old holder");
        let ok = ack(&mut client, &second_id, &[a.sequence, b.sequence]).await;
        assert_eq!(ok, (2, 0));
        let g = groups(&mut brokers[1].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.redeliveries, g.backlog), (0, 1, 0), "{g:?}");
        // The group holds nothing, so nothing more can come: the member
        // that nacked was handed its one message and no other.
        let f = listed(brokers[0].subscriptions().await, &first_id).unwrap();
        assert_eq!(
            (f.delivered, f.queue_depth),
            (1, 0),
            "nothing more for the member that nacked: {f:?}"
        );
        drop(first);
    })
    .await;
}

/// A Nack by the only member of a group on its replica hands the message
/// to a member on another replica, as in single-node mode another member
/// gets it first (docs/contract.md, Cluster mode): not back through
/// JetStream to whichever pull comes first, the nacking member's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_goes_to_a_member_on_another_replica_when_none_here_has_room() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "nackthere").await;
        let mut clients = [brokers[0].client().await, brokers[1].client().await];
        let (mut s0, id0) = open(&mut clients[0], member_request(&["job"], "w", true, 8)).await;
        let (mut s1, id1) = open(&mut clients[1], member_request(&["job"], "w", true, 8)).await;
        let ids = [id0, id1];
        wait_members(&brokers[0], 2).await;
        const N: usize = 6;
        let sent = publish_n(&brokers[0], "job", N).await;
        // Each first delivery is nacked by the member that got it; the
        // second must reach the other member.
        let mut first_at = std::collections::HashMap::new();
        let mut second_at = std::collections::HashMap::new();
        while second_at.len() < N {
            let (m, member) = tokio::select! {
                m = next_message(&mut s0, "a delivery") => (m, 0),
                m = next_message(&mut s1, "a delivery") => (m, 1),
            };
            assert!(sent.contains(&m.sequence), "{m:?}");
            match m.delivery_attempt {
                1 => {
                    assert!(first_at.insert(m.sequence, member).is_none(), "{m:?}");
                    let r = clients[member]
                        .nack(pb::NackRequest {
                            subscription_id: ids[member].clone(),
                            sequences: vec![m.sequence],
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    assert_eq!((r.requeued, r.unknown), (1, 0));
                }
                2 => {
                    assert!(second_at.insert(m.sequence, member).is_none(), "{m:?}");
                    assert_eq!(ack(&mut clients[member], &ids[member], &[m.sequence]).await, (1, 0));
                }
                n => panic!("attempt {n} of {m:?}"),
            }
        }
        for seq in &sent {
            assert_ne!(
                first_at[seq], second_at[seq],
                "message {seq} came back to the member that nacked it: first {first_at:?}, second {second_at:?}"
            );
        }
        let g = groups(&mut brokers[1].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.redeliveries, g.backlog), (0, N as u64, 0), "{g:?}");
    })
    .await;
}

/// A message whose ack deadline passed goes to another member with room,
/// as in single-node mode, not back through JetStream to whichever member
/// pulls first (the late one included): four messages held by a member
/// that never acks all reach the member that joined after them, attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_hands_the_message_to_another_member() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 2, "deadline").await;
        let mut client = brokers[0].client().await;
        let mut request = member_request(&["slow"], "w", true, 4);
        request.ack_deadline_ms = 1_000;
        let (mut late, late_id) = open(&mut client, request).await;
        let sent = publish_n(&brokers[1], "slow", 4).await;
        for seq in &sent {
            let m = next_message(&mut late, "a message for the member that never acks").await;
            assert_eq!((m.sequence, m.delivery_attempt), (*seq, 1));
        }
        let (mut other, other_id) = open(&mut client, member_request(&["slow"], "w", true, 8)).await;
        let mut again = Vec::new();
        while again.len() < sent.len() {
            let m = next_message(&mut other, "a message whose deadline passed").await;
            assert_eq!(m.delivery_attempt, 2, "{m:?}");
            assert_eq!(ack(&mut client, &other_id, &[m.sequence]).await, (1, 0));
            again.push(m.sequence);
        }
        again.sort_unstable();
        assert_eq!(again, sent);
        let g = groups(&mut brokers[1].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.redeliveries, g.backlog), (0, 4, 0), "{g:?}");
        // Every message is acked and the group holds nothing more: the
        // member that let its deadlines pass was handed the 4 first
        // attempts and nothing came back to it.
        let l = listed(brokers[0].subscriptions().await, &late_id).unwrap();
        assert_eq!(
            (l.delivered, l.queue_depth, l.unacked),
            (4, 0, 0),
            "nothing came back to the member that let its deadlines pass: {l:?}"
        );
        drop(late);
    })
    .await;
}

/// A message handed to another member (a Nack) and later given back through
/// JetStream (no member had room) keeps counting its attempts: JetStream's
/// count is one behind, and `delivery_attempt` and
/// `TINYBROKER_MAX_DELIVERY_ATTEMPTS` must not repeat or stretch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_keep_counting_after_a_hand_over_and_a_redelivery_through_jetstream() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas_with(&nats, 1, "attempts", |c| c.limits.max_delivery_attempts = 3).await;
        let mut client = brokers[0].client().await;
        let (mut dlq, _) = subscribe(&mut client, &["_dlq.w"]).await;
        let (mut a, a_id) = open(&mut client, member_request(&["job"], "w", true, 1)).await;
        let (mut b, b_id) = open(&mut client, member_request(&["job"], "w", true, 1)).await;
        wait_members(&brokers[0], 2).await;
        let nack = |id: String, sequence: u64| {
            let mut client = client.clone();
            async move {
                let r = client
                    .nack(pb::NackRequest {
                        subscription_id: id,
                        sequences: vec![sequence],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!((r.requeued, r.unknown), (1, 0));
            }
        };
        let first = publish_n(&brokers[0], "job", 1).await[0];
        // Whichever member got it first (x) nacks it: the other (y) has room.
        let (mut x, x_id, mut y, y_id) = tokio::select! {
            m = next_message(&mut a, "the first delivery, at a") => {
                assert_eq!((m.sequence, m.delivery_attempt), (first, 1));
                (a, a_id, b, b_id)
            }
            m = next_message(&mut b, "the first delivery, at b") => {
                assert_eq!((m.sequence, m.delivery_attempt), (first, 1));
                (b, b_id, a, a_id)
            }
        };
        nack(x_id.clone(), first).await;
        let m = next_message(&mut y, "the nacked message, at the other member").await;
        assert_eq!((m.sequence, m.delivery_attempt), (first, 2), "handed over");
        // x is busy with another message, y nacks: no member has room, so it
        // goes back through JetStream (which delivered it once so far).
        let second = publish_n(&brokers[0], "job", 1).await[0];
        let m = next_message(&mut x, "the second message").await;
        assert_eq!(m.sequence, second);
        nack(y_id.clone(), first).await;
        let m = next_message(&mut y, "the message, redelivered through JetStream").await;
        assert_eq!(
            (m.sequence, m.delivery_attempt),
            (first, 3),
            "the third attempt, not JetStream's second delivery"
        );
        let js = async_nats::jetstream::new(async_nats::connect(nats.url(0).as_str()).await.unwrap());
        let bucket = js.get_key_value("attempts_attempts").await.unwrap();
        let entries = || async {
            use futures::StreamExt;
            bucket.keys().await.unwrap().count().await
        };
        assert_eq!(
            entries().await,
            1,
            "what ran ahead of JetStream's count, written before the nak"
        );
        // That was the last allowed attempt: a Nack dead-letters it.
        nack(y_id.clone(), first).await;
        let letter = next_message(&mut dlq, "the dead letter").await;
        assert_eq!(
            letter.headers.get("tinybroker-delivery-attempts").map(String::as_str),
            Some("3"),
            "{letter:?}"
        );
        wait_until("the dead-lettered message's entry to be removed", || async {
            entries().await == 0
        })
        .await;
        assert_eq!(ack(&mut client, &x_id, &[second]).await, (1, 0));
        // The group holds nothing now, so nothing more can come: no fourth
        // attempt. y was handed the second and third, x the first and the
        // other message.
        let g = groups(&mut brokers[0].admin().await).await.remove(0);
        assert_eq!((g.in_flight, g.backlog, g.dead_lettered), (0, 0, 1), "{g:?}");
        let listing = brokers[0].subscriptions().await;
        let handed = |id: &str| {
            let s = listed(listing.clone(), id).unwrap();
            (s.delivered, s.queue_depth)
        };
        assert_eq!(handed(&y_id), (2, 0), "no fourth attempt");
        assert_eq!(handed(&x_id), (2, 0));
        drop((x, y));
    })
    .await;
}
