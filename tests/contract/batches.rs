//! Batches on the session (docs/contract.md, "Batches: many messages per
//! gRPC message"): a `publish` of many messages answered by one `published`
//! (its id echoed, answers in request order, consecutive sequences, bad
//! messages rejected by index with the status `Publish` gives, the batch
//! limit, empty and huge batches), batched deliveries opted into with
//! `tinybroker-batch: 1`, acks in bulk, and the batch metrics.
//!
//! The publishing session is on replica `a` (`client_on(0)`), whose metrics
//! the tests read; subscribers are on the other replica in cluster mode
//! (`client_on(1)`), and a test's reference subscriber opens on the
//! transport `TB_TRANSPORT` picks.

use crate::common::session::TestSession;
use crate::common::*;
use crate::transport::{Sub, open, subscribe};
use prost::Message as _;
use std::collections::{HashMap, HashSet, VecDeque};
use tinybroker::config::Limits;
use tinybroker::pb;
use tinybroker::pb::session_event::Event;
use tonic::Code;

/// The most bytes of deliveries one `deliveries` event holds, unless it
/// holds one delivery (docs/contract.md: "up to a byte bound"; 64 KiB).
const DELIVERIES_BOUND: usize = 64 * 1024;

fn message(topic: &str, payload: &str) -> pb::PublishRequest {
    publish_request(topic, payload)
}

/// `n` messages to `topic`, payloads `<prefix>0`, `<prefix>1`, ...
fn messages(topic: &str, prefix: &str, n: usize) -> Vec<pb::PublishRequest> {
    (0..n).map(|i| message(topic, &format!("{prefix}{i}"))).collect()
}

/// A metric on replica `a` (summed over its series).
async fn metric(broker: &TestBroker, name: &str) -> f64 {
    let (_, text) = broker.http_get("/metrics").await;
    process::metric_sum(&text, name)
}

/// A metric summed over every replica (each counts what it did).
async fn metric_everywhere(broker: &TestBroker, name: &str) -> f64 {
    let mut total = 0.0;
    for i in 0..broker.replica_count() {
        let (_, text) = broker.replica(i).http_get("/metrics").await;
        total += process::metric_sum(&text, name);
    }
    total
}

async fn ignored_unknown_sequence(broker: &TestBroker) -> f64 {
    let (_, text) = broker.http_get("/metrics").await;
    process::metric_with_label(
        &text,
        "tinybroker_session_requests_ignored_total",
        "reason=\"unknown_sequence\"",
    )
    .unwrap_or(0.0)
}

/// Reads `n` messages from `sub`: (payload, sequence) each.
async fn receive(sub: &mut Sub, n: usize) -> Vec<(String, u64)> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let m = sub
            .message()
            .await
            .unwrap_or_else(|e| panic!("after {} messages: {e}", got.len()))
            .unwrap_or_else(|| panic!("the subscription ended after {} messages", got.len()));
        got.push((String::from_utf8(m.payload.to_vec()).unwrap(), m.sequence));
    }
    got
}

/// A session's events sorted as they come: the deliveries (those of a
/// `deliveries` event one by one), the `published` answers, and the rest,
/// each with its place in the stream; checks every `deliveries` event
/// against the byte bound, and that a session gets only the kind of
/// delivery event it asked for.
struct Events {
    session: TestSession,
    batched: bool,
    arrived: u64,
    deliveries: VecDeque<(u64, pb::SessionDelivery)>,
    published: VecDeque<pb::SessionPublished>,
    other: VecDeque<(u64, Event)>,
    /// `deliveries` events read, and the deliveries in them.
    delivery_events: u64,
    batched_deliveries: u64,
    /// Deliveries of more than one handle.
    shared: u64,
}

impl Events {
    async fn start(client: &mut pb::broker_client::BrokerClient<tonic::transport::Channel>, batched: bool) -> Self {
        let session = match batched {
            true => TestSession::start_batched(client).await,
            false => TestSession::start(client).await,
        };
        Self {
            session,
            batched,
            arrived: 0,
            deliveries: VecDeque::new(),
            published: VecDeque::new(),
            other: VecDeque::new(),
            delivery_events: 0,
            batched_deliveries: 0,
            shared: 0,
        }
    }

    /// Reads one event from the stream into its queue.
    async fn pump(&mut self) {
        let event = self.session.event().await;
        self.arrived += 1;
        let at = self.arrived;
        match event {
            Event::Deliveries(b) => {
                assert!(
                    self.batched,
                    "a deliveries event on a session that did not ask for them"
                );
                assert!(!b.deliveries.is_empty(), "an empty deliveries event");
                assert!(
                    b.encoded_len() <= DELIVERIES_BOUND || b.deliveries.len() == 1,
                    "a deliveries event of {} deliveries holds {} bytes",
                    b.deliveries.len(),
                    b.encoded_len()
                );
                self.delivery_events += 1;
                self.batched_deliveries += b.deliveries.len() as u64;
                for d in b.deliveries {
                    self.take_delivery(at, d);
                }
            }
            Event::Delivery(d) => {
                assert!(!self.batched, "a bare delivery event on a batched session: {d:?}");
                self.take_delivery(at, d);
            }
            Event::Published(p) => self.published.push_back(p),
            other => self.other.push_back((at, other)),
        }
    }

    fn take_delivery(&mut self, at: u64, d: pb::SessionDelivery) {
        let distinct: HashSet<u32> = d.handles.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            d.handles.len(),
            "a delivery names a handle twice: {d:?}"
        );
        assert!(!d.handles.is_empty(), "a delivery names no handle");
        let m = d.message.as_ref().expect("a delivery carries its message");
        if d.handles.len() > 1 {
            self.shared += 1;
            assert_eq!(m.subscription_id, "", "a delivery of several handles carries no id");
        }
        self.deliveries.push_back((at, d));
    }

    async fn delivery(&mut self) -> pb::SessionDelivery {
        self.delivery_at().await.1
    }

    async fn delivery_at(&mut self) -> (u64, pb::SessionDelivery) {
        loop {
            if let Some(d) = self.deliveries.pop_front() {
                return d;
            }
            self.pump().await;
        }
    }

    async fn published(&mut self) -> pb::SessionPublished {
        loop {
            if let Some(p) = self.published.pop_front() {
                return p;
            }
            self.pump().await;
        }
    }

    /// The next event that is neither a delivery nor an answer.
    async fn other(&mut self) -> (u64, Event) {
        loop {
            if let Some(e) = self.other.pop_front() {
                return e;
            }
            self.pump().await;
        }
    }

    async fn opened(&mut self, handle: u32) -> String {
        match self.other().await {
            (_, Event::Opened(o)) if o.handle == handle => o.subscription_id,
            other => panic!("expected opened for handle {handle}, got {other:?}"),
        }
    }

    async fn open_and_wait(&mut self, handle: u32, request: pb::OpenSubscriptionRequest) -> String {
        self.session.open(handle, request, 0);
        self.opened(handle).await
    }

    /// Publishes a batch and waits for its answer.
    async fn publish(&mut self, id: u64, batch: Vec<pb::PublishRequest>) -> pb::SessionPublished {
        self.session.publish(id, batch);
        let answer = self.published().await;
        assert_eq!(answer.id, id, "{answer:?}");
        answer
    }
}

/// Checks an answer that accepted every one of `n` messages.
#[track_caller]
fn all_accepted(answer: &pb::SessionPublished, n: usize) {
    assert_eq!(answer.accepted as usize, n, "{answer:?}");
    assert!(answer.rejected.is_empty(), "{answer:?}");
    assert!(answer.first_sequence > 0, "{answer:?}");
}

/// A batch's messages reach a subscriber in order, with the consecutive
/// sequences its answer gives them, topics, payloads and headers whole; the
/// answer echoes the batch's id. (Catches: sequences taken one by one
/// instead of in a block; an answer without its id; a batch routed out of
/// order; messages of the batch counted as one.)
#[tokio::test]
async fn a_batch_reaches_subscribers_in_order_with_consecutive_sequences_from_its_answer() {
    timeout(async {
        let broker = start().await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &["b.>"]).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let published_before = metric_everywhere(&broker, "tinybroker_messages_published_total").await;
        let batch: Vec<pb::PublishRequest> = (0..20)
            .map(|i| pb::PublishRequest {
                topic: format!("b.t{}", i % 3),
                payload: format!("m{i}").into_bytes().into(),
                headers: HashMap::from([("index".to_owned(), i.to_string())]),
            })
            .collect();
        let answer = publisher.publish(7, batch).await;
        all_accepted(&answer, 20);
        for i in 0..20u64 {
            let m = sub.message().await.unwrap().expect("the subscription is open");
            assert_eq!(m.topic, format!("b.t{}", i % 3));
            assert_eq!(&m.payload[..], format!("m{i}").as_bytes(), "message {i} in order");
            assert_eq!(m.headers.get("index").map(String::as_str), Some(i.to_string().as_str()));
            assert_eq!(m.sequence, answer.first_sequence + i, "message {i}'s sequence");
            assert_eq!(m.delivery_attempt, 1);
        }
        wait_until("the 20 messages to be counted", || async {
            metric_everywhere(&broker, "tinybroker_messages_published_total").await == published_before + 20.0
        })
        .await;
    })
    .await
}

/// Each bad message is rejected by its index with the code and message
/// `Publish` gives for it (the message may have the index in front), the
/// good ones around it are published, in order, with consecutive
/// sequences. (Catches: a bad message failing the whole batch; rejections
/// with the wrong index, code or text; a bad message taking a sequence.)
#[tokio::test]
async fn bad_messages_are_rejected_by_index_with_publishs_status_and_the_rest_published() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_message_bytes: 4096,
            ..Limits::default()
        })
        .await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &["r.>"]).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let too_many_headers = pb::PublishRequest {
            headers: (0..65).map(|i| (format!("h{i}"), "v".to_owned())).collect(),
            ..message("r.headers", "x")
        };
        let empty_header_name = pb::PublishRequest {
            headers: HashMap::from([(String::new(), "v".to_owned())]),
            ..message("r.headers", "x")
        };
        let batch = vec![
            message("r.ok", "0"),
            message("r.*", "wildcard"),
            message("r.ok", "1"),
            message("", "empty topic"),
            message("r.big", &"p".repeat(4097)),
            message("r.ok", "2"),
            message(&"r".repeat(257), "long topic"),
            too_many_headers,
            empty_header_name,
            message("r. x", "space"),
            message("r.ok", "3"),
        ];
        let bad = [1usize, 3, 4, 6, 7, 8, 9];
        let answer = publisher.publish(42, batch.clone()).await;
        assert_eq!(answer.accepted, 4, "{answer:?}");
        let indexes: Vec<u32> = answer.rejected.iter().map(|r| r.index).collect();
        assert_eq!(indexes, bad.map(|i| i as u32), "rejected by index, in index order");
        let mut unary = broker.client_on(0).await;
        for r in &answer.rejected {
            let status = unary
                .publish(batch[r.index as usize].clone())
                .await
                .expect_err("Publish refuses it too");
            assert_eq!(
                r.code,
                status.code() as u32,
                "index {}: {r:?} where Publish says {status:?}",
                r.index
            );
            assert!(
                r.message.ends_with(status.message()) && !status.message().is_empty(),
                "index {}: {:?} is not Publish's {:?}",
                r.index,
                r.message,
                status.message()
            );
        }
        assert_eq!(
            answer.rejected[2].code,
            Code::ResourceExhausted as u32,
            "the oversize one, index 4"
        );
        for (i, (payload, sequence)) in receive(&mut sub, 4).await.into_iter().enumerate() {
            assert_eq!(payload, i.to_string(), "the good ones, in order");
            assert_eq!(sequence, answer.first_sequence + i as u64, "consecutive sequences");
        }
        // Nothing else came of the batch: the next message is a marker.
        let marker = publisher.publish(43, vec![message("r.marker", "marker")]).await;
        all_accepted(&marker, 1);
        assert_eq!(
            receive(&mut sub, 1).await,
            [("marker".to_owned(), marker.first_sequence)]
        );
    })
    .await
}

/// A batch whose every message is bad publishes nothing: accepted 0,
/// first_sequence 0, every index rejected; the session goes on.
/// (Catches: an answer that claims a first sequence for nothing, a session
/// ended by a batch of errors.)
#[tokio::test]
async fn a_batch_whose_every_message_is_bad_publishes_nothing_and_the_session_goes_on() {
    timeout(async {
        let broker = start().await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &[">"]).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let batch = vec![
            message("a.*", ""),
            message("", ""),
            message("a..b", ""),
            message(">", ""),
        ];
        let answer = publisher.publish(1, batch).await;
        assert_eq!((answer.accepted, answer.first_sequence), (0, 0), "{answer:?}");
        let rejected: Vec<(u32, u32)> = answer.rejected.iter().map(|r| (r.index, r.code)).collect();
        assert_eq!(
            rejected,
            (0..4).map(|i| (i, Code::InvalidArgument as u32)).collect::<Vec<_>>()
        );
        assert!(answer.rejected.iter().all(|r| !r.message.is_empty()), "{answer:?}");
        let next = publisher.publish(2, vec![message("after", "after")]).await;
        all_accepted(&next, 1);
        assert_eq!(receive(&mut sub, 1).await, [("after".to_owned(), next.first_sequence)]);
    })
    .await
}

/// An empty batch is answered with accepted 0 and publishes nothing.
#[tokio::test]
async fn an_empty_batch_is_answered_accepted_0_and_publishes_nothing() {
    timeout(async {
        let broker = start().await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &[">"]).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let before = metric(&broker, "tinybroker_messages_published_total").await;
        let answer = publisher.publish(9, Vec::new()).await;
        assert_eq!(
            (answer.accepted, answer.first_sequence, answer.rejected.len()),
            (0, 0, 0),
            "{answer:?}"
        );
        let next = publisher.publish(10, vec![message("e", "after")]).await;
        all_accepted(&next, 1);
        assert_eq!(receive(&mut sub, 1).await, [("after".to_owned(), next.first_sequence)]);
        assert_eq!(
            metric(&broker, "tinybroker_messages_published_total").await,
            before + 1.0
        );
    })
    .await
}

/// At TINYBROKER_MAX_BATCH_MESSAGES a batch passes; one more and it is
/// rejected whole (every index, RESOURCE_EXHAUSTED naming the variable and
/// its value), nothing of it published, and the session goes on.
/// (Catches: an off-by-one at the limit; a batch over it partly
/// published, or ending the session.)
#[tokio::test]
async fn at_the_batch_limit_a_batch_passes_and_one_over_is_rejected_whole_and_the_session_goes_on() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_batch_messages: 4,
            ..Limits::default()
        })
        .await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &["l"]).await;
        // A client can size its batches: GetBrokerInfo says the limit.
        let info = broker
            .admin()
            .await
            .get_broker_info(tinybroker::pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.limits.unwrap().max_batch_messages, 4);
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let at_limit = publisher.publish(1, messages("l", "a", 4)).await;
        all_accepted(&at_limit, 4);
        let over = publisher.publish(2, messages("l", "b", 5)).await;
        assert_eq!((over.accepted, over.first_sequence), (0, 0), "{over:?}");
        assert_eq!(
            over.rejected.iter().map(|r| r.index).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        for r in &over.rejected {
            assert_eq!(r.code, Code::ResourceExhausted as u32, "{r:?}");
            assert!(r.message.contains("TINYBROKER_MAX_BATCH_MESSAGES"), "{r:?}");
            assert!(r.message.contains("max_batch_messages 4"), "{r:?}");
        }
        // Far over it (more than 4 times): still every index, with the code.
        let far_over = publisher.publish(3, messages("l", "c", 17)).await;
        assert_eq!(far_over.accepted, 0);
        assert_eq!(
            far_over.rejected.iter().map(|r| (r.index, r.code)).collect::<Vec<_>>(),
            (0..17).map(|i| (i, Code::ResourceExhausted as u32)).collect::<Vec<_>>()
        );
        assert!(
            far_over.rejected[0].message.contains("TINYBROKER_MAX_BATCH_MESSAGES"),
            "{far_over:?}"
        );
        let after = publisher.publish(4, messages("l", "d", 4)).await;
        all_accepted(&after, 4);
        let got: Vec<String> = receive(&mut sub, 8).await.into_iter().map(|(p, _)| p).collect();
        assert_eq!(
            got,
            ["a0", "a1", "a2", "a3", "d0", "d1", "d2", "d3"],
            "nothing of b or c"
        );
    })
    .await
}

/// 200,000 tiny messages in one request (within the request size limit,
/// far over the batch limit) are rejected whole, every index named, in an
/// answer that stays small: a few bytes per message, not the text repeated
/// 200,000 times (tonic's client takes at most 4 MiB in one message). The
/// session goes on, and so does another one. (Catches: the text on every
/// rejection; any of them published; the session ended.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_count_of_tiny_messages_is_rejected_whole_in_a_small_answer_and_the_session_goes_on() {
    timeout(async {
        const COUNT: usize = 200_000;
        let broker = start().await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &["t"]).await;
        let mut bystander = Events::start(&mut broker.client_on(0).await, false).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let batch = vec![message("t", ""); COUNT];
        let request = pb::SessionRequest {
            request: Some(pb::session_request::Request::Publish(pb::SessionPublish {
                id: 5,
                messages: batch.clone(),
            })),
        };
        let limit = 1_048_576 + 64 * 1024;
        assert!(request.encoded_len() < limit, "{} bytes", request.encoded_len());
        let answer = publisher.publish(5, batch).await;
        assert_eq!((answer.accepted, answer.first_sequence), (0, 0));
        assert_eq!(answer.rejected.len(), COUNT);
        assert!(
            answer
                .rejected
                .iter()
                .enumerate()
                .all(|(i, r)| r.index as usize == i && r.code == Code::ResourceExhausted as u32),
            "every index, RESOURCE_EXHAUSTED"
        );
        assert!(answer.rejected[0].message.contains("TINYBROKER_MAX_BATCH_MESSAGES"));
        assert!(
            answer.encoded_len() <= 10 * COUNT + 1024,
            "the answer takes {} bytes for {COUNT} rejections",
            answer.encoded_len()
        );
        let after = publisher.publish(6, vec![message("t", "after")]).await;
        all_accepted(&after, 1);
        let other = bystander.publish(1, vec![message("t", "other")]).await;
        all_accepted(&other, 1);
        let got: Vec<String> = receive(&mut sub, 2).await.into_iter().map(|(p, _)| p).collect();
        assert_eq!(got, ["after", "other"]);
    })
    .await
}

/// Batches sent back to back, without waiting, under duplicate ids are
/// each answered once, in request order, with their own outcome.
/// (Catches: answers keyed by id, so that a repeated id is answered once
/// or out of order.)
#[tokio::test]
async fn batches_with_duplicate_ids_are_each_answered_in_request_order() {
    timeout(async {
        let broker = start().await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &["d"]).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let sent = [(5u64, 1usize), (5, 2), (1, 3), (5, 4), (0, 0), (5, 5), (0, 6), (1, 7)];
        for (n, (id, len)) in sent.iter().enumerate() {
            publisher.session.publish(*id, messages("d", &format!("{n}."), *len));
        }
        let mut answers = Vec::new();
        for _ in sent {
            answers.push(publisher.published().await);
        }
        let got: Vec<(u64, usize)> = answers.iter().map(|a| (a.id, a.accepted as usize)).collect();
        assert_eq!(got, sent, "one answer per publish, in order");
        let mut expected = Vec::new();
        for (n, ((_, len), answer)) in sent.iter().zip(&answers).enumerate() {
            for i in 0..*len {
                expected.push((format!("{n}.{i}"), answer.first_sequence + i as u64));
            }
        }
        let total = expected.len();
        assert_eq!(receive(&mut sub, total).await, expected);
    })
    .await
}

/// Batches on a session and single `Publish` calls, one after another
/// from one publisher, reach a subscriber in that order; each batch's
/// messages have its answer's consecutive sequences, also while other
/// sessions publish batches at the same time. (Catches: a batch's block of
/// sequences shared with a concurrent publisher; a batch overtaking or
/// overtaken by a Publish that began after its answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_and_single_publishes_keep_order_and_each_batch_its_consecutive_sequences() {
    timeout(async {
        let broker = start().await;
        let (mut sub, _) = subscribe(&mut broker.client_on(1).await, &["o.>"]).await;
        // Two more publishers, on their own sessions, at the same time.
        let mut noise = Vec::new();
        for n in 0..2 {
            let mut other = Events::start(&mut broker.client_on(n).await, false).await;
            noise.push(tokio::spawn(async move {
                let mut runs = Vec::new();
                for round in 0..20u64 {
                    let answer = other.publish(round, messages(&format!("o.noise{n}"), "", 50)).await;
                    all_accepted(&answer, 50);
                    runs.push(answer.first_sequence);
                }
                runs
            }));
        }
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let mut unary = broker.client_on(0).await;
        let mut expected = Vec::new();
        for round in 0..20u64 {
            let answer = publisher
                .publish(round, messages("o.mine", &format!("b{round}."), 30))
                .await;
            all_accepted(&answer, 30);
            expected.extend((0..30).map(|i| (format!("b{round}.{i}"), answer.first_sequence + i)));
            let payload = format!("p{round}");
            let r = unary.publish(message("o.mine", &payload)).await.unwrap().into_inner();
            expected.push((payload, r.sequence));
        }
        let mut noise_runs = Vec::new();
        for task in noise {
            noise_runs.push(task.await.unwrap());
        }
        // The subscriber gets the 620 of this publisher in order, and the
        // 2,000 of the others, each with the sequence its batch gave it.
        let mut mine = Vec::new();
        let mut others: HashMap<String, Vec<u64>> = HashMap::new();
        while mine.len() < expected.len() || others.values().map(Vec::len).sum::<usize>() < 2000 {
            let m = sub.message().await.unwrap().expect("the subscription is open");
            let payload = String::from_utf8(m.payload.to_vec()).unwrap();
            match m.topic.as_str() {
                "o.mine" => mine.push((payload, m.sequence)),
                other => others.entry(other.to_owned()).or_default().push(m.sequence),
            }
        }
        assert_eq!(mine, expected, "one publisher's batches and Publishes, in order");
        for (n, runs) in noise_runs.iter().enumerate() {
            let want: Vec<u64> = runs.iter().flat_map(|first| *first..first + 50).collect();
            assert_eq!(others[&format!("o.noise{n}")], want, "publisher {n}'s batches");
        }
    })
    .await
}

/// A session that asks for batched deliveries gets `deliveries` events and
/// never a bare `delivery`: each within the byte bound (or one delivery),
/// every handle's messages in order, a message for several handles one
/// delivery naming them (no handle twice); a session that did not ask, on
/// the same topics, sees exactly the bare `delivery` events it always did.
/// (Catches: bare deliveries on a batched session, or batched ones on a
/// plain one; events over the bound; order per handle lost when a batch
/// is cut; a shared message split per handle.)
#[tokio::test]
async fn a_batched_session_gets_deliveries_events_in_order_per_handle_and_a_plain_one_is_unchanged() {
    timeout(async {
        let broker = start().await;
        let mut batched = Events::start(&mut broker.client_on(1).await, true).await;
        batched.open_and_wait(1, subscribe_request(&["d.>"])).await;
        batched.open_and_wait(2, subscribe_request(&["d.even"])).await;
        batched.open_and_wait(3, subscribe_request(&["d.odd", "d.even"])).await;
        let mut plain = Events::start(&mut broker.client_on(1).await, false).await;
        plain.open_and_wait(1, subscribe_request(&["d.>"])).await;
        plain.open_and_wait(2, subscribe_request(&["d.even"])).await;

        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        // 300 messages of 1 KB: several 64 KiB events' worth.
        let payload = "x".repeat(1000);
        let mut sent = Vec::new();
        for round in 0..3u64 {
            let batch: Vec<pb::PublishRequest> = (0..100)
                .map(|i| message(if i % 2 == 0 { "d.even" } else { "d.odd" }, &payload))
                .collect();
            let answer = publisher.publish(round, batch).await;
            all_accepted(&answer, 100);
            sent.extend((0..100).map(|i| (i % 2 == 0, answer.first_sequence + i)));
        }
        let all: Vec<u64> = sent.iter().map(|(_, s)| *s).collect();
        let even: Vec<u64> = sent.iter().filter(|(e, _)| *e).map(|(_, s)| *s).collect();
        for (what, events, handles) in [("batched", &mut batched, 3u32), ("plain", &mut plain, 2)] {
            let mut to: HashMap<u32, Vec<u64>> = HashMap::new();
            while to.get(&1).map_or(0, Vec::len) < 300
                || to.get(&2).map_or(0, Vec::len) < 150
                || (handles == 3 && to.get(&3).map_or(0, Vec::len) < 300)
            {
                let d = events.delivery().await;
                let m = d.message.unwrap();
                assert_eq!(m.payload.len(), 1000, "{what}");
                for h in d.handles {
                    to.entry(h).or_default().push(m.sequence);
                }
            }
            assert_eq!(to[&1], all, "{what}: handle 1 got all, in order");
            assert_eq!(to[&2], even, "{what}: handle 2 the even ones, in order");
            if handles == 3 {
                assert_eq!(to[&3], all, "{what}: handle 3 got all, in order");
            }
            assert!(events.shared > 0, "{what}: a message for several handles came once");
        }
        assert!(
            batched.delivery_events >= 5,
            "300 KB for handles 1 and 3 in 64 KiB events: {} events",
            batched.delivery_events
        );
        assert!(
            batched.delivery_events < 100,
            "not one event per delivery: {} events",
            batched.delivery_events
        );
        // A late one at a low rate: an event of its own, at once.
        let one = publisher.publish(9, vec![message("d.odd", "alone")]).await;
        let d = batched.delivery().await;
        assert_eq!(d.message.unwrap().sequence, one.first_sequence);
        let mut handles = d.handles;
        handles.sort_unstable();
        assert_eq!(handles, [1, 3], "one delivery naming both");
    })
    .await
}

/// A batch to a consumer group: each message goes to one member, members
/// on a batched session and on the transport's own alike. (Catches: a
/// batch routed to the group once per member, or only its first message
/// to the group.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_to_a_consumer_group_gives_each_message_to_one_member() {
    timeout(async {
        let broker = start().await;
        let mut batched = Events::start(&mut broker.client_on(1).await, true).await;
        batched
            .open_and_wait(1, member_request(&["jobs.>"], "batchers", false, 0))
            .await;
        let (mut member, _) = open(
            &mut broker.client_on(0).await,
            member_request(&["jobs.>"], "batchers", false, 0),
        )
        .await;
        wait_until("the group to have 2 members", || async {
            broker.group("batchers").await.is_some_and(|g| g.members == 2)
        })
        .await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let mut sent = HashSet::new();
        for round in 0..3 {
            let answer = publisher.publish(round, messages("jobs.x", "", 100)).await;
            all_accepted(&answer, 100);
            sent.extend(answer.first_sequence..answer.first_sequence + 100);
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let stream_tx = tx.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(m)) = member.message().await {
                if stream_tx.send((0, m)).is_err() {
                    break;
                }
            }
        });
        let session_reader = tokio::spawn(async move {
            loop {
                let d = batched.delivery().await;
                assert_eq!(d.handles, [1], "a group delivery names one handle");
                if tx.send((1, d.message.unwrap())).is_err() {
                    break;
                }
            }
        });
        let mut seen = HashSet::new();
        let mut per_member = [0; 2];
        while seen.len() < 300 {
            let (who, m) = rx.recv().await.expect("a member got it");
            assert_eq!(m.consumer_group, "batchers");
            assert!(seen.insert(m.sequence), "sequence {} delivered twice", m.sequence);
            per_member[who] += 1;
        }
        assert_eq!(seen, sent);
        wait_until("the group to have handed out everything", || async {
            broker
                .group("batchers")
                .await
                .is_some_and(|g| g.backlog == 0 && g.in_flight == 0)
        })
        .await;
        assert!(rx.try_recv().is_err(), "nothing more: each message to one member");
        assert!(
            per_member.iter().all(|n| *n > 0),
            "both members had work: {per_member:?}"
        );
        reader.abort();
        session_reader.abort();
    })
    .await
}

/// Many `SessionAck` requests in a row for a MANUAL member on a batched
/// session: the acked messages are done (never redelivered when the member
/// goes), the room they free is used, and sequences it does not hold are
/// ignored and counted (`unknown_sequence`). (Catches: acks read together
/// applied to the wrong handle, only the last of a run applied, or unknown
/// sequences not counted.)
#[tokio::test]
async fn acks_in_bulk_settle_what_a_member_holds_and_count_the_unknown() {
    timeout(async {
        let broker = start().await;
        let mut member = Events::start(&mut broker.client_on(0).await, true).await;
        let mut request = member_request(&["work"], "bulk", true, 10);
        request.ack_deadline_ms = 60_000;
        member.open_and_wait(1, request.clone()).await;
        // A broadcast handle beside it, whose acks are all unknown.
        member.open_and_wait(2, subscribe_request(&["work"])).await;
        let ignored_before = ignored_unknown_sequence(&broker).await;
        let mut publisher = Events::start(&mut broker.client_on(1).await, false).await;
        let answer = publisher.publish(1, messages("work", "", 30)).await;
        all_accepted(&answer, 30);

        let mut held = Vec::new();
        let mut broadcast = 0;
        while held.len() < 10 || broadcast < 30 {
            let d = member.delivery().await;
            let m = d.message.unwrap();
            match d.handles[..] {
                [1] => held.push(m.sequence),
                [2] => broadcast += 1,
                _ => panic!("a group delivery names only its member: {:?}", d.handles),
            }
        }
        assert_eq!(held.len(), 10, "max_in_flight 10");
        // Ten acks in a row, one sequence each, then unknown ones: for the
        // member, and for the broadcast handle.
        for &sequence in &held {
            member.session.ack(1, &[sequence]);
        }
        member.session.ack(1, &[u64::MAX, 999_999_999]);
        member.session.ack(2, &[held[0]]);
        // Room for ten more.
        let mut second = Vec::new();
        while second.len() < 10 {
            let d = member.delivery().await;
            assert_eq!(d.handles, [1]);
            second.push(d.message.unwrap().sequence);
        }
        let first: HashSet<u64> = held.iter().copied().collect();
        assert!(
            second.iter().all(|s| !first.contains(s)),
            "acked ones are not redelivered"
        );
        wait_until("the 3 unknown sequences to be counted", || async {
            ignored_unknown_sequence(&broker).await == ignored_before + 3.0
        })
        .await;
        // The member goes with 10 unacked and 10 never sent: another member
        // gets exactly those 20, none of the acked 10.
        member.session.close(1);
        let mut other = Events::start(&mut broker.client_on(1).await, true).await;
        other.open_and_wait(1, request).await;
        let mut rest = HashSet::new();
        while rest.len() < 20 {
            let d = other.delivery().await;
            let m = d.message.unwrap();
            assert!(!first.contains(&m.sequence), "acked sequence {} came again", m.sequence);
            // The member may have more room than 10 only after acks; ack
            // as they come so all 20 get through.
            other.session.ack(1, &[m.sequence]);
            rest.insert(m.sequence);
        }
        let all: HashSet<u64> = (answer.first_sequence..answer.first_sequence + 30).collect();
        assert_eq!(rest, all.difference(&first).copied().collect::<HashSet<_>>());
        wait_until("nothing in flight", || async {
            broker
                .group("bulk")
                .await
                .is_some_and(|g| g.in_flight == 0 && g.backlog == 0)
        })
        .await;
    })
    .await
}

/// Batches interleaved with opens, closes and acks on one session, sent
/// without waiting: the answers come in order; a handle gets only what was
/// published while it was open, nothing after its `ended`, and what it
/// never got is its `dropped`. (Catches: a publish reordered against the
/// requests around it.)
#[tokio::test]
async fn batches_interleaved_with_opens_closes_and_acks_keep_request_order() {
    timeout(async {
        let broker = start().await;
        let mut s = Events::start(&mut broker.client_on(0).await, true).await;
        s.open_and_wait(1, subscribe_request(&["i.>"])).await;
        s.session.publish(1, messages("i.x", "one.", 3));
        s.session.ack(1, &[1, 2, 3]);
        s.session.close(1);
        s.session.publish(2, messages("i.x", "two.", 3));
        s.session.nack(5, &[7]);
        s.session.open(2, subscribe_request(&["i.>"]), 0);
        let answers = [s.published().await, s.published().await];
        assert_eq!(answers.iter().map(|a| a.id).collect::<Vec<_>>(), [1, 2]);
        let (ended_at, ended) = match s.other().await {
            (at, Event::Ended(e)) => (at, e),
            other => panic!("expected ended for handle 1, got {other:?}"),
        };
        assert_eq!((ended.handle, ended.reason.as_str()), (1, "closed"), "{ended:?}");
        s.opened(2).await;
        let third = s.publish(3, messages("i.x", "three.", 3)).await;
        all_accepted(&third, 3);
        let mut one = Vec::new();
        let mut two = Vec::new();
        while two.len() < 3 {
            let (at, d) = s.delivery_at().await;
            let m = d.message.unwrap();
            for h in d.handles {
                match h {
                    1 => {
                        assert!(at < ended_at, "a delivery for handle 1 after its ended");
                        one.push(m.sequence);
                    }
                    2 => two.push(m.sequence),
                    other => panic!("handle {other}"),
                }
            }
        }
        let first: Vec<u64> = (0..3).map(|i| answers[0].first_sequence + i).collect();
        assert_eq!(one, first[..one.len()], "handle 1: batch 1's, in order, what came");
        assert_eq!(
            one.len() as u64 + ended.dropped,
            3,
            "handle 1: delivered or dropped: {ended:?}"
        );
        let last: Vec<u64> = (0..3).map(|i| third.first_sequence + i).collect();
        assert_eq!(two, last, "handle 2: only batch 3, opened after batch 2");
    })
    .await
}

/// `tinybroker-batch` with any value but `1` fails the call at once with
/// INVALID_ARGUMENT naming the header; `1` is accepted. (Catches: a value
/// taken as "on" or ignored.)
#[tokio::test]
async fn a_session_with_another_batch_header_value_fails_at_once_naming_it() {
    timeout(async {
        let broker = start().await;
        for value in ["0", "2", "true", "yes", "", " 1", "1 ", "01"] {
            let result = TestSession::try_start_with(&mut broker.client_on(0).await, Some(value)).await;
            let Err(status) = result else {
                panic!("tinybroker-batch: {value:?} was accepted")
            };
            assert_eq!(status.code(), Code::InvalidArgument, "{value:?}: {status:?}");
            assert!(status.message().contains("tinybroker-batch"), "{value:?}: {status:?}");
        }
        let mut ok = Events::start(&mut broker.client_on(0).await, true).await;
        all_accepted(&ok.publish(1, messages("h", "", 2)).await, 2);
    })
    .await
}

/// Replica `a`'s publish_batch_size count and sum, messages published,
/// and delivery_batch_size count and sum.
async fn batch_metrics(broker: &TestBroker) -> (f64, f64, f64, f64, f64) {
    (
        metric(broker, "tinybroker_publish_batch_size_count").await,
        metric(broker, "tinybroker_publish_batch_size_sum").await,
        metric(broker, "tinybroker_messages_published_total").await,
        metric(broker, "tinybroker_delivery_batch_size_count").await,
        metric(broker, "tinybroker_delivery_batch_size_sum").await,
    )
}

/// `tinybroker_publish_batch_size` has one observation per publish request
/// (empty and over-the-limit ones too) of the messages in it;
/// `tinybroker_messages_published_total` counts messages published, not
/// batches; `tinybroker_delivery_batch_size` one observation per
/// `deliveries` event, of the deliveries in it. (Catches: batches counted
/// as one message; rejected messages counted; observations per message.)
#[tokio::test]
async fn batch_metrics_count_requests_messages_and_delivery_events() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_batch_messages: 4,
            ..Limits::default()
        })
        .await;
        let mut receiver = Events::start(&mut broker.client_on(0).await, true).await;
        receiver.open_and_wait(1, subscribe_request(&["m"])).await;
        let mut publisher = Events::start(&mut broker.client_on(0).await, false).await;
        let before = batch_metrics(&broker).await;
        assert_eq!(publisher.publish(1, messages("m", "", 3)).await.accepted, 3);
        assert_eq!(publisher.publish(2, Vec::new()).await.accepted, 0);
        assert_eq!(publisher.publish(3, messages("m", "", 5)).await.accepted, 0);
        let mixed = vec![
            message("m", "a"),
            message("m.*", "bad"),
            message("m", "b"),
            message("m", "c"),
        ];
        assert_eq!(publisher.publish(4, mixed).await.accepted, 3);
        let mut got = 0;
        while got < 6 {
            receiver.delivery().await;
            got += 1;
        }
        let after = batch_metrics(&broker).await;
        assert_eq!(
            after.0 - before.0,
            4.0,
            "publish_batch_size: one observation per publish"
        );
        assert_eq!(after.1 - before.1, 12.0, "publish_batch_size: the messages in each");
        assert_eq!(after.2 - before.2, 6.0, "messages_published_total: messages published");
        assert_eq!(
            (after.3 - before.3, after.4 - before.4),
            (receiver.delivery_events as f64, receiver.batched_deliveries as f64),
            "delivery_batch_size: one observation per deliveries event, of its deliveries"
        );
        assert_eq!(receiver.batched_deliveries, 6);
    })
    .await
}
