//! The group table, `<prefix>_groups` (name → patterns and ack mode): written
//! by a group's first member (a compare-and-set: both are fixed then),
//! checked by every later one with the shared admission rule
//! ([`crate::group::admission`]), and watched by every replica into a
//! local trie, so a publish knows which groups it matches. A replica that
//! makes a group tells the others at once (`RouteGroup`, [`crate::cluster::rpc`]).

use super::stream::{fnv, subject};
use crate::cluster::registry::key;
use crate::cluster::{ClusterEngine, Ready, rpc};
use crate::engine::AckMode;
use crate::engine::BrokerError;
use crate::engine::validate::truncate;
use crate::group::admission::{self, Terms};
use crate::retry::Backoff;
use crate::topic::TopicPattern;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// The wait before watching the group table again (the watch ended or
/// could not be made), doubling while it cannot up to [`WATCH_RETRY_CAP`].
const WATCH_RETRY_FIRST: Duration = Duration::from_millis(160);
const WATCH_RETRY_CAP: Duration = Duration::from_secs(1);

/// Where a publish matching a group goes.
pub(in crate::cluster) struct GroupRoute {
    pub(in crate::cluster) name: String,
    pub(in crate::cluster) subject: String,
}

/// A group's record in the table, fixed by its first member.
#[derive(serde::Serialize, serde::Deserialize)]
struct TableEntry {
    patterns: Vec<String>,
    /// None in a record written by a version before the ack mode was
    /// recorded: not fixed yet; the next member to join fixes it (a
    /// compare-and-set, as for a new record), and every member after it
    /// must ask for the same. Older versions ignore the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ack_mode: Option<AckMode>,
}

impl ClusterEngine {
    /// Reads the whole group table into the local trie: done before the
    /// replica says SERVING, so that its first publishes reach the groups
    /// that already exist ([`Self::watch_groups`] then keeps it in step,
    /// from the table's history again: `route_group` of an entry already
    /// routed changes nothing).
    pub(in crate::cluster) async fn load_groups(&self, ready: &Ready) -> Result<usize, String> {
        use futures::TryStreamExt;
        let keys: Vec<String> = match ready.groups.keys().await {
            Ok(keys) => keys.try_collect().await.map_err(|e| e.to_string())?,
            Err(e) => return Err(e.to_string()),
        };
        let mut loaded = 0;
        for key in keys {
            let Some(name) = crate::cluster::registry::unkey(&key) else {
                continue;
            };
            let Some(value) = ready.groups.get(&key).await.map_err(|e| e.to_string())? else {
                continue;
            };
            if let Ok(e) = serde_json::from_slice::<TableEntry>(&value) {
                self.route_group(&name, e.patterns);
                loaded += 1;
            }
        }
        Ok(loaded)
    }

    /// Keeps the local group trie in step with the table: watches it again
    /// after a wait when the watch ends (the connection was lost) or cannot
    /// be made, the wait doubling while it cannot.
    pub(in crate::cluster) async fn watch_groups(self, ready: Ready) {
        let mut backoff = Backoff::new(WATCH_RETRY_FIRST, WATCH_RETRY_CAP);
        loop {
            let mut watch = match ready.groups.watch_with_history(">").await {
                Ok(watch) => {
                    backoff.reset();
                    watch
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot watch the consumer-group table; retrying");
                    backoff.sleep().await;
                    continue;
                }
            };
            while let Some(entry) = watch.next().await {
                let Ok(entry) = entry else { break };
                let Some(name) = crate::cluster::registry::unkey(&entry.key) else {
                    continue;
                };
                match entry.operation {
                    async_nats::jetstream::kv::Operation::Put => {
                        if let Ok(e) = serde_json::from_slice::<TableEntry>(&entry.value) {
                            self.route_group(&name, e.patterns);
                        }
                    }
                    _ => self.unroute_group(&name),
                }
            }
            backoff.sleep().await;
        }
    }

    pub(in crate::cluster) fn route_group(&self, name: &str, patterns: Vec<String>) {
        let groups = &self.inner.groups;
        let mut table = groups.table.lock();
        if table.get(name) == Some(&patterns) {
            return;
        }
        let id = fnv(name);
        let route = Arc::new(GroupRoute {
            name: name.to_owned(),
            subject: subject(&self.inner.config.prefix, name),
        });
        let mut routes = groups.routes.write();
        if let Some(old) = table.get(name) {
            for p in old.iter().filter_map(|p| TopicPattern::parse(p).ok()) {
                routes.remove(&p, id);
            }
        }
        for p in patterns.iter().filter_map(|p| TopicPattern::parse(p).ok()) {
            routes.insert(&p, id, route.clone());
        }
        table.insert(name.to_owned(), patterns);
    }

    pub(super) fn unroute_group(&self, name: &str) {
        let groups = &self.inner.groups;
        groups.dropped.lock().remove(name);
        if let Some(old) = groups.table.lock().remove(name) {
            let mut routes = groups.routes.write();
            for p in old.iter().filter_map(|p| TopicPattern::parse(p).ok()) {
                routes.remove(&p, fnv(name));
            }
        }
    }

    /// The groups a message to `topic` goes to.
    pub(in crate::cluster) fn group_routes(&self, topic: &str) -> Vec<Arc<GroupRoute>> {
        let routes = self.inner.groups.routes.read();
        // Without groups, no lookup (its cache's lock) and no allocation.
        if routes.is_empty() {
            return Vec::new();
        }
        routes.matches(topic).iter().cloned().collect()
    }

    /// The group's patterns and ack mode are the first member's: writes
    /// them, or checks them against what is written (FAILED_PRECONDITION
    /// naming both); a record without an ack mode gets `ack_mode`, and an
    /// `ack_mode` of None (no member to take it from) fixes and checks
    /// none. A join also writes the entry again (same value, a new
    /// revision), so that a replica about to remove the group as idle (a
    /// delete expecting the revision it saw while the group had no
    /// members) leaves it be. The entry's revision when this made it
    /// (a new group, for [`ClusterEngine::announce_group`]).
    pub(super) async fn fix_patterns(
        &self,
        ready: &Ready,
        name: &str,
        patterns: &[String],
        ack_mode: Option<AckMode>,
    ) -> Result<Option<u64>, BrokerError> {
        let unavailable = |e: &dyn std::fmt::Display| {
            BrokerError::Unavailable(format!("the consumer-group table (NATS) did not answer: {e}"))
        };
        let entry = serde_json::to_vec(&TableEntry {
            patterns: patterns.to_vec(),
            ack_mode,
        })
        .map_err(|e| unavailable(&e))?;
        let mut lost_race = None;
        for _ in 0..5 {
            match ready.groups.create(key(name), entry.clone().into()).await {
                Ok(revision) => {
                    self.route_group(name, patterns.to_vec());
                    return Ok(Some(revision));
                }
                Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {}
                Err(e) => return Err(unavailable(&e)),
            }
            let existing = ready.groups.entry(key(name)).await.map_err(|e| unavailable(&e))?;
            // Removed meanwhile: create it again.
            let Some(existing) = existing.filter(|e| e.operation == async_nats::jetstream::kv::Operation::Put) else {
                continue;
            };
            let (existing_patterns, fixed_mode) = serde_json::from_slice::<TableEntry>(&existing.value)
                .map(|e| (e.patterns, e.ack_mode))
                .unwrap_or_default();
            // The table holds the patterns as validate::patterns gave
            // them to the member that wrote it: sorted, without duplicates.
            let parsed =
                |p: &[String]| -> Vec<TopicPattern> { p.iter().filter_map(|p| TopicPattern::parse(p).ok()).collect() };
            admission::admit(
                name,
                Terms {
                    patterns: &parsed(&existing_patterns),
                    ack_mode: fixed_mode,
                },
                Terms {
                    patterns: &parsed(patterns),
                    ack_mode,
                },
            )?;
            // A record without an ack mode (an earlier version's) gets this
            // member's.
            let value = match (fixed_mode, ack_mode) {
                (None, Some(_)) => entry.clone().into(),
                _ => existing.value.clone(),
            };
            // Written again since this join's last try: by another join,
            // which is as good (unless it left the ack mode to fix).
            if (lost_race.is_some_and(|r| r != existing.revision) && (fixed_mode.is_some() || ack_mode.is_none()))
                || ready.groups.update(key(name), value, existing.revision).await.is_ok()
            {
                self.route_group(name, existing_patterns);
                return Ok(None);
            }
            lost_race = Some(existing.revision);
        }
        Err(BrokerError::Unavailable(format!(
            "consumer group {:?}: its table entry kept changing under this join; try again",
            truncate(name)
        )))
    }

    /// Tells every other live replica of a group this one just made, and
    /// waits for each to route it: a message published on any of them
    /// after the first member's OpenSubscription answered reaches the
    /// group (the table's watch would bring it a moment later). A replica
    /// that does not confirm is logged; it learns of the group by the watch.
    pub(super) async fn announce_group(&self, ready: &Ready, name: &str, patterns: &[String]) {
        let me = &self.inner.config.replica_id;
        let call = rpc::Call::RouteGroup {
            name: name.to_owned(),
            patterns: patterns.to_vec(),
        };
        let replicas = self.live_replicas(ready).await;
        let calls = replicas.iter().filter(|r| *r != me).map(|replica| {
            let call = &call;
            async move {
                let answer = rpc::call(&self.inner.client, &self.inner.config.prefix, replica, call).await;
                (replica, answer)
            }
        });
        for (replica, answer) in futures::future::join_all(calls).await {
            let error = match answer {
                Ok(rpc::Answer::Routed) => continue,
                Ok(other) => other.into_error(),
                Err(error) => error,
            };
            tracing::warn!(%replica, consumer_group = name, %error, "a replica did not confirm a new consumer group; it learns of it from the group table");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_record_keeps_its_ack_mode_and_reads_an_earlier_versions_record() {
        // A record written before the ack mode was recorded: not fixed yet.
        let old: TableEntry = serde_json::from_slice(br#"{"patterns":["a.*"]}"#).unwrap();
        assert_eq!((old.patterns, old.ack_mode), (vec!["a.*".to_owned()], None));
        let new = TableEntry {
            patterns: vec!["a.*".into()],
            ack_mode: Some(AckMode::Manual),
        };
        let written = serde_json::to_vec(&new).unwrap();
        assert_eq!(written, br#"{"patterns":["a.*"],"ack_mode":"Manual"}"#);
        let read: TableEntry = serde_json::from_slice(&written).unwrap();
        assert_eq!(read.ack_mode, Some(AckMode::Manual));
        // An earlier version reads only the patterns (serde ignores the
        // field it does not know), so it keeps routing the group.
        #[derive(serde::Deserialize)]
        struct Earlier {
            patterns: Vec<String>,
        }
        assert_eq!(serde_json::from_slice::<Earlier>(&written).unwrap().patterns, ["a.*"]);
        // None is not written: such a record stays open to the next join.
        let unfixed = TableEntry {
            patterns: vec!["a.*".into()],
            ack_mode: None,
        };
        assert_eq!(serde_json::to_vec(&unfixed).unwrap(), br#"{"patterns":["a.*"]}"#);
    }
}
