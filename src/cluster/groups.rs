//! Consumer groups in cluster mode, over JetStream.
//!
//! - The group table, `<prefix>_groups` (name → patterns and ack mode), is
//!   written by a group's first member (a compare-and-set: both are fixed then)
//!   and watched by every replica into a local trie, so a publish knows
//!   which groups it matches.
//! - Each group is a WorkQueue memory stream `<prefix>_g_<hash>` on the one
//!   subject `<prefix>.g.<hash>` (`max_msgs` = `group_capacity`, `max_bytes`
//!   = `group_max_bytes`), written once per matching group by the publishing
//!   replica with an ack and a message id, and read by one durable pull
//!   consumer. The backlog lives there while no member is connected,
//!   replicated by NATS. A full stream refuses the message (discard new);
//!   the publishing replica then deletes the oldest message never delivered,
//!   counts it (`group_overflow`) and stores the new one
//!   ([`ClusterEngine::make_room`]): JetStream discarding the oldest itself
//!   would say nothing, and every loss must be counted.
//! - A replica with members of a group runs a [`Hub`]: it pulls only as many
//!   messages as its members have room for (`max_in_flight`), hands them
//!   out round-robin, and holds each JetStream message until it is done:
//!   acked when an AUTO member's stream takes it, or by a MANUAL member's
//!   Ack; on Nack handed to another member with room, here or on another
//!   replica (src/cluster/handover.rs), else nacked (redelivered at once, to
//!   any member); nacked at the member's ack deadline, or when the member's
//!   stream closes. A replica that dies leaves its messages to the
//!   consumer's `ack_wait`.
//! - A message whose attempt fails after `max_delivery_attempts` is
//!   published to `_dlq.<group>` by the replica holding it, then acked.
//! - A group without members on any live replica for its idle TTL is
//!   removed cluster-wide ([`ClusterEngine::expire_idle_groups`], from each
//!   replica's heartbeat): table entry, stream and consumer.
//! - A replica shutting down stops pulling, and hands back what its members
//!   still hold before it exits ([`ClusterEngine::hand_back_groups`]).

use super::registry::key;
use super::{ClusterEngine, ClusterStream, Ready};
use crate::broker::{ExternalMember, RouteCache, Subscription};
use crate::engine::validate::{self, truncate};
use crate::engine::{
    AckMode, Acked, BrokerError, Delivery, GroupInfo, Nacked, NewMessage, PublishTime, SubscribeRequest,
};
use crate::sublist::Sublist;
use crate::topic::TopicPattern;
use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use bytes::Bytes;
use futures::StreamExt;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// How long a pull waits for messages before asking again.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How often held messages are checked against their ack deadlines.
const DEADLINE_TICK: Duration = Duration::from_millis(100);
/// How long a replica shutting down waits for its last pulls to be
/// answered before it hands back what its members hold.
const HAND_BACK_WAIT: Duration = Duration::from_millis(1500);
/// How long a group must be seen without members, at two checks at
/// least, before it is removed, however short its idle TTL: a join that
/// wrote the table just before the first check shows its member by the
/// second.
const IDLE_SEEN_FOR: Duration = Duration::from_secs(1);
/// How often a hub whose pulls fail makes sure its stream and consumer
/// exist.
const HEAL_EVERY: Duration = Duration::from_secs(2);
/// How long a publish to a group's stream is retried (a stream leader's
/// election takes 4 to 7 s, docs/cluster-notes.md).
const PUBLISH_RETRY_FOR: Duration = Duration::from_secs(10);
/// Most messages one publish deletes from a full group backlog to make room
/// (a large message in a backlog full of bytes needs several); beyond it,
/// the new message is the one dropped.
const MAKE_ROOM_AT_MOST: usize = 64;
/// How long offering nacked messages to other replicas may take in all
/// (then the rest is nacked through JetStream): well within the shortest
/// `ack_wait` (2 s), which no one renews meanwhile.
const OFFERS_FOR_AT_MOST: Duration = Duration::from_millis(600);

/// What this replica knows of the cluster's groups.
#[derive(Default)]
pub(super) struct Groups {
    /// Group patterns, from the table: what a publish matches.
    routes: RwLock<Sublist<Arc<GroupRoute>>>,
    /// The table as last seen: name → patterns.
    table: Mutex<HashMap<String, Vec<String>>>,
    /// Groups with members on this replica.
    hubs: Mutex<HashMap<String, Arc<Hub>>>,
    /// Cancelled when this replica begins to shut down: its hubs stop
    /// pulling (the group's backlog stays in JetStream for the members
    /// elsewhere), and what they still hold is handed back before it exits
    /// ([`ClusterEngine::hand_back_groups`]).
    closing: tokio_util::sync::CancellationToken,
    /// Groups seen without members on any replica: since when, at which
    /// revision of their table entry (a join writes it again).
    idle: Mutex<HashMap<String, Idle>>,
    /// Messages this replica dropped from a full group backlog, per group.
    overflowed: Mutex<HashMap<String, u64>>,
}

struct Idle {
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

/// Where a publish matching a group goes.
pub(super) struct GroupRoute {
    pub(super) name: String,
    pub(super) subject: String,
}

/// Whether JetStream refused a message because the group's stream is full
/// (`max_msgs` or `max_bytes`, discard new).
pub(super) fn backlog_full(error: &jetstream::context::PublishError) -> bool {
    std::error::Error::source(error)
        .and_then(|e| e.downcast_ref::<jetstream::Error>())
        .is_some_and(|e| {
            e.error_code() == jetstream::ErrorCode::STREAM_STORE_FAILED && e.to_string().contains("maximum")
        })
}

/// A stable 64-bit FNV-1a hash: names a group's stream and subject the
/// same way on every replica and every version.
fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The consumer's `ack_wait`, fixed by the group's first member: its ack
/// deadline, at least 2 s so that progress reports (every third of it)
/// stay few.
fn consumer_ack_wait(ack_deadline: Duration) -> Duration {
    ack_deadline.max(Duration::from_secs(2))
}

fn stream_name(prefix: &str, group: &str) -> String {
    format!("{prefix}_g_{:016x}", fnv(group))
}

fn subject(prefix: &str, group: &str) -> String {
    format!("{prefix}.g.{:016x}", fnv(group))
}

/// How long creating a group's stream is retried while JetStream cannot
/// place it (see [`placement_pending`]).
const PLACEMENT_RETRY_FOR: Duration = Duration::from_secs(5);

/// Whether JetStream refused a stream for want of room on its servers
/// (`CLUSTER_NO_PEERS`, `INSUFFICIENT_RESOURCES`): retried for a while,
/// since a stream deleted a moment before still holds its reservation.
fn placement_pending(error: &jetstream::context::CreateStreamError) -> bool {
    use jetstream::ErrorCode;
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(e)
            if e.error_code() == ErrorCode::CLUSTER_NO_PEERS || e.error_code() == ErrorCode::INSUFFICIENT_RESOURCES
    ) || memory_exhausted(error)
}

/// Whether JetStream has no memory left to reserve for a new stream
/// ("insufficient memory resources available": the servers'
/// `max_memory_store` is taken by other streams' reservations).
fn memory_exhausted(error: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(e)
            if e.error_code() == jetstream::ErrorCode::MEMORY_RESOURCES_EXCEEDED
    )
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
    pub(super) async fn load_groups(&self, ready: &Ready) -> Result<usize, String> {
        use futures::TryStreamExt;
        let keys: Vec<String> = match ready.groups.keys().await {
            Ok(keys) => keys.try_collect().await.map_err(|e| e.to_string())?,
            Err(e) => return Err(e.to_string()),
        };
        let mut loaded = 0;
        for key in keys {
            let Some(name) = super::registry::unkey(&key) else {
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

    /// Keeps the local group trie in step with the table.
    pub(super) async fn watch_groups(self, ready: Ready) {
        loop {
            let mut watch = match ready.groups.watch_with_history(">").await {
                Ok(watch) => watch,
                Err(error) => {
                    tracing::warn!(%error, "cannot watch the consumer-group table; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            while let Some(entry) = watch.next().await {
                let Ok(entry) = entry else { break };
                let Some(name) = super::registry::unkey(&entry.key) else {
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
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub(super) fn route_group(&self, name: &str, patterns: Vec<String>) {
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

    fn unroute_group(&self, name: &str) {
        let groups = &self.inner.groups;
        groups.overflowed.lock().remove(name);
        if let Some(old) = groups.table.lock().remove(name) {
            let mut routes = groups.routes.write();
            for p in old.iter().filter_map(|p| TopicPattern::parse(p).ok()) {
                routes.remove(&p, fnv(name));
            }
        }
    }

    /// The groups a message to `topic` goes to.
    pub(super) fn group_routes(&self, topic: &str) -> Vec<Arc<GroupRoute>> {
        let routes = self.inner.groups.routes.read();
        // Without groups, no lookup (its cache's lock) and no allocation.
        if routes.is_empty() {
            return Vec::new();
        }
        routes.matches(topic).iter().cloned().collect()
    }

    /// Stores `body` in a group's stream after its first store, sent by
    /// [`ClusterEngine::publish_cluster_routed`], ended with `first`
    /// (whether the backlog was full, JetStream's error): makes room in a
    /// full backlog, and retries over a leader election. `id` makes retries
    /// idempotent. False when the group was removed meanwhile (its idle
    /// TTL): the message matched no group.
    pub(super) async fn publish_to_group(
        &self,
        ready: &Ready,
        route: &GroupRoute,
        body: Bytes,
        id: String,
        first: Result<(), (bool, String)>,
    ) -> Result<bool, BrokerError> {
        let mut first = Some(first);
        let started = Instant::now();
        let mut made_room = 0;
        loop {
            // After a refusal for a full backlog, a new message id: a
            // clustered stream remembers the refused one and would answer
            // the retry "duplicate" without storing it.
            let attempt_id = match made_room {
                0 => id.clone(),
                n => format!("{id}-{n}"),
            };
            let result = match first.take() {
                Some(result) => result,
                None => {
                    let message = jetstream::message::PublishMessage::build()
                        .payload(body.clone())
                        .message_id(attempt_id);
                    match ready.js.send_publish(route.subject.clone(), message).await {
                        Ok(ack) => ack.await.map(|_| ()).map_err(|e| (backlog_full(&e), e.to_string())),
                        Err(e) => Err((false, e.to_string())),
                    }
                }
            };
            match result {
                Ok(()) => return Ok(true),
                Err((true, error)) => {
                    // The backlog is full: the oldest message goes, as in
                    // single-node mode, and is counted.
                    if made_room < MAKE_ROOM_AT_MOST && self.make_room(ready, route).await {
                        made_room += 1;
                        continue;
                    }
                    // Everything it holds is with members (or too much to
                    // delete for this one): the new message is dropped.
                    tracing::debug!(group = %route.name, %error, "a full group backlog dropped the new message");
                    self.count_overflow(&route.name);
                    return Ok(true);
                }
                Err(_) if !self.inner.groups.table.lock().contains_key(&route.name) => return Ok(false),
                Err((false, error)) if started.elapsed() < PUBLISH_RETRY_FOR => {
                    tracing::debug!(group = %route.name, %error, "publish to a group's stream retried");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err((false, error)) => {
                    return Err(BrokerError::Unavailable(format!(
                        "consumer group {:?} did not take the message (JetStream: {error}); it reached broadcast subscribers",
                        truncate(&route.name)
                    )));
                }
            }
        }
    }

    /// Deletes the oldest message of a full group backlog that no member
    /// was ever given (above the consumer's delivered sequence: one
    /// consumer per stream), and counts it as dropped. False when there is
    /// none (every message it holds is with a member or waits for
    /// redelivery) or JetStream did not answer. Two replicas making room at
    /// once find the same message; the one whose delete fails looks again.
    async fn make_room(&self, ready: &Ready, route: &GroupRoute) -> bool {
        let name = stream_name(&self.inner.config.prefix, &route.name);
        let Ok(stream) = ready.js.get_stream_no_info(&name).await else {
            return false;
        };
        for _ in 0..3 {
            let Ok(mut consumer) = stream.get_consumer::<pull::Config>("members").await else {
                return false;
            };
            let Ok(info) = consumer.info().await else {
                return false;
            };
            let undelivered = info.delivered.stream_sequence + 1;
            let oldest = stream
                .raw_message_builder()
                .sequence(undelivered)
                .next_by_subject(route.subject.clone())
                .send()
                .await;
            let Ok(oldest) = oldest else {
                return false;
            };
            if let Ok(true) = stream.delete_message(oldest.sequence).await {
                self.count_overflow(&route.name);
                return true;
            }
        }
        false
    }

    fn count_overflow(&self, group: &str) {
        self.inner
            .local
            .stats()
            .dropped_group_overflow
            .fetch_add(1, Ordering::Relaxed);
        *self.inner.groups.overflowed.lock().entry(group.to_owned()).or_default() += 1;
    }

    /// Opens a member of a cluster-wide group on this replica.
    pub(super) async fn join_group(
        &self,
        ready: &Ready,
        mut request: SubscribeRequest,
    ) -> Result<ClusterStream, BrokerError> {
        let name = request.consumer_group.clone();
        validate::group_name(&name)?;
        let patterns: Vec<String> = validate::patterns(&request.topic_patterns)?
            .iter()
            .map(|p| p.to_string())
            .collect();
        let limits = self.inner.local.limits().clone();
        let max_in_flight = match request.max_in_flight {
            0 => limits.default_max_in_flight,
            n => n,
        };
        let ack_deadline = match request.ack_deadline_ms {
            0 => limits.default_ack_deadline,
            ms => Duration::from_millis(ms.into()),
        };
        let created = self
            .fix_patterns(ready, &name, &patterns, Some(request.ack_mode))
            .await?;
        if request.subscription_id.is_empty() {
            request.subscription_id = uuid::Uuid::new_v4().to_string();
        } else {
            validate::name_field("subscription_id", &request.subscription_id)?;
        }
        let id = request.subscription_id.clone();
        let mut hub = match self.hub(ready, &name, &patterns, ack_deadline).await {
            Ok(hub) => hub,
            Err(error) => {
                // A group this join made and could not give a stream (no
                // JetStream memory left) must not stay in the table: every
                // publish to its topics would wait for a stream that is not
                // there.
                if let Some(revision) = created
                    && ready
                        .groups
                        .delete_expect_revision(key(&name), Some(revision))
                        .await
                        .is_ok()
                {
                    self.unroute_group(&name);
                }
                return Err(error);
            }
        };
        if created.is_some() {
            self.announce_group(ready, &name, &patterns).await;
        }
        if let Err(error) = self.claim(ready, &id).await {
            hub.unused();
            return Err(error);
        }
        let release = super::Release {
            store: ready.subscriptions.clone(),
            id: id.clone(),
        };
        let member = ExternalMember {
            group: name.clone(),
            ack_mode: request.ack_mode,
        };
        let inner = match self.inner.local.open_external(&request, max_in_flight, member) {
            Ok(inner) => inner,
            Err(error) => {
                hub.unused();
                return Err(error);
            }
        };
        let settings = Settings {
            max_in_flight,
            ack_deadline,
        };
        // The hub stops 1.25 s after its last member left; if that moment
        // fell within this join (the claim above waits for NATS), join the
        // new one: a member of a stopped hub would never get a message.
        while !hub.join(id.as_str().into(), inner.subscription().clone(), settings) {
            hub = self.hub(ready, &name, &patterns, ack_deadline).await?;
        }
        Ok(ClusterStream {
            inner,
            release: Some(release),
            member: Some(MemberLink {
                hub,
                id: id.into(),
                ack_mode: request.ack_mode,
            }),
            _interested: None,
        })
    }

    /// The group's patterns and ack mode are the first member's: writes
    /// them, or checks them against what is written (FAILED_PRECONDITION
    /// naming both); a record without an ack mode gets `ack_mode`, and an
    /// `ack_mode` of None (no member to take it from) fixes and checks
    /// none. A join also writes the entry again (same value, a new revision), so that a replica about to remove the
    /// group as idle (a delete expecting the revision it saw while the group
    /// had no members) leaves it be. The entry's revision when this made it
    /// (a new group, for [`ClusterEngine::announce_group`]).
    async fn fix_patterns(
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
            if existing_patterns != patterns {
                let shown = |p: &[String]| {
                    let parsed: Vec<TopicPattern> = p.iter().filter_map(|p| TopicPattern::parse(p).ok()).collect();
                    validate::pattern_list(&parsed)
                };
                return Err(BrokerError::FailedPrecondition(format!(
                    "consumer group {:?} has topic_patterns {}; this member asked for {}; all members of a group must use the same set",
                    truncate(name),
                    shown(&existing_patterns),
                    shown(patterns)
                )));
            }
            if let (Some(fixed), Some(asked)) = (fixed_mode, ack_mode) {
                validate::same_ack_mode(name, fixed, asked)?;
            }
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
    async fn announce_group(&self, ready: &Ready, name: &str, patterns: &[String]) {
        let me = &self.inner.config.replica_id;
        let call = super::rpc::Call::RouteGroup {
            name: name.to_owned(),
            patterns: patterns.to_vec(),
        };
        let replicas = self.live_replicas(ready).await;
        let calls = replicas.iter().filter(|r| *r != me).map(|replica| {
            let call = &call;
            async move {
                let answer = super::rpc::call(&self.inner.client, &self.inner.config.prefix, replica, call).await;
                (replica, answer)
            }
        });
        for (replica, answer) in futures::future::join_all(calls).await {
            let error = match answer {
                Ok(super::rpc::Answer::Routed) => continue,
                Ok(other) => other.into_error(),
                Err(error) => error,
            };
            tracing::warn!(%replica, consumer_group = name, %error, "a replica did not confirm a new consumer group; it learns of it from the group table");
        }
    }

    /// Removes, cluster-wide, every group that every live replica reports
    /// without members (`complete`) for its idle TTL: its table entry (a
    /// delete expecting the revision seen when it was first found idle, so
    /// that a join since then keeps it), then its stream and consumer, with
    /// their backlog (dropped, counted here as `group_expired`). Run by
    /// every replica at each heartbeat; the first whose delete succeeds
    /// removes the stream. Sets each memberless group's `memberless` (as
    /// this replica has seen it) in `groups`, and leaves out those removed.
    pub(super) async fn expire_idle_groups(&self, ready: &Ready, groups: &mut Vec<GroupInfo>, complete: bool) {
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
            if idle_since.is_none_or(|since| now.duration_since(since) < ttl) {
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

    /// The group's hub on this replica, started (with its stream and
    /// consumer) on its first local member.
    async fn hub(
        &self,
        ready: &Ready,
        name: &str,
        patterns: &[String],
        ack_deadline: Duration,
    ) -> Result<Arc<Hub>, BrokerError> {
        if let Some(hub) = self.inner.groups.hubs.lock().get(name) {
            return Ok(hub.clone());
        }
        let consumer = self.group_consumer(ready, name, ack_deadline).await?;
        let ack_wait = consumer.cached_info().config.ack_wait;
        let mut hubs = self.inner.groups.hubs.lock();
        if let Some(hub) = hubs.get(name) {
            return Ok(hub.clone());
        }
        let (acks, acked) = tokio::sync::mpsc::unbounded_channel();
        let hub = Arc::new(Hub {
            name: name.to_owned(),
            patterns: patterns.to_vec(),
            engine: self.clone(),
            js: ready.js.clone(),
            consumer: Mutex::new(consumer),
            healed_at: Mutex::new(Instant::now()),
            state: Mutex::new(HubState::default()),
            room: tokio::sync::Notify::new(),
            emptied: tokio::sync::Notify::new(),
            pulling: tokio::sync::watch::Sender::new(false),
            stop: tokio_util::sync::CancellationToken::new(),
            pulled: tokio_util::sync::CancellationToken::new(),
            ack_wait,
            redeliveries: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            offers: Default::default(),
            acks,
        });
        tokio::spawn(send_acks(acked));
        hubs.insert(name.to_owned(), hub.clone());
        tokio::spawn(hub.clone().pull());
        tokio::spawn(hub.clone().watch_deadlines());
        Ok(hub)
    }

    /// The group's stream and its consumer, created if missing.
    async fn group_consumer(
        &self,
        ready: &Ready,
        name: &str,
        ack_deadline: Duration,
    ) -> Result<jetstream::consumer::PullConsumer, BrokerError> {
        let stream = self.group_stream(ready, name).await?;
        let unavailable =
            |e: &dyn std::fmt::Display| BrokerError::Unavailable(format!("JetStream did not answer: {e}"));
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                "members",
                pull::Config {
                    durable_name: Some("members".into()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: consumer_ack_wait(ack_deadline),
                    max_deliver: -1,
                    max_ack_pending: -1,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(consumer)
    }

    /// The group's stream, created if missing.
    async fn group_stream(&self, ready: &Ready, name: &str) -> Result<jetstream::stream::Stream, BrokerError> {
        let limits = self.inner.local.limits();
        let prefix = &self.inner.config.prefix;
        let unavailable =
            |e: &dyn std::fmt::Display| BrokerError::Unavailable(format!("JetStream did not answer: {e}"));
        let config = stream::Config {
            name: stream_name(prefix, name),
            subjects: vec![subject(prefix, name)],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::Memory,
            num_replicas: self.inner.config.nats_replicas,
            max_messages: limits.group_capacity as i64,
            max_bytes: limits.group_max_bytes as i64,
            // Refused when full, so the publishing replica drops (and
            // counts) the oldest: `publish_to_group`.
            discard: stream::DiscardPolicy::New,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        // A stream just deleted (a group removed after its idle TTL, whose
        // name is taken again) still holds its memory reservation on the
        // servers for a moment: JetStream answers "no suitable peers for
        // placement, insufficient storage" (10005) until it lets go.
        let started = Instant::now();
        let stream = loop {
            match ready.js.get_or_create_stream(config.clone()).await {
                Ok(stream) => break stream,
                Err(e) if placement_pending(&e) && started.elapsed() < PLACEMENT_RETRY_FOR => {
                    tracing::debug!(group = %name, error = %e, "creating a group's stream retried");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // Every group's stream reserves its byte budget on each
                // of its servers: a limit reached, not an outage.
                Err(e) if placement_pending(&e) => {
                    return Err(BrokerError::ResourceExhausted(format!(
                        "consumer group {:?}: the NATS servers have no JetStream memory left for its stream (each group reserves TINYBROKER_GROUP_MAX_BYTES={} on each of its TINYBROKER_NATS_REPLICAS={} servers): raise max_memory_store on the NATS servers, lower TINYBROKER_GROUP_MAX_BYTES, or let unused groups expire (JetStream: {e})",
                        truncate(name),
                        limits.group_max_bytes,
                        self.inner.config.nats_replicas
                    )));
                }
                Err(e) => return Err(unavailable(&e)),
            }
        };
        Ok(stream)
    }

    /// After NATS lost its state (`recovery.rs`): every group this replica
    /// routes gets its table entry and stream again, and each hub here its
    /// consumer. Returns what was lost: the groups' last backlogs, counted
    /// by one replica, the first of the live ones by id (a hub's repair or
    /// another replica may write a table entry again first, so its writer
    /// cannot be the one), and the messages members here held (nothing is
    /// left to settle their acks, or to redeliver them).
    pub(super) async fn rebuild_groups(&self, ready: &Ready) -> Result<u64, BrokerError> {
        let table = self.inner.groups.table.lock().clone();
        let me = &self.inner.config.replica_id;
        let counts_backlogs = self.inner.live.lock().iter().min().is_none_or(|first| first == me);
        // Taken, not read: a second rebuild before the next gathering (a
        // replica's witness purged by another's rebuild) counts them once.
        let mut lost: u64 = 0;
        for group in self.inner.groups_seen.lock().iter_mut() {
            if counts_backlogs {
                lost += group.backlog as u64;
            }
            group.backlog = 0;
        }
        let hubs = self.inner.groups.hubs.lock().clone();
        for (name, patterns) in table {
            let hub = hubs.get(&name);
            self.fix_patterns(ready, &name, &patterns, hub.and_then(|h| h.members_ack_mode()))
                .await?;
            match hub {
                Some(hub) => {
                    let consumer = self.group_consumer(ready, &name, hub.ack_wait).await?;
                    *hub.consumer.lock() = consumer;
                    lost += hub.forget_held() as u64;
                }
                None => {
                    self.group_stream(ready, &name).await?;
                }
            }
        }
        Ok(lost)
    }

    /// Takes a nacked message offered by another replica into this
    /// replica's hub of `group`, if it has one with room for it.
    pub(super) fn take_offered(&self, group: &str, message: jetstream::Message, attempt: u32) -> bool {
        let hub = self.inner.groups.hubs.lock().get(group).cloned();
        hub.is_some_and(|hub| hub.take(message, attempt))
    }

    /// The hub holding member `id`, if it is on this replica.
    pub(super) fn hub_of(&self, id: &str) -> Option<Arc<Hub>> {
        let hubs = self.inner.groups.hubs.lock();
        hubs.values()
            .find(|h| h.state.lock().members.iter().any(|m| &*m.id == id))
            .cloned()
    }

    /// This replica's view of its groups: (name, members, held,
    /// redeliveries, dead-lettered, acked).
    pub(super) fn local_groups(&self) -> Vec<LocalGroup> {
        let hubs = self.inner.groups.hubs.lock();
        let overflowed = self.inner.groups.overflowed.lock();
        let mut groups: Vec<LocalGroup> = hubs
            .values()
            .map(|h| {
                let state = h.state.lock();
                LocalGroup {
                    name: h.name.clone(),
                    members: state.members.len(),
                    held: state.held.len(),
                    redeliveries: h.redeliveries.load(Ordering::Relaxed),
                    dead_lettered: h.dead_lettered.load(Ordering::Relaxed),
                    acked: h.acked.load(Ordering::Relaxed),
                    dropped: overflowed.get(&h.name).copied().unwrap_or(0),
                    delivered: h.delivered.load(Ordering::Relaxed),
                    oldest_held_ms: state
                        .held
                        .values()
                        .map(|held| held.given_at)
                        .min()
                        .map(|at| at.elapsed().as_millis() as u64),
                }
            })
            .collect();
        // Groups this replica published into without serving a member.
        for (name, &dropped) in overflowed.iter().filter(|(name, _)| !hubs.contains_key(*name)) {
            groups.push(LocalGroup {
                name: name.clone(),
                dropped,
                ..LocalGroup::default()
            });
        }
        groups
    }

    /// Every group of the table, with members and counts summed over the
    /// replicas' parts, and its backlog from its consumer.
    pub(super) async fn cluster_groups(&self, ready: &Ready, parts: Vec<LocalGroup>) -> Vec<GroupInfo> {
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
            let prefix = &self.inner.config.prefix;
            if let Ok(stream) = ready.js.get_stream(stream_name(prefix, &name)).await
                && let Ok(mut consumer) = stream.get_consumer::<pull::Config>("members").await
                && let Ok(consumer_info) = consumer.info().await
            {
                info.backlog = consumer_info.num_pending as usize;
            }
            groups.push(info);
        }
        groups.sort_by(|a, b| a.name.cmp(&b.name));
        groups
    }

    /// Shutdown begins: no hub pulls from its group any more.
    pub(super) fn stop_pulling(&self) {
        self.inner.groups.closing.cancel();
    }

    /// At shutdown, once the grace period is over: every group message this
    /// replica still holds (handed to a member and not acked, or pulled and
    /// not handed out yet) goes back to its group at once, so that members
    /// on other replicas get it now rather than after the consumer's
    /// `ack_wait`. The pulls still open are waited for first (what they
    /// bring is handed back as it comes). The caller flushes the
    /// connection.
    pub(super) async fn hand_back_groups(&self) {
        self.stop_pulling();
        let hubs: Vec<Arc<Hub>> = self.inner.groups.hubs.lock().values().cloned().collect();
        let deadline = Instant::now() + HAND_BACK_WAIT;
        for hub in &hubs {
            let _ = tokio::time::timeout_at(deadline, hub.pulled.cancelled()).await;
        }
        let mut messages = Vec::new();
        for hub in &hubs {
            let mut state = hub.state.lock();
            // Lowest sequence first (nak_in_order).
            let mut held: Vec<(u64, Held)> = state.held.drain().collect();
            held.sort_unstable_by_key(|(seq, _)| *seq);
            hub.redeliveries.fetch_add(held.len() as u64, Ordering::Relaxed);
            messages.extend(held.into_iter().map(|(_, h)| (h.message, h.attempt)));
            messages.extend(state.waiting.drain(..).map(|w| (w.message, w.attempt)));
            for member in &mut state.members {
                member.holds = 0;
            }
        }
        // The acks of what members were done with, before the last flush.
        for hub in &hubs {
            let (sent, acks_sent) = tokio::sync::oneshot::channel();
            if hub.acks.send(Acking::Sent(sent)).is_ok() {
                let _ = tokio::time::timeout_at(deadline, acks_sent).await;
            }
        }
        let count = messages.len();
        self.remember_attempts(messages.iter().map(|(m, attempt)| (m, *attempt)))
            .await;
        for (message, _) in messages {
            let _ = message.ack_with(AckKind::Nak(None)).await;
        }
        if count > 0 {
            tracing::info!(
                handed_back = count,
                "shutdown: unacked consumer-group messages handed back to their groups"
            );
        }
    }

    /// Publishes a message that used its last attempt to `_dlq.<group>`.
    /// `remembered`: its attempts were read from the `<prefix>_attempts`
    /// bucket, where its entry goes once it is dead-lettered.
    async fn dead_letter(&self, group: &str, message: &jetstream::Message, attempts: u32, remembered: bool) {
        let Ok(m) = super::wire::decode(message.payload.clone()) else {
            return;
        };
        tracing::warn!(
            consumer_group = group,
            sequence = m.sequence,
            topic = %m.topic,
            attempts,
            "message dead-lettered after its last delivery attempt"
        );
        let mut headers = m.headers;
        headers.insert(crate::broker::ORIGINAL_TOPIC_HEADER.into(), m.topic.clone());
        headers.insert(crate::broker::DELIVERY_ATTEMPTS_HEADER.into(), attempts.to_string());
        let letter = NewMessage {
            topic: format!("{}{group}", validate::DEAD_LETTER_PREFIX),
            payload: m.payload,
            headers,
            ..Default::default()
        };
        if let Err(error) = self
            .publish_cluster(letter, &mut RouteCache::default(), PublishTime::now())
            .await
        {
            tracing::warn!(consumer_group = group, %error, "dead letter not published; the message is redelivered instead");
            let _ = message.ack_with(AckKind::Nak(None)).await;
            return;
        }
        let _ = message.double_ack().await;
        if remembered {
            self.forget_attempts(message);
        }
    }
}

/// One replica's part of a group, for the cluster-wide listing.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct LocalGroup {
    pub(super) name: String,
    pub(super) members: usize,
    pub(super) held: usize,
    pub(super) redeliveries: u64,
    pub(super) dead_lettered: u64,
    pub(super) acked: u64,
    /// Dropped from the full backlog by this replica's publishes (absent
    /// from a replica of an earlier version).
    #[serde(default)]
    pub(super) dropped: u64,
    /// Written to the streams of members here, redeliveries included
    /// (absent from a replica of an earlier version).
    #[serde(default)]
    pub(super) delivered: u64,
    /// How long the oldest message members here hold has been held, in
    /// milliseconds (absent from a replica of an earlier version).
    #[serde(default)]
    pub(super) oldest_held_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    max_in_flight: u32,
    ack_deadline: Duration,
}

/// A group's members on this replica and the JetStream messages they hold.
pub(super) struct Hub {
    name: String,
    /// The group's patterns, to write the table again if the group was
    /// removed under its members ([`Hub::heal`]).
    patterns: Vec<String>,
    engine: ClusterEngine,
    js: jetstream::Context,
    consumer: Mutex<jetstream::consumer::PullConsumer>,
    /// When [`Hub::heal`] last ran.
    healed_at: Mutex<Instant>,
    state: Mutex<HubState>,
    /// Notified when a member gets room.
    room: tokio::sync::Notify,
    /// Notified when the last member leaves.
    emptied: tokio::sync::Notify,
    /// True while a pull is outstanding.
    pulling: tokio::sync::watch::Sender<bool>,
    /// The consumer's `ack_wait`: JetStream redelivers a message not acked
    /// or progressed for this long (a replica that died).
    ack_wait: Duration,
    stop: tokio_util::sync::CancellationToken,
    /// Cancelled when the pull loop has ended (no pull of it is open).
    pulled: tokio_util::sync::CancellationToken,
    redeliveries: AtomicU64,
    dead_lettered: AtomicU64,
    acked: AtomicU64,
    /// Group messages written to the streams of members here.
    delivered: AtomicU64,
    /// Turns the replica a nacked message is offered to first.
    offers: std::sync::atomic::AtomicUsize,
    /// What its members are done with, for [`send_acks`] to ack.
    acks: tokio::sync::mpsc::UnboundedSender<Acking>,
}

#[derive(Default)]
struct HubState {
    members: Vec<Member>,
    cursor: usize,
    /// Handed out and not done, by sequence.
    held: HashMap<u64, Held>,
    /// Pulled and not handed out yet: a member left meanwhile, or none has
    /// room (a pull asks for what there was room for, but a member may
    /// leave while it is answered).
    waiting: std::collections::VecDeque<Waiting>,
}

struct Waiting {
    message: jetstream::Message,
    published: Arc<crate::broker::Published>,
    attempt: u32,
    /// The member that nacked it: passed over while another has room.
    avoid: Option<Arc<str>>,
    /// Its attempts beyond JetStream's count were read from the
    /// `<prefix>_attempts` bucket (removed there once it is done).
    remembered: bool,
}

struct Member {
    id: Arc<str>,
    subscription: Arc<Subscription>,
    settings: Settings,
    holds: u32,
}

struct Held {
    member: Arc<str>,
    message: jetstream::Message,
    /// What the member was given, to hand it to another member on a Nack.
    published: Arc<crate::broker::Published>,
    attempt: u32,
    deadline: Instant,
    /// When JetStream was last told this replica still works on it.
    progress_at: Instant,
    /// When its member was given it (the oldest unacked age).
    given_at: Instant,
    /// As [`Waiting::remembered`].
    remembered: bool,
}

/// Acks, in order, what a hub's members are done with, until the hub is
/// gone and every ack it queued is sent. One task for all: the acks an Ack
/// call (or a burst of AUTO deliveries) queues go into the NATS client's
/// queue back to back and leave in one write. A task per ack sent most of
/// them alone, a system call each on the replica and on the NATS server (a
/// third of a member replica's CPU in the cluster group benchmark).
async fn send_acks(mut acked: tokio::sync::mpsc::UnboundedReceiver<Acking>) {
    let mut batch = Vec::with_capacity(ACKS_AT_ONCE);
    while acked.recv_many(&mut batch, ACKS_AT_ONCE).await > 0 {
        for acking in batch.drain(..) {
            match acking {
                Acking::Done(message) => {
                    let _ = message.ack().await;
                }
                Acking::Sent(sent) => {
                    let _ = sent.send(());
                }
            }
        }
    }
}

/// What [`send_acks`] is given. Nearly all are `Done`: boxing the message
/// to shrink the rare `Sent` would cost an allocation per ack.
#[allow(clippy::large_enum_variant)]
enum Acking {
    /// A message to ack.
    Done(jetstream::Message),
    /// Answered once every ack queued before it is with the NATS client.
    Sent(tokio::sync::oneshot::Sender<()>),
}

/// Most acks [`send_acks`] takes from its queue at once.
const ACKS_AT_ONCE: usize = 256;

/// What a member's stream needs of its hub.
pub(super) struct MemberLink {
    hub: Arc<Hub>,
    id: Arc<str>,
    ack_mode: AckMode,
}

impl MemberLink {
    /// The member's stream took `delivery`.
    pub(super) fn streamed(&self, delivery: &Delivery) {
        self.hub.delivered.fetch_add(1, Ordering::Relaxed);
        if self.ack_mode == AckMode::Auto {
            self.hub.done(&self.id, delivery.message.sequence);
        }
    }
}

impl Drop for MemberLink {
    fn drop(&mut self) {
        let hub = self.hub.clone();
        hub.leave(&self.id);
    }
}

impl HubState {
    /// What the members have room for, beyond what waits already.
    fn room(&self) -> usize {
        let room: usize = self
            .members
            .iter()
            .map(|m| m.settings.max_in_flight.saturating_sub(m.holds) as usize)
            .sum();
        room.saturating_sub(self.waiting.len())
    }

    /// Hands waiting messages to members with room, round-robin.
    fn dispatch(&mut self) {
        while let Some(front) = self.waiting.front() {
            let avoid = front.avoid.clone();
            let n = self.members.len();
            let has_room = |m: &Member| m.holds < m.settings.max_in_flight;
            let mut with_room = (0..n)
                .map(|i| (self.cursor + i) % n)
                .filter(|&i| has_room(&self.members[i]));
            let first = with_room.next();
            // The member that nacked it only when no other has room.
            let pick = match (&avoid, first) {
                (Some(avoid), Some(i)) if self.members[i].id == *avoid => with_room.next().or(first),
                _ => first,
            };
            let Some(index) = pick else { return };
            let Some(w) = self.waiting.pop_front() else { return };
            self.cursor = index + 1;
            let member = &mut self.members[index];
            let delivery = Delivery {
                message: w.published.clone(),
                attempt: w.attempt,
            };
            if member.subscription.hand(delivery).is_err() {
                // Closing: its leave is on the way. Out of the rotation.
                self.members.remove(index);
                self.waiting.push_front(w);
                continue;
            }
            member.holds += 1;
            let sequence = w.published.sequence;
            let held = Held {
                member: member.id.clone(),
                published: w.published.clone(),
                deadline: Instant::now() + member.settings.ack_deadline,
                progress_at: Instant::now(),
                given_at: Instant::now(),
                message: w.message,
                attempt: w.attempt,
                remembered: w.remembered,
            };
            self.held.insert(sequence, held);
        }
    }

    /// A failed delivery (its member's hold already released) goes to
    /// another member here with room, passing over the one it failed with,
    /// with its attempt one higher and the JetStream message still held
    /// here, as in single-node mode. Given back when none here has room.
    fn hand_over(&mut self, held: Held) -> Option<Held> {
        let other_has_room = self
            .members
            .iter()
            .any(|m| m.id != held.member && m.holds < m.settings.max_in_flight);
        if !other_has_room {
            return Some(held);
        }
        self.waiting.push_front(Waiting {
            message: held.message,
            published: held.published,
            attempt: held.attempt + 1,
            avoid: Some(held.member),
            remembered: held.remembered,
        });
        self.dispatch();
        None
    }

    fn release(&mut self, member: &str) {
        self.unhold(member);
        self.dispatch();
    }

    /// One message fewer held by `member` (gone already: nothing).
    fn unhold(&mut self, member: &str) {
        if let Some(m) = self.members.iter_mut().find(|m| &*m.id == member) {
            m.holds = m.holds.saturating_sub(1);
        }
    }
}

impl Hub {
    /// Adds a member; false when the hub has stopped (checked under the
    /// state lock, under which the last member's leave stops it).
    fn join(&self, id: Arc<str>, subscription: Arc<Subscription>, settings: Settings) -> bool {
        let mut state = self.state.lock();
        if self.stop.is_cancelled() {
            return false;
        }
        state.members.push(Member {
            id,
            subscription,
            settings,
            holds: 0,
        });
        state.dispatch();
        drop(state);
        self.room.notify_one();
        true
    }

    /// Pulls as many messages as the members have room for, and hands them
    /// out.
    async fn pull(self: Arc<Self>) {
        let _pulled = self.pulled.clone().drop_guard();
        let closing = self.engine.inner.groups.closing.clone();
        loop {
            if self.stop.is_cancelled() || closing.is_cancelled() {
                return;
            }
            let room = self.state.lock().room();
            if room == 0 {
                tokio::select! {
                    _ = self.room.notified() => continue,
                    _ = self.stop.cancelled() => return,
                    _ = closing.cancelled() => return,
                }
            }
            let mut consumer = self.consumer.lock().clone();
            self.pulling.send_replace(true);
            let batch = Pull::start(&self.engine.inner.client, &self.js, &consumer, room.min(256)).await;
            match batch {
                Ok(mut batch) => loop {
                    let message = tokio::select! {
                        message = batch.next() => Some(message),
                        _ = self.emptied.notified() => None,
                    };
                    let Some(message) = message else {
                        if self.state.lock().members.is_empty() {
                            // The last member left: its inbox unsubscribed,
                            // the server forgets a pull nobody listens to.
                            // What is published now stays in the stream,
                            // the backlog, instead of reaching this hub
                            // with no member to take it (to be nacked
                            // later, using up an attempt).
                            batch.cancel().await;
                            // JetStream drops a pull whose inbox lost its
                            // subscriber only when it next goes over its
                            // waiting pulls, as a consumer info makes it
                            // do; till then a nacked message could be sent
                            // to it, found undeliverable and queued again
                            // behind the others (out of order).
                            let _ = tokio::time::timeout(PULL_EXPIRES, consumer.info()).await;
                            break;
                        }
                        continue;
                    };
                    let Some(message) = message else { break };
                    match message {
                        Ok(message) if self.stop.is_cancelled() || closing.is_cancelled() => {
                            let _ = message.ack_with(AckKind::Nak(None)).await;
                        }
                        Ok(message) => self.hand_out(message).await,
                        Err(error) => {
                            tracing::debug!(group = %self.name, %error, "pull interrupted");
                            self.heal().await;
                            break;
                        }
                    }
                },
                Err(error) => {
                    tracing::debug!(group = %self.name, %error, "pull failed; retrying");
                    self.pulling.send_replace(false);
                    self.heal().await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            // The batch (its inbox) is gone.
            self.pulling.send_replace(false);
        }
    }

    /// After a failed pull, at most every [`HEAL_EVERY`]: while the hub has
    /// members, makes sure its group is in the table and its stream and
    /// consumer exist (a group removed as idle by another replica just as a
    /// member joined here, or a stream lost with its servers), and pulls
    /// from that consumer from now on. Idempotent when all is there.
    async fn heal(&self) {
        {
            let mut healed_at = self.healed_at.lock();
            if healed_at.elapsed() < HEAL_EVERY || self.state.lock().members.is_empty() {
                return;
            }
            *healed_at = Instant::now();
        }
        let Some(ready) = self.engine.inner.ready.lock().clone() else {
            return;
        };
        let healed = async {
            let created = self
                .engine
                .fix_patterns(&ready, &self.name, &self.patterns, self.members_ack_mode())
                .await?;
            let consumer = self.engine.group_consumer(&ready, &self.name, self.ack_wait).await?;
            Ok::<_, BrokerError>((created, consumer))
        };
        match healed.await {
            Ok((created, consumer)) => {
                *self.consumer.lock() = consumer;
                if created.is_some() {
                    self.engine.announce_group(&ready, &self.name, &self.patterns).await;
                }
            }
            Err(error) => tracing::debug!(group = %self.name, %error, "group stream not checked"),
        }
    }

    /// A pulled message, to a member with room (or to wait for one). A
    /// redelivery's attempts beyond JetStream's count are read first, in
    /// the pull's order (a round trip, only for redeliveries).
    async fn hand_out(&self, message: jetstream::Message) {
        let delivered = super::attempts::delivered(&message);
        let Some(published) = self.published(&message) else {
            tracing::warn!(group = %self.name, "undecodable group message dropped");
            tokio::spawn(async move {
                let _ = message.ack_with(AckKind::Term).await;
            });
            return;
        };
        let ahead = if delivered > 1 {
            self.engine.recall_attempts(&message).await
        } else {
            0
        };
        self.wait_for_member(message, published, delivered.saturating_add(ahead), ahead > 0);
    }

    fn wait_for_member(
        &self,
        message: jetstream::Message,
        published: Arc<crate::broker::Published>,
        attempt: u32,
        remembered: bool,
    ) {
        let mut state = self.state.lock();
        state.waiting.push_back(Waiting {
            message,
            published,
            attempt,
            avoid: None,
            remembered,
        });
        state.dispatch();
    }

    /// What a group message (the publishing replica's envelope) gives the
    /// members; None when it does not decode.
    fn published(&self, message: &jetstream::Message) -> Option<Arc<crate::broker::Published>> {
        let m = super::wire::decode(message.payload.clone()).ok()?;
        let (new_message, sequence, publish_time) = super::wire::from_envelope(m);
        Some(
            self.engine
                .inner
                .local
                .published_elsewhere(new_message, sequence, publish_time),
        )
    }

    /// A message is done (an AUTO member's stream took it, or an Ack).
    /// The ack mode its members asked for, which its record is written
    /// again with (all the same, unless they joined under an earlier
    /// version); None without members.
    fn members_ack_mode(&self) -> Option<AckMode> {
        self.state
            .lock()
            .members
            .iter()
            .find_map(|m| m.subscription.external().map(|e| e.ack_mode))
    }

    /// What members hold, forgotten: JetStream lost it with its state
    /// (nothing left to ack, or to redeliver); its acks count as unknown.
    /// How many.
    fn forget_held(&self) -> usize {
        let mut state = self.state.lock();
        let held: Vec<Held> = state.held.drain().map(|(_, held)| held).collect();
        for h in &held {
            state.release(&h.member);
        }
        drop(state);
        if !held.is_empty() {
            self.room.notify_one();
        }
        held.len()
    }

    fn done(&self, member: &str, sequence: u64) -> bool {
        let mut state = self.state.lock();
        let Some(held) = state.held.remove_if(sequence, member) else {
            return false;
        };
        state.release(member);
        drop(state);
        self.acked.fetch_add(1, Ordering::Relaxed);
        self.room.notify_one();
        if held.remembered {
            self.engine.forget_attempts(&held.message);
        }
        // Closed only once the hub is gone, and nothing is done after that.
        let _ = self.acks.send(Acking::Done(held.message));
        true
    }

    pub(super) fn ack(&self, member: &str, sequences: &[u64]) -> Acked {
        let mut result = Acked::default();
        for &seq in sequences {
            if self.done(member, seq) {
                result.acked += 1;
            } else {
                result.unknown += 1;
            }
        }
        result
    }

    pub(super) fn nack(self: &Arc<Self>, member: &str, sequences: &[u64]) -> Nacked {
        let mut result = Nacked::default();
        let mut failed = Vec::new();
        let mut elsewhere = Vec::new();
        for &seq in sequences {
            let mut state = self.state.lock();
            let Some(held) = state.held.remove_if(seq, member) else {
                result.unknown += 1;
                continue;
            };
            result.requeued += 1;
            state.unhold(member);
            self.redirect(&mut state, seq, held, &mut failed, &mut elsewhere);
        }
        self.settle(failed, elsewhere);
        self.room.notify_one();
        result
    }

    /// Where a delivery that failed (a Nack, a deadline) goes, its member's
    /// hold taken off (`state` is this hub's, locked): dead-lettered after
    /// its last allowed attempt (`failed`); else, ahead of what waits, to
    /// another member here with room, without a round through JetStream
    /// (which would give it to whichever replica pulls first, the member it
    /// failed with included); else offered to the other replicas
    /// (`elsewhere`).
    fn redirect(
        &self,
        state: &mut HubState,
        seq: u64,
        held: Held,
        failed: &mut Vec<(u64, Held)>,
        elsewhere: &mut Vec<(u64, Held)>,
    ) {
        let max = self.engine.inner.local.limits().max_delivery_attempts;
        if max > 0 && held.attempt >= max {
            state.dispatch();
            failed.push((seq, held));
        } else if let Some(held) = state.hand_over(held) {
            state.dispatch();
            elsewhere.push((seq, held));
        } else {
            self.redeliveries.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What [`Hub::redirect`] left: dead letters and JetStream naks
    /// (`failed`), offers to other replicas (`elsewhere`).
    fn settle(self: &Arc<Self>, failed: Vec<(u64, Held)>, elsewhere: Vec<(u64, Held)>) {
        self.retry(failed);
        if !elsewhere.is_empty() {
            tokio::spawn(self.clone().offer_elsewhere(elsewhere));
        }
    }

    /// Nacked messages no other member here has room for: offered to the
    /// other live replicas in turn (a member there with room takes the
    /// JetStream message itself, [`ClusterEngine::take_offered`]); what none
    /// takes goes back through JetStream, to whichever member pulls first,
    /// the one that nacked it included.
    async fn offer_elsewhere(self: Arc<Self>, mut held: Vec<(u64, Held)>) {
        held.sort_unstable_by_key(|(seq, _)| *seq);
        let engine = &self.engine;
        let me = &engine.inner.config.replica_id;
        let mut others = engine.inner.live.lock().clone();
        others.retain(|r| r != me);
        // Alone at the last heartbeat: a replica started since is not
        // known yet; the registry says.
        let ready = engine.inner.ready.lock().clone();
        if others.is_empty()
            && let Some(ready) = ready
        {
            others = engine.live_replicas(&ready).await;
            others.retain(|r| r != me);
        }
        // A replica that refused one has no room now: not asked again for
        // the rest of these.
        let mut refused = vec![false; others.len()];
        let until = Instant::now() + OFFERS_FOR_AT_MOST;
        let mut left = Vec::new();
        for (seq, h) in held {
            let first = self.offers.fetch_add(1, Ordering::Relaxed);
            let mut taken = false;
            for i in 0..others.len() {
                let at = (first + i) % others.len();
                if refused[at] {
                    continue;
                }
                if Instant::now() >= until || engine.inner.groups.closing.is_cancelled() {
                    break;
                }
                let wait = until.saturating_duration_since(Instant::now());
                if engine
                    .offer(&others[at], &self.name, &h.message, h.attempt + 1, wait)
                    .await
                {
                    taken = true;
                    break;
                }
                refused[at] = true;
            }
            if taken {
                self.redeliveries.fetch_add(1, Ordering::Relaxed);
            } else {
                left.push((seq, h));
            }
        }
        self.retry(left);
    }

    /// A message another replica offers (nacked there, no other member
    /// there had room): taken when a member here has room, and handed to
    /// it first. This replica holds the JetStream message from then on.
    fn take(&self, message: jetstream::Message, attempt: u32) -> bool {
        let has_room = |state: &HubState| {
            !self.stop.is_cancelled() && !self.engine.inner.groups.closing.is_cancelled() && state.room() > 0
        };
        if !has_room(&self.state.lock()) {
            return false;
        }
        let Some(published) = self.published(&message) else {
            return false;
        };
        let mut state = self.state.lock();
        if !has_room(&state) {
            return false;
        }
        state.waiting.push_front(Waiting {
            message,
            published,
            attempt,
            avoid: None,
            remembered: false,
        });
        state.dispatch();
        true
    }

    /// Deliveries failed: each redelivered, or dead-lettered after its
    /// last allowed attempt.
    fn retry(&self, failed: Vec<(u64, Held)>) {
        let max = self.engine.inner.local.limits().max_delivery_attempts;
        let mut redeliver = Vec::new();
        for (seq, held) in failed {
            if max > 0 && held.attempt >= max {
                self.dead_lettered.fetch_add(1, Ordering::Relaxed);
                let engine = self.engine.clone();
                let group = self.name.clone();
                tokio::spawn(async move {
                    engine
                        .dead_letter(&group, &held.message, held.attempt, held.remembered)
                        .await
                });
            } else {
                redeliver.push((seq, held));
            }
        }
        self.redeliveries.fetch_add(redeliver.len() as u64, Ordering::Relaxed);
        nak_in_order(&self.engine, redeliver, std::future::ready(()));
    }

    /// Retries what is held past its member's ack deadline.
    async fn watch_deadlines(self: Arc<Self>) {
        let mut tick = tokio::time::interval(DEADLINE_TICK);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.stop.cancelled() => return,
            }
            let now = Instant::now();
            let (expired, elsewhere) = {
                let mut state = self.state.lock();
                // Still being worked on here: JetStream must not redeliver
                // it elsewhere (each member has its own deadline).
                for held in state.held.values_mut() {
                    if now.saturating_duration_since(held.progress_at) >= self.ack_wait / 3 {
                        held.progress_at = now;
                        let message = held.message.clone();
                        tokio::spawn(async move {
                            let _ = message.ack_with(AckKind::Progress).await;
                        });
                    }
                }
                let seqs: Vec<u64> = state
                    .held
                    .iter()
                    .filter(|(_, h)| h.deadline <= now)
                    .map(|(s, _)| *s)
                    .collect();
                // As after a Nack: to another member with room, here or
                // elsewhere, before JetStream (single-node mode offers an
                // expired message to another member first too).
                let (mut expired, mut elsewhere) = (Vec::new(), Vec::new());
                for seq in seqs {
                    let Some(held) = state.held.remove(&seq) else { continue };
                    state.unhold(&held.member);
                    self.redirect(&mut state, seq, held, &mut expired, &mut elsewhere);
                }
                (expired, elsewhere)
            };
            if !expired.is_empty() || !elsewhere.is_empty() {
                self.settle(expired, elsewhere);
                self.room.notify_one();
            }
        }
    }

    /// A join that took this hub failed before its member was added: the
    /// hub stops as after its last member's leave, unless it has members
    /// (else a hub started for it would stay, never pulling).
    fn unused(self: &Arc<Self>) {
        self.leave("");
    }

    /// A member left: what it held goes back at once. The last member out
    /// stops the hub once its pull can no longer be answered (what it still
    /// brings waits for a member joining meanwhile, or goes back).
    fn leave(self: &Arc<Self>, member: &str) {
        let (held, empty) = {
            let mut state = self.state.lock();
            state.members.retain(|m| &*m.id != member);
            let seqs: Vec<u64> = state
                .held
                .iter()
                .filter(|(_, h)| &*h.member == member)
                .map(|(s, _)| *s)
                .collect();
            let held: Vec<(u64, Held)> = seqs.iter().filter_map(|&s| Some((s, state.held.remove(&s)?))).collect();
            (held, state.members.is_empty())
        };
        self.redeliveries.fetch_add(held.len() as u64, Ordering::Relaxed);
        if empty {
            self.emptied.notify_one();
            // The pull goes first (its inbox unsubscribed before the naks
            // are sent), or a redelivery would come back to this hub with
            // no member to take it.
            let mut pulling = self.pulling.subscribe();
            nak_in_order(&self.engine, held, async move {
                let _ = tokio::time::timeout(2 * PULL_EXPIRES, pulling.wait_for(|p| !*p)).await;
            });
            let hub = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(PULL_EXPIRES + Duration::from_millis(250)).await;
                let waiting = {
                    let mut hubs = hub.engine.inner.groups.hubs.lock();
                    let mut state = hub.state.lock();
                    if !state.members.is_empty() {
                        return;
                    }
                    if hubs.get(&hub.name).is_some_and(|h| Arc::ptr_eq(h, &hub)) {
                        hubs.remove(&hub.name);
                    }
                    hub.stop.cancel();
                    std::mem::take(&mut state.waiting)
                };
                hub.engine
                    .remember_attempts(waiting.iter().map(|w| (&w.message, w.attempt)))
                    .await;
                for w in waiting {
                    let _ = w.message.ack_with(AckKind::Nak(None)).await;
                }
            });
        } else {
            nak_in_order(&self.engine, held, std::future::ready(()));
        }
        self.room.notify_one();
    }
}

/// Hands messages back to JetStream for redelivery at once (once `first`
/// is done), lowest sequence first, one after another on the connection:
/// JetStream redelivers in the order of the naks, so the backlog's front is
/// in sequence order as the contract says (one task per nak, as before,
/// reordered them).
fn nak_in_order(
    engine: &ClusterEngine,
    mut held: Vec<(u64, Held)>,
    first: impl std::future::Future<Output = ()> + Send + 'static,
) {
    if held.is_empty() {
        return;
    }
    held.sort_unstable_by_key(|(seq, _)| *seq);
    let engine = engine.clone();
    tokio::spawn(async move {
        first.await;
        engine
            .remember_attempts(held.iter().map(|(_, h)| (&h.message, h.attempt)))
            .await;
        for (_, h) in held {
            let _ = h.message.ack_with(AckKind::Nak(None)).await;
        }
    });
}

/// One pull request and the subscription its answer comes to, as
/// async-nats' `Consumer::batch` makes them, with an unsubscribe that is
/// awaited ([`Pull::cancel`]): dropping async-nats' `Batch` unsubscribes from
/// a task of its own, so what this replica sends next (a leaving member's
/// naks) could reach the server first and be redelivered to the pull being
/// dropped.
struct Pull {
    subscriber: async_nats::Subscriber,
    js: jetstream::Context,
    left: usize,
    /// As async-nats: a pull whose expiry never came ends 5 s after it.
    deadline: Instant,
}

impl Pull {
    async fn start(
        client: &async_nats::Client,
        js: &jetstream::Context,
        consumer: &jetstream::consumer::PullConsumer,
        messages: usize,
    ) -> Result<Pull, async_nats::Error> {
        let inbox = client.new_inbox();
        let subscriber = client.subscribe(inbox.clone()).await?;
        let request = pull::BatchConfig {
            batch: messages,
            expires: Some(PULL_EXPIRES),
            ..Default::default()
        };
        consumer.request_batch(request, inbox.into()).await?;
        Ok(Pull {
            subscriber,
            js: js.clone(),
            left: messages,
            deadline: Instant::now() + PULL_EXPIRES + Duration::from_secs(5),
        })
    }

    /// The next message; None once the pull is answered in full or has
    /// expired.
    async fn next(&mut self) -> Option<Result<jetstream::Message, String>> {
        use async_nats::StatusCode;
        while self.left > 0 {
            let message = tokio::time::timeout_at(self.deadline, self.subscriber.next())
                .await
                .ok()??;
            match message.status.unwrap_or(StatusCode::OK) {
                StatusCode::OK => {
                    self.left -= 1;
                    return Some(Ok(jetstream::Message {
                        message,
                        context: self.js.clone(),
                    }));
                }
                StatusCode::IDLE_HEARTBEAT => {}
                StatusCode::TIMEOUT | StatusCode::NOT_FOUND => return None,
                status => return Some(Err(format!("{status}: {:?}", message.description))),
            }
        }
        None
    }

    /// Unsubscribes (sent before anything this replica sends after).
    async fn cancel(&mut self) {
        let _ = self.subscriber.unsubscribe().await;
    }
}

trait HeldExt {
    fn remove_if(&mut self, seq: u64, member: &str) -> Option<Held>;
}

impl HeldExt for HashMap<u64, Held> {
    fn remove_if(&mut self, seq: u64, member: &str) -> Option<Held> {
        if self.get(&seq).is_some_and(|h| &*h.member == member) {
            return self.remove(&seq);
        }
        None
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
