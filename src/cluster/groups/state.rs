//! A hub's state and its decisions, with no I/O: the consumer-group state
//! machine both engines use (`group/machine.rs`), with JetStream as
//! the backlog behind it, and what JetStream must hear of what it decides.
//! Time is passed in (`now`), and every decision JetStream must hear of (an
//! ack, a nak, a progress report, a term, a dead letter, an offer to the
//! other replicas) is appended to [`HubCore::out`], in the order it was
//! made; the hub task sends them on in that order (`hub.rs`).
//!
//! # The life of a message in a hub
//!
//! ```text
//!          pulled (or taken from another replica's offer)
//!  JetStream ──────────► backlog ──── dispatch ───► held by a member
//!      ▲                    ▲                          │
//!      │  nak (none took    │ another member here      │ done: its AUTO stream
//!      │  the offer; hand   │ has room (Nack,          │ took it, or an Ack
//!      │  back at shutdown) │ deadline, member left)   │ ──► Ack
//!      └────────────────────┴──────────────────────────┤
//!                      offered to other replicas ◄─────┤ no other member here
//!                                                      │ has room
//!                      dead letter ◄───────────────────┘ after the last attempt
//! ```
//!
//! What differs from a single-node group is the machine's [`Rules`]: no
//! backlog bound here (the hub pulls only what its members have room for;
//! the group's stream is bounded), a failed delivery with no other member
//! here with room goes to the other replicas ([`NoRoom::Elsewhere`]), and
//! an AUTO member's messages are kept until its stream takes each
//! ([`AutoDone::PerMessage`]), since JetStream must be told of each.
//!
//! A message this replica holds is in exactly one of the machine's backlog
//! and held messages, or has left it in one operation of [`HubCore::out`]
//! (property tests here and in the machine check it after every step).

use crate::broker::Subscription;
use crate::engine::Published;
use crate::engine::{Acked, Nacked};
use crate::group::machine::{AutoDone, Event, GroupMachine, MemberUnacked, NoRoom, Rules};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

pub(crate) use crate::group::MemberSettings as Settings;
pub(crate) use crate::group::machine::Counters;

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
    /// Back to JetStream for redelivery, each with the deliveries it has
    /// made (written to the attempts bucket first when that ran ahead of
    /// JetStream's count; a message pulled and not handed out made none
    /// this time), in the order given: lowest sequence first, which is the
    /// order JetStream redelivers them in.
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
    /// A replica handed it back through JetStream and wrote its attempts
    /// down in the `<prefix>_attempts` bucket (removed there once it is
    /// done); false for a first delivery, and for one JetStream redelivered
    /// on its own.
    pub(crate) remembered: bool,
}

/// The machine's token of a message: the JetStream message, and whether
/// its attempts are in the bucket.
#[derive(Debug, Clone)]
pub(crate) struct Token<M> {
    message: M,
    remembered: bool,
}

/// What the rest of the replica reads of a hub (the listings, the
/// metrics, a repair): written by the hub task after each step.
#[derive(Debug, Default, Clone)]
pub(crate) struct View {
    pub(crate) members: usize,
    pub(crate) held: usize,
    /// When the oldest message MANUAL members hold unacked was given out.
    pub(crate) oldest_given_at: Option<Instant>,
    pub(crate) counters: Counters,
    /// The ack mode its members asked for (None without members).
    pub(crate) ack_mode: Option<crate::engine::AckMode>,
    /// What each MANUAL member here holds unacked, by subscription id
    /// (brought up to date at ticks, with `oldest_given_at`).
    pub(crate) unacked: Arc<HashMap<Arc<str>, MemberUnacked>>,
}

/// A group's members on this replica and the JetStream messages they hold.
pub(crate) struct HubCore<M> {
    machine: GroupMachine<Token<M>, Arc<str>>,
    /// The consumer's `ack_wait`: a held message is reported in progress
    /// every third of it.
    ack_wait: Duration,
    /// What JetStream must hear, in the order decided.
    pub(crate) out: Vec<Outbound<M>>,
}

impl<M: Clone> HubCore<M> {
    pub(crate) fn new(max_delivery_attempts: u32, ack_wait: Duration) -> Self {
        Self {
            machine: GroupMachine::new(Rules {
                max_delivery_attempts,
                backlog: None,
                no_room: NoRoom::Elsewhere,
                auto: AutoDone::PerMessage,
            }),
            ack_wait,
            out: Vec::new(),
        }
    }

    pub(crate) fn members(&self) -> usize {
        self.machine.members()
    }

    /// Brings `view` up to date, cheaply: the oldest held message is
    /// looked for (a pass over what is held) only when there was none, or
    /// at a tick (`full`); in between, one acked may leave it a tick old.
    pub(crate) fn update_view(&self, view: &mut View, full: bool) {
        view.members = self.machine.members();
        view.held = self.machine.in_flight();
        view.counters = self.machine.counters();
        view.ack_mode = self.machine.ack_mode();
        if view.held == 0 {
            view.oldest_given_at = None;
            if !view.unacked.is_empty() {
                view.unacked = Arc::default();
            }
        } else if full || view.oldest_given_at.is_none() {
            view.oldest_given_at = self.machine.oldest_unacked();
            view.unacked = Arc::new(self.machine.unacked_by_member());
        }
    }

    /// What the members have room for, beyond what waits already: what
    /// the hub's next pull asks for.
    pub(crate) fn room(&self) -> usize {
        self.machine.room()
    }

    /// A member's session added credit: what waits goes to it if it has
    /// room now (and the next pull may ask for more).
    pub(crate) fn room_made(&mut self, now: Instant) {
        self.machine.room_made(now);
        self.take_out();
    }

    /// Adds a member and hands it what waits.
    pub(crate) fn join(&mut self, id: Arc<str>, subscription: Arc<Subscription>, settings: Settings, now: Instant) {
        // Every external member's queue is shared (`Broker::open_external`);
        // one that is not could never be handed anything.
        let Some(queue) = subscription.queue.shared() else {
            debug_assert!(false, "member {id} has no shared queue");
            tracing::error!(member = %id, "a group member without a shared queue was not joined");
            return;
        };
        self.machine.join(id, queue.clone(), settings, now);
        self.take_out();
    }

    /// A member left: what it held goes to another member here with room,
    /// else to the other replicas (then back to JetStream), lowest sequence
    /// first; dead-lettered after its last attempt. `AfterPull` first when
    /// it was the last member: the hub's pull goes before the naks (else a
    /// redelivery could come back to a hub with no member to take it).
    pub(crate) fn leave(&mut self, member: &Arc<str>, now: Instant) {
        self.machine.leave(member, std::iter::empty(), now);
        if self.machine.members() == 0 {
            self.out.push(Outbound::AfterPull);
        }
        self.take_out();
    }

    /// A message pulled from the group's stream: to a member with room,
    /// or to wait for one. `closing`: this replica is shutting down, and
    /// the message goes back at once.
    pub(crate) fn pulled(&mut self, pulled: Pulled<M>, closing: bool, now: Instant) {
        let attempts = pulled.attempt.saturating_sub(1);
        if closing {
            self.out.push(Outbound::Nak(vec![(pulled.message, attempts)]));
            return;
        }
        // Delivered before, and no replica handed it back (one that does
        // writes its attempts down first, `attempts.rs`): JetStream
        // redelivered it after its ack wait, the attempt ending with a
        // replica cut off or gone, or an ack that did not reach JetStream.
        // No machine counted that attempt as failed: counted here, so that
        // a message delivered again after a partition heals is a
        // redelivery in the group's record.
        if pulled.attempt > 1 && !pulled.remembered {
            self.machine.count_redelivery();
        }
        let (published, token) = token(pulled);
        self.machine.offer(published, token, attempts, now);
        self.take_out();
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
        let attempts = pulled.attempt.saturating_sub(1);
        let (published, token) = token(pulled);
        self.machine.offer_first(published, token, attempts, now);
        self.take_out();
        true
    }

    /// An AUTO member's stream took `sequence`: done. False when the
    /// member does not hold it.
    pub(crate) fn done(&mut self, member: &Arc<str>, sequence: u64, now: Instant) -> bool {
        let done = self.machine.done(member, sequence, now);
        self.take_out();
        done
    }

    pub(crate) fn ack(&mut self, member: &Arc<str>, sequences: &[u64], now: Instant) -> Acked {
        let acked = self.machine.ack(member, sequences, now);
        self.take_out();
        acked
    }

    /// Hands messages back: to another member here with room, else offered
    /// to the other replicas, else nacked through JetStream; dead-lettered
    /// after their last allowed attempt (and still counted as requeued:
    /// the member no longer holds them).
    pub(crate) fn nack(&mut self, member: &Arc<str>, sequences: &[u64], now: Instant) -> Nacked {
        let nacked = self.machine.nack(member, sequences, now);
        self.take_out();
        nacked
    }

    /// Every [`super::hub::TICK`]: reports in progress what has been held
    /// for a third of `ack_wait` since it last was (each member has its own
    /// deadline, JetStream must not redeliver it meanwhile), and takes back
    /// what MANUAL members hold past their ack deadline, as after a Nack.
    pub(crate) fn tick(&mut self, now: Instant) {
        let due = self.machine.due_for_report(now, self.ack_wait / 3);
        self.out
            .extend(due.into_iter().map(|token| Outbound::Progress(token.message)));
        self.machine.expire(now);
        self.take_out();
    }

    /// Shutdown: everything this replica holds, held by members (lowest
    /// sequence first) or waiting, goes back to JetStream at once. How many
    /// messages.
    pub(crate) fn hand_back(&mut self) -> usize {
        let naks = naks(self.machine.take_all());
        let count = naks.len();
        if count > 0 {
            self.out.push(Outbound::Nak(naks));
        }
        count
    }

    /// The hub stops (no member for a while): what still waits goes back.
    pub(crate) fn stop(&mut self) {
        let naks = naks(self.machine.take_backlog());
        if !naks.is_empty() {
            self.out.push(Outbound::Nak(naks));
        }
    }

    /// What members hold, forgotten: JetStream lost it with its state
    /// (nothing left to ack, or to redeliver); its acks count as unknown.
    /// How many.
    pub(crate) fn forget_held(&mut self, now: Instant) -> usize {
        let forgotten = self.machine.forget_held(now);
        self.take_out();
        forgotten
    }

    /// What the machine decided, for JetStream (and the other replicas).
    fn take_out(&mut self) {
        for event in self.machine.out.drain(..) {
            self.out.push(match event {
                Event::Done(token) => Outbound::Ack {
                    message: token.message,
                    remembered: token.remembered,
                },
                Event::DeadLetter { token, attempts, .. } => Outbound::DeadLetter {
                    message: token.message,
                    attempts,
                    remembered: token.remembered,
                },
                Event::Elsewhere(messages) => Outbound::Offer(naks(messages)),
                // A hub's backlog has no bound (Rules::backlog is None).
                Event::Dropped(token) => {
                    debug_assert!(false, "a hub dropped a message");
                    Outbound::Nak(vec![(token.message, 0)])
                }
            });
        }
    }

    /// Where each message is, for the property test: sequences waiting,
    /// and held (with their member).
    #[cfg(test)]
    pub(crate) fn places(&self) -> (Vec<u64>, Vec<(u64, Arc<str>)>) {
        self.machine.places()
    }
}

/// A pulled message as the machine takes it.
fn token<M>(pulled: Pulled<M>) -> (Arc<Published>, Token<M>) {
    let token = Token {
        message: pulled.message,
        remembered: pulled.remembered,
    };
    (pulled.published, token)
}

/// Messages with their attempts, as JetStream's naks (and offers) take them.
fn naks<M>(messages: Vec<(Token<M>, u32)>) -> Vec<(M, u32)> {
    messages
        .into_iter()
        .map(|(token, attempts)| (token.message, attempts))
        .collect()
}
