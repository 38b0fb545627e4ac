//! Consumer groups (DELIVERY_MODE_SINGLE): one shared backlog, members that
//! each hold at most `max_in_flight` messages, manual acks with deadlines,
//! redelivery and dead-lettering.
//!
//! # The life of a message in a group
//!
//! Every message offered to a group is, at any moment, in exactly one place
//! (a property test below checks it after every step):
//!
//! ```text
//!            offer                 dispatch
//!  publish ────────► backlog ───────────────► member's queue
//!                      ▲  ▲                      │ the member's stream takes it
//!     overflow: oldest │  │ taken back           ▼
//!     dropped, counted │  │ (nack, deadline,  on the stream ──► done: streamed (auto),
//!                      │  │  member left)      (manual: in       acked (manual)
//!                      │  └──────────────────  flight) ────────► dead letter after the
//!                      │                                          last attempt
//!                      └── removed with the group (idle TTL, shutdown): dropped, counted
//! ```
//!
//! A message taken back before it left the member's queue was never
//! delivered: it goes back as it was, without using an attempt
//! ([`Retry::Unsent`]). One taken back from the stream used an attempt: it is
//! redelivered ([`Retry::Again`]) or, after the last allowed attempt,
//! dead-lettered ([`Retry::Exhausted`]).
//!
//! All of it happens under the group's one lock, for one short transition per
//! call; dead letters are returned to the caller, which publishes them
//! outside it. Time is passed in (`now`), so the logic is tested without a
//! clock.
//!
//! Who gets the next message ([`pick_member`]) and when a failed delivery
//! was the last allowed ([`attempts_exhausted`]) are decided here for both
//! engines: a cluster hub (`cluster/groups/state.rs`) uses the same two
//! functions.

use super::queue::Push;
use super::{Delivery, Published, Subscription};
use crate::engine::validate;
use crate::engine::{AckMode, Acked, BrokerError, GroupInfo, Nacked};
use crate::topic::TopicPattern;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// A member's settings, fixed when it joins.
#[derive(Debug, Clone, Copy)]
pub struct MemberSettings {
    pub ack_mode: AckMode,
    pub max_in_flight: u32,
    pub ack_deadline: Duration,
}

/// What bounds a group, fixed when it is created.
#[derive(Debug, Clone, Copy)]
pub struct GroupLimits {
    /// Most messages the backlog holds (`TINYBROKER_GROUP_CAPACITY`).
    pub capacity: usize,
    /// Most bytes the backlog holds (`TINYBROKER_GROUP_MAX_BYTES`).
    pub max_bytes: usize,
    /// Deliveries tried before a message is dead-lettered; 0 = no limit.
    pub max_delivery_attempts: u32,
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
    /// trie, before any member's queue (the lock order in `broker/mod.rs`).
    state: Mutex<GroupState>,
    /// Messages written to members' streams (redeliveries included), added
    /// by the streams in batches without taking the lock.
    delivered: AtomicU64,
}

struct GroupState {
    limits: GroupLimits,
    backlog: Backlog,
    members: Vec<MemberSlot>,
    /// Round-robin position in `members`.
    cursor: usize,
    /// Manual-ack messages on a member's stream or queue, by sequence.
    in_flight: HashMap<u64, InFlight>,
    /// When the last member left (None while any member is connected).
    idle_since: Option<Instant>,
    /// Set when the group is removed; a joining member then starts a new one.
    removed: bool,
    /// The last time the group completed a message (an ack, or an auto-ack
    /// member's stream taking one) or was seen with no work at all (the
    /// maintenance tick looks every 50 ms): [`GroupInfo::stalled`] is
    /// measured from here.
    progress_at: Instant,
    /// Set once the current stall has been reported (logged).
    stall_reported: bool,
    counters: GroupCounters,
}

/// Lifetime counts of one group.
#[derive(Debug, Default, Clone, Copy)]
struct GroupCounters {
    redeliveries: u64,
    dead_lettered: u64,
    /// Oldest backlog messages dropped because the backlog was full.
    dropped: u64,
    /// Messages acked by manual-ack members.
    acked: u64,
}

/// Messages waiting for a member with room, oldest first, and their bytes.
#[derive(Default)]
struct Backlog {
    items: VecDeque<Pending>,
    bytes: usize,
}

impl Backlog {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    fn front(&self) -> Option<&Pending> {
        self.items.front()
    }

    fn push_back(&mut self, pending: Pending) {
        self.bytes += pending.message.size();
        self.items.push_back(pending);
    }

    fn push_front(&mut self, pending: Pending) {
        self.bytes += pending.message.size();
        self.items.push_front(pending);
    }

    fn pop_front(&mut self) -> Option<Pending> {
        let pending = self.items.pop_front()?;
        self.bytes -= pending.message.size();
        Some(pending)
    }

    fn clear(&mut self) {
        self.items.clear();
        self.bytes = 0;
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = &Pending> {
        self.items.iter()
    }
}

/// A message in the backlog.
struct Pending {
    message: Arc<Published>,
    /// Deliveries that already reached a member's stream.
    attempts: u32,
    /// A member to pass over when another has room (the one that nacked it).
    avoid: Option<u64>,
}

struct MemberSlot {
    key: u64,
    subscription: Arc<Subscription>,
    settings: MemberSettings,
    /// Messages this member holds: queued for its stream, plus (manual)
    /// on its stream and not yet acked.
    held: u32,
}

/// A manual-ack message handed to a member and not acked yet.
struct InFlight {
    member: u64,
    attempt: u32,
    message: Arc<Published>,
    handed_out: Instant,
    deadline: Instant,
}

/// Where a message taken back from a member goes.
enum Retry {
    /// It never left the member's queue: back as it was, no attempt used.
    Unsent(Pending),
    /// It reached the member's stream: the attempt counts, it goes again.
    Again(Pending),
    /// That was its last allowed attempt.
    Exhausted(DeadLetter),
}

/// Messages taken back in one transition, settled at its end: the retries
/// go to the front of the backlog (lowest sequence first), the dead letters
/// to the caller.
#[derive(Default)]
struct TakenBack {
    retries: Vec<Pending>,
    dead_letters: Vec<DeadLetter>,
}

impl TakenBack {
    fn add(&mut self, retry: Retry) {
        match retry {
            Retry::Unsent(pending) | Retry::Again(pending) => self.retries.push(pending),
            Retry::Exhausted(letter) => self.dead_letters.push(letter),
        }
    }
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
                limits,
                backlog: Backlog::default(),
                members: Vec::new(),
                cursor: 0,
                in_flight: HashMap::new(),
                idle_since: Some(now),
                removed: false,
                progress_at: now,
                stall_reported: false,
                counters: GroupCounters::default(),
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
        if self.patterns != patterns {
            return Err(BrokerError::FailedPrecondition(format!(
                "consumer group {:?} has topic_patterns {}; this member asked for {}; all members of a group must use the same set",
                validate::truncate(&self.name),
                validate::pattern_list(&self.patterns),
                validate::pattern_list(patterns)
            )));
        }
        validate::same_ack_mode(&self.name, self.ack_mode, ack_mode)
    }

    #[cfg(test)]
    fn counters(&self) -> GroupCounters {
        self.state.lock().counters
    }

    /// A member's stream wrote `count` messages.
    pub(crate) fn add_delivered(&self, count: u64) {
        self.delivered.fetch_add(count, Ordering::Relaxed);
    }

    /// What Admin and the metrics see.
    pub fn info(&self, now: Instant) -> GroupInfo {
        let state = self.state.lock();
        GroupInfo {
            name: self.name.to_string(),
            topic_patterns: self.patterns.iter().map(|p| p.to_string()).collect(),
            members: state.members.len(),
            backlog: state.backlog.len(),
            backlog_bytes: state.backlog.bytes,
            in_flight: state.members.iter().map(|m| m.held as usize).sum(),
            oldest_unacked_age: state
                .in_flight
                .values()
                .map(|f| now.saturating_duration_since(f.handed_out))
                .max(),
            stalled: if state.has_work() {
                now.saturating_duration_since(state.progress_at)
            } else {
                Duration::ZERO
            },
            memberless: state
                .idle_since
                .filter(|_| state.members.is_empty())
                .map(|since| now.saturating_duration_since(since)),
            redeliveries: state.counters.redeliveries,
            dead_lettered: state.counters.dead_lettered,
            dropped: state.counters.dropped,
            acked: state.counters.acked,
            delivered: self.delivered.load(Ordering::Relaxed),
        }
    }

    /// The group's view, once per stall, when it has been stalled for
    /// `after` (for the broker's WARN line).
    pub(crate) fn stall_to_report(&self, now: Instant, after: Duration) -> Option<GroupInfo> {
        {
            let mut state = self.state.lock();
            if state.stall_reported || !state.has_work() || now.saturating_duration_since(state.progress_at) < after {
                return None;
            }
            state.stall_reported = true;
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
        let limits = state.limits;
        let mut dropped = 0;
        // The newest message always gets in, however large.
        while !state.backlog.is_empty()
            && (state.backlog.len() >= limits.capacity || state.backlog.bytes + message.size() > limits.max_bytes)
        {
            state.backlog.pop_front();
            dropped += 1;
        }
        state.counters.dropped += dropped;
        state.backlog.push_back(Pending {
            message,
            attempts: 0,
            avoid: None,
        });
        state.dispatch(now);
        dropped
    }

    /// Adds a member (its patterns were checked by the caller) and hands it
    /// what the backlog holds. False when the group was removed meanwhile.
    pub(crate) fn join(&self, subscription: Arc<Subscription>, settings: MemberSettings, now: Instant) -> bool {
        let mut state = self.state.lock();
        if state.removed {
            return false;
        }
        state.members.push(MemberSlot {
            key: subscription.key,
            subscription,
            settings,
            held: 0,
        });
        state.idle_since = None;
        state.dispatch(now);
        true
    }

    /// A member left (cancelled, closed or shutting down). `unstreamed` is
    /// what its queue still held: never delivered, so it goes back as it was;
    /// its manual-ack messages that did reach its stream are retried.
    /// Returns the dead letters that made.
    pub(crate) fn leave(&self, member: u64, unstreamed: VecDeque<Delivery>, now: Instant) -> Vec<DeadLetter> {
        let mut state = self.state.lock();
        state.members.retain(|m| m.key != member);
        if state.members.is_empty() && state.idle_since.is_none() {
            state.idle_since = Some(now);
        }
        let mut taken = TakenBack::default();
        let never_streamed: HashSet<u64> = unstreamed.iter().map(|d| d.message.sequence).collect();
        for delivery in unstreamed {
            state.in_flight.remove(&delivery.message.sequence);
            taken.add(Retry::Unsent(Pending {
                message: delivery.message,
                attempts: delivery.attempt - 1,
                avoid: None,
            }));
        }
        let on_its_stream: Vec<u64> = state
            .in_flight
            .iter()
            .filter(|(seq, f)| f.member == member && !never_streamed.contains(seq))
            .map(|(seq, _)| *seq)
            .collect();
        for seq in on_its_stream {
            if let Some(flight) = state.in_flight.remove(&seq) {
                let retry = state.attempt_failed(flight, None);
                taken.add(retry);
            }
        }
        state.settle(taken, now)
    }

    /// An auto-ack member's stream took `count` messages: they are done, and
    /// the member has room for as many more.
    pub(crate) fn streamed(&self, member: u64, count: u32, now: Instant) {
        let mut state = self.state.lock();
        if let Some(slot) = state.members.iter_mut().find(|m| m.key == member) {
            slot.held = slot.held.saturating_sub(count);
        }
        if count > 0 {
            state.progressed(now);
        }
        state.dispatch(now);
    }

    /// Marks messages done. A sequence this member does not hold (never had,
    /// already acked, or lost to a redelivery) is unknown and changes nothing.
    pub(crate) fn ack(&self, member: u64, sequences: &[u64], now: Instant) -> Acked {
        let mut state = self.state.lock();
        let mut result = Acked::default();
        for seq in sequences {
            let Some(flight) = state.in_flight.remove_if_held_by(*seq, member) else {
                result.unknown += 1;
                continue;
            };
            // A redelivery to the same member may still wait in its queue:
            // the ack covers it too. A first delivery cannot (the member has
            // seen it), which spares the common case the scan.
            if flight.attempt > 1
                && let Some(slot) = state.members.iter().find(|m| m.key == member)
            {
                slot.subscription.queue.remove(*seq);
            }
            state.release(member);
            result.acked += 1;
        }
        if result.acked > 0 {
            state.progressed(now);
            state.counters.acked += u64::from(result.acked);
        }
        state.dispatch(now);
        result
    }

    /// Hands messages back for immediate redelivery, preferably to another
    /// member. A message that used its last attempt is dead-lettered
    /// instead (and still counted as requeued: the member no longer holds
    /// it).
    pub(crate) fn nack(&self, member: u64, sequences: &[u64], now: Instant) -> NackOutcome {
        let mut state = self.state.lock();
        let mut nacked = Nacked::default();
        let mut taken = TakenBack::default();
        for seq in sequences {
            let Some(flight) = state.in_flight.remove_if_held_by(*seq, member) else {
                nacked.unknown += 1;
                continue;
            };
            state.release(member);
            let retry = state.take_back(flight, Some(member));
            taken.add(retry);
            nacked.requeued += 1;
        }
        NackOutcome {
            nacked,
            dead_letters: state.settle(taken, now),
        }
    }

    /// Takes back manual-ack messages whose ack deadline has passed. Also
    /// notes a group with no work as not stalled (see
    /// [`GroupInfo::stalled`]); the maintenance tick calls this. Returns the
    /// dead letters that made.
    pub(crate) fn expire(&self, now: Instant) -> Vec<DeadLetter> {
        let mut state = self.state.lock();
        if !state.has_work() {
            state.progressed(now);
        }
        let expired: Vec<u64> = state
            .in_flight
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(seq, _)| *seq)
            .collect();
        if expired.is_empty() {
            return Vec::new();
        }
        let mut taken = TakenBack::default();
        for seq in expired {
            if let Some(flight) = state.in_flight.remove(&seq) {
                state.release(flight.member);
                let holder = flight.member;
                let retry = state.take_back(flight, Some(holder));
                taken.add(retry);
            }
        }
        state.settle(taken, now)
    }

    /// Some (and the group is marked removed) when it has had no member for
    /// `ttl`: the number of messages it still held, for counting.
    pub(crate) fn remove_if_idle(&self, now: Instant, ttl: Duration) -> Option<usize> {
        let mut state = self.state.lock();
        match state.idle_since {
            Some(since) if state.members.is_empty() && now.saturating_duration_since(since) >= ttl => {
                Some(state.remove())
            }
            _ => None,
        }
    }

    /// Shutdown: empties the group; returns how many messages it held.
    pub(crate) fn discard_all(&self) -> usize {
        self.state.lock().remove()
    }
}

/// Who gets the next message, in both engines (this file's dispatch, and a
/// cluster hub's, `cluster/groups/state.rs`): round-robin from `cursor`
/// over `n` members, the first with room (`has_room`) that is not the
/// member the message failed with (`avoided`, the one that nacked it or let
/// its deadline pass), else that member when it alone has room. The cursor
/// moves past the one picked.
pub(crate) fn pick_member(
    cursor: &mut usize,
    n: usize,
    has_room: impl Fn(usize) -> bool,
    avoided: impl Fn(usize) -> bool,
) -> Option<usize> {
    let mut fallback = None;
    for i in 0..n {
        let index = (*cursor + i) % n;
        if !has_room(index) {
            continue;
        }
        if avoided(index) {
            fallback.get_or_insert(index);
            continue;
        }
        *cursor = index + 1;
        return Some(index);
    }
    let index = fallback?;
    *cursor = index + 1;
    Some(index)
}

/// Whether a delivery that failed at `attempt` was the last allowed
/// (`max` = `TINYBROKER_MAX_DELIVERY_ATTEMPTS`, 0 = no limit): the message
/// is dead-lettered rather than tried again. Both engines.
pub(crate) fn attempts_exhausted(attempt: u32, max: u32) -> bool {
    max > 0 && attempt >= max
}

/// In-flight messages, looked up by who holds them.
trait InFlightExt {
    /// Removes `seq` if `member` holds it.
    fn remove_if_held_by(&mut self, seq: u64, member: u64) -> Option<InFlight>;
}

impl InFlightExt for HashMap<u64, InFlight> {
    fn remove_if_held_by(&mut self, seq: u64, member: u64) -> Option<InFlight> {
        if self.get(&seq).is_some_and(|f| f.member == member) {
            return self.remove(&seq);
        }
        None
    }
}

impl GroupState {
    /// The group completed a message, or has nothing to do.
    fn progressed(&mut self, now: Instant) {
        self.progress_at = now;
        self.stall_reported = false;
    }

    /// Whether anything waits in the backlog or is held by a member.
    fn has_work(&self) -> bool {
        !self.backlog.is_empty() || self.members.iter().any(|m| m.held > 0)
    }

    /// Marks the group removed and empties it; returns how many messages it
    /// still held.
    fn remove(&mut self) -> usize {
        self.removed = true;
        let left = self.backlog.len() + self.in_flight.len();
        self.backlog.clear();
        self.in_flight.clear();
        left
    }

    /// Hands backlog messages to members with room, round-robin.
    fn dispatch(&mut self, now: Instant) {
        while let Some(front) = self.backlog.front() {
            let Some(index) = self.pick_member(front.avoid) else {
                return;
            };
            let Some(pending) = self.backlog.pop_front() else {
                return;
            };
            let slot = &mut self.members[index];
            let attempt = pending.attempts + 1;
            // Only a manual-ack member's message is also kept in flight; an
            // auto-ack delivery hands over the group's only reference.
            let kept = (slot.settings.ack_mode == AckMode::Manual).then(|| pending.message.clone());
            let delivery = Delivery {
                message: pending.message,
                attempt,
            };
            let refused = match slot.subscription.queue.push(delivery) {
                Push::Queued => {
                    slot.held += 1;
                    if let Some(message) = kept {
                        let (member, deadline) = (slot.key, now + slot.settings.ack_deadline);
                        self.in_flight.insert(
                            message.sequence,
                            InFlight {
                                member,
                                attempt,
                                message,
                                handed_out: now,
                                deadline,
                            },
                        );
                    }
                    continue;
                }
                // A member's queue holds `max_in_flight` and the member is
                // only picked while it holds fewer: a full queue means the
                // accounting is broken.
                Push::Full { item, .. } => {
                    debug_assert!(false, "a member with room had a full queue");
                    tracing::error!(
                        consumer_group_member = slot.subscription.id(),
                        "bug: a consumer-group member with room had a full queue; it leaves the rotation"
                    );
                    item
                }
                // The member is leaving (its `leave` is on the way).
                Push::Closed(item) => item,
            };
            // Take the member out of the rotation and keep the message.
            self.members.remove(index);
            self.backlog.push_front(Pending {
                message: refused.message,
                attempts: attempt - 1,
                avoid: pending.avoid,
            });
        }
    }

    fn pick_member(&mut self, avoid: Option<u64>) -> Option<usize> {
        let members = &self.members;
        pick_member(
            &mut self.cursor,
            members.len(),
            |i| members[i].held < members[i].settings.max_in_flight,
            |i| avoid == Some(members[i].key),
        )
    }

    /// A manual-ack message is taken back from the member holding it (a
    /// nack, or its deadline passed), to be passed over `avoid` next time.
    fn take_back(&mut self, flight: InFlight, avoid: Option<u64>) -> Retry {
        let holder = self.members.iter().find(|m| m.key == flight.member);
        if holder.is_some_and(|m| m.subscription.queue.remove(flight.message.sequence).is_some()) {
            return Retry::Unsent(Pending {
                message: flight.message,
                attempts: flight.attempt - 1,
                avoid,
            });
        }
        self.attempt_failed(flight, avoid)
    }

    /// A delivery that reached a member's stream did not complete: the
    /// message goes again, or is dead-lettered after its last allowed
    /// attempt.
    fn attempt_failed(&mut self, flight: InFlight, avoid: Option<u64>) -> Retry {
        if attempts_exhausted(flight.attempt, self.limits.max_delivery_attempts) {
            self.counters.dead_lettered += 1;
            return Retry::Exhausted(DeadLetter {
                message: flight.message,
                attempts: flight.attempt,
            });
        }
        self.counters.redeliveries += 1;
        Retry::Again(Pending {
            message: flight.message,
            attempts: flight.attempt,
            avoid,
        })
    }

    /// Ends a transition that took messages back: the retries go to the
    /// front of the backlog, lowest sequence first, and are dispatched; the
    /// dead letters are returned for the caller to publish.
    fn settle(&mut self, mut taken: TakenBack, now: Instant) -> Vec<DeadLetter> {
        taken.retries.sort_by_key(|p| std::cmp::Reverse(p.message.sequence));
        for pending in taken.retries {
            self.backlog.push_front(pending);
        }
        self.dispatch(now);
        taken.dead_letters
    }

    fn release(&mut self, member: u64) {
        if let Some(slot) = self.members.iter_mut().find(|m| m.key == member) {
            slot.held = slot.held.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::queue::Queue;
    use proptest::prelude::*;
    use std::task::{Context, Poll, Waker};

    fn published(seq: u64) -> Arc<Published> {
        Arc::new(Published::for_test("t", seq))
    }

    fn member(key: u64, capacity: usize) -> Arc<Subscription> {
        Arc::new(Subscription::new(
            key,
            format!("m{key}").into(),
            vec![TopicPattern::parse("t").unwrap()],
            None,
            Queue::new(capacity, usize::MAX),
            None,
        ))
    }

    fn settings(mode: AckMode, max_in_flight: u32) -> MemberSettings {
        MemberSettings {
            ack_mode: mode,
            max_in_flight,
            ack_deadline: Duration::from_secs(10),
        }
    }

    fn pop(sub: &Subscription) -> Option<Delivery> {
        match sub.queue.poll_pop(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(d) => d,
            Poll::Pending => None,
        }
    }

    fn group(capacity: usize, max_attempts: u32) -> ConsumerGroup {
        group_at(capacity, max_attempts, Instant::now())
    }

    fn group_at(capacity: usize, max_attempts: u32, now: Instant) -> ConsumerGroup {
        let p = vec![TopicPattern::parse("t").unwrap()];
        let limits = GroupLimits {
            capacity,
            max_bytes: usize::MAX,
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
        g.join(m.clone(), settings(AckMode::Auto, 2), now);
        assert_eq!(g.info(now).backlog, 1, "only max_in_flight handed out");
        assert_eq!(pop(&m).unwrap().message.sequence, 1);
        g.streamed(1, 1, now);
        assert_eq!(g.info(now).backlog, 0);
    }

    #[test]
    fn a_member_must_ask_for_the_patterns_and_ack_mode_of_the_first() {
        let patterns =
            |p: &[&str]| -> Vec<TopicPattern> { p.iter().map(|p| TopicPattern::parse(p).unwrap()).collect() };
        let limits = GroupLimits {
            capacity: 10,
            max_bytes: usize::MAX,
            max_delivery_attempts: 0,
        };
        for (fixed, other) in [(AckMode::Auto, AckMode::Manual), (AckMode::Manual, AckMode::Auto)] {
            let g = ConsumerGroup::new(0, "g".into(), patterns(&["t"]), fixed, limits, Instant::now());
            assert_eq!(g.admits(&patterns(&["t"]), fixed), Ok(()));
            let Err(BrokerError::FailedPrecondition(message)) = g.admits(&patterns(&["t"]), other) else {
                panic!("{other:?} joined a group of {fixed:?}");
            };
            assert_eq!(
                message,
                format!(
                    "consumer group \"g\" was opened with ack_mode {}; this member asked for {}; all members of a group must use the same ack mode (ACK_MODE_UNSPECIFIED is ACK_MODE_AUTO)",
                    validate::ack_mode_name(fixed),
                    validate::ack_mode_name(other)
                )
            );
            let Err(BrokerError::FailedPrecondition(message)) = g.admits(&patterns(&["u"]), other) else {
                panic!("other patterns joined");
            };
            assert!(
                message.contains("has topic_patterns [t]; this member asked for [u]"),
                "{message}"
            );
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
        g.join(m.clone(), settings(AckMode::Auto, 8), now);
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
                capacity: 10,
                max_bytes: 2 * size + size / 2,
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
        g.join(m.clone(), settings(AckMode::Auto, 8), now);
        assert_eq!(pop(&m).unwrap().message.sequence, 2);
        assert_eq!(g.info(now).backlog_bytes, 0, "handed out");
    }

    #[test]
    fn nack_prefers_another_member_and_late_acks_are_unknown() {
        let now = Instant::now();
        let g = group(10, 0);
        let (a, b) = (member(1, 4), member(2, 4));
        g.join(a.clone(), settings(AckMode::Manual, 4), now);
        g.offer(published(1), now);
        assert_eq!(pop(&a).unwrap().attempt, 1);
        g.join(b.clone(), settings(AckMode::Manual, 4), now);
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
        g.join(m.clone(), settings(AckMode::Manual, 4), start);
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
        g.join(m.clone(), settings(AckMode::Auto, 4), start);
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
            !g.join(member(2, 4), settings(AckMode::Auto, 4), start),
            "removed groups take no members"
        );
    }

    #[test]
    fn a_group_that_never_acks_is_stalled_whatever_its_ack_deadline() {
        let start = Instant::now();
        let secs = |n| start + Duration::from_secs(n);
        let g = group_at(10, 0, start);
        let m = member(1, 4);
        g.join(m.clone(), settings(AckMode::Manual, 4), start);
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
        let after = Duration::from_secs(45);
        let g = group_at(10, 0, start);
        let m = member(1, 4);
        g.join(m.clone(), settings(AckMode::Manual, 4), start);
        g.offer(published(1), start);
        pop(&m).unwrap();
        assert!(g.stall_to_report(secs(44), after).is_none());
        let s = g.stall_to_report(secs(45), after).expect("stalled for 45 s");
        assert_eq!((s.members, s.in_flight, s.stalled), (1, 1, after));
        assert!(g.stall_to_report(secs(100), after).is_none(), "once per stall");
        g.ack(1, &[1], secs(100));
        g.offer(published(2), secs(100));
        pop(&m).unwrap();
        assert!(g.stall_to_report(secs(144), after).is_none());
        assert!(g.stall_to_report(secs(145), after).is_some(), "a new stall");
    }

    #[test]
    fn auto_ack_progress_and_memberless_time() {
        let start = Instant::now();
        let secs = |n| start + Duration::from_secs(n);
        let g = group_at(10, 0, start);
        assert_eq!(g.info(secs(3)).memberless, Some(Duration::from_secs(3)));
        let m = member(1, 4);
        g.join(m.clone(), settings(AckMode::Auto, 4), secs(3));
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

    #[derive(Debug, Clone)]
    enum Op {
        Publish,
        Join(bool, u32),
        Leave(usize),
        /// A member's stream takes one message from its queue.
        Stream(usize),
        Ack(usize, usize),
        Nack(usize, usize),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Publish),
            1 => (any::<bool>(), 1u32..4).prop_map(|(m, n)| Op::Join(m, n)),
            1 => any::<usize>().prop_map(Op::Leave),
            4 => any::<usize>().prop_map(Op::Stream),
            2 => (any::<usize>(), any::<usize>()).prop_map(|(m, s)| Op::Ack(m, s)),
            1 => (any::<usize>(), any::<usize>()).prop_map(|(m, s)| Op::Nack(m, s)),
            1 => (0u64..15).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Every published message is, at every step, in exactly one place,
        /// and never held by two members at once.
        #[test]
        fn every_message_is_in_exactly_one_place(ops in prop::collection::vec(op(), 1..120), capacity in 1usize..8, max_attempts in 0u32..4) {
            let mut now = Instant::now();
            let g = group(capacity, max_attempts);
            let mut next_seq = 0u64;
            let mut next_key = 1u64;
            // (subscription, manual, sequences on its stream not yet acked)
            let mut members: Vec<(Arc<Subscription>, bool, Vec<u64>)> = Vec::new();
            let mut done: HashSet<u64> = HashSet::new();
            let mut dead_total = 0u64;
            for op in ops {
                match op {
                    Op::Publish => {
                        next_seq += 1;
                        g.offer(published(next_seq), now);
                    }
                    Op::Join(manual, max) => {
                        let sub = member(next_key, max as usize);
                        next_key += 1;
                        let mode = if manual { AckMode::Manual } else { AckMode::Auto };
                        g.join(sub.clone(), settings(mode, max), now);
                        members.push((sub, manual, Vec::new()));
                    }
                    Op::Leave(i) if !members.is_empty() => {
                        let (sub, _, _) = members.remove(i % members.len());
                        let left = sub.queue.close(crate::engine::CloseReason::Cancelled, None).unwrap_or_default();
                        dead_total += g.leave(sub.key, left, now).len() as u64;
                    }
                    Op::Stream(i) if !members.is_empty() => {
                        let n = members.len();
                        let (sub, manual, on_stream) = &mut members[i % n];
                        if let Some(d) = pop(sub) {
                            if *manual {
                                on_stream.push(d.message.sequence);
                            } else {
                                prop_assert!(done.insert(d.message.sequence), "delivered twice");
                                g.streamed(sub.key, 1, now);
                            }
                        }
                    }
                    Op::Ack(i, s) if !members.is_empty() => {
                        let n = members.len();
                        let (sub, _, on_stream) = &mut members[i % n];
                        if !on_stream.is_empty() {
                            let seq = on_stream.remove(s % on_stream.len());
                            if g.ack(sub.key, &[seq], now).acked == 1 {
                                prop_assert!(done.insert(seq), "acked twice");
                            }
                        }
                    }
                    Op::Nack(i, s) if !members.is_empty() => {
                        let n = members.len();
                        let (sub, _, on_stream) = &mut members[i % n];
                        if !on_stream.is_empty() {
                            let seq = on_stream.remove(s % on_stream.len());
                            dead_total += g.nack(sub.key, &[seq], now).dead_letters.len() as u64;
                        }
                    }
                    Op::Tick(secs) => {
                        now += Duration::from_secs(secs);
                        dead_total += g.expire(now).len() as u64;
                    }
                    _ => {}
                }
                // Where every message is now.
                let state = g.state.lock();
                let mut places: HashMap<u64, usize> = HashMap::new();
                for p in state.backlog.iter() {
                    *places.entry(p.message.sequence).or_default() += 1;
                }
                for (sub, manual, _) in &members {
                    let queued: Vec<u64> = sub.queue.sequences();
                    for seq in &queued {
                        *places.entry(*seq).or_default() += 1;
                    }
                    if *manual {
                        for (seq, f) in &state.in_flight {
                            if f.member == sub.key && !queued.contains(seq) {
                                *places.entry(*seq).or_default() += 1;
                            }
                        }
                    }
                }
                for seq in &done {
                    *places.entry(*seq).or_default() += 1;
                }
                let live = places.len() as u64;
                prop_assert!(places.values().all(|&n| n == 1), "a message is in two places: {:?}", places);
                prop_assert_eq!(live + state.counters.dropped + dead_total, next_seq, "every message accounted for");
                prop_assert_eq!(dead_total, state.counters.dead_lettered);
                drop(state);
            }
        }
    }
}
