//! Sessions (docs/contract.md, "Sessions"): many subscriptions on one
//! stream, credit per subscription, acks in-band, every `ended` reason, bad
//! input answered per handle, the per-session limit and the metrics. Run on
//! the engine `TB_ENGINE` picks, like the contract suite; the session is on
//! replica `a` (`client_on(0)`), whose metrics the tests read.

mod common;

use common::session::TestSession;
use common::*;
use std::collections::HashSet;
use std::time::Duration;
use tinybroker::config::Limits;
use tinybroker::pb;
use tinybroker::pb::session_event::Event;
use tonic::Code;

async fn metric(broker: &TestBroker, name: &str, label: Option<&str>) -> f64 {
    let (_, text) = broker.http_get("/metrics").await;
    match label {
        Some(label) => process::metric_with_label(&text, name, label).unwrap_or(0.0),
        None => process::metric_sum(&text, name),
    }
}

/// Publishes one message; its sequence.
async fn publish_seq(
    publisher: &mut pb::broker_client::BrokerClient<tonic::transport::Channel>,
    topic: &str,
    payload: &str,
) -> u64 {
    let response = publisher.publish(publish_request(topic, payload)).await.unwrap();
    response.into_inner().sequence
}

async fn ignored(broker: &TestBroker, reason: &str) -> f64 {
    metric(
        broker,
        "tinybroker_session_requests_ignored_total",
        Some(&format!("reason=\"{reason}\"")),
    )
    .await
}

#[tokio::test]
async fn one_session_carries_many_subscriptions_and_a_shared_message_comes_once() {
    timeout(async {
        let broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let mut ids = Vec::new();
        for handle in 1..=50u32 {
            ids.push(session.open_and_wait(handle, subscribe_request(&["news.>"]), 0).await);
        }
        let distinct: HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), 50, "each subscription has an id of its own");
        let listed = broker.subscriptions().await;
        assert!(ids.iter().all(|id| listed.iter().any(|s| &s.subscription_id == id)));
        // A subscription of its own pattern on the same session.
        let sports = session.open_and_wait(51, subscribe_request(&["sports.*"]), 0).await;

        let mut publisher = broker.client().await;
        let first = publisher
            .publish(publish_request("news.eu", "a"))
            .await
            .unwrap()
            .into_inner();
        let second = publisher
            .publish(publish_request("sports.golf", "b"))
            .await
            .unwrap()
            .into_inner();

        // The 50 handles of news.> get the message once, all named; the
        // delivery of several handles carries no subscription id.
        let mut named = Vec::new();
        let mut deliveries = 0;
        while named.len() < 50 {
            let d = session.delivery().await;
            deliveries += 1;
            let m = d.message.unwrap();
            assert_eq!(m.sequence, first.sequence);
            assert_eq!(&m.payload[..], b"a");
            if d.handles.len() > 1 {
                assert_eq!(m.subscription_id, "", "several handles: no id");
            }
            named.extend(d.handles);
        }
        named.sort_unstable();
        assert_eq!(named, (1..=50).collect::<Vec<_>>(), "each handle once");
        // Usually one delivery names all 50; the session's task may start
        // on the first wake-ups while the publish still queues the rest.
        assert!(deliveries < 50, "one message for 50 handles came {deliveries} times");
        let d = session.delivery().await;
        assert_eq!(d.handles, vec![51]);
        let m = d.message.unwrap();
        assert_eq!(
            (m.sequence, m.subscription_id.as_str()),
            (second.sequence, sports.as_str())
        );
        assert_eq!(metric(&broker, "tinybroker_sessions", None).await, 1.0);
    })
    .await
}

#[tokio::test]
async fn the_broker_answers_with_headers_before_any_open() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client_on(0).await;
        // `start` returns once the response headers arrived: nothing was sent.
        let session = TestSession::start(&mut client).await;
        wait_until("the session to be counted", || async {
            metric(&broker, "tinybroker_sessions", None).await == 1.0
        })
        .await;
        drop(session);
        wait_until("the session to be gone from tinybroker_sessions", || async {
            metric(&broker, "tinybroker_sessions", None).await == 0.0
        })
        .await;
    })
    .await
}

#[tokio::test]
async fn per_subscription_order_holds_when_handles_share_deliveries() {
    timeout(async {
        let broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        session.open_and_wait(1, subscribe_request(&["o.>"]), 0).await;
        session.open_and_wait(2, subscribe_request(&["o.even"]), 0).await;
        let mut publisher = broker.client().await;
        let mut sequences = Vec::new();
        for i in 0..200 {
            let topic = if i % 2 == 0 { "o.even" } else { "o.odd" };
            let r = publisher.publish(publish_request(topic, &i.to_string())).await.unwrap();
            sequences.push((topic, r.into_inner().sequence));
        }
        let (mut one, mut two) = (Vec::new(), Vec::new());
        while one.len() < 200 || two.len() < 100 {
            let d = session.delivery().await;
            let sequence = d.message.unwrap().sequence;
            let handles: HashSet<u32> = d.handles.iter().copied().collect();
            assert_eq!(handles.len(), d.handles.len(), "no handle twice in a delivery");
            if handles.contains(&1) {
                one.push(sequence);
            }
            if handles.contains(&2) {
                two.push(sequence);
            }
        }
        let all: Vec<u64> = sequences.iter().map(|(_, s)| *s).collect();
        let even: Vec<u64> = sequences
            .iter()
            .filter(|(t, _)| *t == "o.even")
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(one, all);
        assert_eq!(two, even);
    })
    .await
}

#[tokio::test]
async fn credit_limits_each_subscription_and_a_stalled_one_is_evicted_alone() {
    timeout(async {
        let broker = start_with_limits(Limits {
            consumer_capacity: 16,
            ..Limits::default()
        })
        .await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let stalled = session.open_and_wait(1, subscribe_request(&["c.>"]), 3).await;
        session.open_and_wait(2, subscribe_request(&["c.>"]), 0).await;
        let mut publisher = broker.client().await;
        let mut sequences = Vec::new();
        for i in 0..3 {
            sequences.push(publish_seq(&mut publisher, "c.x", &i.to_string()).await);
        }
        // Both get the first three (credit 3).
        let mut got = [Vec::new(), Vec::new()];
        while got[0].len() < 3 || got[1].len() < 3 {
            let d = session.delivery().await;
            for h in d.handles {
                got[h as usize - 1].push(d.message.as_ref().unwrap().sequence);
            }
        }
        assert_eq!(got[0], sequences);
        // Handle 1 has no credit left: the next 10 reach handle 2 only,
        // and wait in handle 1's queue.
        for i in 0..10 {
            sequences.push(publish_seq(&mut publisher, "c.x", &i.to_string()).await);
        }
        for expected in &sequences[3..] {
            let d = session.delivery().await;
            assert_eq!(d.handles, vec![2], "handle 1 is out of credit");
            assert_eq!(d.message.unwrap().sequence, *expected);
        }
        wait_until("handle 1's queue to hold the 10", || async {
            listed(broker.subscriptions().await, &stalled).is_some_and(|s| s.queue_depth == 10)
        })
        .await;
        // Two more credits: the two oldest of its queue.
        session.credit(1, 2);
        for expected in &sequences[3..5] {
            let d = session.delivery().await;
            assert_eq!(d.handles, vec![1]);
            assert_eq!(d.message.unwrap().sequence, *expected);
        }
        // Its queue (16) overflows: evicted alone, while handle 2 gets all.
        let before = sequences.len();
        for i in 0..20 {
            sequences.push(publish_seq(&mut publisher, "c.x", &i.to_string()).await);
        }
        let mut to_two = Vec::new();
        let mut ended = None;
        while to_two.len() < 20 || ended.is_none() {
            match session.event().await {
                Event::Delivery(d) => {
                    assert_eq!(d.handles, vec![2]);
                    to_two.push(d.message.unwrap().sequence);
                }
                Event::Ended(e) => ended = Some(e),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(to_two, sequences[before..]);
        let ended = ended.unwrap();
        assert_eq!((ended.handle, ended.reason.as_str(), ended.code), (1, "evicted", 0));
        // It held 8 (10 - 2), took 8 more to its capacity of 16, and lost
        // those 16 plus the one that did not fit.
        assert_eq!(ended.dropped, 17);
        assert_eq!(ended.last_sequence, sequences[4]);
        assert!(listed(broker.subscriptions().await, &stalled).is_none());
        // Handle 1 is free again; handle 2 still works.
        session.open_and_wait(1, subscribe_request(&["c.>"]), 0).await;
        let last = publish_seq(&mut publisher, "c.x", "z").await;
        let d = session.delivery().await;
        assert_eq!(d.message.unwrap().sequence, last);
        let mut handles = d.handles;
        handles.sort_unstable();
        assert_eq!(handles, vec![1, 2]);
    })
    .await
}

#[tokio::test]
async fn close_ends_one_subscription_and_says_what_it_dropped() {
    timeout(async {
        let broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let closed = session.open_and_wait(1, subscribe_request(&["k.>"]), 1).await;
        session.open_and_wait(2, subscribe_request(&["k.>"]), 0).await;
        let mut publisher = broker.client().await;
        let mut sequences = Vec::new();
        for i in 0..5 {
            sequences.push(publish_seq(&mut publisher, "k.v", &i.to_string()).await);
        }
        let mut two = 0;
        while two < 5 {
            let d = session.delivery().await;
            two += usize::from(d.handles.contains(&2));
        }
        wait_until("handle 1 to hold 4 (credit 1)", || async {
            listed(broker.subscriptions().await, &closed).is_some_and(|s| s.queue_depth == 4)
        })
        .await;
        let dropped_before = broker.dropped_total("closed").await;
        session.close(1);
        let e = session.ended().await;
        assert_eq!((e.handle, e.reason.as_str(), e.dropped), (1, "closed", 4));
        assert_eq!(e.last_sequence, sequences[0]);
        assert_eq!(broker.dropped_total("closed").await - dropped_before, 4.0);
        assert!(listed(broker.subscriptions().await, &closed).is_none());
        // Nothing comes for handle 1 after it: the next is handle 2's alone.
        let next = publish_seq(&mut publisher, "k.v", "n").await;
        let d = session.delivery().await;
        assert_eq!((d.handles, d.message.unwrap().sequence), (vec![2], next));
    })
    .await
}

fn rejected(e: pb::SessionEnded, handle: u32, code: Code, text: &str) {
    assert_eq!((e.handle, e.reason.as_str()), (handle, "rejected"), "{e:?}");
    assert_eq!(e.code, code as u32, "{e:?}");
    assert!(e.message.contains(text), "{:?} should name {text:?}", e.message);
}

#[tokio::test]
async fn bad_opens_are_rejected_per_handle_and_the_session_goes_on() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_subscriptions_per_session: 3,
            ..Limits::default()
        })
        .await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        session.open_and_wait(1, subscribe_request(&["ok.>"]), 0).await;

        let mut check: Vec<(u32, Code, String)> = Vec::new();
        session.open(0, subscribe_request(&["ok.>"]), 0);
        check.push((0, Code::InvalidArgument, "handle 0".to_string()));
        session.open(1, subscribe_request(&["other"]), 0);
        check.push((1, Code::AlreadyExists, "handle 1".to_string()));
        session.open(7, subscribe_request(&["a..b"]), 0);
        check.push((7, Code::InvalidArgument, "\"a..b\"".to_string()));
        session.open(8, pb::OpenSubscriptionRequest::default(), 0);
        check.push((8, Code::InvalidArgument, "topic_patterns is empty".to_string()));
        let mut bad_mode = subscribe_request(&["x"]);
        bad_mode.mode = 9;
        session.open(9, bad_mode, 0);
        check.push((9, Code::InvalidArgument, "mode 9".to_string()));
        let mut taken = subscribe_request(&["x"]);
        taken.subscription_id = session_id_of(&broker).await;
        session.open(10, taken.clone(), 0);
        check.push((10, Code::AlreadyExists, taken.subscription_id.clone()));
        let mut events = Vec::new();
        for _ in 0..check.len() {
            events.push(session.ended().await);
        }
        for (e, (handle, code, text)) in events.into_iter().zip(check.iter()) {
            rejected(e, *handle, *code, text);
        }
        // The limit: 3 per session.
        session.open_and_wait(2, subscribe_request(&["ok.>"]), 0).await;
        session.open_and_wait(3, subscribe_request(&["ok.>"]), 0).await;
        session.open(4, subscribe_request(&["ok.>"]), 0);
        let e = session.ended().await;
        assert_eq!((e.handle, e.code), (4, Code::ResourceExhausted as u32), "{e:?}");
        assert!(
            e.message.contains("TINYBROKER_MAX_SUBSCRIPTIONS_PER_SESSION"),
            "{}",
            e.message
        );

        // Requests naming nothing are ignored and counted.
        let (no_request, unknown) = (
            ignored(&broker, "no_request").await,
            ignored(&broker, "unknown_handle").await,
        );
        session.send_empty();
        session.credit(99, 5);
        session.close(98);
        session.ack(97, &[1]);
        session.nack(96, &[1]);
        wait_until("the ignored requests to be counted", || async {
            ignored(&broker, "no_request").await == no_request + 1.0
                && ignored(&broker, "unknown_handle").await == unknown + 4.0
        })
        .await;

        // Handle 1 (the first open, untouched by the duplicate) still works.
        let seq = publish_seq(&mut broker.client().await, "ok.go", "1").await;
        let d = session.delivery().await;
        assert_eq!(d.message.unwrap().sequence, seq);
        let mut handles = d.handles;
        handles.sort_unstable();
        assert_eq!(handles, vec![1, 2, 3]);
    })
    .await
}

/// An id in use on the broker (opened on a stream of its own).
async fn session_id_of(broker: &TestBroker) -> String {
    let (stream, id) = subscribe(&mut broker.client_on(0).await, &["held"]).await;
    std::mem::forget(stream);
    id
}

#[tokio::test]
async fn in_band_ack_and_nack_work_for_a_group_member() {
    timeout(async {
        let broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let member = member_request(&["jobs.>"], "workers", true, 10);
        let id = session.open_and_wait(1, member, 0).await;
        let sequences = publish_many(&broker, "jobs.a", 3).await;
        let mut held = Vec::new();
        while held.len() < 3 {
            let d = session.delivery().await;
            assert_eq!(d.handles, vec![1], "a group delivery names one handle");
            let m = d.message.unwrap();
            assert_eq!(
                (m.subscription_id.as_str(), m.consumer_group.as_str()),
                (id.as_str(), "workers")
            );
            held.push(m.sequence);
        }
        assert_eq!(held, sequences);
        // Ack the first, nack the second: it comes back, attempt 2.
        session.ack(1, &sequences[..1]);
        session.nack(1, &sequences[1..2]);
        let d = session.delivery().await;
        let m = d.message.unwrap();
        assert_eq!((m.sequence, m.delivery_attempt), (sequences[1], 2));
        // Sequences it does not hold are ignored and counted.
        let unknown = ignored(&broker, "unknown_sequence").await;
        session.ack(1, &[sequences[0], 999_999]);
        wait_until("the unknown sequences to be counted", || async {
            ignored(&broker, "unknown_sequence").await == unknown + 2.0
        })
        .await;
        // The unary Ack by id still works for a session's subscription.
        let (acked, _) = ack(&mut broker.client_on(0).await, &id, &sequences[1..]).await;
        assert_eq!(acked, 2);
        wait_until("the group to hold nothing", || async {
            broker
                .group("workers")
                .await
                .is_some_and(|g| g.in_flight == 0 && g.backlog == 0)
        })
        .await;
    })
    .await
}

#[tokio::test]
async fn half_close_ends_every_subscription_closed_then_the_session_with_ok() {
    timeout(async {
        let broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let a = session.open_and_wait(1, subscribe_request(&["h.>"]), 0).await;
        let b = session
            .open_and_wait(2, member_request(&["h.>"], "g", true, 4), 0)
            .await;
        let sequences = publish_many(&broker, "h.x", 2).await;
        // Handle 1's two deliveries and the group's two to handle 2.
        let mut seen = 0;
        while seen < 4 {
            seen += session.delivery().await.handles.len();
        }
        session.half_close();
        let mut ended = Vec::new();
        while let Some(event) = session.next().await {
            match event {
                Event::Ended(e) => ended.push((e.handle, e.reason, e.last_sequence)),
                other => panic!("unexpected {other:?}"),
            }
        }
        ended.sort();
        assert_eq!(
            ended,
            vec![
                (1, "closed".to_string(), sequences[1]),
                (2, "closed".to_string(), sequences[1])
            ]
        );
        let listed = broker.subscriptions().await;
        assert!(!listed.iter().any(|s| s.subscription_id == a || s.subscription_id == b));
        // The member's unacked messages went back to the group: the next
        // member gets them again.
        let (mut next, _) = open(&mut broker.client().await, member_request(&["h.>"], "g", true, 4)).await;
        for sequence in &sequences {
            let m = next.message().await.unwrap().unwrap();
            assert_eq!((m.sequence, m.delivery_attempt), (*sequence, 2));
        }
    })
    .await
}

#[tokio::test]
async fn admin_close_and_shutdown_end_handles_with_their_reason() {
    timeout(async {
        let mut broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let by_admin = session.open_and_wait(1, subscribe_request(&["s.>"]), 0).await;
        session.open_and_wait(2, subscribe_request(&["s.>"]), 0).await;
        let mut admin = broker.admin().await;
        admin
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: by_admin,
            })
            .await
            .unwrap();
        let e = session.ended().await;
        assert_eq!((e.handle, e.reason.as_str()), (1, "closed_by_admin"));
        broker.trigger_shutdown();
        let e = session.ended().await;
        assert_eq!((e.handle, e.reason.as_str()), (2, "shutdown"));
        assert!(session.next().await.is_none(), "then the session ends with OK");
        broker.join().await;
    })
    .await
}

#[tokio::test]
async fn cancelling_the_session_closes_its_subscriptions_and_redelivers_a_members_messages() {
    timeout(async {
        let broker = start().await;
        let mut session = TestSession::start(&mut broker.client_on(0).await).await;
        let a = session.open_and_wait(1, subscribe_request(&["z.>"]), 0).await;
        session
            .open_and_wait(2, member_request(&["z.>"], "zg", true, 4), 0)
            .await;
        let sequences = publish_many(&broker, "z.x", 1).await;
        let mut seen = 0;
        while seen < 2 {
            seen += session.delivery().await.handles.len();
        }
        drop(session);
        wait_until("the subscriptions to be gone", || async {
            !broker.subscriptions().await.iter().any(|s| s.subscription_id == a)
        })
        .await;
        let (mut other, _) = open(&mut broker.client().await, member_request(&["z.>"], "zg", true, 4)).await;
        let m = other.message().await.unwrap().unwrap();
        assert_eq!((m.sequence, m.delivery_attempt), (sequences[0], 2));
    })
    .await
}

#[tokio::test]
async fn a_session_that_is_not_read_loses_each_subscription_to_eviction() {
    timeout(async {
        let broker = start_with_limits(Limits {
            consumer_capacity: 64,
            ..Limits::default()
        })
        .await;
        // A narrow HTTP/2 window, so the stalled session's stream fills
        // fast (replica a's: its metrics are read).
        let channel = tonic::transport::Endpoint::from_shared(broker.url())
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap();
        let mut client = pb::broker_client::BrokerClient::new(channel);
        let mut session = TestSession::start(&mut client).await;
        for handle in 1..=20u32 {
            session.open_and_wait(handle, subscribe_request(&["flood.>"]), 0).await;
        }
        let evictions = metric(&broker, "tinybroker_evictions_total", None).await;
        // Nobody reads the session: publish until every queue overflowed.
        let mut publisher = broker.client().await;
        let payload = "x".repeat(1024);
        let mut published = 0;
        while metric(&broker, "tinybroker_evictions_total", None).await < evictions + 20.0 {
            for _ in 0..64 {
                publisher.publish(publish_request("flood.x", &payload)).await.unwrap();
            }
            published += 64;
            assert!(
                published < 100_000,
                "the stalled session's subscriptions were never evicted"
            );
        }
        // Reading again: what was in flight, then the 20 ended events.
        let mut ended = HashSet::new();
        while ended.len() < 20 {
            match tokio::time::timeout(Duration::from_secs(10), session.event())
                .await
                .expect("events")
            {
                Event::Ended(e) => {
                    assert_eq!(e.reason, "evicted", "{e:?}");
                    assert!(e.dropped > 0);
                    ended.insert(e.handle);
                }
                Event::Delivery(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(ended.len(), 20);
        // The session itself is still open.
        session.open_and_wait(1, subscribe_request(&["flood.>"]), 0).await;
    })
    .await
}

/// Sends whatever bytes it is given as the session's requests (each one
/// gRPC message), and decodes the events as a client does.
struct RawCodec;

struct RawEncoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = bytes::Bytes;
    type Error = tonic::Status;

    fn encode(&mut self, item: bytes::Bytes, buf: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        buf.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = bytes::Bytes;
    type Decode = pb::SessionEvent;
    type Encoder = RawEncoder;
    type Decoder = tonic_prost::ProstDecoder<pb::SessionEvent>;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

#[tokio::test]
async fn only_a_request_that_cannot_be_decoded_ends_the_session() {
    timeout(async {
        use prost::Message as _;
        let broker = start().await;
        // Another session, which must not notice.
        let mut other = TestSession::start(&mut broker.client_on(0).await).await;
        other.open_and_wait(1, subscribe_request(&["d.>"]), 0).await;

        let channel = tonic::transport::Endpoint::from_shared(broker.url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let open = pb::SessionRequest {
            request: Some(pb::session_request::Request::Open(pb::SessionOpen {
                handle: 1,
                subscription: Some(subscribe_request(&["d.>"])),
                credit: 0,
            })),
        };
        let (requests, receiver) = futures::channel::mpsc::unbounded();
        requests
            .unbounded_send(bytes::Bytes::from(open.encode_to_vec()))
            .unwrap();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static("/tinybroker.v1.Broker/Session");
        let mut events = grpc
            .streaming(tonic::Request::new(receiver), path, RawCodec)
            .await
            .unwrap()
            .into_inner();
        let first = events.message().await.unwrap().unwrap();
        assert!(
            matches!(first.event, Some(Event::Opened(ref o)) if o.handle == 1),
            "{first:?}"
        );
        // Field 1 as a varint where a message is expected, then a length
        // past the end: not a SessionRequest.
        requests
            .unbounded_send(bytes::Bytes::from_static(&[0x08, 0x96, 0x01, 0x0a, 0x7f]))
            .unwrap();
        let status = match events.message().await {
            Ok(Some(event)) => panic!("nothing more before the end: {event:?}"),
            Ok(None) => panic!("the session ended with OK"),
            Err(status) => status,
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("SessionRequest"), "{}", status.message());
        // Its subscription is gone; the other session still delivers.
        wait_until("the failed session's subscription to be removed", || async {
            broker.subscriptions().await.len() == 1
        })
        .await;
        let sequence = publish_seq(&mut broker.client().await, "d.x", "1").await;
        let d = other.delivery().await;
        assert_eq!((d.handles, d.message.unwrap().sequence), (vec![1], sequence));
    })
    .await
}
