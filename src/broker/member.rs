//! A group member's side of its consumer group: what a member's
//! subscription, its stream, its acks and its closing ask of the group.
//!
//! A group (`group/`) holds its members' subscriptions in its state
//! machine, and a member's subscription holds its group. This file is the
//! type of that back-reference: [`MemberGroup`], which the group
//! implements, so that `subscription.rs` names what it asks of a group and
//! not the group, and the files depend one way: `group/` and the machine
//! on `subscription.rs`, and `subscription.rs` on this file.
//!
//! The calls are dynamic, on paths that are never per message: a stream
//! reports to its group once per run of deliveries (when its queue runs
//! dry, and at most every 64) and adds to its count every 256; an ack, a
//! nack, added credit and leaving are one call per request.

use super::message::{Delivery, Published};
use crate::engine::{Acked, Nacked};
use crate::group::MemberSettings;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::time::Instant;

/// What makes a subscription a consumer-group member: its group, and the
/// settings it joined with.
pub(crate) struct Membership {
    pub(crate) group: Arc<dyn MemberGroup>,
    pub(crate) settings: MemberSettings,
}

/// A consumer group, as its members reach it (the single-node engine's
/// `ConsumerGroup` is the one implementation). `member` is the member's
/// subscription key. Each call takes the group's lock for one short
/// transition, except [`MemberGroup::add_delivered`].
pub(crate) trait MemberGroup: Send + Sync {
    /// The group's name.
    fn name(&self) -> &str;

    /// A member's stream wrote `count` messages (a counter; no lock).
    fn add_delivered(&self, count: u64);

    /// An auto-ack member's stream took `count` messages: they are done, and
    /// the member has room for as many more.
    fn streamed(&self, member: u64, count: u32, now: Instant);

    /// A member's session added credit: it may have room now.
    fn credit_added(&self, now: Instant);

    /// Marks manual-ack messages done (see the group's `ack`).
    fn ack(&self, member: u64, sequences: &[u64], now: Instant) -> Acked;

    /// Hands manual-ack messages back for redelivery (see the group's `nack`).
    fn nack(&self, member: u64, sequences: &[u64], now: Instant) -> NackOutcome;

    /// The member left; `unstreamed` is what its queue still held. Returns
    /// the dead letters that made.
    fn leave(&self, member: u64, unstreamed: VecDeque<Delivery>, now: Instant) -> Vec<DeadLetter>;

    /// Shutdown, once the grace period is over: the member leaves and what
    /// it holds (`unstreamed`, what its queue still held, and what reached
    /// its stream and is not done) is discarded, not handed back. How many.
    fn discard(&self, member: u64, unstreamed: VecDeque<Delivery>) -> usize;
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
