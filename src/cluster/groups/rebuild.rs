//! The groups rebuilt after NATS lost its state (`recovery.rs`): table
//! entries, streams and consumers made again, and what was lost counted,
//! once over the replicas.
//!
//! Who knows what a lost group held: its members' replicas know what they
//! held, and every replica knows every group's backlog as of its last
//! gathering (every heartbeat, while NATS was seen to keep its state: the
//! table, the members on every replica, each stream's count), whether the
//! group had members anywhere or none. The table in NATS went with the
//! rest, so the gathering is what is left of it. Each replica counts what
//! its own members held; a group's backlog is counted by the one replica
//! that marks the group first in `<prefix>_losses` (a create, which only
//! one replica's can win), whichever rebuilds first, so the sum over the
//! replicas is the loss. The marks live in NATS's memory too: the next
//! loss takes them, and its backlogs are counted again.

use crate::cluster::registry::key;
use crate::cluster::{ClusterEngine, Ready};
use crate::engine::BrokerError;
use async_nats::jetstream::kv;
use std::sync::atomic::Ordering;

impl ClusterEngine {
    /// After NATS lost its state (`recovery.rs`): every group this replica
    /// routes gets its table entry and stream again, and each hub here its
    /// consumer. Counts what was lost as it goes (a rebuild that fails half
    /// way and is tried again counts nothing twice): each group's last
    /// backlog that this replica is the first to mark, and the messages
    /// members here held (nothing is left to settle their acks, or to
    /// redeliver them). Returns how many messages it counted.
    pub(in crate::cluster) async fn rebuild_groups(&self, ready: &Ready) -> Result<u64, BrokerError> {
        let mut counted = self.count_lost_backlogs(ready).await?;
        let table = self.inner.groups.table.lock().clone();
        let hubs = self.inner.groups.hubs.lock().clone();
        for (name, patterns) in table {
            let hub = hubs.get(&name);
            self.fix_patterns(ready, &name, &patterns, hub.and_then(|h| h.view().ack_mode))
                .await?;
            match hub {
                Some(hub) => {
                    let consumer = self.group_consumer(ready, &name, hub.backend().ack_wait).await?;
                    hub.backend().set_consumer(consumer);
                    let held = hub.forget_held().await as u64;
                    self.count_lost(&name, held);
                    counted += held;
                }
                None => {
                    self.group_stream(ready, &name).await?;
                }
            }
        }
        Ok(counted)
    }

    /// Each group's backlog as this replica last gathered it, counted here
    /// if this replica marks the group first (module docs). Taken, counted
    /// or not: a later loss before the next gathering is not this one.
    async fn count_lost_backlogs(&self, ready: &Ready) -> Result<u64, BrokerError> {
        let seen: Vec<(String, u64)> = self
            .inner
            .groups_seen
            .lock()
            .iter()
            .filter(|g| g.backlog > 0)
            .map(|g| (g.name.clone(), g.backlog as u64))
            .collect();
        let me = bytes::Bytes::from(self.inner.config.replica_id.clone());
        let mut counted = 0;
        for (name, backlog) in seen {
            match ready.losses.create(key(&name), me.clone()).await {
                Ok(_) => {
                    self.count_lost(&name, backlog);
                    counted += backlog;
                }
                // Another replica counted it.
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(BrokerError::Unavailable(format!(
                        "the record of lost backlogs (NATS) did not answer: {e}"
                    )));
                }
            }
            if let Some(group) = self.inner.groups_seen.lock().iter_mut().find(|g| g.name == name) {
                group.backlog = 0;
            }
        }
        Ok(counted)
    }

    /// `lost` messages of `group` lost with NATS's memory, counted here.
    fn count_lost(&self, group: &str, lost: u64) {
        if lost == 0 {
            return;
        }
        self.inner.state_lost.fetch_add(lost, Ordering::Relaxed);
        *self.inner.groups.dropped.lock().entry(group.to_owned()).or_default() += lost;
    }
}
