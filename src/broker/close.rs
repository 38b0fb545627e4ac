//! Ending subscriptions: closed by their client, by an admin, by shutdown,
//! or evicted; what their queues held is handed back or counted.

use super::subscription::Subscription;
use super::{Broker, EVICTION_HISTORY};
use crate::engine::validate;
use crate::engine::{BrokerError, CloseReason, EvictionRecord, display_peer};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

/// Why a subscription is evicted, with its queue's depth and bytes then.
#[derive(Debug, Clone, Copy)]
pub(super) enum Eviction {
    /// A message did not fit: the queue was at its capacity or byte limit.
    QueueFull { depth: usize, bytes: usize },
    /// The broker's memory budget was spent and this queue held the most.
    MemoryLimit { depth: usize, bytes: usize },
}

impl Broker {
    /// Closes one subscription by id (Admin API); its stream ends cleanly.
    pub fn close_subscription(&self, id: &str) -> Result<(), BrokerError> {
        validate::subscription_id_given("CloseSubscription", id)?;
        let subscription = self.open_subscription(id)?;
        let dropped = self.close(&subscription, CloseReason::ClosedByAdmin, 0);
        tracing::info!(
            subscription_id = id,
            peer = %display_peer(subscription.peer()),
            patterns = ?subscription.patterns().iter().map(|p| p.as_str()).collect::<Vec<_>>(),
            consumer_group = subscription.consumer_group().unwrap_or(""),
            dropped = dropped.unwrap_or(0),
            "subscription closed by an admin (Admin/CloseSubscription)"
        );
        Ok(())
    }

    /// Closes a subscription's queue and removes it from routing. Idempotent.
    /// A group member's undelivered messages go back to its group (at
    /// shutdown, what it holds is discarded and counted instead); a
    /// broadcast subscription's are dropped and counted, with `also_lost`
    /// more (the message that did not fit, for an eviction). Returns how
    /// many it dropped or discarded (0 for a member handing back), or None
    /// when it was closed already.
    pub(super) fn close(&self, subscription: &Arc<Subscription>, reason: CloseReason, also_lost: u64) -> Option<usize> {
        let lost = subscription.is_broadcast().then_some(also_lost);
        let left = subscription.queue.close(reason, lost);
        self.detach(subscription);
        let left = left?;
        if subscription.external().is_some() {
            // Its group's engine takes back what it had handed out.
            return Some(0);
        }
        if let Some(membership) = subscription.membership() {
            let group = &membership.group;
            if reason == CloseReason::Shutdown {
                // The grace period is over: what it holds goes with it.
                let held = group.discard(subscription.key, left);
                self.shared
                    .stats
                    .discarded_on_shutdown
                    .fetch_add(held as u64, Ordering::Relaxed);
                return Some(held);
            }
            let dead = group.leave(subscription.key, left, tokio::time::Instant::now());
            self.dead_letter(group.name(), dead);
            return Some(0);
        }
        let stats = &self.shared.stats;
        match reason {
            CloseReason::Evicted => &stats.dropped_evicted,
            CloseReason::Shutdown => &stats.discarded_on_shutdown,
            CloseReason::Cancelled | CloseReason::ClosedByAdmin => &stats.dropped_closed,
        }
        .fetch_add(left.len() as u64, Ordering::Relaxed);
        Some(left.len())
    }

    /// Removes a subscription from routing and the registry. Idempotent.
    pub(super) fn detach(&self, subscription: &Arc<Subscription>) {
        if subscription.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        // Members are routed through their group, not the trie.
        if subscription.is_broadcast() {
            self.remove_routes(subscription.key, subscription.patterns());
        }
        self.shared.subscriptions.lock().remove(subscription.id());
    }

    /// The client went away: close what is left of its subscription.
    pub(super) fn close_on_drop(&self, subscription: &Arc<Subscription>) {
        self.close(subscription, CloseReason::Cancelled, 0);
    }

    pub(super) fn evict(&self, subscription: &Arc<Subscription>, why: Eviction) {
        // The message that did not fit a full queue is lost to it as well.
        let did_not_fit = u64::from(matches!(why, Eviction::QueueFull { .. }));
        let Some(_) = self.close(subscription, CloseReason::Evicted, did_not_fit) else {
            return;
        };
        let stats = &self.shared.stats;
        let (depth, bytes, reason) = match why {
            Eviction::QueueFull { depth, bytes } => {
                stats.dropped_evicted.fetch_add(did_not_fit, Ordering::Relaxed);
                let reason = if depth >= subscription.queue.capacity() {
                    "its queue was full"
                } else {
                    "its queue held more than consumer_max_bytes (TINYBROKER_CONSUMER_MAX_BYTES)"
                };
                (depth, bytes, reason)
            }
            Eviction::MemoryLimit { depth, bytes } => {
                stats.evictions_memory_limit.fetch_add(1, Ordering::Relaxed);
                (
                    depth,
                    bytes,
                    "the broker's memory limit (TINYBROKER_MAX_MEMORY_BYTES) was reached and its queue held the most bytes",
                )
            }
        };
        stats.evictions.fetch_add(1, Ordering::Relaxed);
        let record = EvictionRecord {
            subscription_id: subscription.id().to_owned(),
            evicted_at: SystemTime::now(),
            topic_patterns: subscription.patterns().iter().map(|p| p.to_string()).collect(),
            queue_depth: depth,
            last_delivered_sequence: subscription.last_delivered_sequence(),
            peer: subscription.peer(),
            replica_id: self.shared.replica_id.to_string(),
        };
        tracing::warn!(
            subscription_id = %record.subscription_id,
            peer = %display_peer(record.peer),
            patterns = ?record.topic_patterns,
            queue_depth = depth,
            queue_bytes = bytes,
            capacity = subscription.queue.capacity(),
            last_delivered_sequence = record.last_delivered_sequence,
            "slow consumer evicted: {reason}"
        );
        let mut evictions = self.shared.evictions.lock();
        if evictions.len() >= EVICTION_HISTORY {
            evictions.pop_front();
        }
        evictions.push_back(record);
    }
}
