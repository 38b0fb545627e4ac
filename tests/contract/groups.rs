//! Consumer groups over real gRPC: sharing, routing around slow members,
//! backlog, manual ack, redelivery, dead letters, overflow and idle TTL.

use crate::common::*;
use crate::transport::{open, subscribe, try_open};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tinybroker::config::{Config, Limits};
use tinybroker::pb;
use tokio::sync::mpsc;
use tonic::Code;

/// Waits until the group has `n` members (as the Admin API sees it).
async fn wait_members(broker: &TestBroker, group: &str, n: u32) {
    wait_until(&format!("{group} to have {n} members"), || async {
        broker.group(group).await.is_some_and(|g| g.members == n)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_share_3000_messages_each_exactly_once() {
    timeout(async {
        let broker = start().await;
        let (tx, mut rx) = mpsc::unbounded_channel::<(usize, pb::Message)>();
        let mut tasks = Vec::new();
        for member in 0..3 {
            let mut client = broker.client().await;
            let (mut stream, _) = open(&mut client, member_request(&["jobs.*"], "workers", false, 0)).await;
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(m)) = stream.message().await {
                    if tx.send((member, m)).is_err() {
                        break;
                    }
                }
            }));
        }
        let published = publish_many(&broker, "jobs.build", 3000).await;
        let mut seen = HashSet::new();
        let mut per_member = [0usize; 3];
        while seen.len() < 3000 {
            let (member, m) = rx.recv().await.unwrap();
            assert_eq!(m.consumer_group, "workers");
            assert_eq!(m.delivery_attempt, 1);
            assert!(seen.insert(m.sequence), "sequence {} delivered twice", m.sequence);
            per_member[member] += 1;
        }
        assert_eq!(seen, published.into_iter().collect());
        for (member, n) in per_member.iter().enumerate() {
            assert!(*n >= 450, "member {member} got {n} of 3000: {per_member:?}");
        }
        // Nothing more arrives: each message went to exactly one member.
        let g = broker.group("workers").await.unwrap();
        assert_eq!((g.backlog, g.in_flight, g.members), (0, 0, 3));
        assert!(rx.try_recv().is_err());
        for t in tasks {
            t.abort();
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_max_in_flight_1_that_never_acks_gets_only_1() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut stuck, stuck_id) = open(&mut client, member_request(&["jobs.>"], "w", true, 1)).await;
        let (tx, mut rx) = mpsc::unbounded_channel::<pb::Message>();
        for _ in 0..2 {
            let mut request = member_request(&["jobs.>"], "w", true, 16);
            request.ack_deadline_ms = 60_000;
            let (mut stream, id) = open(&mut broker.client().await, request).await;
            let tx = tx.clone();
            let mut acker = broker.client().await;
            tokio::spawn(async move {
                while let Ok(Some(m)) = stream.message().await {
                    let r = acker
                        .ack(pb::AckRequest {
                            subscription_id: id.clone(),
                            sequences: vec![m.sequence],
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    assert_eq!((r.acked, r.unknown), (1, 0));
                    if tx.send(m).is_err() {
                        break;
                    }
                }
            });
        }
        publish_many(&broker, "jobs.x", 300).await;
        let first = stuck.message().await.unwrap().unwrap();
        assert_eq!(first.delivery_attempt, 1);
        // Once nothing waits and the others acked all they got, what the
        // group holds is the stuck member's: nothing more can come to it.
        wait_until("the others to ack all they were handed", || async {
            let g = broker.group("w").await.unwrap();
            let stuck = listed(broker.subscriptions().await, &stuck_id).unwrap();
            g.backlog == 0 && g.in_flight == stuck.unacked
        })
        .await;
        let g = broker.group("w").await.unwrap();
        assert_eq!(g.in_flight, 1, "only the stuck member's message is unacked");
        let stuck = listed(broker.subscriptions().await, &stuck_id).unwrap();
        assert_eq!(
            (stuck.delivered, stuck.queue_depth),
            (1, 0),
            "the stuck member gets nothing more: {stuck:?}"
        );
        for _ in 0..299 {
            rx.recv().await.unwrap();
        }
    })
    .await
}

/// A member that never acks beside two that do: its queue reads 0 like
/// theirs, but ListSubscriptions names it by the messages it holds unacked
/// and how long it has held the oldest (the CLI, `top`, the status page and
/// `tinybroker_subscription_unacked` show the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_member_is_named_by_its_unacked_messages() {
    timeout(async {
        let broker = start().await;
        let mut request = member_request(&["jobs.>"], "hang", true, 8);
        request.ack_deadline_ms = 60_000;
        let (mut hung, hung_id) = open(&mut broker.client().await, request.clone()).await;
        let (tx, mut rx) = mpsc::unbounded_channel::<pb::Message>();
        let mut healthy_ids = Vec::new();
        for _ in 0..2 {
            let (mut stream, id) = open(&mut broker.client().await, request.clone()).await;
            healthy_ids.push(id.clone());
            let tx = tx.clone();
            let mut acker = broker.client().await;
            tokio::spawn(async move {
                while let Ok(Some(m)) = stream.message().await {
                    acker
                        .ack(pb::AckRequest {
                            subscription_id: id.clone(),
                            sequences: vec![m.sequence],
                        })
                        .await
                        .unwrap();
                    if tx.send(m).is_err() {
                        break;
                    }
                }
            });
        }
        wait_members(&broker, "hang", 3).await;
        publish_many(&broker, "jobs.x", 60).await;
        // The hung member takes what its max_in_flight allows; the others
        // everything else.
        let mut held = 0;
        while held < 8 {
            hung.message().await.unwrap().unwrap();
            held += 1;
        }
        for _ in 0..52 {
            rx.recv().await.unwrap();
        }
        wait_until("the hung member's record to name its 8 unacked messages", || async {
            let list = broker.subscriptions().await;
            let record = |id: &str| list.iter().find(|s| s.subscription_id == id).cloned().unwrap();
            let hung = record(&hung_id);
            hung.unacked == 8
                && hung.queue_depth == 0
                && hung.oldest_unacked_age.is_some()
                && healthy_ids.iter().all(|id| {
                    let s = record(id);
                    s.unacked == 0 && s.oldest_unacked_age.is_none()
                })
        })
        .await;
        // Its oldest unacked message ages.
        let age = |list: Vec<pb::SubscriptionInfo>| {
            let d = list
                .into_iter()
                .find(|s| s.subscription_id == hung_id)
                .and_then(|s| s.oldest_unacked_age)
                .unwrap();
            Duration::new(d.seconds as u64, d.nanos as u32)
        };
        let first = age(broker.subscriptions().await);
        wait_until("the oldest unacked age to grow", || async {
            age(broker.subscriptions().await) >= first + Duration::from_millis(300)
        })
        .await;
    })
    .await
}

#[tokio::test]
async fn messages_published_while_no_member_is_connected_arrive_when_one_joins() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (first, _) = open(&mut client, member_request(&["orders.*"], "billing", false, 0)).await;
        drop(first);
        wait_members(&broker, "billing", 0).await;
        let mut publisher = broker.client().await;
        let mut sequences = Vec::new();
        for i in 0..5 {
            let r = publisher
                .publish(publish_request("orders.new", &i.to_string()))
                .await
                .unwrap()
                .into_inner();
            assert_eq!((r.matched_subscriptions, r.matched_groups), (0, 1));
            sequences.push(r.sequence);
        }
        assert_eq!(broker.group("billing").await.unwrap().backlog, 5);
        let (mut late, _) = open(&mut client, member_request(&["orders.*"], "billing", false, 0)).await;
        for seq in sequences {
            let m = late.message().await.unwrap().unwrap();
            assert_eq!((m.sequence, m.delivery_attempt), (seq, 1));
        }
    })
    .await
}

#[tokio::test]
async fn unacked_messages_of_a_member_that_goes_away_are_redelivered_with_attempt_2() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut a, _) = open(&mut client, member_request(&["t.*"], "g", true, 10)).await;
        let published = publish_many(&broker, "t.a", 5).await;
        for seq in &published {
            assert_eq!(a.message().await.unwrap().unwrap().sequence, *seq);
        }
        assert_eq!(broker.group("g").await.unwrap().in_flight, 5);
        let (mut b, _) = open(&mut broker.client_on(1).await, member_request(&["t.*"], "g", true, 10)).await;
        drop(a);
        for seq in &published {
            let m = b.message().await.unwrap().unwrap();
            assert_eq!((m.sequence, m.delivery_attempt), (*seq, 2));
        }
        assert_eq!(broker.group("g").await.unwrap().redeliveries, 5);
    })
    .await
}

#[tokio::test]
async fn an_expired_ack_deadline_redelivers() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let mut request = member_request(&["d"], "g", true, 4);
        request.ack_deadline_ms = 200;
        let (mut member, id) = open(&mut client, request).await;
        broker.client().await.publish(publish_request("d", "x")).await.unwrap();
        let first = member.message().await.unwrap().unwrap();
        assert_eq!(first.delivery_attempt, 1);
        let again = member.message().await.unwrap().unwrap();
        assert_eq!((again.sequence, again.delivery_attempt), (first.sequence, 2));
        let r = client
            .ack(pb::AckRequest {
                subscription_id: id,
                sequences: vec![first.sequence],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.acked, r.unknown), (1, 0));
        let g = broker.group("g").await.unwrap();
        assert_eq!((g.in_flight, g.redeliveries), (0, 1));
    })
    .await
}

#[tokio::test]
async fn nack_hands_the_message_to_another_member_and_the_old_ack_is_unknown() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut a, a_id) = open(&mut client, member_request(&["n"], "g", true, 4)).await;
        client.publish(publish_request("n", "x")).await.unwrap();
        let m = a.message().await.unwrap().unwrap();
        let (mut b, b_id) = open(&mut broker.client_on(1).await, member_request(&["n"], "g", true, 4)).await;
        let r = client
            .nack(pb::NackRequest {
                subscription_id: a_id.clone(),
                sequences: vec![m.sequence, 999_999],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.requeued, r.unknown), (1, 1));
        // docs/contract.md, Cluster mode: a Nack redelivers at once to any
        // member (whichever replica pulls it first, possibly the same one),
        // not to another member first.
        let (again, new_holder, old_holder) = if test_engine() == TestEngine::Cluster {
            tokio::select! {
                m = a.message() => (m.unwrap().unwrap(), a_id, b_id),
                m = b.message() => (m.unwrap().unwrap(), b_id, a_id),
            }
        } else {
            (b.message().await.unwrap().unwrap(), b_id, a_id)
        };
        assert_eq!((again.sequence, again.delivery_attempt), (m.sequence, 2));
        assert_eq!(again.subscription_id, new_holder);
        let late = ack(&mut client, &old_holder, &[m.sequence]).await;
        assert_eq!(late, (0, 1), "a late ack from the old holder");
        let ok = ack(&mut client, &new_holder, &[m.sequence]).await;
        assert_eq!(ok, (1, 0), "the new holder is undisturbed");
    })
    .await
}

#[tokio::test]
async fn a_message_is_dead_lettered_after_max_delivery_attempts() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_delivery_attempts: 2,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let mut other = broker.client().await;
        let (mut dlq, _) = subscribe(&mut other, &["_dlq.>"]).await;
        let (mut member, id) = open(&mut client, member_request(&["pay.*"], "payments", true, 4)).await;
        let mut request = publish_request("pay.card", "charge");
        request.headers.insert("k".into(), "v".into());
        let sequence = client.publish(request).await.unwrap().into_inner().sequence;
        for attempt in 1..=2 {
            let m = member.message().await.unwrap().unwrap();
            assert_eq!((m.sequence, m.delivery_attempt), (sequence, attempt));
            let r = other
                .nack(pb::NackRequest {
                    subscription_id: id.clone(),
                    sequences: vec![sequence],
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.requeued, 1);
        }
        let dead = dlq.message().await.unwrap().unwrap();
        assert_eq!(dead.topic, "_dlq.payments");
        assert_eq!(&dead.payload[..], b"charge");
        assert_eq!(dead.headers["tinybroker-original-topic"], "pay.card");
        assert_eq!(dead.headers["tinybroker-delivery-attempts"], "2");
        assert_eq!(dead.headers["k"], "v");
        assert!(dead.sequence > sequence);
        let g = broker.group("payments").await.unwrap();
        assert_eq!((g.dead_lettered, g.in_flight, g.backlog), (1, 0, 0));
    })
    .await
}

/// docs/contract.md, "Dead letters": a dead letter carries the original's
/// headers and the broker's two, and may use a message limit to the full
/// (64 headers; exactly max_message_bytes); one that the broker's two
/// headers take over a limit (65 headers; one byte over max_message_bytes)
/// is neither delivered nor redelivered: it is dropped and counted
/// (`reason="dead_letter_invalid"`), having been counted as dead-lettered,
/// and the next dead letter that fits is the next one out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_over_a_message_limit_is_dropped_and_counted_not_redelivered() {
    const MAX: usize = 2000;
    timeout(async {
        let broker = start_with_limits(Limits {
            max_delivery_attempts: 1,
            max_message_bytes: MAX,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let mut other = broker.client().await;
        let (mut dlq, _) = subscribe(&mut other, &["_dlq.jobs"]).await;
        let (mut member, id) = open(&mut client, member_request(&["jobs.>"], "jobs", true, 1)).await;
        // Publishes `request`, nacks its one delivery (its last attempt),
        // and returns its sequence. The member's next message must be it,
        // at attempt 1: a dead letter given back to the group instead of
        // dropped would come back to the member (max_in_flight 1) first.
        let mut fail_once = async |request: pb::PublishRequest| {
            let sequence = client.publish(request).await.unwrap().into_inner().sequence;
            let m = member.message().await.unwrap().unwrap();
            assert_eq!(
                (m.sequence, m.delivery_attempt),
                (sequence, 1),
                "not the message just published"
            );
            let r = client
                .nack(pb::NackRequest {
                    subscription_id: id.clone(),
                    sequences: vec![sequence],
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.requeued, 1);
            sequence
        };
        let with_headers = |n: usize| {
            let mut r = publish_request("jobs.a", "p");
            r.headers = (0..n).map(|i| (format!("h{i:02}"), "v".to_string())).collect();
            r
        };

        // 62 headers: dead-lettered with 64, the broker's two included.
        let original = with_headers(62);
        fail_once(original.clone()).await;
        let dead = dlq.message().await.unwrap().unwrap();
        assert_eq!(dead.headers.len(), 64);
        assert_eq!(dead.headers["tinybroker-original-topic"], "jobs.a");
        assert_eq!(dead.headers["tinybroker-delivery-attempts"], "1");
        assert!(original.headers.iter().all(|(k, v)| dead.headers.get(k) == Some(v)));
        let added: usize = dead
            .headers
            .iter()
            .filter(|(k, _)| !original.headers.contains_key(*k))
            .map(|(k, v)| k.len() + v.len())
            .sum();
        // The broker's two headers: their names, the topic and "1".
        assert_eq!(
            added,
            "tinybroker-original-topic".len() + "jobs.a".len() + "tinybroker-delivery-attempts".len() + 1
        );
        assert_eq!(broker.dropped_total("dead_letter_invalid").await, 0.0);

        // 63 headers: the letter would have 65; dropped, counted, and the
        // next dead letter is the next one that fits.
        fail_once(with_headers(63)).await;
        let marker = fail_once(publish_request("jobs.a", "marker 1")).await;
        let next = dlq.message().await.unwrap().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&next.payload),
            "marker 1",
            "the 65-header letter must not be delivered"
        );
        assert!(next.sequence > marker);
        assert_eq!(broker.dropped_total("dead_letter_invalid").await, 1.0);

        // Bytes: an original that leaves exactly room for the two headers
        // is dead-lettered at max_message_bytes; one byte more is dropped.
        fail_once(publish_request("jobs.a", &"f".repeat(MAX - added))).await;
        let letter = dlq.message().await.unwrap().unwrap();
        let size = letter.payload.len() + letter.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        assert_eq!(size, MAX, "a dead letter exactly at the limit is delivered");
        fail_once(publish_request("jobs.a", &"o".repeat(MAX - added + 1))).await;
        fail_once(publish_request("jobs.a", "marker 2")).await;
        let next = dlq.message().await.unwrap().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&next.payload),
            "marker 2",
            "the oversized letter must not be delivered"
        );
        assert_eq!(broker.dropped_total("dead_letter_invalid").await, 2.0);
        // Six dead-lettered, the two dropped among them.
        wait_until("the group to have dead-lettered 6 and hold nothing", || async {
            broker
                .group("jobs")
                .await
                .is_some_and(|g| (g.dead_lettered, g.in_flight, g.backlog) == (6, 0, 0))
        })
        .await;
    })
    .await
}

/// The backlog's byte bound: 20 messages of 1,000 bytes into 4 KiB keep the
/// newest that fit; every other one is dropped and counted, and the member
/// that comes back gets exactly the ones kept, the newest.
#[tokio::test]
async fn a_backlog_full_of_bytes_drops_the_oldest_and_counts_them() {
    timeout(async {
        let broker = start_with_limits(Limits {
            group_max_bytes: 4096,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let (first, _) = open(&mut client, member_request(&["b"], "g", false, 0)).await;
        drop(first);
        wait_members(&broker, "g", 0).await;
        let payload = "x".repeat(1000);
        let requests: Vec<_> = (0..20).map(|_| publish_request("b", &payload)).collect();
        let r = client
            .publish_stream(futures::stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.accepted, 20);
        let g = broker.group("g").await.unwrap();
        assert!((1..=4).contains(&g.backlog), "{g:?}");
        assert_eq!(g.backlog as u64 + g.dropped, 20, "kept or counted: {g:?}");
        assert_eq!(broker.dropped_total("group_overflow").await, g.dropped as f64);
        let (mut member, _) = open(&mut client, member_request(&["b"], "g", false, 0)).await;
        let kept = r.last_sequence + 1 - g.backlog as u64..=r.last_sequence;
        for seq in kept {
            assert_eq!(member.message().await.unwrap().unwrap().sequence, seq);
        }
    })
    .await
}

#[tokio::test]
async fn a_full_backlog_drops_the_oldest_and_counts_it() {
    timeout(async {
        let broker = start_with_limits(Limits {
            group_capacity: 3,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let (first, _) = open(&mut client, member_request(&["o"], "g", false, 0)).await;
        drop(first);
        wait_members(&broker, "g", 0).await;
        let published = publish_many(&broker, "o", 5).await;
        let g = broker.group("g").await.unwrap();
        assert_eq!((g.backlog, g.dropped), (3, 2));
        assert_eq!(
            broker.dropped_total("group_overflow").await,
            2.0,
            "tinybroker_messages_dropped_total{{reason=\"group_overflow\"}}"
        );
        let (mut member, _) = open(&mut client, member_request(&["o"], "g", false, 0)).await;
        for seq in &published[2..] {
            assert_eq!(member.message().await.unwrap().unwrap().sequence, *seq);
        }
    })
    .await
}

#[tokio::test]
async fn an_idle_group_is_removed_after_its_ttl() {
    timeout(async {
        let broker = start_with(Config {
            limits: Limits {
                group_idle_ttl: Duration::from_millis(300),
                ..Limits::default()
            },
            ..config()
        })
        .await;
        let mut client = broker.client().await;
        let (member, _) = open(&mut client, member_request(&["i"], "idle", false, 0)).await;
        client.publish(publish_request("i", "x")).await.unwrap();
        drop(member);
        wait_until("the idle group to be removed", || async {
            broker.group("idle").await.is_none()
        })
        .await;
        let r = client.publish(publish_request("i", "y")).await.unwrap().into_inner();
        assert_eq!(r.matched_groups, 0);
        // The name can be used again, even with other patterns and the
        // other ack mode (and from the other replica in cluster mode):
        // the new first member fixes them anew.
        let mut client = broker.client().await;
        let (mut again, again_id) = open(&mut client, member_request(&["other"], "idle", true, 0)).await;
        let err = try_open(&mut client, member_request(&["other"], "idle", false, 0))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
        assert!(
            err.message().contains("opened with ack_mode ACK_MODE_MANUAL"),
            "{}",
            err.message()
        );
        let sequence = client
            .publish(publish_request("other", "z"))
            .await
            .unwrap()
            .into_inner()
            .sequence;
        assert_eq!(again.message().await.unwrap().unwrap().sequence, sequence);
        assert_eq!(ack(&mut client, &again_id, &[sequence]).await, (1, 0));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_must_share_the_groups_ack_mode() {
    timeout(async {
        let broker = start().await;
        for (first_manual, group) in [(false, "auto-first"), (true, "manual-first")] {
            let (fixed, other) = match first_manual {
                false => ("ACK_MODE_AUTO", "ACK_MODE_MANUAL"),
                true => ("ACK_MODE_MANUAL", "ACK_MODE_AUTO"),
            };
            let topic = format!("{group}.job");
            let pattern = format!("{group}.*");
            let mut client = broker.client().await;
            let (mut first, first_id) = open(&mut client, member_request(&[&pattern], group, first_manual, 0)).await;
            // Another connection (in cluster mode, possibly another replica).
            let mut client = broker.client().await;
            let err = try_open(&mut client, member_request(&[&pattern], group, !first_manual, 0))
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
            assert!(
                err.message().contains(&format!(
                    "consumer group {group:?} was opened with ack_mode {fixed}; this member asked for {other}"
                )),
                "{}",
                err.message()
            );
            // The refused member changed nothing: the first still
            // receives (and acks, when MANUAL).
            let sequence = client
                .publish(publish_request(&topic, "x"))
                .await
                .unwrap()
                .into_inner()
                .sequence;
            assert_eq!(first.message().await.unwrap().unwrap().sequence, sequence);
            if first_manual {
                assert_eq!(ack(&mut client, &first_id, &[sequence]).await, (1, 0));
            }
            // UNSPECIFIED is AUTO: admitted to the AUTO group only.
            let mut unspecified = member_request(&[&pattern], group, false, 0);
            unspecified.ack_mode = pb::AckMode::Unspecified as i32;
            let _unspecified = match try_open(&mut client, unspecified).await {
                Ok(stream) => {
                    assert!(!first_manual, "an UNSPECIFIED member joined the MANUAL group");
                    Some(stream)
                }
                Err(err) => {
                    assert!(first_manual, "{}", err.message());
                    assert_eq!(err.code(), Code::FailedPrecondition);
                    assert!(
                        err.message().contains("this member asked for ACK_MODE_AUTO"),
                        "{}",
                        err.message()
                    );
                    None
                }
            };
            // A member with the group's own mode joins.
            let _same = open(&mut client, member_request(&[&pattern], group, first_manual, 0)).await;
            wait_members(&broker, group, if first_manual { 2 } else { 3 }).await;
        }
    })
    .await
}

#[tokio::test]
async fn members_must_share_the_groups_patterns() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let _first = open(&mut client, member_request(&["a.*", "b.>"], "g", false, 0)).await;
        let mut client = broker.client().await;
        // The same set in another order (and with a repeat) is the same set.
        let _second = open(&mut client, member_request(&["b.>", "a.*", "a.*"], "g", false, 0)).await;
        let err = try_open(&mut client, member_request(&["a.*"], "g", false, 0))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(err.message().contains("[a.*, b.>]"), "{}", err.message());
        assert!(err.message().contains("[a.*]"), "{}", err.message());
        for bad in ["", "has space", "a.*", "x>"] {
            let err = try_open(&mut client, member_request(&["a.*"], bad, false, 0))
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "group {bad:?}");
        }
        let mut bad_ack_mode = member_request(&["a.*"], "h", false, 0);
        bad_ack_mode.ack_mode = 7;
        let err = try_open(&mut client, bad_ack_mode).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("ack_mode 7"), "{}", err.message());
    })
    .await
}

#[tokio::test]
async fn ack_and_nack_errors() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let err = client
            .ack(pb::AckRequest {
                subscription_id: "nobody".into(),
                sequences: vec![1],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert!(err.message().contains("nobody"), "{}", err.message());
        let err = client
            .nack(pb::NackRequest {
                subscription_id: "nobody".into(),
                sequences: vec![1],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        let err = client
            .ack(pb::AckRequest {
                subscription_id: String::new(),
                sequences: vec![1],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let (_member, id) = open(&mut client, member_request(&["a"], "g", true, 0)).await;
        let mut client = broker.client().await;
        let err = client
            .ack(pb::AckRequest {
                subscription_id: id.clone(),
                sequences: vec![],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let r = client
            .ack(pb::AckRequest {
                subscription_id: id,
                sequences: vec![5, 6],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.acked, r.unknown), (0, 2));
    })
    .await
}

#[tokio::test]
async fn broadcast_subscribers_and_several_groups_each_get_a_copy() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut watcher, _) = subscribe(&mut client, &["evt.>"]).await;
        let mut members = HashMap::new();
        for group in ["audit", "mailer"] {
            members.insert(
                group,
                open(&mut client, member_request(&["evt.*"], group, false, 0)).await.0,
            );
        }
        let r = broker
            .client()
            .await
            .publish(publish_request("evt.signup", "u1"))
            .await
            .unwrap()
            .into_inner();
        if test_engine() == TestEngine::Cluster {
            // docs/contract.md, Cluster mode: `matched_subscriptions` counts
            // the publishing replica's matches; the watcher is on the other.
            assert_eq!((r.matched_subscriptions, r.matched_groups), (0, 2));
        } else {
            assert_eq!((r.matched_subscriptions, r.matched_groups), (1, 2));
        }
        assert_eq!(watcher.message().await.unwrap().unwrap().sequence, r.sequence);
        for (group, stream) in &mut members {
            let m = stream.message().await.unwrap().unwrap();
            assert_eq!((m.sequence, m.consumer_group.as_str()), (r.sequence, *group));
        }
    })
    .await
}

/// docs/contract.md, "Sessions", credit and groups: a member's room is the
/// smaller of what `max_in_flight` leaves and its session credit. A member
/// with credit 5 and `max_in_flight` 32 that does not ack is handed exactly
/// 5 of 40 messages, the other member (no credit limit) the other 35 at
/// once; once the first member's session adds credit, the group hands it
/// what waits. Through sessions whatever `TB_TRANSPORT` says, MANUAL and
/// AUTO.
async fn a_member_is_handed_no_more_than_its_session_credit(manual: bool) {
    use crate::common::session::TestSession;
    const PUBLISHED: usize = 40;
    const CREDIT: usize = 5;
    let group = if manual { "credit-manual" } else { "credit-auto" };
    let topic = format!("{group}.job");
    let pattern = format!("{group}.*");
    let broker = start().await;
    let mut short = TestSession::start(&mut broker.client().await).await;
    let mut plenty = TestSession::start(&mut broker.client().await).await;
    short
        .open_and_wait(1, member_request(&[&pattern], group, manual, 32), CREDIT as u32)
        .await;
    plenty
        .open_and_wait(2, member_request(&[&pattern], group, manual, 64), 0)
        .await;
    wait_members(&broker, group, 2).await;

    let published = publish_many(&broker, &topic, PUBLISHED).await;
    let mut to_plenty = Vec::new();
    while to_plenty.len() < PUBLISHED - CREDIT {
        let d = tokio::time::timeout(Duration::from_secs(10), plenty.delivery())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the member with credit to spare got {} of the {} messages the other cannot be sent: some wait in the other's queue",
                    to_plenty.len(),
                    PUBLISHED - CREDIT
                )
            });
        assert_eq!(d.handles, [2]);
        to_plenty.push(d.message.unwrap().sequence);
    }
    let mut to_short = Vec::new();
    while to_short.len() < CREDIT {
        let d = short.delivery().await;
        assert_eq!(d.handles, [1]);
        to_short.push(d.message.unwrap().sequence);
    }
    // Every message is accounted for: none more can be on its way to either.
    let mut all: Vec<u64> = to_plenty.iter().chain(&to_short).copied().collect();
    all.sort_unstable();
    assert_eq!(all, published);

    // The member with credit to spare leaves, having acked what it held;
    // what is published next waits for the other, which has no credit.
    if manual {
        plenty.ack(2, &to_plenty);
        wait_until("the acks of the member with credit to spare", || async {
            broker.group(group).await.is_some_and(|g| g.in_flight == CREDIT as u64)
        })
        .await;
    }
    plenty.close(2);
    assert_eq!(plenty.ended().await.reason, "closed");
    wait_members(&broker, group, 1).await;
    let later = publish_many(&broker, &topic, 10).await;
    short.credit(1, 10);
    let mut more = Vec::new();
    while more.len() < later.len() {
        let d = tokio::time::timeout(Duration::from_secs(10), short.delivery())
            .await
            .expect("credit added: the group hands the member what waits");
        assert_eq!(d.handles, [1]);
        more.push(d.message.unwrap().sequence);
    }
    more.sort_unstable();
    assert_eq!(more, later);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_member_is_handed_no_more_than_its_session_credit() {
    timeout(a_member_is_handed_no_more_than_its_session_credit(true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_member_is_handed_no_more_than_its_session_credit() {
    timeout(a_member_is_handed_no_more_than_its_session_credit(false)).await;
}
