//! Tests of the engine as a whole (each part has its own beside it).

use super::*;
use crate::engine::validate;
use crate::engine::{BrokerError, DeliveryMode, NewMessage, SubscribeRequest, message_size};
use bytes::Bytes;

fn member(id: &str, group: &str, pattern: &str) -> SubscribeRequest {
    SubscribeRequest {
        topic_patterns: vec![pattern.into()],
        subscription_id: id.into(),
        mode: DeliveryMode::Single,
        consumer_group: group.into(),
        ..Default::default()
    }
}

/// A broadcast subscription holds what only members need boxed, its peer
/// packed, its opening time in 8 bytes and its queue in place: 208 bytes,
/// 224 with its `Arc`'s counts, in jemalloc's 224-byte class (with the
/// queue in an `Arc` of its own: two allocations of 128).
/// ARCHITECTURE.md, "What an idle subscription holds"; the guard's
/// `idle-session` measures the whole.
#[test]
fn a_subscription_is_208_bytes_with_its_queue() {
    let size = std::mem::size_of::<Subscription>();
    assert!(size <= 208, "{size}");
    assert_eq!(
        std::mem::size_of::<super::QueueSlot>(),
        std::mem::size_of::<crate::engine::queue::Queue>(),
        "the slot's variant fits in the queue's own bytes"
    );
}

/// A subscription's stream, held by its session slot or its response body:
/// its counters in 4 bytes each (32 in all, 40 with a `u64` and an
/// `Option<u32>`).
#[test]
fn a_subscription_stream_is_32_bytes() {
    let size = std::mem::size_of::<SubscriptionStream>();
    assert!(size <= 32, "{size}");
}

/// The packed peer gives back what it was given: IPv4, IPv6 and none.
#[test]
fn a_subscriptions_peer_and_opening_time_read_back_as_given() {
    let broker = Broker::new(Limits::default());
    for peer in [
        None,
        Some("10.1.2.3:4567"),
        Some("[2001:db8::7]:50051"),
        Some("[::ffff:1.2.3.4]:80"),
    ] {
        let peer: Option<std::net::SocketAddr> = peer.map(|p| p.parse().unwrap());
        let before = std::time::SystemTime::now();
        let mut stream = broker
            .subscribe(SubscribeRequest {
                topic_patterns: vec!["t".into()],
                peer,
                ..Default::default()
            })
            .unwrap();
        let info = broker
            .subscriptions(crate::engine::Peaks::Keep)
            .into_iter()
            .find(|s| s.subscription_id == stream.id())
            .unwrap();
        assert_eq!(info.peer, peer);
        assert!(
            info.opened_at >= before - std::time::Duration::from_millis(1)
                && info.opened_at <= std::time::SystemTime::now()
        );
        stream.close();
    }
}

fn message(topic: &str) -> NewMessage {
    NewMessage {
        topic: topic.into(),
        ..Default::default()
    }
}

#[test]
fn an_auto_ack_member_reports_what_it_streamed_when_its_queue_runs_dry() {
    use futures::StreamExt;
    use std::task::{Context, Poll, Waker};
    let broker = Broker::new(Limits::default());
    // max_in_flight 8: streamed messages are reported two at a time.
    let mut stream = broker
        .subscribe(SubscribeRequest {
            max_in_flight: 8,
            ..member("", "g", "t")
        })
        .unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..3 {
        broker.publish(message("t"), None).unwrap();
    }
    for _ in 0..3 {
        assert!(matches!(stream.poll_next_unpin(&mut cx), Poll::Ready(Some(_))));
    }
    // The third is reported when the queue runs dry, not left counted
    // against the member's room.
    assert!(stream.poll_next_unpin(&mut cx).is_pending());
    for _ in 0..8 {
        broker.publish(message("t"), None).unwrap();
    }
    let group = broker.groups().into_iter().next().unwrap();
    assert_eq!(group.backlog, 0, "all 8 fit");
}

/// A stream whose queue never runs dry yields after its turn (so that its
/// connection's other subscriptions and writes get theirs): 128 deliveries,
/// then `Pending` with its waker woken, then the rest, in order.
#[test]
fn a_busy_stream_yields_after_its_turn_and_then_goes_on() {
    use futures::StreamExt;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Context, Poll, Wake, Waker};
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    let broker = Broker::new(Limits::default());
    let mut stream = broker
        .subscribe(SubscribeRequest {
            topic_patterns: vec!["t".into()],
            ..Default::default()
        })
        .unwrap();
    for _ in 0..200 {
        broker.publish(message("t"), None).unwrap();
    }
    let woken = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(woken.clone());
    let mut cx = Context::from_waker(&waker);
    let mut sequences = Vec::new();
    while let Poll::Ready(Some(d)) = stream.poll_next_unpin(&mut cx) {
        sequences.push(d.message.sequence);
    }
    assert_eq!(sequences.len(), 128, "one turn");
    assert_eq!(woken.0.load(Ordering::Relaxed), 1, "it asks to be polled again");
    while let Poll::Ready(Some(d)) = stream.poll_next_unpin(&mut cx) {
        sequences.push(d.message.sequence);
    }
    assert_eq!(sequences.len(), 200, "the rest on the next turn");
    assert!(sequences.windows(2).all(|w| w[0] < w[1]), "in order");
}

#[test]
fn validation_charges_what_message_size_says() {
    let broker = Broker::new(Limits::default());
    let message = NewMessage {
        topic: "a.b".into(),
        payload: Bytes::from_static(b"12345"),
        headers: HashMap::from([("k".into(), "vv".into()), ("kk".into(), "v".into())]),
        ..Default::default()
    };
    let expected = message_size(&message.topic, &message.payload, &message.headers);
    assert_eq!(
        validate::message(&message, broker.limits().max_message_bytes),
        Ok(expected)
    );
}

#[test]
fn the_memory_limit_evicts_a_reader_far_behind_but_never_one_that_keeps_up() {
    let big = |topic: &str| NewMessage {
        topic: topic.into(),
        payload: Bytes::from(vec![0u8; 1 << 20]),
        ..Default::default()
    };
    // 63 MiB for messages (7/8 of the limit).
    let broker = Broker::new(Limits {
        max_memory_bytes: Some(72 << 20),
        ..Limits::default()
    });
    let limit = broker.shared.memory.limit().unwrap();
    let _keeps_up = broker
        .subscribe(SubscribeRequest {
            topic_patterns: vec!["small".into()],
            ..Default::default()
        })
        .unwrap();
    broker.publish(message("small"), None).unwrap();
    let _member = broker.subscribe(member("", "g", "jobs")).unwrap();
    drop(_member);
    // The memberless group fills the budget: the reader holding one small
    // message stays, the publish is refused.
    let mut refused = None;
    for _ in 0..(limit >> 20) + 2 {
        if let Err(e) = broker.publish(big("jobs"), None) {
            refused = Some(e);
            break;
        }
    }
    assert!(
        matches!(refused, Some(BrokerError::ResourceExhausted(_))),
        "{refused:?}"
    );
    assert_eq!(
        broker.stats().evictions.load(Ordering::Relaxed),
        0,
        "the reader that keeps up stays"
    );
    assert_eq!(broker.subscription_count(), 1);
}

#[test]
fn a_refused_member_leaves_no_group_behind() {
    let broker = Broker::new(Limits::default());
    let _a = broker.subscribe(member("same-id", "first", "x")).unwrap();
    let err = broker.subscribe(member("same-id", "second", "x")).err().unwrap();
    assert!(matches!(err, BrokerError::AlreadyExists(_)), "{err}");
    let names: Vec<String> = broker.groups().into_iter().map(|g| g.name).collect();
    assert_eq!(names, ["first"]);
    assert_eq!(broker.publish(message("x"), None).unwrap().matched_groups, 1);
}

#[test]
fn groups_removed_with_messages_are_remembered_bounded() {
    let broker = Broker::new(Limits::default());
    let ttl = broker.limits().group_idle_ttl;
    let now = tokio::time::Instant::now();
    drop(broker.subscribe(member("", "empty", "e")).unwrap());
    drop(broker.subscribe(member("", "full", "f")).unwrap());
    broker.publish(message("f"), None).unwrap();
    broker.publish(message("f"), None).unwrap();
    broker.tick(now + ttl + Duration::from_secs(1));
    assert!(broker.groups().is_empty());
    let removals = broker.group_removals();
    assert_eq!(removals.len(), 1, "only the group that lost messages: {removals:?}");
    assert_eq!((removals[0].consumer_group.as_str(), removals[0].dropped), ("full", 2));
    for i in 0..GROUP_REMOVAL_HISTORY + 5 {
        drop(broker.subscribe(member("", &format!("g{i}"), "f")).unwrap());
    }
    broker.publish(message("f"), None).unwrap();
    broker.tick(tokio::time::Instant::now() + ttl + Duration::from_secs(1));
    let removals = broker.group_removals();
    assert_eq!(removals.len(), GROUP_REMOVAL_HISTORY);
    assert!(removals.iter().all(|r| r.dropped == 1 && r.consumer_group != "full"));
}

#[test]
fn what_is_left_at_shutdown_is_counted_as_discarded() {
    let broker = Broker::new(Limits::default());
    let broadcast = broker
        .subscribe(SubscribeRequest {
            topic_patterns: vec!["t".into()],
            ..Default::default()
        })
        .unwrap();
    let member_stream = broker.subscribe(member("", "g", "t")).unwrap();
    drop(member_stream);
    // A MANUAL member with room for 2 of the 3 published to its group.
    let _holder = broker
        .subscribe(SubscribeRequest {
            ack_mode: crate::engine::AckMode::Manual,
            max_in_flight: 2,
            ..member("", "h", "u")
        })
        .unwrap();
    for _ in 0..3 {
        broker.publish(message("t"), None).unwrap();
        broker.publish(message("u"), None).unwrap();
    }
    assert_eq!(
        broker.queued_total(),
        9,
        "3 queued for the subscriber, 3 + 1 in the group backlogs, 2 queued for the member"
    );
    assert_eq!(broker.drainable(), 6, "the memberless group's backlog cannot drain");
    broker.begin_shutdown();
    assert!(matches!(
        broker.publish(message("t"), None),
        Err(BrokerError::Unavailable(_))
    ));
    // The member's 2 are discarded as in flight, not as its group's backlog.
    assert_eq!(
        broker.close_all(),
        crate::engine::Discarded {
            queued: 3,
            backlog: 4,
            in_flight: 2
        }
    );
    assert_eq!(broker.stats().discarded_on_shutdown.load(Ordering::Relaxed), 9);
    assert_eq!(broker.subscription_count(), 0);
    drop(broadcast);
}
