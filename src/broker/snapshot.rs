//! What Admin and the metrics read: plain values copied out of the live
//! state, so nothing outside the engine holds a subscription or a group.

use super::Broker;
use super::group::ConsumerGroup;
use super::subscription::Subscription;
use crate::engine::{
    Counters, EngineInfo, EvictionRecord, GroupInfo, GroupRemoval, MemoryUse, Peaks, Snapshot, SubscriptionInfo,
};
use crate::group::machine::MemberUnacked;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A group member's unacked messages in its record, as its group's machine
/// has them at `now`: handed to it, the oldest `oldest` ago, and its stall.
/// What still waits in its queue was not delivered: `unacked` is the rest
/// (the record's `queue_depth` says how many wait).
pub(crate) fn set_unacked(info: &mut SubscriptionInfo, unacked: &MemberUnacked, now: tokio::time::Instant) {
    info.unacked = u64::from(unacked.count).saturating_sub(info.queue_depth as u64);
    info.oldest_unacked_age = Some(now.saturating_duration_since(unacked.oldest));
    info.stalled = Some(now.saturating_duration_since(unacked.stalled_since));
}

impl Broker {
    /// Every open subscription, oldest first.
    pub(super) fn live_subscriptions(&self) -> Vec<Arc<Subscription>> {
        let mut subs: Vec<_> = self.shared.subscriptions.lock().iter().map(|s| s.0.clone()).collect();
        subs.sort_by(|a, b| a.opened_at().cmp(&b.opened_at()).then_with(|| a.id().cmp(b.id())));
        subs
    }

    /// Every consumer group, by name.
    pub(super) fn live_groups(&self) -> Vec<Arc<ConsumerGroup>> {
        let mut groups: Vec<_> = self.shared.groups.lock().values().cloned().collect();
        groups.sort_by(|a, b| a.name().cmp(b.name()));
        groups
    }

    /// Every open subscription, oldest first; with [`Peaks::Take`] each
    /// queue starts a new peak period.
    pub fn subscriptions(&self, peaks: Peaks) -> Vec<SubscriptionInfo> {
        let now = tokio::time::Instant::now();
        // Each group's members' unacked messages, in one pass per group.
        let mut unacked = HashMap::new();
        self.live_subscriptions()
            .iter()
            .map(|s| {
                let mut info = s.info(peaks, &self.shared.replica_id);
                if let Some(m) = s.membership() {
                    let by_member = unacked
                        .entry(Arc::as_ptr(&m.group))
                        .or_insert_with(|| m.group.unacked_by_member());
                    if let Some(u) = by_member.get(&s.key) {
                        set_unacked(&mut info, u, now);
                    }
                }
                info
            })
            .collect()
    }

    /// Every consumer group, by name.
    pub fn groups(&self) -> Vec<GroupInfo> {
        let now = tokio::time::Instant::now();
        self.live_groups().iter().map(|g| g.info(now)).collect()
    }

    pub fn subscription_count(&self) -> usize {
        self.shared.subscriptions.lock().len()
    }

    pub fn group_count(&self) -> usize {
        self.shared.groups.lock().len()
    }

    /// The most recent evictions, newest first.
    pub fn evictions(&self) -> Vec<EvictionRecord> {
        self.shared.evictions.lock().iter().rev().cloned().collect()
    }

    /// The most recent removals of groups that still held messages, newest
    /// first.
    pub fn group_removals(&self) -> Vec<GroupRemoval> {
        self.shared.group_removals.lock().iter().rev().cloned().collect()
    }

    /// The lifetime counters.
    pub fn counters(&self) -> Counters {
        let s = &self.shared.stats;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            published: load(&s.published),
            unrouted: load(&s.unrouted),
            evictions: load(&s.evictions),
            delivered_multi: load(&s.delivered_multi),
            delivered_single: load(&s.delivered_single),
            dropped_evicted: load(&s.dropped_evicted),
            dropped_closed: load(&s.dropped_closed),
            dropped_group_overflow: load(&s.dropped_group_overflow),
            dropped_group_expired: load(&s.dropped_group_expired),
            dropped_dead_letter_invalid: load(&s.dropped_dead_letter_invalid),
            discarded_on_shutdown: load(&s.discarded_on_shutdown),
            refused_memory_limit: load(&s.refused_memory_limit),
            evictions_memory_limit: load(&s.evictions_memory_limit),
        }
    }

    /// The ids of every open subscription.
    pub fn subscription_ids(&self) -> Vec<String> {
        self.shared
            .subscriptions
            .lock()
            .iter()
            .map(|s| s.0.id().to_owned())
            .collect()
    }

    /// Everything the metrics report.
    pub fn snapshot(&self, peaks: Peaks) -> Snapshot {
        let memory = self.shared.memory;
        Snapshot {
            counters: self.counters(),
            subscriptions: self.subscriptions(peaks),
            groups: self.groups(),
            evictions: self.evictions(),
            group_removals: self.group_removals(),
            memory: MemoryUse {
                used: memory.used(),
                limit: memory.limit(),
            },
            shutting_down: self.is_shutting_down(),
            nats: None,
        }
    }

    /// GetBrokerInfo's view.
    pub fn info(&self) -> EngineInfo {
        EngineInfo {
            started_at: self.shared.started_at,
            uptime: self.shared.started.elapsed(),
            subscriptions: self.subscription_count() as u64,
            consumer_groups: self.group_count() as u64,
            last_sequence: self.last_sequence(),
            cluster: None,
        }
    }
}
