//! The groups rebuilt after NATS lost its state (`recovery.rs`): table
//! entries, streams and consumers made again, and what was lost counted.

use crate::cluster::{ClusterEngine, Ready};
use crate::engine::BrokerError;
use std::collections::HashMap;

impl ClusterEngine {
    /// After NATS lost its state (`recovery.rs`): every group this replica
    /// routes gets its table entry and stream again, and each hub here its
    /// consumer. Returns what was lost: the groups' last backlogs, counted
    /// by one replica, the first of the live ones by id (a hub's repair or
    /// another replica may write a table entry again first, so its writer
    /// cannot be the one), and the messages members here held (nothing is
    /// left to settle their acks, or to redeliver them).
    pub(in crate::cluster) async fn rebuild_groups(&self, ready: &Ready) -> Result<u64, BrokerError> {
        let table = self.inner.groups.table.lock().clone();
        let me = &self.inner.config.replica_id;
        let counts_backlogs = self.inner.live.lock().iter().min().is_none_or(|first| first == me);
        // Taken, not read: a second rebuild before the next gathering (a
        // replica's witness purged by another's rebuild) counts them once.
        let mut lost: u64 = 0;
        let mut by_group: HashMap<String, u64> = HashMap::new();
        for group in self.inner.groups_seen.lock().iter_mut() {
            if counts_backlogs && group.backlog > 0 {
                lost += group.backlog as u64;
                *by_group.entry(group.name.clone()).or_default() += group.backlog as u64;
            }
            group.backlog = 0;
        }
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
                    lost += held;
                    if held > 0 {
                        *by_group.entry(name.clone()).or_default() += held;
                    }
                }
                None => {
                    self.group_stream(ready, &name).await?;
                }
            }
        }
        let mut dropped = self.inner.groups.dropped.lock();
        for (name, n) in by_group {
            *dropped.entry(name).or_default() += n;
        }
        Ok(lost)
    }
}
