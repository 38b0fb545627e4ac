//! A consumer group's state machine, for both engines: who gets a message,
//! what a Nack, an expired deadline or a member leaving does with the
//! messages it held, when a message has used its last attempt, what a full
//! backlog drops. No I/O, and no lock but a member's queue (the seam's
//! [`Queue`], innermost) when a message is pushed to a member or taken
//! back from it: time is passed in (`now`), and what the
//! engine must act on (a message done, a dead letter, a message for another
//! replica, one dropped) is appended to [`GroupMachine::out`] in the order it
//! was decided.
//!
//! The single-node engine keeps one behind each group's mutex
//! ([`crate::broker`]'s `group/mod.rs`); a cluster hub keeps one in its task
//! (`cluster/groups/state.rs`), with JetStream as the backlog behind it.
//! What differs between them is data, [`Rules`], not code.
//!
//! # The life of a message
//!
//! Every message offered is, at any moment, in exactly one place (a
//! property test below checks it after every step, under both engines'
//! rules):
//!
//! ```text
//!            offer                 dispatch
//!  publish ────────► backlog ───────────────► member's queue
//!  (cluster: pulled)   ▲  ▲                      │ the member's stream takes it
//!     overflow: oldest │  │ taken back           ▼
//!     dropped          │  │ (nack, deadline,  on the stream ──► done: streamed (AUTO),
//!     (Rules::backlog) │  │  member left)      (MANUAL: in       acked (MANUAL)
//!                      │  └──────────────────  flight) ────────► dead letter after the
//!                      │                           │              last attempt
//!                      │                           └──► elsewhere: no other member here
//!                      │                                has room (NoRoom::Elsewhere)
//!                      └── removed with the group: counted by the caller
//! ```
//!
//! A message taken back before it left the member's queue was never
//! delivered: it goes back as it was, without using an attempt. One taken
//! back from the stream used an attempt: it is redelivered or, after the
//! last allowed attempt ([`attempts_exhausted`]), dead-lettered. A retry is
//! passed over the member it failed with while another has room
//! ([`pick_member`]).
//!
//! A member's room is what `max_in_flight` leaves, and no more than its
//! stream may take now: a session subscription's credit, kept in its queue
//! (`Queue::credit_room`), so nothing waits in a member's queue for credit
//! while another member has room. Credit added is a call here too
//! ([`GroupMachine::room_made`]).

use super::admission::MemberSettings;
use super::backlog::BacklogLimits;
use crate::engine::queue::{Push, Queue};
use crate::engine::{AckMode, Acked, Delivery, Nacked, Published};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Where a failed delivery goes when no member but the one it failed with
/// has room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoRoom {
    /// To the front of the backlog, for the next member with room (that
    /// one included). Single-node mode: the backlog is the whole group.
    Wait,
    /// Out, as [`Event::Elsewhere`]: a cluster hub offers it to the other
    /// replicas' members, and hands what none takes back to JetStream.
    Elsewhere,
}

/// When an AUTO member's message is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AutoDone {
    /// Its stream took it; the stream says how many
    /// ([`GroupMachine::streamed`]), nothing is kept per message.
    Counted,
    /// Its stream took it; the stream names it ([`GroupMachine::done`]),
    /// and the machine keeps it (and its token) until then, with no
    /// deadline: JetStream must hear of each ([`Event::Done`]).
    PerMessage,
}

/// What an engine decides with: the only things that differ between a
/// single-node group and a cluster hub.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rules {
    /// Deliveries tried before a message is dead-lettered; 0 = no limit.
    pub(crate) max_delivery_attempts: u32,
    /// Single-node mode: the backlog's bounds, the oldest dropped past
    /// them. None: the backlog holds only what was pulled for members with
    /// room (a cluster hub; JetStream's stream is bounded).
    pub(crate) backlog: Option<BacklogLimits>,
    pub(crate) no_room: NoRoom,
    pub(crate) auto: AutoDone,
}

/// What the engine must act on, in the order decided. `T` is the engine's
/// token of a message (nothing in single-node mode; the JetStream message
/// in a cluster hub).
#[derive(Debug)]
pub(crate) enum Event<T> {
    /// Done: acked by its MANUAL member, or (AutoDone::PerMessage) taken
    /// by its AUTO member's stream.
    Done(T),
    /// Used its last allowed attempt: published to the dead-letter topic.
    DeadLetter {
        message: Arc<Published>,
        token: T,
        attempts: u32,
    },
    /// Failed with no other member here with room (NoRoom::Elsewhere),
    /// lowest sequence first, with the attempts each has made.
    Elsewhere(Vec<(T, u32)>),
    /// The oldest in a full backlog, dropped for a new one.
    Dropped(T),
}

/// Lifetime counts of one group (single-node) or hub (cluster).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) redeliveries: u64,
    pub(crate) dead_lettered: u64,
    /// Oldest backlog messages dropped because the backlog was full.
    pub(crate) dropped: u64,
    /// Messages acked by MANUAL members.
    pub(crate) acked: u64,
}

/// A message in the backlog.
struct Pending<T, K> {
    message: Arc<Published>,
    token: T,
    /// Deliveries that already reached a member's stream.
    attempts: u32,
    /// A member to pass over when another has room (the one it failed
    /// with).
    avoid: Option<K>,
}

/// Messages waiting for a member with room, oldest first, and their bytes.
struct Backlog<T, K> {
    items: VecDeque<Pending<T, K>>,
    bytes: usize,
}

impl<T, K> Backlog<T, K> {
    fn push_back(&mut self, pending: Pending<T, K>) {
        self.bytes += pending.message.size();
        self.items.push_back(pending);
    }

    fn push_front(&mut self, pending: Pending<T, K>) {
        self.bytes += pending.message.size();
        self.items.push_front(pending);
    }

    fn pop_front(&mut self) -> Option<Pending<T, K>> {
        let pending = self.items.pop_front()?;
        self.bytes -= pending.message.size();
        Some(pending)
    }
}

struct Member<K> {
    key: K,
    /// Its subscription's queue: what its stream takes from.
    queue: Arc<Queue>,
    settings: MemberSettings,
    /// Messages this member holds: queued for its stream, plus those on its
    /// stream not done yet (MANUAL, or AUTO per message).
    held: u32,
    /// MANUAL: since when it has held messages without acking or nacking
    /// any (the first handed to it after its last ack or nack). Its ack
    /// deadline passing does not move it, unlike the oldest unacked age:
    /// a member that never acks stays stalled across redeliveries.
    stalled_since: Option<Instant>,
}

impl<K> Member<K> {
    /// How many more messages it may be handed now: what `max_in_flight`
    /// leaves, and no more than its stream may take now (a session's
    /// credit, [`crate::engine::queue::Queue::credit_room`]), so that
    /// nothing waits in its queue for credit while another member has room.
    fn room(&self) -> usize {
        let in_flight = self.settings.max_in_flight.saturating_sub(self.held) as usize;
        match self.queue.credit_room() {
            Some(credit) if in_flight > 0 => in_flight.min(usize::try_from(credit).unwrap_or(usize::MAX)),
            _ => in_flight,
        }
    }

    fn has_room(&self) -> bool {
        self.held < self.settings.max_in_flight && self.queue.credit_room().is_none_or(|c| c > 0)
    }
}

/// A MANUAL member's messages not acked or nacked yet (Admin's
/// `unacked` and `oldest_unacked_age` of a member).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemberUnacked {
    /// Handed to it: on its stream, or still in its queue.
    pub(crate) count: u32,
    /// When the oldest of them was handed to it.
    pub(crate) oldest: Instant,
    /// Since when it has held messages without acking or nacking any
    /// (`tinybroker_subscription_stalled_seconds`): not restarted by a
    /// redelivery after its ack deadline, as `oldest` is.
    pub(crate) stalled_since: Instant,
}

/// A message handed to a member and not done yet (MANUAL, or AUTO per
/// message).
struct Held<T, K> {
    member: K,
    attempt: u32,
    message: Arc<Published>,
    token: T,
    handed_out: Instant,
    /// MANUAL: its ack deadline. AUTO: none (done when streamed).
    deadline: Option<Instant>,
    /// When the engine last reported it still held ([`GroupMachine::due_for_report`]).
    reported_at: Instant,
}

/// A consumer group's members, backlog and held messages. `K` is the
/// engine's member key, `T` its token of a message.
pub(crate) struct GroupMachine<T, K> {
    rules: Rules,
    backlog: Backlog<T, K>,
    members: Vec<Member<K>>,
    /// Round-robin position in `members`.
    cursor: usize,
    /// Handed out and not done, by sequence.
    held: HashMap<u64, Held<T, K>>,
    counters: Counters,
    /// What the engine must act on, in the order decided; the engine drains
    /// it after each call.
    pub(crate) out: Vec<Event<T>>,
}

impl<T, K: PartialEq + Clone + std::fmt::Debug> GroupMachine<T, K> {
    pub(crate) fn new(rules: Rules) -> Self {
        Self {
            rules,
            backlog: Backlog {
                items: VecDeque::new(),
                bytes: 0,
            },
            members: Vec::new(),
            cursor: 0,
            held: HashMap::new(),
            counters: Counters::default(),
            out: Vec::new(),
        }
    }

    pub(crate) fn counters(&self) -> Counters {
        self.counters
    }

    /// A message offered again after an attempt that ended elsewhere and
    /// that no machine took back (cluster: JetStream redelivered it after
    /// its ack wait, its member's replica cut off or gone): a redelivery.
    pub(crate) fn count_redelivery(&mut self) {
        self.counters.redeliveries += 1;
    }

    pub(crate) fn members(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn backlog_len(&self) -> usize {
        self.backlog.items.len()
    }

    pub(crate) fn backlog_bytes(&self) -> usize {
        self.backlog.bytes
    }

    /// Messages members hold (queued for their streams, or on them and not
    /// done).
    pub(crate) fn in_flight(&self) -> usize {
        self.members.iter().map(|m| m.held as usize).sum()
    }

    /// Whether anything waits in the backlog or is held by a member.
    pub(crate) fn has_work(&self) -> bool {
        !self.backlog.items.is_empty() || self.members.iter().any(|m| m.held > 0)
    }

    /// When the oldest MANUAL message not acked yet was handed out.
    pub(crate) fn oldest_unacked(&self) -> Option<Instant> {
        self.held
            .values()
            .filter(|h| h.deadline.is_some())
            .map(|h| h.handed_out)
            .min()
    }

    /// What each member holds unacked (MANUAL: handed to it, not acked
    /// or nacked yet), in one pass over what is held: members holding
    /// nothing are absent.
    pub(crate) fn unacked_by_member(&self) -> HashMap<K, MemberUnacked>
    where
        K: std::hash::Hash + Eq,
    {
        let mut by_member: HashMap<K, MemberUnacked> = HashMap::new();
        for held in self.held.values().filter(|h| h.deadline.is_some()) {
            by_member
                .entry(held.member.clone())
                .and_modify(|u| {
                    u.count += 1;
                    u.oldest = u.oldest.min(held.handed_out);
                })
                .or_insert(MemberUnacked {
                    count: 1,
                    oldest: held.handed_out,
                    stalled_since: held.handed_out,
                });
        }
        for member in &self.members {
            if let (Some(u), Some(since)) = (by_member.get_mut(&member.key), member.stalled_since) {
                u.stalled_since = since;
            }
        }
        by_member
    }

    /// The ack mode of the first member (all have the same), if any.
    pub(crate) fn ack_mode(&self) -> Option<AckMode> {
        self.members.first().map(|m| m.settings.ack_mode)
    }

    /// What the members have room for beyond what the backlog holds: what
    /// a cluster hub's next pull asks for.
    pub(crate) fn room(&self) -> usize {
        let room: usize = self.members.iter().map(Member::room).sum();
        room.saturating_sub(self.backlog.items.len())
    }

    /// A member may have gained room without a call here saying so (its
    /// session added credit): hands it what waits.
    pub(crate) fn room_made(&mut self, now: Instant) {
        self.dispatch(now);
    }

    /// A message that has made `attempts` deliveries (0: a new one; a
    /// cluster hub's pull may bring a redelivery), at the back of the
    /// backlog, then to a member with room. With backlog limits, the oldest
    /// are dropped to make room (the newest always gets in, however large):
    /// how many.
    pub(crate) fn offer(&mut self, message: Arc<Published>, token: T, attempts: u32, now: Instant) -> u64 {
        let mut dropped = 0;
        if let Some(limits) = self.rules.backlog {
            while !self.backlog.items.is_empty()
                && limits.must_drop_oldest(self.backlog.items.len(), self.backlog.bytes, message.size())
            {
                if let Some(oldest) = self.backlog.pop_front() {
                    self.out.push(Event::Dropped(oldest.token));
                }
                dropped += 1;
            }
            self.counters.dropped += dropped;
        }
        self.backlog.push_back(Pending {
            message,
            token,
            attempts,
            avoid: None,
        });
        self.dispatch(now);
        dropped
    }

    /// A message that has made `attempts` deliveries, at the front of the
    /// backlog (a cluster hub taking another replica's retry), then to a
    /// member with room.
    pub(crate) fn offer_first(&mut self, message: Arc<Published>, token: T, attempts: u32, now: Instant) {
        self.backlog.push_front(Pending {
            message,
            token,
            attempts,
            avoid: None,
        });
        self.dispatch(now);
    }

    /// Adds a member and hands it what the backlog holds.
    pub(crate) fn join(&mut self, key: K, queue: Arc<Queue>, settings: MemberSettings, now: Instant) {
        self.members.push(Member {
            key,
            queue,
            settings,
            held: 0,
            stalled_since: None,
        });
        self.dispatch(now);
    }

    /// A member left. `unstreamed` is what its closed queue still held,
    /// with a token for those not kept here (AutoDone::Counted): never
    /// delivered, they go back as they were. What it held that reached its
    /// stream is retried (or dead-lettered). A message still in its queue
    /// (not closed yet) was never delivered either.
    pub(crate) fn leave(&mut self, key: &K, unstreamed: impl IntoIterator<Item = (Delivery, T)>, now: Instant) {
        let index = self.members.iter().position(|m| m.key == *key);
        let member = index.map(|i| self.members.remove(i));
        let mut retries = Vec::new();
        let mut never_streamed = HashSet::new();
        for (delivery, token) in unstreamed {
            let seq = delivery.message.sequence;
            never_streamed.insert(seq);
            let token = match self.held.remove(&seq) {
                Some(held) => held.token,
                None => token,
            };
            retries.push(Pending {
                message: delivery.message,
                token,
                attempts: delivery.attempt - 1,
                avoid: None,
            });
        }
        let mut its: Vec<u64> = self
            .held
            .iter()
            .filter(|(seq, h)| h.member == *key && !never_streamed.contains(seq))
            .map(|(seq, _)| *seq)
            .collect();
        its.sort_unstable();
        for seq in its {
            let Some(held) = self.held.remove(&seq) else { continue };
            let queued = member.as_ref().is_some_and(|m| m.queue.remove(seq).is_some());
            if queued {
                retries.push(Pending {
                    message: held.message,
                    token: held.token,
                    attempts: held.attempt - 1,
                    avoid: None,
                });
            } else {
                self.attempt_failed(held, None, &mut retries);
            }
        }
        self.settle(retries, now);
    }

    /// The member leaves and what it holds is let go, not taken back:
    /// `unstreamed`, the sequences its queue still held, and what reached
    /// its stream and is not done (shutdown: everything goes at once, and
    /// is counted by kind). How many messages it held.
    pub(crate) fn discard_member(&mut self, key: &K, unstreamed: impl IntoIterator<Item = u64>) -> usize {
        if let Some(i) = self.members.iter().position(|m| m.key == *key) {
            self.members.remove(i);
        }
        // Queued for its stream: held (MANUAL, AUTO per message) or only
        // counted (AUTO, AutoDone::Counted).
        let mut discarded = 0;
        for seq in unstreamed {
            self.held.remove(&seq);
            discarded += 1;
        }
        let before = self.held.len();
        self.held.retain(|_, h| h.member != *key);
        discarded + (before - self.held.len())
    }

    /// An AUTO member's stream took `count` messages (AutoDone::Counted):
    /// done, and the member has room for as many more.
    pub(crate) fn streamed(&mut self, key: &K, count: u32, now: Instant) {
        if let Some(member) = self.members.iter_mut().find(|m| m.key == *key) {
            member.held = member.held.saturating_sub(count);
        }
        self.dispatch(now);
    }

    /// An AUTO member's stream took `sequence` (AutoDone::PerMessage):
    /// done. False when the member does not hold it.
    pub(crate) fn done(&mut self, key: &K, sequence: u64, now: Instant) -> bool {
        let Some(held) = self.take_held(sequence, key) else {
            return false;
        };
        self.release(key);
        self.out.push(Event::Done(held.token));
        self.dispatch(now);
        true
    }

    /// Marks MANUAL messages done. A sequence this member does not hold
    /// (never had, already acked, or lost to a redelivery) is unknown and
    /// changes nothing.
    pub(crate) fn ack(&mut self, key: &K, sequences: &[u64], now: Instant) -> Acked {
        let mut result = Acked::default();
        for &seq in sequences {
            let Some(held) = self.take_held(seq, key) else {
                result.unknown += 1;
                continue;
            };
            // A redelivery to the same member may still wait in its queue:
            // the ack covers it too. A first delivery cannot (the member has
            // seen it), which spares the common case the scan.
            if held.attempt > 1
                && let Some(member) = self.members.iter().find(|m| m.key == *key)
            {
                member.queue.remove(seq);
            }
            self.release(key);
            self.out.push(Event::Done(held.token));
            result.acked += 1;
        }
        self.counters.acked += u64::from(result.acked);
        if result.acked > 0 {
            self.progressed(key, now);
        }
        self.dispatch(now);
        result
    }

    /// Hands messages back for immediate redelivery, to another member
    /// first. One that used its last attempt is dead-lettered instead (and
    /// still counted as requeued: the member no longer holds it).
    pub(crate) fn nack(&mut self, key: &K, sequences: &[u64], now: Instant) -> Nacked {
        let mut result = Nacked::default();
        let mut retries = Vec::new();
        for &seq in sequences {
            let Some(held) = self.take_held(seq, key) else {
                result.unknown += 1;
                continue;
            };
            self.release(key);
            self.take_back(held, &mut retries);
            result.requeued += 1;
        }
        if result.requeued > 0 {
            self.progressed(key, now);
        }
        self.settle(retries, now);
        result
    }

    /// Takes back MANUAL messages whose ack deadline has passed, as after a
    /// Nack by their member.
    pub(crate) fn expire(&mut self, now: Instant) {
        let mut expired: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline.is_some_and(|d| d <= now))
            .map(|(seq, _)| *seq)
            .collect();
        if expired.is_empty() {
            return;
        }
        expired.sort_unstable();
        let mut retries = Vec::new();
        for seq in expired {
            if let Some(held) = self.held.remove(&seq) {
                let holder = held.member.clone();
                self.release(&holder);
                self.take_back(held, &mut retries);
            }
        }
        self.settle(retries, now);
    }

    /// The held messages not reported for `every`, lowest sequence first,
    /// marked reported now (a cluster hub tells JetStream they are still
    /// being worked on).
    pub(crate) fn due_for_report(&mut self, now: Instant, every: Duration) -> Vec<T>
    where
        T: Clone,
    {
        let mut due: Vec<(u64, T)> = Vec::new();
        for (seq, held) in self.held.iter_mut() {
            if now.saturating_duration_since(held.reported_at) >= every {
                held.reported_at = now;
                due.push((*seq, held.token.clone()));
            }
        }
        due.sort_unstable_by_key(|(seq, _)| *seq);
        due.into_iter().map(|(_, token)| token).collect()
    }

    /// Empties the machine of messages: what members hold (lowest sequence
    /// first), then the backlog, each with the attempts it has made (a
    /// delivery still queued counts as made). Members stay, holding nothing.
    pub(crate) fn take_all(&mut self) -> Vec<(T, u32)> {
        let mut held: Vec<(u64, Held<T, K>)> = self.held.drain().collect();
        held.sort_unstable_by_key(|(seq, _)| *seq);
        let mut all: Vec<(T, u32)> = held.into_iter().map(|(_, h)| (h.token, h.attempt)).collect();
        all.extend(self.take_backlog());
        for member in &mut self.members {
            member.held = 0;
            member.stalled_since = None;
        }
        all
    }

    /// Empties the backlog: each message with the attempts it has made.
    pub(crate) fn take_backlog(&mut self) -> Vec<(T, u32)> {
        self.backlog.bytes = 0;
        self.backlog.items.drain(..).map(|p| (p.token, p.attempts)).collect()
    }

    /// Forgets what members hold (its source lost it); their acks will be
    /// unknown. How many.
    pub(crate) fn forget_held(&mut self, now: Instant) -> usize {
        let held: Vec<Held<T, K>> = self.held.drain().map(|(_, h)| h).collect();
        for h in &held {
            self.release(&h.member);
        }
        for member in &mut self.members {
            member.stalled_since = None;
        }
        self.dispatch(now);
        held.len()
    }

    /// Empties the group (removed); how many messages it still held.
    pub(crate) fn clear(&mut self) -> usize {
        let left = self.backlog.items.len() + self.held.len();
        self.backlog.items.clear();
        self.backlog.bytes = 0;
        self.held.clear();
        left
    }

    /// Hands backlog messages to members with room, round-robin; the member
    /// a message failed with only when no other has room.
    fn dispatch(&mut self, now: Instant) {
        while let Some(front) = self.backlog.items.front() {
            let members = &self.members;
            let pick = pick_member(
                &mut self.cursor,
                members.len(),
                |i| members[i].has_room(),
                |i| front.avoid.as_ref() == Some(&members[i].key),
            );
            let Some(index) = pick else { return };
            let Some(pending) = self.backlog.pop_front() else {
                return;
            };
            let member = &mut self.members[index];
            let attempt = pending.attempts + 1;
            let kept = member.settings.ack_mode == AckMode::Manual || self.rules.auto == AutoDone::PerMessage;
            // Kept: the message is also held here until done. Else the
            // delivery takes the group's only reference.
            let message = kept.then(|| pending.message.clone());
            let delivery = Delivery {
                message: pending.message,
                attempt,
            };
            let refused = match member.queue.push(delivery) {
                Push::Queued => {
                    member.held += 1;
                    if member.settings.ack_mode == AckMode::Manual && member.stalled_since.is_none() {
                        member.stalled_since = Some(now);
                    }
                    if let Some(message) = message {
                        let deadline =
                            (member.settings.ack_mode == AckMode::Manual).then(|| now + member.settings.ack_deadline);
                        self.held.insert(
                            message.sequence,
                            Held {
                                member: member.key.clone(),
                                attempt,
                                message,
                                token: pending.token,
                                handed_out: now,
                                deadline,
                                reported_at: now,
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
                        consumer_group_member = ?member.key,
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
                token: pending.token,
                attempts: pending.attempts,
                avoid: pending.avoid,
            });
        }
    }

    /// A held message taken back from its member (a Nack, its deadline
    /// passed): never delivered if still in the member's queue, else an
    /// attempt that failed. Passed over that member next time.
    fn take_back(&mut self, held: Held<T, K>, retries: &mut Vec<Pending<T, K>>) {
        let holder = self.members.iter().find(|m| m.key == held.member);
        if holder.is_some_and(|m| m.queue.remove(held.message.sequence).is_some()) {
            retries.push(Pending {
                message: held.message,
                token: held.token,
                attempts: held.attempt - 1,
                avoid: Some(held.member),
            });
            return;
        }
        let avoid = Some(held.member.clone());
        self.attempt_failed(held, avoid, retries);
    }

    /// A delivery that reached a member's stream did not complete: the
    /// message goes again, or is dead-lettered after its last allowed
    /// attempt.
    fn attempt_failed(&mut self, held: Held<T, K>, avoid: Option<K>, retries: &mut Vec<Pending<T, K>>) {
        if attempts_exhausted(held.attempt, self.rules.max_delivery_attempts) {
            self.counters.dead_lettered += 1;
            self.out.push(Event::DeadLetter {
                message: held.message,
                token: held.token,
                attempts: held.attempt,
            });
            return;
        }
        self.counters.redeliveries += 1;
        retries.push(Pending {
            message: held.message,
            token: held.token,
            attempts: held.attempt,
            avoid,
        });
    }

    /// Ends a transition that took messages back, lowest sequence first:
    /// to the front of the backlog and dispatched; with NoRoom::Elsewhere,
    /// one that no member but the one it failed with has room for goes out
    /// instead.
    fn settle(&mut self, mut retries: Vec<Pending<T, K>>, now: Instant) {
        retries.sort_by_key(|p| p.message.sequence);
        match self.rules.no_room {
            NoRoom::Wait => {
                for pending in retries.into_iter().rev() {
                    self.backlog.push_front(pending);
                }
                self.dispatch(now);
            }
            // One at a time: after a dispatch the backlog is empty or no
            // member has room, so a retry placed at its front while a
            // member has room is handed out at once, and the next sees the
            // room that is left.
            NoRoom::Elsewhere => {
                let mut elsewhere = Vec::new();
                for pending in retries {
                    let room_here = self
                        .members
                        .iter()
                        .any(|m| pending.avoid.as_ref() != Some(&m.key) && m.has_room());
                    if room_here {
                        self.backlog.push_front(pending);
                        self.dispatch(now);
                    } else {
                        elsewhere.push((pending.token, pending.attempts));
                    }
                }
                self.dispatch(now);
                if !elsewhere.is_empty() {
                    self.out.push(Event::Elsewhere(elsewhere));
                }
            }
        }
    }

    /// Takes `seq` from what is held, if `key` holds it.
    fn take_held(&mut self, seq: u64, key: &K) -> Option<Held<T, K>> {
        if self.held.get(&seq).is_some_and(|h| h.member == *key) {
            return self.held.remove(&seq);
        }
        None
    }

    /// One message fewer held by `key` (gone already: nothing).
    fn release(&mut self, key: &K) {
        if let Some(member) = self.members.iter_mut().find(|m| m.key == *key) {
            member.held = member.held.saturating_sub(1);
        }
    }

    /// `key` acked or nacked: its stall, if it still holds messages,
    /// starts again now.
    fn progressed(&mut self, key: &K, now: Instant) {
        if let Some(member) = self.members.iter_mut().find(|m| m.key == *key) {
            member.stalled_since = (member.held > 0).then_some(now);
        }
    }

    /// Where each message is, for the property tests: sequences in the
    /// backlog, and held (with their member).
    #[cfg(test)]
    pub(crate) fn places(&self) -> (Vec<u64>, Vec<(u64, K)>) {
        let backlog = self.backlog.items.iter().map(|p| p.message.sequence).collect();
        let held = self.held.iter().map(|(s, h)| (*s, h.member.clone())).collect();
        (backlog, held)
    }
}

/// Who gets the next message: round-robin from `cursor` over `n` members,
/// the first with room (`has_room`) that is not the member the message
/// failed with (`avoided`, the one that nacked it or let its deadline
/// pass), else that member when it alone has room. The cursor moves past
/// the one picked.
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
/// is dead-lettered rather than tried again.
pub(crate) fn attempts_exhausted(attempt: u32, max: u32) -> bool {
    max > 0 && attempt >= max
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::CloseReason;
    use proptest::prelude::*;
    use std::task::{Context, Poll, Waker};

    /// A single-node group's rules, and a cluster hub's.
    fn rules(cluster: bool, capacity: usize, max_delivery_attempts: u32) -> Rules {
        if cluster {
            Rules {
                max_delivery_attempts,
                backlog: None,
                no_room: NoRoom::Elsewhere,
                auto: AutoDone::PerMessage,
            }
        } else {
            Rules {
                max_delivery_attempts,
                backlog: Some(BacklogLimits {
                    capacity,
                    max_bytes: usize::MAX,
                }),
                no_room: NoRoom::Wait,
                auto: AutoDone::Counted,
            }
        }
    }

    /// A member as the machine sees it: its key and its subscription's
    /// queue.
    pub(crate) struct TestMember {
        pub(crate) key: u64,
        pub(crate) queue: Arc<Queue>,
    }

    /// A member whose queue holds `capacity`.
    pub(crate) fn member(key: u64, capacity: usize) -> Arc<TestMember> {
        Arc::new(TestMember {
            key,
            queue: Arc::new(Queue::new(capacity, usize::MAX)),
        })
    }

    /// What the member's stream would take next.
    pub(crate) fn pop(sub: &TestMember) -> Option<Delivery> {
        match sub.queue.poll_pop(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(d) => d,
            Poll::Pending => None,
        }
    }

    #[test]
    fn a_retry_with_no_other_member_with_room_waits_or_goes_elsewhere() {
        let now = Instant::now();
        for cluster in [false, true] {
            let mut g: GroupMachine<u64, u64> = GroupMachine::new(rules(cluster, 10, 0));
            let (a, b) = (member(1, 1), member(2, 1));
            let manual = |max| MemberSettings {
                ack_mode: AckMode::Manual,
                max_in_flight: max,
                ack_deadline: Duration::from_secs(10),
            };
            g.join(1, a.queue.clone(), manual(1), now);
            g.join(2, b.queue.clone(), manual(1), now);
            g.offer(Arc::new(Published::for_test("t", 1)), 1, 0, now);
            g.offer(Arc::new(Published::for_test("t", 2)), 2, 0, now);
            assert_eq!(pop(&a).unwrap().message.sequence, 1);
            assert_eq!(pop(&b).unwrap().message.sequence, 2);
            g.out.clear();
            // b is full: a's nack has no other member with room.
            assert_eq!(g.nack(&1, &[1], now).requeued, 1);
            if cluster {
                assert!(matches!(&g.out[..], [Event::Elsewhere(m)] if m == &[(1, 1)]));
                assert!(pop(&a).is_none(), "offered to other replicas, not to its member again");
            } else {
                assert!(g.out.is_empty());
                let again = pop(&a).expect("back to the only member with room");
                assert_eq!((again.message.sequence, again.attempt), (1, 2));
            }
            assert_eq!(g.counters().redeliveries, 1);
        }
    }

    /// A member that never acks is stalled since its first message, across
    /// the redeliveries its ack deadline causes (its oldest unacked age
    /// restarts at each); one that acks or nacks starts again.
    #[test]
    fn a_members_stall_survives_its_deadline_and_ends_with_an_ack_or_nack() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        for cluster in [false, true] {
            let mut g: GroupMachine<u64, u64> = GroupMachine::new(rules(cluster, 10, 0));
            let (hung, ok) = (member(1, 2), member(2, 2));
            let manual = MemberSettings {
                ack_mode: AckMode::Manual,
                max_in_flight: 2,
                ack_deadline: Duration::from_secs(10),
            };
            g.join(1, hung.queue.clone(), manual, start);
            g.join(2, ok.queue.clone(), manual, start);
            let offer = |g: &mut GroupMachine<u64, u64>, seq: u64, now| {
                g.offer(Arc::new(Published::for_test("t", seq)), seq, 0, now);
            };
            // Round-robin: 1 and 3 to hung, 2 and 4 to ok.
            for seq in 1..=4 {
                offer(&mut g, seq, start);
            }
            while pop(&hung).is_some() {}
            while pop(&ok).is_some() {}
            g.ack(&2, &[2], at(3));
            offer(&mut g, 5, at(3));
            let u = g.unacked_by_member();
            assert_eq!((u[&1].oldest, u[&1].stalled_since), (start, start));
            assert_eq!((u[&2].oldest, u[&2].stalled_since), (start, at(3)), "acked at 3 s");
            g.nack(&2, &[4], at(9));
            assert_eq!(g.unacked_by_member()[&2].stalled_since, at(9), "nacked at 9 s");
            // The hung member's deadline passes with ok full: single node,
            // its messages come back to it, and its stall goes on while its
            // oldest unacked age restarts; a cluster hub offers them to the
            // other replicas instead.
            g.expire(at(11));
            if cluster {
                assert!(!g.unacked_by_member().contains_key(&1));
                continue;
            }
            let u = g.unacked_by_member();
            assert_eq!(u[&1].count, 2);
            assert_eq!((u[&1].oldest, u[&1].stalled_since), (at(11), start));
            // Its first ack ends it.
            while pop(&hung).is_some() {}
            assert_eq!(g.ack(&1, &[1], at(13)).acked, 1);
            assert_eq!(g.unacked_by_member()[&1].stalled_since, at(13));
        }
    }

    /// docs/contract.md, "Sessions" (credit and groups): a member is handed no more than its
    /// session's credit lets it send, the rest goes to the others or
    /// waits, and credit added gives it room again.
    #[test]
    fn a_member_is_handed_no_more_than_its_credit() {
        let now = Instant::now();
        for cluster in [false, true] {
            let mut g: GroupMachine<u64, u64> = GroupMachine::new(rules(cluster, 100, 0));
            let short = Arc::new(TestMember {
                key: 1,
                queue: Arc::new(Queue::new(32, usize::MAX).with_credit(Some(2))),
            });
            let other = member(2, 4);
            let settings = |max| MemberSettings {
                ack_mode: AckMode::Manual,
                max_in_flight: max,
                ack_deadline: Duration::from_secs(10),
            };
            g.join(1, short.queue.clone(), settings(32), now);
            g.join(2, other.queue.clone(), settings(4), now);
            assert_eq!(g.room(), 2 + 4);
            for seq in 1..=10 {
                g.offer(Arc::new(Published::for_test("t", seq)), seq, 0, now);
            }
            assert_eq!((short.queue.len(), other.queue.len(), g.backlog_len()), (2, 4, 4));
            assert_eq!(g.room(), 0, "no room: credit spent, max_in_flight reached");
            // Its stream takes what it was handed: still no room.
            assert!(pop(&short).is_some() && pop(&short).is_some());
            g.room_made(now);
            assert_eq!((short.queue.len(), g.backlog_len()), (0, 4));
            // Credit added: it is handed that many.
            short.queue.add_credit(3);
            g.room_made(now);
            assert_eq!((short.queue.len(), g.backlog_len()), (3, 1));
        }
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

    struct Model {
        /// (subscription, manual, sequences on its stream not yet acked)
        members: Vec<(Arc<TestMember>, bool, Vec<u64>)>,
        done: HashSet<u64>,
        /// Out of this machine: dead-lettered, dropped, or (a cluster hub)
        /// gone to other replicas.
        gone: HashSet<u64>,
        dead_letters: u64,
        dropped: u64,
    }

    impl Model {
        /// What the machine decided, taken in: each message left at most
        /// once, and a done one was held.
        fn take_out(&mut self, g: &mut GroupMachine<u64, u64>) -> Result<(), TestCaseError> {
            for event in g.out.drain(..) {
                let left: Vec<u64> = match event {
                    Event::Done(seq) => {
                        prop_assert!(self.done.insert(seq), "done twice: {}", seq);
                        continue;
                    }
                    Event::DeadLetter { token, message, .. } => {
                        prop_assert_eq!(token, message.sequence);
                        self.dead_letters += 1;
                        vec![token]
                    }
                    Event::Elsewhere(messages) => messages.into_iter().map(|(seq, _)| seq).collect(),
                    Event::Dropped(seq) => {
                        self.dropped += 1;
                        vec![seq]
                    }
                };
                for seq in left {
                    prop_assert!(self.gone.insert(seq), "left twice: {}", seq);
                }
            }
            Ok(())
        }
    }

    proptest! {
        /// Under both engines' rules, every offered message is, at every
        /// step, in exactly one place, never held by two members at once,
        /// and what the machine says left it (done, dead letter, elsewhere,
        /// dropped) left once.
        #[test]
        fn every_message_is_in_exactly_one_place(
            ops in prop::collection::vec(op(), 1..120),
            cluster in any::<bool>(),
            capacity in 1usize..8,
            max_attempts in 0u32..4,
        ) {
            let mut now = Instant::now();
            let mut g: GroupMachine<u64, u64> = GroupMachine::new(rules(cluster, capacity, max_attempts));
            let mut next_seq = 0u64;
            let mut next_key = 1u64;
            let mut m = Model { members: Vec::new(), done: HashSet::new(), gone: HashSet::new(), dead_letters: 0, dropped: 0 };
            for op in ops {
                match op {
                    Op::Publish => {
                        next_seq += 1;
                        g.offer(Arc::new(Published::for_test("t", next_seq)), next_seq, 0, now);
                    }
                    Op::Join(manual, max) => {
                        let sub = member(next_key, max as usize);
                        let settings = MemberSettings {
                            ack_mode: if manual { AckMode::Manual } else { AckMode::Auto },
                            max_in_flight: max,
                            ack_deadline: Duration::from_secs(10),
                        };
                        g.join(next_key, sub.queue.clone(), settings, now);
                        next_key += 1;
                        m.members.push((sub, manual, Vec::new()));
                    }
                    Op::Leave(i) if !m.members.is_empty() => {
                        let (sub, _, _) = m.members.remove(i % m.members.len());
                        let left = sub.queue.close(CloseReason::Cancelled, None).unwrap_or_default();
                        if cluster {
                            // A cluster hub hears of the leave without what
                            // the closed queue held: those were attempts.
                            g.leave(&sub.key, std::iter::empty(), now);
                        } else {
                            let unstreamed = left.into_iter().map(|d| {
                                let seq = d.message.sequence;
                                (d, seq)
                            });
                            g.leave(&sub.key, unstreamed, now);
                        }
                    }
                    Op::Stream(i) if !m.members.is_empty() => {
                        let n = m.members.len();
                        let (sub, manual, on_stream) = &mut m.members[i % n];
                        if let Some(d) = pop(sub) {
                            let seq = d.message.sequence;
                            if *manual {
                                on_stream.push(seq);
                            } else if cluster {
                                prop_assert!(g.done(&sub.key, seq, now), "an AUTO delivery not held");
                            } else {
                                prop_assert!(m.done.insert(seq), "delivered twice");
                                g.streamed(&sub.key, 1, now);
                            }
                        }
                    }
                    Op::Ack(i, s) if !m.members.is_empty() => {
                        let n = m.members.len();
                        let (sub, _, on_stream) = &mut m.members[i % n];
                        if !on_stream.is_empty() {
                            let seq = on_stream.remove(s % on_stream.len());
                            let acked = g.ack(&sub.key, &[seq], now).acked;
                            let said_done = g.out.iter().any(|e| matches!(e, Event::Done(s) if *s == seq));
                            prop_assert_eq!(acked == 1, said_done);
                        }
                    }
                    Op::Nack(i, s) if !m.members.is_empty() => {
                        let n = m.members.len();
                        let (sub, _, on_stream) = &mut m.members[i % n];
                        if !on_stream.is_empty() {
                            let seq = on_stream.remove(s % on_stream.len());
                            g.nack(&sub.key, &[seq], now);
                        }
                    }
                    Op::Tick(secs) => {
                        now += Duration::from_secs(secs);
                        g.expire(now);
                    }
                    _ => {}
                }
                m.take_out(&mut g)?;
                // Where every message is now.
                let (backlog, held) = g.places();
                let mut places: HashMap<u64, usize> = HashMap::new();
                for seq in backlog {
                    *places.entry(seq).or_default() += 1;
                }
                let mut queued_anywhere = HashSet::new();
                for (sub, _, _) in &m.members {
                    for seq in sub.queue.sequences() {
                        queued_anywhere.insert(seq);
                        *places.entry(seq).or_default() += 1;
                    }
                }
                for (seq, _) in held.iter().filter(|(seq, _)| !queued_anywhere.contains(seq)) {
                    *places.entry(*seq).or_default() += 1;
                }
                for seq in m.done.iter().chain(m.gone.iter()) {
                    *places.entry(*seq).or_default() += 1;
                }
                prop_assert!(places.values().all(|&n| n == 1), "a message is in two places: {:?}", places);
                prop_assert_eq!(places.len() as u64, next_seq, "every message accounted for");
                let counters = g.counters();
                prop_assert_eq!((m.dead_letters, m.dropped), (counters.dead_lettered, counters.dropped));
            }
        }
    }
}
