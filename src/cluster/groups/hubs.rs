//! This replica's hubs, one per group with members here: started (with
//! its stream and consumer) on the group's first local member, offered
//! the messages other replicas hand over, told to stop pulling when the
//! replica begins to shut down, and made to hand back what their members
//! hold before it exits.

use super::hub::{HubConfig, HubHandle};
use super::nats::{self, Nats};
use super::state::Pulled;
use crate::cluster::{ClusterEngine, Ready};
use crate::engine::BrokerError;
use async_nats::jetstream;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How long a replica shutting down waits for its last pulls to be
/// answered before it hands back what its members hold.
const HAND_BACK_WAIT: Duration = Duration::from_millis(1500);

impl ClusterEngine {
    /// The group's hub on this replica, started (with its stream and
    /// consumer) on its first local member.
    pub(super) async fn hub(
        &self,
        ready: &Ready,
        name: &str,
        patterns: &[String],
        ack_deadline: Duration,
    ) -> Result<HubHandle<Nats>, BrokerError> {
        if let Some(hub) = self.inner.groups.hubs.lock().get(name) {
            return Ok(hub.clone());
        }
        let consumer = self.group_consumer(ready, name, ack_deadline).await?;
        let nats = Nats::new(self.clone(), name, patterns, ready.js.clone(), consumer);
        let config = HubConfig {
            max_delivery_attempts: self.inner.local.limits().max_delivery_attempts,
            ack_wait: nats.ack_wait,
            closing: self.inner.groups.closing.clone(),
        };
        let (hub, starting) = HubHandle::new(name, Arc::new(nats), config);
        {
            let mut hubs = self.inner.groups.hubs.lock();
            if let Some(hub) = hubs.get(name) {
                return Ok(hub.clone());
            }
            hubs.insert(name.to_owned(), hub.clone());
        }
        // Its tasks start outside the lock.
        starting.start();
        Ok(hub)
    }

    /// Takes a nacked message offered by another replica into this
    /// replica's hub of `group`, if it has one with room for it.
    pub(in crate::cluster) async fn take_offered(
        &self,
        group: &str,
        message: jetstream::Message,
        attempt: u32,
    ) -> bool {
        let Some(hub) = self.inner.groups.hubs.lock().get(group).cloned() else {
            return false;
        };
        let Some(published) = nats::published(self, &message) else {
            return false;
        };
        hub.take(Pulled {
            message,
            published,
            attempt,
            remembered: false,
        })
        .await
    }

    /// Shutdown begins: no hub pulls from its group any more.
    pub(in crate::cluster) fn stop_pulling(&self) {
        self.inner.groups.closing.cancel();
    }

    /// At shutdown, once the grace period is over: every group message this
    /// replica still holds (handed to a member and not acked, or pulled and
    /// not handed out yet) goes back to its group at once, so that members
    /// on other replicas get it now rather than after the consumer's
    /// `ack_wait`. The pulls still open are waited for first (what they
    /// bring is handed back as it comes). The caller flushes the
    /// connection.
    pub(in crate::cluster) async fn hand_back_groups(&self) {
        self.stop_pulling();
        let hubs: Vec<HubHandle<Nats>> = self.inner.groups.hubs.lock().values().cloned().collect();
        let deadline = Instant::now() + HAND_BACK_WAIT;
        for hub in &hubs {
            let _ = tokio::time::timeout_at(deadline, hub.pulled()).await;
        }
        // Each hub queues its naks behind the acks of what its members were
        // done with, and says when all are with the NATS client (before
        // the caller's last flush).
        let mut count = 0;
        let mut sent = Vec::new();
        for hub in &hubs {
            if let Some((handed, flushed)) = hub.hand_back().await {
                count += handed;
                sent.push(flushed);
            }
        }
        let deadline = Instant::now() + HAND_BACK_WAIT;
        for flushed in sent {
            let _ = tokio::time::timeout_at(deadline, flushed).await;
        }
        if count > 0 {
            tracing::info!(
                handed_back = count,
                "shutdown: unacked consumer-group messages handed back to their groups"
            );
        }
    }
}
