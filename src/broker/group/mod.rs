//! Consumer groups (DELIVERY_MODE_SINGLE) in single-node mode: one shared
//! backlog, members that each hold at most `max_in_flight` messages (and are
//! handed no more than their session's credit), manual
//! acks with deadlines, redelivery and dead-lettering.
//!
//! What happens to a message is decided by [`GroupMachine`], and who may
//! join, when the group has been idle too long and when its stall is
//! reported by the other rules of [`crate::group`], which a cluster hub
//! decides with too. A [`ConsumerGroup`] keeps the machine behind its mutex
//! with what only a single-node group has: its name, patterns and ack mode,
//! when it was last without members (the idle TTL), and when it last made
//! progress (the stall report).
//!
//! All of it happens under the group's one lock, for one short transition per
//! call; dead letters are returned to the caller, which publishes them
//! outside it. Time is passed in (`now`), so the logic is tested without a
//! clock.

use crate::engine::queue::Queue;
use crate::engine::{AckMode, Acked, BrokerError, Delivery, GroupInfo, Nacked, Published};
use crate::group::admission::{self, Terms};
use crate::group::machine::{self, AutoDone, Event, GroupMachine, NoRoom, Rules};
use crate::group::stall::StallReport;
use crate::group::{BacklogLimits, MemberSettings, idle};
use crate::topic::TopicPattern;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// What bounds a group, fixed when it is created.
#[derive(Debug, Clone, Copy)]
pub struct GroupLimits {
    pub backlog: BacklogLimits,
    /// Deliveries tried before a message is dead-lettered; 0 = no limit.
    pub max_delivery_attempts: u32,
}

impl GroupLimits {
    /// A single-node group's rules: its backlog is the group, bounded, and
    /// a failed delivery waits in it for the next member with room; an
    /// AUTO member's stream counts what it took.
    fn rules(self) -> Rules {
        Rules {
            max_delivery_attempts: self.max_delivery_attempts,
            backlog: Some(self.backlog),
            no_room: NoRoom::Wait,
            auto: AutoDone::Counted,
        }
    }
}

pub struct ConsumerGroup {
    /// Key of the group's entries in the routing trie.
    pub(crate) key: u64,
    name: Arc<str>,
    /// Fixed by the first member, like `ack_mode`: every later member must
    /// ask for the same ([`ConsumerGroup::admits`]).
    patterns: Vec<TopicPattern>,
    ack_mode: AckMode,
    /// A plain mutex: nothing awaits while it is held. Publishers, member
    /// streams (auto mode), acks and the maintenance tick each hold it for
    /// one short state transition. Taken after the broker's registries and
    /// trie, before any member's queue (ARCHITECTURE.md, "Locks and their order").
    state: Mutex<GroupState>,
    /// Messages written to members' streams (redeliveries included), added
    /// by the streams in batches without taking the lock.
    delivered: AtomicU64,
}

struct GroupState {
    /// Members are keyed by their subscription's key; a message has no
    /// token beyond itself.
    machine: GroupMachine<(), u64>,
    /// When the last member left (None while any member is connected).
    idle_since: Option<Instant>,
    /// Set when the group is removed; a joining member then starts a new one.
    removed: bool,
    /// The last time the group completed a message (an ack, or an auto-ack
    /// member's stream taking one) or was seen with no work at all (the
    /// maintenance tick looks every 50 ms): [`GroupInfo::stalled`] is
    /// measured from here.
    progress_at: Instant,
    /// Whether the current stall has been reported (logged).
    stall: StallReport,
}

impl ConsumerGroup {
    pub(crate) fn new(
        key: u64,
        name: Arc<str>,
        patterns: Vec<TopicPattern>,
        ack_mode: AckMode,
        limits: GroupLimits,
        now: Instant,
    ) -> Self {
        Self {
            key,
            name,
            patterns,
            ack_mode,
            state: Mutex::new(GroupState {
                machine: GroupMachine::new(limits.rules()),
                idle_since: Some(now),
                removed: false,
                progress_at: now,
                stall: StallReport::default(),
            }),
            delivered: AtomicU64::new(0),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn patterns(&self) -> &[TopicPattern] {
        &self.patterns
    }

    /// Whether a member asking for `patterns` (sorted, without duplicates)
    /// and `ack_mode` may join: both must be what the first member fixed
    /// (FAILED_PRECONDITION naming both otherwise).
    pub(crate) fn admits(&self, patterns: &[TopicPattern], ack_mode: AckMode) -> Result<(), BrokerError> {
        admission::admit(
            &self.name,
            Terms {
                patterns: &self.patterns,
                ack_mode: Some(self.ack_mode),
            },
            Terms {
                patterns,
                ack_mode: Some(ack_mode),
            },
        )
    }

    #[cfg(test)]
    fn counters(&self) -> machine::Counters {
        self.state.lock().machine.counters()
    }

    /// What each MANUAL member holds unacked, by subscription key.
    pub(crate) fn unacked_by_member(&self) -> std::collections::HashMap<u64, machine::MemberUnacked> {
        self.state.lock().machine.unacked_by_member()
    }

    /// What Admin and the metrics see.
    pub fn info(&self, now: Instant) -> GroupInfo {
        let state = self.state.lock();
        let machine = &state.machine;
        let counters = machine.counters();
        GroupInfo {
            name: self.name.to_string(),
            topic_patterns: self.patterns.iter().map(|p| p.to_string()).collect(),
            members: machine.members(),
            backlog: machine.backlog_len(),
            backlog_bytes: machine.backlog_bytes(),
            in_flight: machine.in_flight(),
            oldest_unacked_age: machine.oldest_unacked().map(|at| now.saturating_duration_since(at)),
            stalled: if machine.has_work() {
                now.saturating_duration_since(state.progress_at)
            } else {
                Duration::ZERO
            },
            memberless: state
                .idle_since
                .filter(|_| machine.members() == 0)
                .map(|since| now.saturating_duration_since(since)),
            redeliveries: counters.redeliveries,
            dead_lettered: counters.dead_lettered,
            dropped: counters.dropped,
            acked: counters.acked,
            delivered: self.delivered.load(Ordering::Relaxed),
        }
    }

    /// The group's view, when its stall is due to be reported
    /// ([`StallReport::due`]: once per stall; for the broker's WARN line).
    pub(crate) fn stall_to_report(&self, now: Instant) -> Option<GroupInfo> {
        {
            let mut state = self.state.lock();
            let stalled = if state.machine.has_work() {
                now.saturating_duration_since(state.progress_at)
            } else {
                Duration::ZERO
            };
            if !state.stall.due(stalled) {
                return None;
            }
        }
        Some(self.info(now))
    }

    /// Routes one published message to the group: into the backlog, then to
    /// a member with room. Returns how many of the oldest backlog messages
    /// were dropped to make room (the backlog was at its capacity or its
    /// byte limit).
    pub(crate) fn offer(&self, message: Arc<Published>, now: Instant) -> u64 {
        let mut state = self.state.lock();
        if state.removed {
            return 0;
        }
        let dropped = state.machine.offer(message, (), 0, now);
        state.machine.out.clear();
        dropped
    }

    /// Adds a member (its patterns were checked by the caller) and hands it
    /// what the backlog holds. False when the group was removed meanwhile.
    /// `member` is its subscription's key, `queue` its subscription's queue.
    pub(crate) fn join(&self, member: u64, queue: Arc<Queue>, settings: MemberSettings, now: Instant) -> bool {
        let mut state = self.state.lock();
        if state.removed {
            return false;
        }
        state.machine.join(member, queue, settings, now);
        state.idle_since = None;
        true
    }

    /// Takes back manual-ack messages whose ack deadline has passed. Also
    /// notes a group with no work as not stalled (see
    /// [`GroupInfo::stalled`]); the maintenance tick calls this. Returns the
    /// dead letters that made.
    pub(crate) fn expire(&self, now: Instant) -> Vec<DeadLetter> {
        let mut state = self.state.lock();
        if !state.machine.has_work() {
            state.progressed(now);
        }
        state.machine.expire(now);
        state.dead_letters()
    }

    /// Some (and the group is marked removed) when it has had no member for
    /// `ttl`: the number of messages it still held, for counting.
    pub(crate) fn remove_if_idle(&self, now: Instant, ttl: Duration) -> Option<usize> {
        let mut state = self.state.lock();
        match state.idle_since {
            Some(since) if state.machine.members() == 0 && idle::outlived(since, now, ttl) => Some(state.remove()),
            _ => None,
        }
    }

    /// Shutdown: empties the group; returns how many messages it held, in
    /// its backlog and held by members (none once every member was
    /// discarded, [`ConsumerGroup::discard`]).
    pub(crate) fn discard_all(&self) -> (usize, usize) {
        let mut state = self.state.lock();
        let backlog = state.machine.backlog_len();
        let left = state.remove();
        (backlog, left - backlog)
    }
}

/// What a member's subscription, its stream, its acks and its closing ask
/// of its group. `member` is the member's subscription key. Each takes the
/// group's lock for one short transition, except `add_delivered`. None is
/// per message: a stream reports once per run of deliveries (when its
/// queue runs dry, and at most every 64) and adds to its count every 256;
/// an ack, a nack, added credit and leaving are one call per request.
impl ConsumerGroup {
    /// A member's stream wrote `count` messages.
    pub(crate) fn add_delivered(&self, count: u64) {
        self.delivered.fetch_add(count, Ordering::Relaxed);
    }

    /// A member left (cancelled, closed or shutting down). `unstreamed` is
    /// what its queue still held: never delivered, so it goes back as it was;
    /// its manual-ack messages that did reach its stream are retried.
    /// Returns the dead letters that made.
    pub(crate) fn leave(&self, member: u64, unstreamed: VecDeque<Delivery>, now: Instant) -> Vec<DeadLetter> {
        let mut state = self.state.lock();
        state
            .machine
            .leave(&member, unstreamed.into_iter().map(|d| (d, ())), now);
        if state.machine.members() == 0 && state.idle_since.is_none() {
            state.idle_since = Some(now);
        }
        state.dead_letters()
    }

    /// Shutdown, once the grace period is over: the member leaves and what
    /// it holds (`unstreamed`, what its queue still held, and what reached
    /// its stream and is not done) is discarded, not handed back. How many.
    pub(crate) fn discard(&self, member: u64, unstreamed: VecDeque<Delivery>) -> usize {
        self.state
            .lock()
            .machine
            .discard_member(&member, unstreamed.into_iter().map(|d| d.message.sequence))
    }

    /// An auto-ack member's stream took `count` messages: they are done, and
    /// the member has room for as many more.
    pub(crate) fn streamed(&self, member: u64, count: u32, now: Instant) {
        let mut state = self.state.lock();
        if count > 0 {
            state.progressed(now);
        }
        state.machine.streamed(&member, count, now);
    }

    /// A member's session added credit: it may have room now.
    pub(crate) fn credit_added(&self, now: Instant) {
        self.state.lock().machine.room_made(now);
    }

    /// Marks messages done. A sequence this member does not hold (never had,
    /// already acked, or lost to a redelivery) is unknown and changes nothing.
    pub(crate) fn ack(&self, member: u64, sequences: &[u64], now: Instant) -> Acked {
        let mut state = self.state.lock();
        let result = state.machine.ack(&member, sequences, now);
        state.machine.out.clear();
        if result.acked > 0 {
            state.progressed(now);
        }
        result
    }

    /// Hands messages back for immediate redelivery, preferably to another
    /// member. A message that used its last attempt is dead-lettered
    /// instead (and still counted as requeued: the member no longer holds
    /// it).
    pub(crate) fn nack(&self, member: u64, sequences: &[u64], now: Instant) -> NackOutcome {
        let mut state = self.state.lock();
        let nacked = state.machine.nack(&member, sequences, now);
        NackOutcome {
            nacked,
            dead_letters: state.dead_letters(),
        }
    }
}

/// A message that used up its delivery attempts, to be published to the
/// group's dead-letter topic by the caller (outside the group's lock).
#[derive(Debug)]
pub struct DeadLetter {
    pub message: Arc<Published>,
    pub attempts: u32,
}

/// What a Nack did, and the dead letters it made.
#[derive(Debug)]
pub struct NackOutcome {
    pub nacked: Nacked,
    pub dead_letters: Vec<DeadLetter>,
}

impl GroupState {
    /// The group completed a message, or has nothing to do.
    fn progressed(&mut self, now: Instant) {
        self.progress_at = now;
        self.stall.progressed();
    }

    /// Marks the group removed and empties it; returns how many messages it
    /// still held.
    fn remove(&mut self) -> usize {
        self.removed = true;
        self.machine.clear()
    }

    /// The dead letters of the last transition (the rest of what it
    /// decided needs nothing of a single-node group).
    fn dead_letters(&mut self) -> Vec<DeadLetter> {
        self.machine
            .out
            .drain(..)
            .filter_map(|event| match event {
                Event::DeadLetter { message, attempts, .. } => Some(DeadLetter { message, attempts }),
                Event::Done(()) | Event::Elsewhere(_) | Event::Dropped(()) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::machine::tests::{member, pop};

    fn published(seq: u64) -> Arc<Published> {
        Arc::new(Published::for_test("t", seq))
    }

    fn settings(mode: AckMode, max_in_flight: u32) -> MemberSettings {
        MemberSettings {
            ack_mode: mode,
            max_in_flight,
            ack_deadline: Duration::from_secs(10),
        }
    }

    fn group(capacity: usize, max_attempts: u32) -> ConsumerGroup {
        group_at(capacity, max_attempts, Instant::now())
    }

    fn group_at(capacity: usize, max_attempts: u32, now: Instant) -> ConsumerGroup {
        let p = vec![TopicPattern::parse("t").unwrap()];
        let limits = GroupLimits {
            backlog: BacklogLimits {
                capacity,
                max_bytes: usize::MAX,
            },
            max_delivery_attempts: max_attempts,
        };
        ConsumerGroup::new(0, "g".into(), p, AckMode::Auto, limits, now)
    }

    #[test]
    fn backlog_waits_for_a_member_then_flows() {
        let now = Instant::now();
        let g = group(10, 0);
        for seq in 1..=3 {
            g.offer(published(seq), now);
        }
        assert_eq!(g.info(now).backlog, 3);
        let m = member(1, 2);
        g.join(m.key, m.queue.clone(), settings(AckMode::Auto, 2), now);
        assert_eq!(g.info(now).backlog, 1, "only max_in_flight handed out");
        assert_eq!(pop(&m).unwrap().message.sequence, 1);
        g.streamed(1, 1, now);
        assert_eq!(g.info(now).backlog, 0);
    }

    /// The rule and its texts are `group::admission`'s (tested there); a
    /// group answers with it, for its own first member's terms.
    #[test]
    fn a_member_must_ask_for_the_patterns_and_ack_mode_of_the_first() {
        use crate::group::admission::{Terms, admit};
        let patterns =
            |p: &[&str]| -> Vec<TopicPattern> { p.iter().map(|p| TopicPattern::parse(p).unwrap()).collect() };
        let limits = GroupLimits {
            backlog: BacklogLimits {
                capacity: 10,
                max_bytes: usize::MAX,
            },
            max_delivery_attempts: 0,
        };
        let (t, u) = (patterns(&["t"]), patterns(&["u"]));
        for (fixed, other) in [(AckMode::Auto, AckMode::Manual), (AckMode::Manual, AckMode::Auto)] {
            let g = ConsumerGroup::new(0, "g".into(), t.clone(), fixed, limits, Instant::now());
            let first = Terms {
                patterns: &t,
                ack_mode: Some(fixed),
            };
            for (asked, mode) in [(&t, fixed), (&t, other), (&u, other)] {
                let terms = Terms {
                    patterns: asked,
                    ack_mode: Some(mode),
                };
                assert_eq!(g.admits(asked, mode), admit("g", first, terms), "{asked:?} {mode:?}");
            }
            assert!(g.admits(&t, other).is_err() && g.admits(&u, fixed).is_err());
        }
    }

    #[test]
    fn overflow_drops_the_oldest() {
        let now = Instant::now();
        let g = group(2, 0);
        assert_eq!(g.offer(published(1), now), 0);
        assert_eq!(g.offer(published(2), now), 0);
        assert_eq!(g.offer(published(3), now), 1);
        assert_eq!(g.counters().dropped, 1);
        let m = member(1, 8);
        g.join(m.key, m.queue.clone(), settings(AckMode::Auto, 8), now);
        assert_eq!(pop(&m).unwrap().message.sequence, 2);
    }

    #[test]
    fn a_backlog_over_its_byte_limit_drops_the_oldest() {
        let now = Instant::now();
        let size = published(0).size();
        let p = vec![TopicPattern::parse("t").unwrap()];
        // Room for two and a half messages by bytes, ten by count.
        let g = ConsumerGroup::new(
            0,
            "g".into(),
            p,
            AckMode::Auto,
            GroupLimits {
                backlog: BacklogLimits {
                    capacity: 10,
                    max_bytes: 2 * size + size / 2,
                },
                max_delivery_attempts: 0,
            },
            now,
        );
        assert_eq!(g.offer(published(1), now), 0);
        assert_eq!(g.offer(published(2), now), 0);
        assert_eq!(g.info(now).backlog_bytes, 2 * size);
        assert_eq!(g.offer(published(3), now), 1, "the oldest makes room");
        assert_eq!(g.info(now).backlog, 2);
        assert_eq!(g.info(now).backlog_bytes, 2 * size);
        let m = member(1, 8);
        g.join(m.key, m.queue.clone(), settings(AckMode::Auto, 8), now);
        assert_eq!(pop(&m).unwrap().message.sequence, 2);
        assert_eq!(g.info(now).backlog_bytes, 0, "handed out");
    }

    #[test]
    fn nack_prefers_another_member_and_late_acks_are_unknown() {
        let now = Instant::now();
        let g = group(10, 0);
        let (a, b) = (member(1, 4), member(2, 4));
        g.join(a.key, a.queue.clone(), settings(AckMode::Manual, 4), now);
        g.offer(published(1), now);
        assert_eq!(pop(&a).unwrap().attempt, 1);
        g.join(b.key, b.queue.clone(), settings(AckMode::Manual, 4), now);
        assert_eq!(g.nack(1, &[1, 99], now).nacked.requeued, 1);
        let redelivered = pop(&b).expect("the other member gets it");
        assert_eq!((redelivered.message.sequence, redelivered.attempt), (1, 2));
        assert_eq!(
            g.ack(1, &[1], now),
            Acked { acked: 0, unknown: 1 },
            "late ack from the old holder"
        );
        assert_eq!(g.ack(2, &[1], now), Acked { acked: 1, unknown: 0 });
        assert_eq!(g.counters().redeliveries, 1);
    }

    #[test]
    fn deadline_expiry_redelivers_and_dead_letters_after_max_attempts() {
        let start = Instant::now();
        let g = group(10, 2);
        let m = member(1, 4);
        g.join(m.key, m.queue.clone(), settings(AckMode::Manual, 4), start);
        assert_eq!(g.info(start).oldest_unacked_age, None);
        g.offer(published(7), start);
        assert_eq!(pop(&m).unwrap().attempt, 1);
        let age = g.info(start + Duration::from_secs(3)).oldest_unacked_age;
        assert_eq!(age, Some(Duration::from_secs(3)));
        assert!(g.expire(start + Duration::from_secs(9)).is_empty());
        assert!(g.expire(start + Duration::from_secs(10)).is_empty());
        assert_eq!(pop(&m).unwrap().attempt, 2);
        let dead = g.expire(start + Duration::from_secs(20));
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].attempts, 2);
        assert_eq!(g.counters().dead_lettered, 1);
        assert_eq!(g.info(start).in_flight, 0);
    }

    #[test]
    fn idle_groups_are_removed_after_the_ttl() {
        let start = Instant::now();
        let g = group(10, 0);
        let m = member(1, 4);
        g.join(m.key, m.queue.clone(), settings(AckMode::Auto, 4), start);
        g.leave(1, VecDeque::new(), start);
        g.offer(published(1), start);
        assert_eq!(
            g.remove_if_idle(start + Duration::from_secs(4), Duration::from_secs(5)),
            None
        );
        assert_eq!(
            g.remove_if_idle(start + Duration::from_secs(5), Duration::from_secs(5)),
            Some(1)
        );
        assert!(
            !g.join(2, member(2, 4).queue.clone(), settings(AckMode::Auto, 4), start),
            "removed groups take no members"
        );
    }

    #[test]
    fn a_group_that_never_acks_is_stalled_whatever_its_ack_deadline() {
        let start = Instant::now();
        let secs = |n| start + Duration::from_secs(n);
        let g = group_at(10, 0, start);
        let m = member(1, 4);
        g.join(m.key, m.queue.clone(), settings(AckMode::Manual, 4), start);
        // Idle for a minute: no work, so not stalled, however long ago the
        // last ack was (the maintenance tick notes it).
        assert!(g.expire(secs(60)).is_empty());
        assert_eq!(g.info(secs(60)).stalled, Duration::ZERO);
        g.offer(published(1), secs(60));
        assert_eq!(pop(&m).unwrap().attempt, 1);
        assert_eq!(g.info(secs(65)).stalled, Duration::from_secs(5));
        // The 10 s deadline passes: redelivered, still not progress.
        assert!(g.expire(secs(70)).is_empty());
        assert_eq!(pop(&m).unwrap().attempt, 2);
        assert_eq!(g.counters().redeliveries, 1);
        let s = g.info(secs(75));
        assert_eq!(s.stalled, Duration::from_secs(15));
        assert_eq!(
            s.oldest_unacked_age,
            Some(Duration::from_secs(5)),
            "restarted at the redelivery"
        );
        // An ack is progress; with nothing left the group is not stalled.
        assert_eq!(g.ack(1, &[1], secs(76)), Acked { acked: 1, unknown: 0 });
        assert_eq!(g.counters().acked, 1);
        assert_eq!(g.info(secs(80)).stalled, Duration::ZERO);
        // New work: counted from the last tick that saw none (the broker
        // ticks every 50 ms), not from the ack long before.
        assert!(g.expire(secs(89)).is_empty());
        g.offer(published(2), secs(90));
        assert_eq!(g.info(secs(95)).stalled, Duration::from_secs(6));
        assert!(g.expire(secs(95)).is_empty());
        assert_eq!(
            g.info(secs(96)).stalled,
            Duration::from_secs(7),
            "work held: the tick changes nothing"
        );
    }

    #[test]
    fn a_stall_is_reported_once_until_the_group_progresses() {
        let start = Instant::now();
        let secs = |n| start + Duration::from_secs(n);
        let after = crate::group::stall::STALL_WARNING_AFTER;
        let g = group_at(10, 0, start);
        let m = member(1, 4);
        g.join(m.key, m.queue.clone(), settings(AckMode::Manual, 4), start);
        g.offer(published(1), start);
        pop(&m).unwrap();
        assert!(g.stall_to_report(secs(44)).is_none());
        let s = g.stall_to_report(secs(45)).expect("stalled for 45 s");
        assert_eq!((s.members, s.in_flight, s.stalled), (1, 1, after));
        assert!(g.stall_to_report(secs(100)).is_none(), "once per stall");
        g.ack(1, &[1], secs(100));
        g.offer(published(2), secs(100));
        pop(&m).unwrap();
        assert!(g.stall_to_report(secs(144)).is_none());
        assert!(g.stall_to_report(secs(145)).is_some(), "a new stall");
    }

    #[test]
    fn auto_ack_progress_and_memberless_time() {
        let start = Instant::now();
        let secs = |n| start + Duration::from_secs(n);
        let g = group_at(10, 0, start);
        assert_eq!(g.info(secs(3)).memberless, Some(Duration::from_secs(3)));
        let m = member(1, 4);
        g.join(m.key, m.queue.clone(), settings(AckMode::Auto, 4), secs(3));
        assert_eq!(g.info(secs(4)).memberless, None);
        assert!(g.expire(secs(4)).is_empty(), "the idle tick");
        g.offer(published(1), secs(4));
        g.offer(published(2), secs(4));
        assert_eq!(g.info(secs(9)).stalled, Duration::from_secs(5), "queued, not streamed");
        pop(&m).unwrap();
        g.streamed(1, 1, secs(10));
        assert_eq!(
            g.info(secs(12)).stalled,
            Duration::from_secs(2),
            "one streamed at 10, one held"
        );
        g.leave(
            1,
            m.queue.close(crate::engine::CloseReason::Cancelled, None).unwrap(),
            secs(20),
        );
        let s = g.info(secs(50));
        assert_eq!((s.members, s.backlog), (0, 1));
        assert_eq!(s.memberless, Some(Duration::from_secs(30)));
        assert_eq!(s.stalled, Duration::from_secs(40), "a memberless backlog waits too");
    }
}
