//! Idle groups, removed cluster-wide: a group without members on any live
//! replica for its idle TTL ([`crate::group::idle`]) loses its table
//! entry, stream and consumer, from each replica's heartbeat; what it held
//! is dropped and counted (`group_expired`).

use super::stream::stream_name;
use crate::cluster::registry::key;
use crate::cluster::{ClusterEngine, Ready};
use crate::engine::GroupInfo;
use crate::group::idle;
use std::time::Duration;
use tokio::time::Instant;

/// How long a group must be seen without members, at two checks at
/// least, before it is removed, however short its idle TTL: a join that
/// wrote the table just before the first check shows its member by the
/// second.
const IDLE_SEEN_FOR: Duration = Duration::from_secs(1);

pub(super) struct Idle {
    revision: u64,
    /// When this replica first saw it memberless (the memberless gauge).
    since: Instant,
    /// When it was seen memberless a second time in a row: its idle TTL
    /// runs from here. A member joining as the first check gathered the
    /// counts may not be counted yet, and one that left before the second
    /// check is never seen; the second memberless sighting comes after
    /// any member's leave, so the group is never removed before its TTL.
    confirmed: Option<Instant>,
}

impl ClusterEngine {
    /// Removes, cluster-wide, every group that every live replica reports
    /// without members (`complete`) for its idle TTL: its table entry (a
    /// delete expecting the revision seen when it was first found idle, so
    /// that a join since then keeps it), then its stream and consumer, with
    /// their backlog (dropped, counted here as `group_expired`). Run by
    /// every replica at each heartbeat; the first whose delete succeeds
    /// removes the stream. Sets each memberless group's `memberless` (as
    /// this replica has seen it) in `groups`, and leaves out those removed.
    pub(in crate::cluster) async fn expire_idle_groups(
        &self,
        ready: &Ready,
        groups: &mut Vec<GroupInfo>,
        complete: bool,
    ) {
        let ttl = self.inner.local.limits().group_idle_ttl.max(IDLE_SEEN_FOR);
        let memberless: Vec<String> = groups
            .iter()
            .filter(|g| complete && g.members == 0)
            .map(|g| g.name.clone())
            .collect();
        self.inner
            .groups
            .idle
            .lock()
            .retain(|name, _| memberless.contains(name));
        let mut removed = Vec::new();
        for name in memberless {
            let Ok(Some(entry)) = ready.groups.entry(key(&name)).await else {
                continue;
            };
            if entry.operation != async_nats::jetstream::kv::Operation::Put {
                continue;
            }
            let now = Instant::now();
            let (seen_since, idle_since) = {
                let mut idle = self.inner.groups.idle.lock();
                let fresh = Idle {
                    revision: entry.revision,
                    since: now,
                    confirmed: None,
                };
                let seen = idle.entry(name.clone()).or_insert(fresh);
                if seen.revision != entry.revision {
                    *seen = Idle {
                        revision: entry.revision,
                        since: now,
                        confirmed: None,
                    };
                } else if seen.confirmed.is_none() && seen.since != now {
                    seen.confirmed = Some(now);
                }
                (seen.since, seen.confirmed)
            };
            // For the memberless gauge (as this replica has seen it).
            if let Some(group) = groups.iter_mut().find(|g| g.name == name) {
                group.memberless = Some(now.duration_since(seen_since));
            }
            if !idle_since.is_some_and(|since| idle::outlived(since, now, ttl)) {
                continue;
            }
            self.inner.groups.idle.lock().remove(&name);
            if ready
                .groups
                .delete_expect_revision(key(&name), Some(entry.revision))
                .await
                .is_err()
            {
                // A member joined, or another replica removed it first.
                continue;
            }
            self.unroute_group(&name);
            // What it held: every message of the work-queue stream, the
            // backlog and what waits for a dead replica's ack_wait alike.
            let stream = stream_name(&self.inner.config.prefix, &name);
            let left = match ready.js.get_stream(&stream).await {
                Ok(s) => s.cached_info().state.messages as usize,
                Err(_) => groups.iter().find(|g| g.name == name).map_or(0, |g| g.backlog),
            };
            if let Err(error) = ready.js.delete_stream(&stream).await {
                tracing::warn!(consumer_group = %name, %stream, %error, "the idle group's stream was not deleted");
            }
            self.inner.local.count_group_removal(&name, left);
            removed.push(name);
        }
        groups.retain(|g| !removed.contains(&g.name));
    }
}
