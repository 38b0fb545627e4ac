//! The hub against a fake JetStream, in tokio's paused time: deadlines and
//! redelivery, a member leaving, the order JetStream sees acks and naks in,
//! hand-over (here and to another replica), dead letters, the last member
//! leaving, shutdown's hand-back. And a property test of the hub's state
//! machine: every message in exactly one place after every step.

use super::hub::{Backend, HubConfig, HubHandle, LINGER, Pull, Pulling};
use super::state::{HubCore, Outbound, Pulled, Settings};
use crate::broker::{ExternalMember, QueueSlot, Subscription};
use crate::engine::queue::Queue;
use crate::engine::{AckMode, Acked, Nacked};
use crate::engine::{Delivery, Published};
use crate::topic::TopicPattern;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A message the fake holds out: its sequence and the attempt it is
/// delivered for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Msg {
    seq: u64,
    attempt: u32,
}

/// What the fake JetStream (and the other replicas) saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Pull(usize),
    PullClosed,
    Ack(u64),
    Progress(u64),
    /// A nak, with the attempt the message's last delivery had.
    Nak(u64, u32),
    Term(u64),
    DeadLetter(u64, u32),
    /// Another replica took the message, for this attempt.
    TakenElsewhere(u64, u32),
}

#[derive(Default)]
struct Fake {
    seen: Mutex<Vec<Seen>>,
    /// Told whenever something is seen.
    saw: Notify,
    /// Nacked messages, redelivered before new ones (lowest first).
    redeliver: Mutex<VecDeque<Msg>>,
    fresh: Mutex<VecDeque<Msg>>,
    /// Told when a message is published or nacked.
    arrived: Notify,
    /// Whether another replica takes what is offered.
    others_take: AtomicBool,
    unregistered: AtomicBool,
}

impl Fake {
    fn see(&self, seen: Seen) {
        self.seen.lock().push(seen);
        self.saw.notify_waiters();
    }

    fn publish(&self, seq: u64) {
        self.fresh.lock().push_back(Msg { seq, attempt: 1 });
        self.arrived.notify_one();
    }

    /// The next message, and whether it was handed back (nacked: the real
    /// backend wrote its attempts down, so it comes back remembered).
    fn next(&self) -> Option<(Msg, bool)> {
        if let Some(m) = self.redeliver.lock().pop_front() {
            return Some((m, true));
        }
        self.fresh.lock().pop_front().map(|m| (m, false))
    }

    /// What was seen, pulls left out.
    fn sent(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .iter()
            .filter(|s| !matches!(s, Seen::Pull(_)))
            .cloned()
            .collect()
    }

    /// Waits (in paused time: until the runtime is idle and its next timer
    /// is past `within`) until `done` holds for what was sent.
    async fn wait_for(&self, within: Duration, done: impl Fn(&[Seen]) -> bool) -> Vec<Seen> {
        let deadline = Instant::now() + within;
        loop {
            let saw = self.saw.notified();
            let sent = self.sent();
            if done(&sent) {
                return sent;
            }
            if tokio::time::timeout_at(deadline, saw).await.is_err() {
                panic!("not seen within {within:?}; JetStream saw {sent:?}");
            }
        }
    }
}

struct FakePull {
    fake: Arc<Fake>,
    left: usize,
    expires: Instant,
}

impl Pull<Msg> for FakePull {
    async fn next(&mut self) -> Option<Result<Pulling<Msg>, String>> {
        while self.left > 0 {
            let arrived = self.fake.arrived.notified();
            if let Some((m, handed_back)) = self.fake.next() {
                self.left -= 1;
                let published = Arc::new(Published::for_test("t", m.seq));
                return Some(Ok(Pulling::Message(Pulled {
                    attempt: m.attempt,
                    message: m,
                    published,
                    remembered: handed_back,
                })));
            }
            tokio::select! {
                _ = arrived => {}
                _ = tokio::time::sleep_until(self.expires) => return None,
            }
        }
        None
    }

    /// An unsubscribe and a consumer info: a round trip.
    async fn cancel(self) {
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.fake.see(Seen::PullClosed);
    }
}

/// The fake shares its state with the test through an `Arc`.
struct FakeBackend(Arc<Fake>);

impl FakeBackend {
    /// A nak writes the attempts bucket first (when the message ran ahead
    /// of JetStream's count): a round trip. An offer waits for the other
    /// replicas' answers.
    async fn round_trip() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    fn nak(&self, m: Msg, attempt: u32) {
        self.0.see(Seen::Nak(m.seq, attempt));
        self.0.redeliver.lock().push_back(Msg {
            seq: m.seq,
            attempt: attempt + 1,
        });
        self.0.arrived.notify_one();
    }
}

impl Backend for FakeBackend {
    type Message = Msg;
    type Pull = FakePull;

    async fn pull(&self, messages: usize) -> Result<FakePull, String> {
        self.0.see(Seen::Pull(messages));
        Ok(FakePull {
            fake: self.0.clone(),
            left: messages,
            expires: Instant::now() + super::hub::PULL_EXPIRES,
        })
    }

    async fn pull_failed(&self, _members: usize, _ack_mode: Option<AckMode>) {}

    async fn send(&self, operation: Outbound<Msg>) {
        // Into the NATS client's queue: other tasks may run meanwhile.
        tokio::task::yield_now().await;
        match operation {
            Outbound::Ack { message, .. } => self.0.see(Seen::Ack(message.seq)),
            Outbound::Progress(message) => self.0.see(Seen::Progress(message.seq)),
            Outbound::Nak(messages) => {
                Self::round_trip().await;
                for (m, attempt) in messages {
                    self.nak(m, attempt);
                }
            }
            Outbound::Term(message) => self.0.see(Seen::Term(message.seq)),
            Outbound::DeadLetter { message, attempts, .. } => self.0.see(Seen::DeadLetter(message.seq, attempts)),
            Outbound::Offer(messages) => {
                Self::round_trip().await;
                for (m, attempt) in messages {
                    if self.0.others_take.load(Ordering::Relaxed) {
                        self.0.see(Seen::TakenElsewhere(m.seq, attempt + 1));
                    } else {
                        self.nak(m, attempt);
                    }
                }
            }
            Outbound::AfterPull | Outbound::Flushed(_) => unreachable!("done by the sender task"),
        }
    }

    fn unregister(&self, _hub: &HubHandle<Self>) {
        self.0.unregistered.store(true, Ordering::Relaxed);
    }
}

fn start(
    fake: &Arc<Fake>,
    max_delivery_attempts: u32,
    ack_wait: Duration,
) -> (HubHandle<FakeBackend>, CancellationToken) {
    let closing = CancellationToken::new();
    let config = HubConfig {
        max_delivery_attempts,
        ack_wait,
        closing: closing.clone(),
    };
    let (hub, starting) = HubHandle::new("g", Arc::new(FakeBackend(fake.clone())), config);
    starting.start();
    (hub, closing)
}

fn subscription(id: &str, max_in_flight: u32, ack_mode: AckMode) -> Arc<Subscription> {
    let mut s = Subscription::new(
        0,
        id.into(),
        vec![TopicPattern::parse("t").unwrap()],
        None,
        QueueSlot::Shared(Arc::new(Queue::new(max_in_flight as usize, usize::MAX))),
        None,
    );
    s.set_external(ExternalMember {
        group: "g".into(),
        ack_mode,
    });
    Arc::new(s)
}

/// A member on the hub, as `join_group` makes it.
struct TestMember {
    id: Arc<str>,
    subscription: Arc<Subscription>,
    ack_mode: AckMode,
}

async fn join(
    hub: &HubHandle<FakeBackend>,
    id: &str,
    max_in_flight: u32,
    ack_mode: AckMode,
    deadline: Duration,
) -> TestMember {
    let subscription = subscription(id, max_in_flight, ack_mode);
    let settings = Settings {
        ack_mode,
        max_in_flight,
        ack_deadline: deadline,
    };
    assert!(hub.join(id.into(), subscription.clone(), settings).await, "joined");
    TestMember {
        id: id.into(),
        subscription,
        ack_mode,
    }
}

impl TestMember {
    /// The next delivery its stream takes (as `ClusterStream` does).
    async fn next(&self, hub: &HubHandle<FakeBackend>) -> Delivery {
        let popped = std::future::poll_fn(|cx| self.subscription.queue.poll_pop(cx));
        let delivery = tokio::time::timeout(Duration::from_secs(30), popped)
            .await
            .unwrap_or_else(|_| panic!("{} got nothing", self.id))
            .expect("open");
        hub.streamed(&self.id, self.ack_mode, &delivery);
        delivery
    }
}

fn at(d: &Delivery) -> (u64, u32) {
    (d.message.sequence, d.attempt)
}

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test(start_paused = true)]
async fn an_expired_deadline_redelivers_and_held_messages_are_reported_in_progress() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_millis(2400));
    let m = join(&hub, "a", 1, AckMode::Manual, SECOND).await;
    let started = Instant::now();
    fake.publish(1);
    assert_eq!(at(&m.next(&hub).await), (1, 1));
    assert_eq!(hub.view().oldest_given_at, Some(started), "the oldest unacked age runs");
    // A third of ack_wait (800 ms): in progress; the 1 s deadline: nacked
    // (no other member, no other replica takes it), then redelivered.
    let redelivered = m.next(&hub).await;
    assert_eq!(at(&redelivered), (1, 2));
    assert!(started.elapsed() >= SECOND, "redelivered after {:?}", started.elapsed());
    assert_eq!(fake.sent(), [Seen::Progress(1), Seen::Nak(1, 1)]);
    assert_eq!(hub.ack("a", &[1]).await, Acked { acked: 1, unknown: 0 });
    fake.wait_for(SECOND, |s| s.ends_with(&[Seen::Ack(1)])).await;
    let view = hub.view();
    assert_eq!((view.held, view.counters.redeliveries, view.counters.acked), (0, 1, 1));
    assert_eq!(view.oldest_given_at, None);
}

#[tokio::test(start_paused = true)]
async fn the_hub_pulls_only_what_its_members_have_room_for() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 2, AckMode::Manual, Duration::from_secs(30)).await;
    for seq in 1..=5 {
        fake.publish(seq);
    }
    assert_eq!(at(&m.next(&hub).await), (1, 1));
    assert_eq!(at(&m.next(&hub).await), (2, 1));
    let pulls = || -> Vec<Seen> {
        let seen = fake.seen.lock();
        seen.iter().filter(|s| matches!(s, Seen::Pull(_))).cloned().collect()
    };
    assert_eq!(pulls(), [Seen::Pull(2)], "no room: no new pull");
    assert_eq!(hub.ack("a", &[1]).await.acked, 1);
    assert_eq!(at(&m.next(&hub).await), (3, 1));
    assert_eq!(pulls(), [Seen::Pull(2), Seen::Pull(1)]);
    assert_eq!(fake.fresh.lock().len(), 2, "the rest stays in JetStream");
}

#[tokio::test(start_paused = true)]
async fn a_member_leaving_gives_back_what_it_held_to_another() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let a = join(&hub, "a", 1, AckMode::Manual, Duration::from_secs(30)).await;
    fake.publish(1);
    assert_eq!(at(&a.next(&hub).await), (1, 1));
    let b = join(&hub, "b", 2, AckMode::Manual, Duration::from_secs(30)).await;
    hub.leave(a.id.clone());
    // Another member here has room: it gets the message at once, its
    // attempt one higher, as in single-node mode; JetStream hears nothing
    // until it is acked.
    assert_eq!(at(&b.next(&hub).await), (1, 2));
    assert_eq!(hub.ack("a", &[1]).await, Acked { acked: 0, unknown: 1 }, "gone");
    assert_eq!(hub.ack("b", &[1]).await, Acked { acked: 1, unknown: 0 });
    let sent = fake.wait_for(SECOND, |s| s.contains(&Seen::Ack(1))).await;
    assert_eq!(sent, [Seen::Ack(1)]);
    assert_eq!(hub.view().counters.redeliveries, 1);
}

#[tokio::test(start_paused = true)]
async fn the_last_member_leaving_offers_what_it_held_to_the_other_replicas() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let a = join(&hub, "a", 2, AckMode::Manual, Duration::from_secs(30)).await;
    fake.publish(1);
    fake.publish(2);
    assert_eq!(at(&a.next(&hub).await), (1, 1));
    // 2 is still in a's queue: never delivered, it has used no attempt.
    fake.others_take.store(true, Ordering::Relaxed);
    hub.leave(a.id.clone());
    let sent = fake.wait_for(SECOND, |s| s.contains(&Seen::TakenElsewhere(2, 1))).await;
    assert_eq!(sent, [Seen::TakenElsewhere(1, 2), Seen::TakenElsewhere(2, 1)]);
}

#[tokio::test(start_paused = true)]
async fn jetstream_sees_acks_and_naks_in_the_order_they_were_decided() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 4, AckMode::Manual, Duration::from_secs(30)).await;
    for seq in 1..=4 {
        fake.publish(seq);
    }
    for seq in 1..=4 {
        assert_eq!(at(&m.next(&hub).await), (seq, 1));
    }
    // Acks and naks in the order the calls came (a nack between two acks:
    // no one else has room, so it goes back through JetStream), and two
    // naks of one call lowest sequence first.
    // Sent together, as concurrent calls do: they reach the hub in this
    // order, and JetStream must hear them in it.
    let (first, nacked, last) = tokio::join!(hub.ack("a", &[3]), hub.nack("a", &[4, 2]), hub.ack("a", &[1]));
    assert_eq!((first.acked, last.acked), (1, 1));
    assert_eq!(
        nacked,
        Nacked {
            requeued: 2,
            unknown: 0
        }
    );
    let sent = fake.wait_for(SECOND, |s| s.len() >= 4).await;
    assert_eq!(sent, [Seen::Ack(3), Seen::Nak(2, 1), Seen::Nak(4, 1), Seen::Ack(1)]);
    // AUTO: a message is acked as the member's stream takes it, in that
    // order.
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "auto", 8, AckMode::Auto, Duration::from_secs(30)).await;
    for seq in 1..=5 {
        fake.publish(seq);
    }
    for seq in 1..=5 {
        assert_eq!(at(&m.next(&hub).await), (seq, 1));
    }
    let sent = fake.wait_for(SECOND, |s| s.len() >= 5).await;
    assert_eq!(sent, (1..=5).map(Seen::Ack).collect::<Vec<_>>());
    assert_eq!(
        hub.view().counters.acked,
        0,
        "acked counts MANUAL members' acks, as in single-node mode"
    );
}

#[tokio::test(start_paused = true)]
async fn an_auto_members_queued_messages_have_no_deadline() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(3));
    // Its stream takes nothing for 5 ack deadlines: what waits in its queue
    // stays there (as in single-node mode), reported in progress to
    // JetStream, neither redelivered nor handed to the other member.
    let m = join(&hub, "auto", 2, AckMode::Auto, SECOND).await;
    fake.publish(1);
    fake.publish(2);
    tokio::time::timeout(SECOND, async {
        while m.subscription.queue.len() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("both handed out");
    let other = join(&hub, "other", 2, AckMode::Auto, SECOND).await;
    tokio::time::sleep(5 * SECOND).await;
    assert_eq!(m.subscription.queue.len(), 2);
    assert_eq!(other.subscription.queue.len(), 0);
    let sent = fake.sent();
    assert!(
        sent.iter().all(|s| matches!(s, Seen::Progress(_))) && !sent.is_empty(),
        "{sent:?}"
    );
    assert_eq!(at(&m.next(&hub).await), (1, 1));
    assert_eq!(at(&m.next(&hub).await), (2, 1));
    fake.wait_for(SECOND, |s| s.ends_with(&[Seen::Ack(1), Seen::Ack(2)]))
        .await;
}

#[tokio::test(start_paused = true)]
async fn a_nack_hands_over_to_another_member_here_then_to_another_replica() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let a = join(&hub, "a", 1, AckMode::Manual, Duration::from_secs(30)).await;
    let b = join(&hub, "b", 1, AckMode::Manual, Duration::from_secs(30)).await;
    fake.publish(1);
    assert_eq!(at(&a.next(&hub).await), (1, 1));
    // B has room: it gets the message from this replica, attempt 2,
    // without a round through JetStream.
    assert_eq!(hub.nack("a", &[1]).await.requeued, 1);
    assert_eq!(at(&b.next(&hub).await), (1, 2));
    assert_eq!(fake.sent(), []);
    // A has room now, but it nacked last time... B nacks: A takes it (the
    // member it failed with is B).
    assert_eq!(hub.nack("b", &[1]).await.requeued, 1);
    assert_eq!(at(&a.next(&hub).await), (1, 3));
    // No one here has room (B got a new message): another replica takes
    // it, for its next attempt.
    fake.others_take.store(true, Ordering::Relaxed);
    fake.publish(2);
    assert_eq!(at(&b.next(&hub).await), (2, 1));
    assert_eq!(hub.nack("a", &[1]).await.requeued, 1);
    let sent = fake.wait_for(SECOND, |s| !s.is_empty()).await;
    assert_eq!(sent, [Seen::TakenElsewhere(1, 4)]);
    assert_eq!(hub.ack("a", &[1]).await.unknown, 1, "no longer held here");
    assert_eq!(hub.view().counters.redeliveries, 3);
}

#[tokio::test(start_paused = true)]
async fn an_expired_deadline_hands_over_to_a_member_with_room() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let a = join(&hub, "a", 1, AckMode::Manual, SECOND).await;
    let b = join(&hub, "b", 1, AckMode::Manual, Duration::from_secs(30)).await;
    fake.publish(1);
    assert_eq!(at(&a.next(&hub).await), (1, 1));
    let started = Instant::now();
    assert_eq!(at(&b.next(&hub).await), (1, 2));
    assert!(started.elapsed() >= SECOND);
    assert_eq!(fake.sent(), []);
}

#[tokio::test(start_paused = true)]
async fn the_last_allowed_attempt_is_dead_lettered() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 2, Duration::from_secs(30));
    let m = join(&hub, "a", 1, AckMode::Manual, Duration::from_secs(30)).await;
    fake.publish(1);
    assert_eq!(at(&m.next(&hub).await), (1, 1));
    assert_eq!(hub.nack("a", &[1]).await.requeued, 1);
    assert_eq!(at(&m.next(&hub).await), (1, 2));
    assert_eq!(
        hub.nack("a", &[1]).await.requeued,
        1,
        "still requeued: the member no longer holds it"
    );
    let sent = fake.wait_for(SECOND, |s| s.len() >= 2).await;
    assert_eq!(sent, [Seen::Nak(1, 1), Seen::DeadLetter(1, 2)]);
    let view = hub.view();
    assert_eq!(
        (view.held, view.counters.dead_lettered, view.counters.redeliveries),
        (0, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn the_last_member_leaving_closes_the_pull_before_the_naks_and_the_hub_stops() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 2, AckMode::Manual, Duration::from_secs(30)).await;
    fake.publish(1);
    assert_eq!(at(&m.next(&hub).await), (1, 1));
    hub.leave(m.id.clone());
    let sent = fake.wait_for(SECOND, |s| s.len() >= 2).await;
    assert_eq!(sent, [Seen::PullClosed, Seen::Nak(1, 1)]);
    // The hub lingers, then stops: a join is refused (the engine makes a
    // new hub), and it has left the replica's table.
    let left = Instant::now();
    tokio::time::timeout(10 * SECOND, hub.pulled())
        .await
        .expect("the hub stops");
    assert!(fake.unregistered.load(Ordering::Relaxed));
    assert!(left.elapsed() >= LINGER, "stopped after {:?}", left.elapsed());
    let settings = Settings {
        ack_mode: AckMode::Manual,
        max_in_flight: 1,
        ack_deadline: SECOND,
    };
    assert!(
        !hub.join("b".into(), subscription("b", 1, AckMode::Manual), settings)
            .await
    );
    // What it pulled meanwhile (nothing) stayed in JetStream.
    assert_eq!(fake.redeliver.lock().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_member_whose_stream_closed_leaves_the_rotation_and_what_waits_goes_back_when_the_hub_stops() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 1, AckMode::Manual, Duration::from_secs(30)).await;
    fake.wait_for(SECOND, |_| !fake.seen.lock().is_empty()).await;
    // Its stream is gone, its leave not sent yet: the message pulled for
    // it cannot be handed to it, and waits; the hub, without a member in
    // its rotation, closes its pull, lingers, stops, and gives it back.
    m.subscription.queue.close(crate::engine::CloseReason::Cancelled, None);
    fake.publish(1);
    tokio::time::timeout(10 * SECOND, hub.pulled())
        .await
        .expect("the hub stops");
    // Its one pull was answered in full: nothing to close. It was never
    // handed out: no attempt made.
    let sent = fake.wait_for(SECOND, |s| s.contains(&Seen::Nak(1, 0))).await;
    assert_eq!(sent, [Seen::Nak(1, 0)]);
    assert!(fake.unregistered.load(Ordering::Relaxed));
}

#[tokio::test(start_paused = true)]
async fn shutdown_hands_back_what_is_held_after_the_acks_before_it() {
    let fake = Arc::new(Fake::default());
    let (hub, closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 3, AckMode::Manual, Duration::from_secs(30)).await;
    for seq in 1..=3 {
        fake.publish(seq);
    }
    for seq in 1..=3 {
        assert_eq!(at(&m.next(&hub).await), (seq, 1));
    }
    assert_eq!(hub.ack("a", &[2]).await.acked, 1);
    closing.cancel();
    tokio::time::timeout(10 * SECOND, hub.pulled())
        .await
        .expect("the pull ends");
    let (count, flushed) = hub.hand_back().await.expect("the hub answers");
    assert_eq!(count, 2);
    flushed.await.expect("flushed");
    assert_eq!(fake.sent(), [Seen::Ack(2), Seen::Nak(1, 1), Seen::Nak(3, 1)]);
    assert_eq!(hub.view().held, 0);
    assert_eq!(hub.ack("a", &[1]).await.unknown, 1);
}

#[tokio::test(start_paused = true)]
async fn a_redelivery_no_replica_handed_back_is_counted() {
    // JetStream redelivered it after its ack wait (its replica was cut off,
    // its ack lost): no machine counted the failed attempt.
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 4, AckMode::Manual, Duration::from_secs(30)).await;
    fake.fresh.lock().push_back(Msg { seq: 5, attempt: 2 });
    fake.arrived.notify_one();
    assert_eq!(at(&m.next(&hub).await), (5, 2));
    assert_eq!(hub.view().counters.redeliveries, 1);
    // A first delivery is not.
    fake.publish(6);
    assert_eq!(at(&m.next(&hub).await), (6, 1));
    assert_eq!(hub.view().counters.redeliveries, 1);
}

#[tokio::test(start_paused = true)]
async fn a_message_offered_by_another_replica_is_taken_only_with_room() {
    let fake = Arc::new(Fake::default());
    let (hub, _closing) = start(&fake, 0, Duration::from_secs(30));
    let m = join(&hub, "a", 1, AckMode::Manual, Duration::from_secs(30)).await;
    let offered = |seq| Pulled {
        message: Msg { seq, attempt: 1 },
        published: Arc::new(Published::for_test("t", seq)),
        attempt: 3,
        remembered: false,
    };
    assert!(hub.take(offered(7)).await);
    assert_eq!(at(&m.next(&hub).await), (7, 3));
    assert!(!hub.take(offered(8)).await, "no room");
    assert_eq!(hub.ack("a", &[7]).await.acked, 1);
    fake.wait_for(SECOND, |s| s == [Seen::Ack(7)]).await;
}

/// The hub's state machine, driven at random, with JetStream and the
/// member queues modelled: after every step every message is in exactly
/// one place (JetStream, waiting in the hub, held by one member, done or
/// taken by another replica), nothing is acked or dead-lettered twice, and
/// no member holds more than its `max_in_flight`.
mod property {
    use super::*;
    use proptest::prelude::*;
    use std::task::{Context, Poll, Waker};

    #[derive(Debug, Clone)]
    enum Op {
        Publish,
        Pull(usize),
        Join(bool, u32),
        Leave(usize),
        Stream(usize),
        Ack(usize, usize),
        Nack(usize, usize),
        Tick(u64),
        Offered,
        OthersTake(bool),
        HandBack,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Publish),
            3 => (1usize..4).prop_map(Op::Pull),
            1 => (any::<bool>(), 1u32..4).prop_map(|(m, n)| Op::Join(m, n)),
            1 => any::<usize>().prop_map(Op::Leave),
            4 => any::<usize>().prop_map(Op::Stream),
            2 => (any::<usize>(), any::<usize>()).prop_map(|(m, s)| Op::Ack(m, s)),
            2 => (any::<usize>(), any::<usize>()).prop_map(|(m, s)| Op::Nack(m, s)),
            1 => (0u64..15).prop_map(Op::Tick),
            1 => Just(Op::Offered),
            1 => any::<bool>().prop_map(Op::OthersTake),
            1 => Just(Op::HandBack),
        ]
    }

    fn pop(sub: &Subscription) -> Option<Delivery> {
        match sub.queue.poll_pop(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(d) => d,
            Poll::Pending => None,
        }
    }

    /// A member in the model: id, subscription, manual, max_in_flight, and
    /// what its stream took and it has not acked.
    type ModelMember = (Arc<str>, Arc<Subscription>, bool, u32, Vec<u64>);

    proptest! {
        #[test]
        fn every_message_is_in_exactly_one_place(ops in prop::collection::vec(op(), 1..150), max_attempts in 0u32..4) {
            let mut now = Instant::now();
            let mut core: HubCore<Msg> = HubCore::new(max_attempts, Duration::from_secs(6));
            // JetStream: messages it would deliver next, with their attempt.
            let mut jetstream: VecDeque<Msg> = VecDeque::new();
            let mut done: HashSet<u64> = HashSet::new();
            let mut elsewhere: HashSet<u64> = HashSet::new();
            let mut others_take = false;
            let mut next_seq = 0u64;
            let mut next_member = 0u32;
            // (id, subscription, manual, max_in_flight, taken by its stream and not acked)
            let mut members: Vec<ModelMember> = Vec::new();
            for op in ops {
                match op {
                    Op::Publish => {
                        next_seq += 1;
                        jetstream.push_back(Msg { seq: next_seq, attempt: 1 });
                    }
                    Op::Pull(n) => {
                        for _ in 0..n.min(core.room()) {
                            let Some(m) = jetstream.pop_front() else { break };
                            let published = Arc::new(Published::for_test("t", m.seq));
                            let attempt = m.attempt;
                            core.pulled(Pulled { message: m, published, attempt, remembered: false }, false, now);
                        }
                    }
                    Op::Join(manual, max) => {
                        next_member += 1;
                        let id: Arc<str> = format!("m{next_member}").into();
                        let mode = if manual { AckMode::Manual } else { AckMode::Auto };
                        let sub = subscription(&id, max, mode);
                        core.join(id.clone(), sub.clone(), Settings { ack_mode: mode, max_in_flight: max, ack_deadline: Duration::from_secs(10) }, now);
                        members.push((id, sub, manual, max, Vec::new()));
                    }
                    Op::Leave(i) if !members.is_empty() => {
                        let (id, sub, ..) = members.remove(i % members.len());
                        sub.queue.close(crate::engine::CloseReason::Cancelled, None);
                        core.leave(&id, now);
                    }
                    Op::Stream(i) if !members.is_empty() => {
                        let n = members.len();
                        let (id, sub, manual, _, taken) = &mut members[i % n];
                        if let Some(d) = pop(sub) {
                            if *manual {
                                taken.push(d.message.sequence);
                            } else {
                                // False for a stale copy: its deadline passed
                                // while it waited in the queue, and the hub
                                // gave it to another member or back.
                                core.done(id, d.message.sequence, now);
                            }
                        }
                    }
                    Op::Ack(i, s) if !members.is_empty() => {
                        let n = members.len();
                        let (id, _, _, _, taken) = &mut members[i % n];
                        if !taken.is_empty() {
                            let seq = taken.remove(s % taken.len());
                            core.ack(id, &[seq], now);
                        }
                    }
                    Op::Nack(i, s) if !members.is_empty() => {
                        let n = members.len();
                        let (id, _, _, _, taken) = &mut members[i % n];
                        if !taken.is_empty() {
                            let seq = taken.remove(s % taken.len());
                            core.nack(id, &[seq], now);
                        }
                    }
                    Op::Tick(secs) => {
                        now += Duration::from_secs(secs);
                        core.tick(now);
                    }
                    // Another replica's message: a new sequence, in
                    // JetStream's count already.
                    Op::Offered if core.room() > 0 => {
                        next_seq += 1;
                        let published = Arc::new(Published::for_test("t", next_seq));
                        let m = Msg { seq: next_seq, attempt: 2 };
                        let taken = core.take(Pulled { message: m, published, attempt: 2, remembered: false }, false, now);
                        prop_assert!(taken, "room, and not taken");
                    }
                    Op::OthersTake(take) => others_take = take,
                    Op::HandBack => {
                        core.hand_back();
                        // The members' queues keep what they had: it is
                        // no longer the hub's (the replica is going).
                        for (_, sub, _, _, taken) in &mut members {
                            while pop(sub).is_some() {}
                            taken.clear();
                        }
                    }
                    _ => {}
                }
                // JetStream (and the other replicas) hear what was decided.
                for out in core.out.drain(..) {
                    match out {
                        Outbound::Ack { message, .. } => prop_assert!(done.insert(message.seq), "acked twice"),
                        Outbound::DeadLetter { message, attempts, .. } => {
                            prop_assert!(max_attempts > 0 && attempts >= max_attempts);
                            prop_assert!(done.insert(message.seq), "dead-lettered twice");
                        }
                        Outbound::Nak(list) => {
                            for (m, attempt) in list {
                                jetstream.push_back(Msg { seq: m.seq, attempt: attempt + 1 });
                            }
                        }
                        Outbound::Offer(list) => {
                            for (m, attempt) in list {
                                if others_take {
                                    elsewhere.insert(m.seq);
                                } else {
                                    jetstream.push_back(Msg { seq: m.seq, attempt: attempt + 1 });
                                }
                            }
                        }
                        Outbound::Progress(_) | Outbound::AfterPull => {}
                        Outbound::Term(_) | Outbound::Flushed(_) => prop_assert!(false, "not made here"),
                    }
                }
                // Where every message is now.
                let (waiting, held) = core.places();
                let mut places: HashMap<u64, usize> = HashMap::new();
                for seq in jetstream.iter().map(|m| m.seq).chain(waiting).chain(held.iter().map(|(s, _)| *s)).chain(done.iter().copied()).chain(elsewhere.iter().copied()) {
                    *places.entry(seq).or_default() += 1;
                }
                prop_assert!(places.values().all(|&n| n == 1), "a message in two places: {:?}", places);
                prop_assert_eq!(places.len() as u64, next_seq, "every message accounted for");
                for (id, _, _, max, _) in &members {
                    let holds = held.iter().filter(|(_, m)| m == id).count() as u32;
                    prop_assert!(holds <= *max, "{id} holds {holds} > {max}");
                }
            }
        }
    }
}
