//! Shutdown and draining, and the maintenance tick (ack deadlines, stalls,
//! idle groups).

use super::{Broker, GROUP_REMOVAL_HISTORY, MAINTENANCE_INTERVAL};
use crate::engine::{BrokerError, CloseReason, Discarded, GroupRemoval};
use crate::group::{idle, stall};
use std::sync::atomic::Ordering;
use std::time::SystemTime;

impl Broker {
    pub(super) fn check_open(&self) -> Result<(), BrokerError> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(BrokerError::Unavailable("the broker is shutting down".into()));
        }
        Ok(())
    }

    /// Refuses new work from now on; queued messages keep draining.
    pub fn begin_shutdown(&self) {
        let _guard = self.shared.subscriptions.lock();
        self.shared.draining.store(true, Ordering::Release);
        self.shared.drain_signal.cancel();
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shared.draining.load(Ordering::Acquire)
    }

    /// Messages waiting anywhere: subscription queues and every group's
    /// backlog (what a shutdown puts at risk).
    pub fn queued_total(&self) -> usize {
        self.waiting(true)
    }

    /// Resolves when shutdown begins.
    pub fn draining(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.shared.drain_signal.clone().cancelled_owned()
    }

    /// What shutdown waits for: messages that can still reach a subscriber,
    /// that is every subscription queue and the backlogs of groups that have
    /// members. A memberless group's backlog cannot drain, so waiting for
    /// it would only spend the whole grace period.
    pub fn drainable(&self) -> usize {
        self.waiting(false)
    }

    fn waiting(&self, memberless_groups: bool) -> usize {
        let now = tokio::time::Instant::now();
        let queues: usize = self.live_subscriptions().iter().map(|s| s.queue_depth()).sum();
        let backlogs: usize = self
            .live_groups()
            .iter()
            .map(|g| g.info(now))
            .filter(|s| memberless_groups || s.members > 0)
            .map(|s| s.backlog)
            .sum();
        queues + backlogs
    }

    /// Ends every subscription and empties every group, once the grace
    /// period is over: what each held is discarded and counted, by kind. A
    /// member's messages are discarded with it, not handed back to its
    /// group first (where they would be counted as its backlog).
    pub fn close_all(&self) -> Discarded {
        let mut discarded = Discarded::default();
        for subscription in self.live_subscriptions() {
            let Some(left) = self.close(&subscription, CloseReason::Shutdown, 0) else {
                continue;
            };
            match subscription.membership() {
                Some(_) => discarded.in_flight += left,
                None => discarded.queued += left,
            }
        }
        for group in self.live_groups() {
            let (backlog, held) = group.discard_all();
            discarded.backlog += backlog;
            // Held by a member that was not listed (closing as shutdown began).
            discarded.in_flight += held;
            self.shared
                .stats
                .discarded_on_shutdown
                .fetch_add((backlog + held) as u64, Ordering::Relaxed);
        }
        discarded
    }

    /// Counts `messages` lost at shutdown elsewhere than in this broker's
    /// queues (a replica's broadcasts for the other replicas that it did
    /// not hand to NATS before exiting) in
    /// `tinybroker_messages_discarded_on_shutdown_total`.
    pub fn count_discarded_on_shutdown(&self, messages: usize) {
        self.shared
            .stats
            .discarded_on_shutdown
            .fetch_add(messages as u64, Ordering::Relaxed);
    }

    /// Redelivers messages whose ack deadline passed and removes groups idle
    /// for longer than their TTL. Called every [`MAINTENANCE_INTERVAL`].
    pub fn tick(&self, now: tokio::time::Instant) {
        for group in self.live_groups() {
            let dead = group.expire(now);
            self.dead_letter(group.name(), dead);
            if let Some(s) = group.stall_to_report(now) {
                stall::warn(&s);
            }
        }
        let ttl = self.shared.limits.group_idle_ttl;
        let mut groups = self.shared.groups.lock();
        let mut removed = Vec::new();
        groups.retain(|_, group| match group.remove_if_idle(now, ttl) {
            Some(left) => {
                removed.push((group.clone(), left));
                false
            }
            None => true,
        });
        drop(groups);
        for (group, left) in removed {
            self.remove_routes(group.key, group.patterns());
            self.count_group_removal(group.name(), left);
        }
    }

    /// Counts and logs the removal of group `name` after its idle TTL with
    /// `left` messages dropped (also for the cluster engine's groups, which
    /// live in JetStream).
    pub fn count_group_removal(&self, name: &str, left: usize) {
        self.shared
            .stats
            .dropped_group_expired
            .fetch_add(left as u64, Ordering::Relaxed);
        idle::log_removal(name, left);
        if left == 0 {
            return;
        }
        let mut removals = self.shared.group_removals.lock();
        if removals.len() >= GROUP_REMOVAL_HISTORY {
            removals.pop_front();
        }
        removals.push_back(GroupRemoval {
            consumer_group: name.to_owned(),
            removed_at: SystemTime::now(),
            dropped: left,
        });
    }

    /// Runs [`Broker::tick`] until the broker is dropped or `stop` resolves.
    pub async fn maintain(self, stop: impl std::future::Future<Output = ()>) {
        let mut interval = tokio::time::interval(MAINTENANCE_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                now = interval.tick() => self.tick(now),
            }
        }
    }
}
