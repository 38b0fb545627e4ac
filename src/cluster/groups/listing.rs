//! What Admin and the metrics see of the groups: this replica's part of
//! each ([`LocalGroup`], the answer to another replica's `ListGroups`),
//! the cluster-wide sum with each backlog from its stream, and what each
//! MANUAL member here holds unacked.

use super::hub::HubHandle;
use super::nats::Nats;
use super::stream::stream_name;
use crate::cluster::rpc::LocalGroup;
use crate::cluster::{ClusterEngine, Ready};
use crate::engine::GroupInfo;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

impl ClusterEngine {
    /// The records of this replica's subscriptions, with what each MANUAL
    /// member holds unacked (its hub's view, as of its last tick).
    pub(in crate::cluster) fn local_subscriptions(
        &self,
        peaks: crate::engine::Peaks,
    ) -> Vec<crate::engine::SubscriptionInfo> {
        let mut list = self.inner.local.subscriptions(peaks);
        self.fill_unacked(&mut list);
        list
    }

    /// Sets what each MANUAL member in `list` holds unacked, from its
    /// hub's view (as of the hub's last tick).
    pub(in crate::cluster) fn fill_unacked(&self, list: &mut [crate::engine::SubscriptionInfo]) {
        let hubs = self.inner.groups.hubs.lock().clone();
        let now = Instant::now();
        let mut views = HashMap::new();
        for info in list.iter_mut().filter(|i| !i.consumer_group.is_empty()) {
            let Some(hub) = hubs.get(&info.consumer_group) else {
                continue;
            };
            let view = views
                .entry(info.consumer_group.clone())
                .or_insert_with(|| hub.view().unacked);
            if let Some(u) = view.get(info.subscription_id.as_str()) {
                crate::broker::set_unacked(info, u, now);
            }
        }
    }

    /// This replica's view of its groups.
    pub(in crate::cluster) fn local_groups(&self) -> Vec<LocalGroup> {
        let hubs: Vec<HubHandle<Nats>> = self.inner.groups.hubs.lock().values().cloned().collect();
        let dropped = self.inner.groups.dropped.lock().clone();
        let now = Instant::now();
        let mut groups: Vec<LocalGroup> = hubs
            .iter()
            .map(|h| {
                let view = h.view();
                LocalGroup {
                    name: h.name().to_owned(),
                    members: view.members,
                    held: view.held,
                    redeliveries: view.counters.redeliveries,
                    dead_lettered: view.counters.dead_lettered,
                    acked: view.counters.acked,
                    dropped: dropped.get(h.name()).copied().unwrap_or(0),
                    delivered: h.delivered(),
                    oldest_held_ms: view
                        .oldest_given_at
                        .map(|at| now.saturating_duration_since(at).as_millis() as u64),
                }
            })
            .collect();
        // Groups this replica dropped messages of without serving a member.
        for (name, &dropped) in dropped
            .iter()
            .filter(|(name, _)| !hubs.iter().any(|h| h.name() == *name))
        {
            groups.push(LocalGroup {
                name: name.clone(),
                dropped,
                ..LocalGroup::default()
            });
        }
        groups
    }

    /// Every group of the table, with members and counts summed over the
    /// replicas' parts, and its backlog from its stream.
    pub(in crate::cluster) async fn cluster_groups(&self, ready: &Ready, parts: Vec<LocalGroup>) -> Vec<GroupInfo> {
        let table = self.inner.groups.table.lock().clone();
        let mut groups = Vec::new();
        for (name, patterns) in table {
            let mut info = GroupInfo {
                name: name.clone(),
                topic_patterns: patterns,
                ..Default::default()
            };
            for part in parts.iter().filter(|p| p.name == name) {
                info.members += part.members;
                info.in_flight += part.held;
                info.redeliveries += part.redeliveries;
                info.dead_lettered += part.dead_lettered;
                info.acked += part.acked;
                info.dropped += part.dropped;
                info.delivered += part.delivered;
                if let Some(ms) = part.oldest_held_ms {
                    let age = Duration::from_millis(ms);
                    info.oldest_unacked_age = Some(info.oldest_unacked_age.map_or(age, |a| a.max(age)));
                }
            }
            // What the work-queue stream holds is every message not done
            // yet: those never delivered, those handed back (a Nack with no
            // room, a member that left: JetStream redelivers them, so its
            // consumer counts them as pending acks, not as pending), those
            // a dead replica's members held, and those members hold now.
            // All but the last wait for a member: the backlog.
            let prefix = &self.inner.config.prefix;
            if let Ok(stream) = ready.js.get_stream(stream_name(prefix, &name)).await {
                let stored = usize::try_from(stream.cached_info().state.messages).unwrap_or(usize::MAX);
                info.backlog = stored.saturating_sub(info.in_flight);
            }
            groups.push(info);
        }
        groups.sort_by(|a, b| a.name.cmp(&b.name));
        groups
    }
}
