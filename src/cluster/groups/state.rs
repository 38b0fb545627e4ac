//! A hub's state and its decisions, with no I/O: which member gets a pulled
//! message, what a Nack or an expired deadline does with it, what a member
//! leaving gives back. Time is passed in (`now`), and every decision that
//! JetStream must hear of (an ack, a nak, a progress report, a term, a dead
//! letter, an offer to the other replicas) is appended to [`HubCore::out`],
//! in the order it was made; the hub task sends them on in that order
//! (`hub.rs`).
//!
//! # The life of a message in a hub
//!
//! ```text
//!          pulled (or taken from another replica's offer)
//!  JetStream ──────────► waiting ──── dispatch ───► held by a member
//!      ▲                    ▲                          │
//!      │  nak (member left, │ hand-over: another       │ done: acked (AUTO
//!      │  none took the     │ member here has room     │ stream took it, or
//!      │  offer, hand back) │ (Nack, deadline)         │ an Ack) ──► Ack
//!      └────────────────────┴──────────────────────────┤
//!                      offered to other replicas ◄─────┤ no other member here
//!                                                      │ has room
//!                      dead letter ◄───────────────────┘ after the last attempt
//! ```
//!
//! A message this replica holds is in exactly one of `waiting` and `held`,
//! or has left it in one operation of [`HubCore::out`] (a property test in
//! `hub_tests.rs` checks it after every step).
//!
//! Who gets a message (round-robin over the members with room, the member
//! it failed with last) and when a failed delivery was the last allowed are
//! the single-node engine's own rules (`broker/group.rs`, `pick_member`
//! and `attempts_exhausted`), not a copy of them.

use crate::broker::{Delivery, Published, Subscription, attempts_exhausted, pick_member};
use crate::engine::{AckMode, Acked, Nacked};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A member's settings, fixed when it joins.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) max_in_flight: u32,
    pub(crate) ack_deadline: Duration,
}

/// What a hub sends to JetStream (or, for an offer, to the other
/// replicas), in the order its state machine decided it. `M` is the handle
/// of a JetStream message this replica holds.
#[derive(Debug)]
pub(crate) enum Outbound<M> {
    /// The message is done: acked. `remembered`: its entry in the
    /// attempts bucket goes too.
    Ack { message: M, remembered: bool },
    /// Still being worked on here: JetStream must not redeliver it.
    Progress(M),
    /// Back to JetStream for redelivery, each with the attempt its last
    /// delivery had (written to the attempts bucket first when it ran
    /// ahead of JetStream's count), in the order given: lowest sequence
    /// first, which is the order JetStream redelivers them in.
    Nak(Vec<(M, u32)>),
    /// A message that cannot be decoded: never redelivered.
    Term(M),
    /// Used its last attempt: published to `_dlq.<group>`, then acked.
    DeadLetter {
        message: M,
        attempts: u32,
        remembered: bool,
    },
    /// Nacked with no other member here with room: offered to the other
    /// live replicas in turn, for their attempt one higher; what none
    /// takes is nacked (as [`Outbound::Nak`]).
    Offer(Vec<(M, u32)>),
    /// Waits until the hub's pull is closed (its inbox unsubscribed), so
    /// that the naks behind it cannot be redelivered to it: the last
    /// member left.
    AfterPull,
    /// Answered once everything before it is with the NATS client.
    Flushed(tokio::sync::oneshot::Sender<()>),
}

/// A message pulled from the group's stream (or offered by another
/// replica), decoded.
pub(crate) struct Pulled<M> {
    pub(crate) message: M,
    pub(crate) published: Arc<Published>,
    /// Its delivery attempt: JetStream's count plus what the attempts
    /// bucket remembered.
    pub(crate) attempt: u32,
    /// Its attempts beyond JetStream's count were read from the
    /// `<prefix>_attempts` bucket (removed there once it is done).
    pub(crate) remembered: bool,
}

struct Waiting<M> {
    pulled: Pulled<M>,
    /// The member that nacked it: passed over while another has room.
    avoid: Option<Arc<str>>,
}

struct Member {
    id: Arc<str>,
    subscription: Arc<Subscription>,
    settings: Settings,
    holds: u32,
}

struct Held<M> {
    member: Arc<str>,
    pulled: Pulled<M>,
    deadline: Instant,
    /// When JetStream was last told this replica still works on it.
    progress_at: Instant,
    /// When its member was given it (the oldest unacked age).
    given_at: Instant,
}

/// Lifetime counts of one hub.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) redeliveries: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) acked: u64,
}

/// What the rest of the replica reads of a hub (the listings, the
/// metrics, a repair): written by the hub task after each step.
#[derive(Debug, Default, Clone)]
pub(crate) struct View {
    pub(crate) members: usize,
    pub(crate) held: usize,
    /// When the oldest message members hold was given out.
    pub(crate) oldest_given_at: Option<Instant>,
    pub(crate) counters: Counters,
    /// The ack mode its members asked for (None without members).
    pub(crate) ack_mode: Option<AckMode>,
}

/// A group's members on this replica and the JetStream messages they hold.
pub(crate) struct HubCore<M> {
    /// Deliveries tried before a message is dead-lettered; 0 = no limit.
    max_delivery_attempts: u32,
    /// The consumer's `ack_wait`: a held message is reported in progress
    /// every third of it.
    ack_wait: Duration,
    members: Vec<Member>,
    /// Round-robin position in `members`.
    cursor: usize,
    /// Handed out and not done, by sequence.
    held: HashMap<u64, Held<M>>,
    /// Pulled and not handed out yet: a member left meanwhile, or none has
    /// room (a pull asks for what there was room for, but a member may
    /// leave while it is answered).
    waiting: VecDeque<Waiting<M>>,
    counters: Counters,
    /// What JetStream must hear, in the order decided.
    pub(crate) out: Vec<Outbound<M>>,
}

impl<M: Clone> HubCore<M> {
    pub(crate) fn new(max_delivery_attempts: u32, ack_wait: Duration) -> Self {
        Self {
            max_delivery_attempts,
            ack_wait,
            members: Vec::new(),
            cursor: 0,
            held: HashMap::new(),
            waiting: VecDeque::new(),
            counters: Counters::default(),
            out: Vec::new(),
        }
    }

    pub(crate) fn members(&self) -> usize {
        self.members.len()
    }

    /// Brings `view` up to date, cheaply: the oldest held message is
    /// looked for (a pass over what is held) only when there was none, or
    /// at a tick (`full`); in between, one acked may leave it a tick old.
    pub(crate) fn update_view(&self, view: &mut View, full: bool) {
        view.members = self.members.len();
        view.held = self.held.len();
        view.counters = self.counters;
        view.ack_mode = self
            .members
            .first()
            .and_then(|m| m.subscription.external().map(|e| e.ack_mode));
        if self.held.is_empty() {
            view.oldest_given_at = None;
        } else if full || view.oldest_given_at.is_none() {
            view.oldest_given_at = self.held.values().map(|h| h.given_at).min();
        }
    }

    /// What the members have room for, beyond what waits already: what
    /// the hub's next pull asks for.
    pub(crate) fn room(&self) -> usize {
        let room: usize = self
            .members
            .iter()
            .map(|m| m.settings.max_in_flight.saturating_sub(m.holds) as usize)
            .sum();
        room.saturating_sub(self.waiting.len())
    }

    /// Adds a member and hands it what waits.
    pub(crate) fn join(&mut self, id: Arc<str>, subscription: Arc<Subscription>, settings: Settings, now: Instant) {
        self.members.push(Member {
            id,
            subscription,
            settings,
            holds: 0,
        });
        self.dispatch(now);
    }

    /// A member left: what it held goes back to JetStream at once, lowest
    /// sequence first. `last`: it was the last member, and the hub's pull
    /// goes before the naks (else a redelivery could come back to a hub
    /// with no member to take it).
    pub(crate) fn leave(&mut self, member: &str) {
        self.members.retain(|m| &*m.id != member);
        let mut seqs: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| &*h.member == member)
            .map(|(s, _)| *s)
            .collect();
        seqs.sort_unstable();
        let naks: Vec<(M, u32)> = seqs
            .iter()
            .filter_map(|s| self.held.remove(s))
            .map(|h| (h.pulled.message, h.pulled.attempt))
            .collect();
        self.counters.redeliveries += naks.len() as u64;
        if self.members.is_empty() {
            self.out.push(Outbound::AfterPull);
        }
        if !naks.is_empty() {
            self.out.push(Outbound::Nak(naks));
        }
    }

    /// A message pulled from the group's stream: to a member with room,
    /// or to wait for one. `closing`: this replica is shutting down, and
    /// the message goes back at once.
    pub(crate) fn pulled(&mut self, pulled: Pulled<M>, closing: bool, now: Instant) {
        if closing {
            self.out.push(Outbound::Nak(vec![(pulled.message, pulled.attempt)]));
            return;
        }
        self.waiting.push_back(Waiting { pulled, avoid: None });
        self.dispatch(now);
    }

    /// A message that does not decode: terminated, never redelivered.
    pub(crate) fn undecodable(&mut self, message: M) {
        self.out.push(Outbound::Term(message));
    }

    /// A message another replica offers (nacked there, no other member
    /// there had room): taken when a member here has room, and handed out
    /// first. This replica holds the JetStream message from then on.
    pub(crate) fn take(&mut self, pulled: Pulled<M>, closing: bool, now: Instant) -> bool {
        if closing || self.room() == 0 {
            return false;
        }
        self.waiting.push_front(Waiting { pulled, avoid: None });
        self.dispatch(now);
        true
    }

    /// An AUTO member's stream took `sequence`, or a MANUAL member acked
    /// it: done. False when the member does not hold it.
    pub(crate) fn done(&mut self, member: &str, sequence: u64, now: Instant) -> bool {
        let Some(held) = self.take_held(sequence, member) else {
            return false;
        };
        self.counters.acked += 1;
        self.out.push(Outbound::Ack {
            message: held.pulled.message,
            remembered: held.pulled.remembered,
        });
        self.unhold(member);
        self.dispatch(now);
        true
    }

    pub(crate) fn ack(&mut self, member: &str, sequences: &[u64], now: Instant) -> Acked {
        let mut result = Acked::default();
        for &seq in sequences {
            if self.done(member, seq, now) {
                result.acked += 1;
            } else {
                result.unknown += 1;
            }
        }
        result
    }

    /// Hands messages back: to another member here with room, else offered
    /// to the other replicas, else nacked through JetStream; dead-lettered
    /// after their last allowed attempt (and still counted as requeued:
    /// the member no longer holds them).
    pub(crate) fn nack(&mut self, member: &str, sequences: &[u64], now: Instant) -> Nacked {
        let mut result = Nacked::default();
        let mut elsewhere = Vec::new();
        for &seq in sequences {
            let Some(held) = self.take_held(seq, member) else {
                result.unknown += 1;
                continue;
            };
            result.requeued += 1;
            self.unhold(member);
            self.redirect(held, now, &mut elsewhere);
        }
        self.offer_elsewhere(elsewhere);
        result
    }

    /// Every [`super::hub::TICK`]: reports in progress what has been held
    /// for a third of `ack_wait` since it last was (each member has its own
    /// deadline, JetStream must not redeliver it meanwhile), and takes back
    /// what is held past its member's ack deadline, as after a Nack
    /// (single-node mode offers an expired message to another member first
    /// too).
    pub(crate) fn tick(&mut self, now: Instant) {
        let mut reported: Vec<(u64, M)> = Vec::new();
        for (seq, held) in self.held.iter_mut() {
            if now.saturating_duration_since(held.progress_at) >= self.ack_wait / 3 {
                held.progress_at = now;
                reported.push((*seq, held.pulled.message.clone()));
            }
        }
        reported.sort_unstable_by_key(|(seq, _)| *seq);
        self.out
            .extend(reported.into_iter().map(|(_, message)| Outbound::Progress(message)));
        let mut expired: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(s, _)| *s)
            .collect();
        if expired.is_empty() {
            return;
        }
        expired.sort_unstable();
        let mut elsewhere = Vec::new();
        for seq in expired {
            let Some(held) = self.held.remove(&seq) else { continue };
            self.unhold(&held.member);
            self.redirect(held, now, &mut elsewhere);
        }
        self.offer_elsewhere(elsewhere);
    }

    /// Shutdown: everything this replica holds, held by members (lowest
    /// sequence first) or waiting, goes back to JetStream at once. How many
    /// messages.
    pub(crate) fn hand_back(&mut self) -> usize {
        let mut held: Vec<(u64, Held<M>)> = self.held.drain().collect();
        held.sort_unstable_by_key(|(seq, _)| *seq);
        self.counters.redeliveries += held.len() as u64;
        let mut naks: Vec<(M, u32)> = held
            .into_iter()
            .map(|(_, h)| (h.pulled.message, h.pulled.attempt))
            .collect();
        naks.extend(self.waiting.drain(..).map(|w| (w.pulled.message, w.pulled.attempt)));
        for member in &mut self.members {
            member.holds = 0;
        }
        let count = naks.len();
        if count > 0 {
            self.out.push(Outbound::Nak(naks));
        }
        count
    }

    /// The hub stops (no member for a while): what still waits goes back.
    pub(crate) fn stop(&mut self) {
        let naks: Vec<(M, u32)> = self
            .waiting
            .drain(..)
            .map(|w| (w.pulled.message, w.pulled.attempt))
            .collect();
        if !naks.is_empty() {
            self.out.push(Outbound::Nak(naks));
        }
    }

    /// What members hold, forgotten: JetStream lost it with its state
    /// (nothing left to ack, or to redeliver); its acks count as unknown.
    /// How many.
    pub(crate) fn forget_held(&mut self, now: Instant) -> usize {
        let held: Vec<Held<M>> = self.held.drain().map(|(_, h)| h).collect();
        for h in &held {
            self.unhold(&h.member);
        }
        self.dispatch(now);
        held.len()
    }

    /// Where a delivery that failed (a Nack, a deadline) goes, its member's
    /// hold taken off: dead-lettered after its last allowed attempt; else,
    /// ahead of what waits, to another member here with room, without a
    /// round through JetStream (which would give it to whichever replica
    /// pulls first, the member it failed with included), with its attempt
    /// one higher, as in single-node mode; else offered to the other
    /// replicas (`elsewhere`).
    fn redirect(&mut self, held: Held<M>, now: Instant, elsewhere: &mut Vec<(u64, M, u32)>) {
        let pulled = held.pulled;
        if attempts_exhausted(pulled.attempt, self.max_delivery_attempts) {
            self.counters.dead_lettered += 1;
            self.out.push(Outbound::DeadLetter {
                message: pulled.message,
                attempts: pulled.attempt,
                remembered: pulled.remembered,
            });
            self.dispatch(now);
            return;
        }
        self.counters.redeliveries += 1;
        let other_has_room = self
            .members
            .iter()
            .any(|m| m.id != held.member && m.holds < m.settings.max_in_flight);
        if !other_has_room {
            self.dispatch(now);
            elsewhere.push((pulled.published.sequence, pulled.message, pulled.attempt));
            return;
        }
        self.waiting.push_front(Waiting {
            pulled: Pulled {
                attempt: pulled.attempt + 1,
                ..pulled
            },
            avoid: Some(held.member),
        });
        self.dispatch(now);
    }

    /// What [`HubCore::redirect`] could not hand over here, lowest sequence
    /// first.
    fn offer_elsewhere(&mut self, mut elsewhere: Vec<(u64, M, u32)>) {
        if elsewhere.is_empty() {
            return;
        }
        elsewhere.sort_unstable_by_key(|(seq, _, _)| *seq);
        self.out.push(Outbound::Offer(
            elsewhere.into_iter().map(|(_, m, attempt)| (m, attempt)).collect(),
        ));
    }

    /// Hands waiting messages to members with room, round-robin; the member
    /// that nacked a message only when no other has room.
    fn dispatch(&mut self, now: Instant) {
        while let Some(front) = self.waiting.front() {
            let members = &self.members;
            let pick = pick_member(
                &mut self.cursor,
                members.len(),
                |i| members[i].holds < members[i].settings.max_in_flight,
                |i| front.avoid.as_ref().is_some_and(|avoid| members[i].id == *avoid),
            );
            let Some(index) = pick else { return };
            let Some(w) = self.waiting.pop_front() else { return };
            let member = &mut self.members[index];
            let delivery = Delivery {
                message: w.pulled.published.clone(),
                attempt: w.pulled.attempt,
            };
            if member.subscription.hand(delivery).is_err() {
                // Closing: its leave is on the way. Out of the rotation.
                self.members.remove(index);
                self.waiting.push_front(w);
                continue;
            }
            member.holds += 1;
            let sequence = w.pulled.published.sequence;
            let held = Held {
                member: member.id.clone(),
                deadline: now + member.settings.ack_deadline,
                progress_at: now,
                given_at: now,
                pulled: w.pulled,
            };
            self.held.insert(sequence, held);
        }
    }

    /// Takes `seq` from what is held, if `member` holds it.
    fn take_held(&mut self, seq: u64, member: &str) -> Option<Held<M>> {
        if self.held.get(&seq).is_some_and(|h| &*h.member == member) {
            return self.held.remove(&seq);
        }
        None
    }

    /// One message fewer held by `member` (gone already: nothing).
    fn unhold(&mut self, member: &str) {
        if let Some(m) = self.members.iter_mut().find(|m| &*m.id == member) {
            m.holds = m.holds.saturating_sub(1);
        }
    }

    /// Where each message is, for the property test: sequences waiting,
    /// and held (with their member).
    #[cfg(test)]
    pub(crate) fn places(&self) -> (Vec<u64>, Vec<(u64, Arc<str>)>) {
        let waiting = self.waiting.iter().map(|w| w.pulled.published.sequence).collect();
        let held = self.held.iter().map(|(s, h)| (*s, h.member.clone())).collect();
        (waiting, held)
    }
}
