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
//! - A replica with members of a group runs a hub (`hub.rs`): it pulls only
//!   as many messages as its members have room for (`max_in_flight`), and
//!   decides what happens to each with the consumer-group state machine
//!   single-node groups use too (`group/machine.rs`): round-robin with
//!   room, the member a message failed with passed over, deadlines,
//!   attempts, dead letters. It holds each JetStream message until it is
//!   done: acked when an AUTO member's stream takes it, or by a MANUAL
//!   member's Ack. A message taken back (a Nack, the member's ack deadline,
//!   the member leaving) goes to another member here with room, else to
//!   one on another replica (src/cluster/handover.rs), else is nacked
//!   (redelivered at once, to any member). A replica that dies leaves its
//!   messages to the consumer's `ack_wait`.
//! - A message whose attempt fails after `max_delivery_attempts` is
//!   published to `_dlq.<group>` by the replica holding it, then acked.
//! - A group without members on any live replica for its idle TTL is
//!   removed cluster-wide ([`ClusterEngine::expire_idle_groups`], from each
//!   replica's heartbeat): table entry, stream and consumer.
//! - A replica shutting down stops pulling, and hands back what its members
//!   still hold before it exits ([`ClusterEngine::hand_back_groups`]).
//!
//! # Files
//!
//! - `mod.rs` (this file): the group table and its trie, publishing into a
//!   group's stream and making room in a full one, joining, idle removal,
//!   the listings, the rebuild after NATS lost its state, shutdown's hand
//!   back, dead letters;
//! - `state.rs`: a hub's state: the shared group state machine with
//!   JetStream's rules, and what JetStream must hear of its decisions (no
//!   I/O, time passed in);
//! - `hub.rs`: the hub's three tasks (hub, puller, sender), its commands,
//!   and the [`hub::Backend`] trait it does its I/O through;
//! - `nats.rs`: that backend over async-nats;
//! - `hub_tests.rs`: the hub against a fake JetStream, in paused time.
//!
//! # Tasks and locks
//!
//! Per hub (one per group with members here, `hub.rs` has the detail):
//! - the **hub task** owns the group's state on this replica (members,
//!   held and waiting messages, deadlines, counts) and nothing else
//!   changes it: joins, leaves, acks, nacks, streamed AUTO deliveries,
//!   pulled and offered messages and its own tick arrive as commands;
//! - the **puller** owns the open pull (its inbox subscription), and asks
//!   for what the hub says its members have room for;
//! - the **sender** owns the ordered queue of what the hub tells JetStream
//!   (acks, naks, progress, terms, dead letters, offers to other
//!   replicas): one operation after another, in the order decided.
//!
//! Per replica: the table watch ([`ClusterEngine::watch_groups`]), and the
//! offers answered from other replicas (`handover.rs`).
//!
//! Locks, all plain mutexes held for a few instructions and never across
//! an `.await`; none is taken while another is held, except `table` then
//! `routes` (in [`ClusterEngine::route_group`]):
//! - `Groups::table`, then `Groups::routes`;
//! - `Groups::hubs`, `Groups::members`, `Groups::idle`,
//!   `Groups::dropped`: leaves;
//! - a hub's view and its `Want` watch, and its backend's consumer and
//!   repair time (`nats.rs`): leaves.

mod hub;
#[cfg(test)]
mod hub_tests;
mod nats;
mod state;

use super::registry::key;
use super::{ClusterEngine, ClusterStream, Ready};
use crate::broker::{ExternalMember, RouteCache};
use crate::engine::validate::{self, truncate};
use crate::engine::{AckMode, BrokerError, Delivery, GroupInfo, PublishTime, SubscribeRequest};
use crate::group::admission::{self, Terms};
use crate::group::{BacklogLimits, MemberSettings, backlog, dead_letter, idle};
use crate::sublist::Sublist;
use crate::topic::TopicPattern;
use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use bytes::Bytes;
use futures::StreamExt;
use hub::{HubConfig, HubHandle};
use nats::Nats;
use parking_lot::{Mutex, RwLock};
use state::Pulled;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How long a replica shutting down waits for its last pulls to be
/// answered before it hands back what its members hold.
const HAND_BACK_WAIT: Duration = Duration::from_millis(1500);
/// How long a group must be seen without members, at two checks at
/// least, before it is removed, however short its idle TTL: a join that
/// wrote the table just before the first check shows its member by the
/// second.
const IDLE_SEEN_FOR: Duration = Duration::from_secs(1);
/// How long a publish to a group's stream is retried (a stream leader's
/// election takes 4 to 7 s, docs/cluster-notes.md).
const PUBLISH_RETRY_FOR: Duration = Duration::from_secs(10);
/// Most messages one publish deletes from a full group backlog to make room
/// (a large message in a backlog full of bytes needs several); beyond it,
/// the new message is the one dropped.
const MAKE_ROOM_AT_MOST: usize = 64;

/// What this replica knows of the cluster's groups.
#[derive(Default)]
pub(super) struct Groups {
    /// Group patterns, from the table: what a publish matches.
    routes: RwLock<Sublist<Arc<GroupRoute>>>,
    /// The table as last seen: name → patterns.
    table: Mutex<HashMap<String, Vec<String>>>,
    /// Groups with members on this replica (and hubs lingering after
    /// their last member left). A leaf lock.
    pub(super) hubs: Mutex<HashMap<String, HubHandle<Nats>>>,
    /// The hub of each member on this replica, by subscription id: where
    /// Ack and Nack go. A leaf lock.
    members: Mutex<HashMap<Arc<str>, HubHandle<Nats>>>,
    /// Cancelled when this replica begins to shut down: its hubs stop
    /// pulling (the group's backlog stays in JetStream for the members
    /// elsewhere), and what they still hold is handed back before it exits
    /// ([`ClusterEngine::hand_back_groups`]).
    closing: tokio_util::sync::CancellationToken,
    /// Groups seen without members on any replica: since when, at which
    /// revision of their table entry (a join writes it again).
    idle: Mutex<HashMap<String, Idle>>,
    /// Messages of each group this replica counted as dropped: the oldest
    /// of a full backlog, and what NATS lost with its memory
    /// (`nats_state_lost`: the backlogs, by the replica that counts them,
    /// and what its hubs held). The group's `dropped` in ListConsumerGroups
    /// is the sum over the replicas.
    dropped: Mutex<HashMap<String, u64>>,
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

/// Why a message is not (known to be) stored in a group's stream.
pub(super) enum NotStored {
    /// The backlog is full: JetStream refused it.
    Full(String),
    /// Not stored: JetStream refused it, or it was never sent.
    Refused(String),
    /// Sent, and not confirmed (no answer in time, or the connection broke
    /// meanwhile): it may have been stored, and then reaches a member.
    Unconfirmed(String),
}

impl NotStored {
    /// What a store's answer (its ack future's error) says.
    pub(super) fn of_answer(error: &jetstream::context::PublishError) -> Self {
        use jetstream::context::PublishErrorKind;
        let text = error.to_string();
        if backlog_full(error) {
            Self::Full(text)
        } else if matches!(error.kind(), PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe) {
            Self::Unconfirmed(text)
        } else {
            Self::Refused(text)
        }
    }
}

/// Whether JetStream refused a message because the group's stream is full
/// (`max_msgs` or `max_bytes`, discard new).
fn backlog_full(error: &jetstream::context::PublishError) -> bool {
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
        groups.dropped.lock().remove(name);
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
    /// [`ClusterEngine::publish_cluster_routed`], ended with `first`: makes
    /// room in a full backlog, and retries over a leader election. `id`
    /// makes retries idempotent. False when the group was removed meanwhile
    /// (its idle TTL): the message matched no group. An error says whether
    /// the message may still have been taken (an attempt was sent and not
    /// confirmed).
    pub(super) async fn publish_to_group(
        &self,
        ready: &Ready,
        route: &GroupRoute,
        body: Bytes,
        id: String,
        first: Result<(), NotStored>,
    ) -> Result<bool, BrokerError> {
        let mut first = Some(first);
        let started = Instant::now();
        let mut made_room = 0;
        // An attempt went out and was not confirmed: the group may have it.
        let mut unconfirmed = false;
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
                        Ok(ack) => ack.await.map(|_| ()).map_err(|e| NotStored::of_answer(&e)),
                        Err(e) => Err(NotStored::Refused(e.to_string())),
                    }
                }
            };
            unconfirmed |= matches!(result, Err(NotStored::Unconfirmed(_)));
            match result {
                Ok(()) => return Ok(true),
                Err(NotStored::Full(error)) => {
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
                Err(NotStored::Refused(error) | NotStored::Unconfirmed(error))
                    if started.elapsed() < PUBLISH_RETRY_FOR =>
                {
                    tracing::debug!(group = %route.name, %error, "publish to a group's stream retried");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(NotStored::Refused(error)) if !unconfirmed => {
                    return Err(BrokerError::Unavailable(format!(
                        "consumer group {:?} did not take the message (JetStream: {error}); it reached broadcast subscribers",
                        truncate(&route.name)
                    )));
                }
                Err(NotStored::Refused(error) | NotStored::Unconfirmed(error)) => {
                    return Err(BrokerError::Unavailable(format!(
                        "consumer group {:?} did not confirm the message (JetStream: {error}): it was sent, and may still have been taken (then a member gets it); it reached broadcast subscribers",
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
        backlog::count_overflow(&self.inner.local.stats().dropped_group_overflow, 1);
        *self.inner.groups.dropped.lock().entry(group.to_owned()).or_default() += 1;
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
        let settings = MemberSettings::of(&request, self.inner.local.limits());
        let ack_deadline = settings.ack_deadline;
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
        // A hub this join started and never joined stops by itself (no
        // member for its linger time).
        self.claim(ready, &id).await?;
        let release = super::Release {
            store: ready.subscriptions.clone(),
            id: id.clone(),
        };
        let member = ExternalMember {
            group: name.clone(),
            ack_mode: request.ack_mode,
        };
        let inner = self
            .inner
            .local
            .open_external(&request, settings.max_in_flight, member)?;
        // A hub stops LINGER after its last member left (or after it was
        // started, without one); if that moment fell within this join (the
        // claim above waits for NATS), join a new one: a member of a
        // stopped hub would never get a message.
        let id: Arc<str> = id.into();
        while !hub.join(id.clone(), inner.subscription().clone(), settings).await {
            hub = self.hub(ready, &name, &patterns, ack_deadline).await?;
        }
        self.inner.groups.members.lock().insert(id.clone(), hub.clone());
        Ok(ClusterStream {
            inner,
            release: Some(release),
            member: Some(MemberLink {
                hub,
                engine: self.clone(),
                id,
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

    /// The group's hub on this replica, started (with its stream and
    /// consumer) on its first local member.
    async fn hub(
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
        let bounds = BacklogLimits::of(limits);
        let prefix = &self.inner.config.prefix;
        let unavailable =
            |e: &dyn std::fmt::Display| BrokerError::Unavailable(format!("JetStream did not answer: {e}"));
        let config = stream::Config {
            name: stream_name(prefix, name),
            subjects: vec![subject(prefix, name)],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::Memory,
            num_replicas: self.inner.config.nats_replicas,
            max_messages: bounds.capacity as i64,
            max_bytes: bounds.max_bytes as i64,
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

    /// Takes a nacked message offered by another replica into this
    /// replica's hub of `group`, if it has one with room for it.
    pub(super) async fn take_offered(&self, group: &str, message: jetstream::Message, attempt: u32) -> bool {
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

    /// The hub holding member `id`, if it is on this replica.
    pub(super) fn hub_of(&self, id: &str) -> Option<HubHandle<Nats>> {
        self.inner.groups.members.lock().get(id).cloned()
    }

    /// The records of this replica's subscriptions, with what each MANUAL
    /// member holds unacked (its hub's view, as of its last tick).
    pub(super) fn local_subscriptions(&self, peaks: crate::engine::Peaks) -> Vec<crate::engine::SubscriptionInfo> {
        let mut list = self.inner.local.subscriptions(peaks);
        self.fill_unacked(&mut list);
        list
    }

    /// Sets what each MANUAL member in `list` holds unacked, from its
    /// hub's view (as of the hub's last tick).
    pub(super) fn fill_unacked(&self, list: &mut [crate::engine::SubscriptionInfo]) {
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
                crate::broker::set_unacked(info, u.count, now.saturating_duration_since(u.oldest));
            }
        }
    }

    /// This replica's view of its groups.
    pub(super) fn local_groups(&self) -> Vec<LocalGroup> {
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

    /// Publishes a message that used its last attempt to `_dlq.<group>`
    /// (as [`crate::group::dead_letter`] makes it), then acks it: done
    /// with. A dead letter that breaks a message limit is dropped and
    /// counted there, and the message acked all the same; one that NATS
    /// did not take is nacked (redelivered, to be dead-lettered again).
    /// `remembered`: its attempts were read from the `<prefix>_attempts`
    /// bucket, where its entry goes once it is done with.
    async fn dead_letter(&self, group: &str, message: &jetstream::Message, attempts: u32, remembered: bool) {
        let Ok(m) = super::wire::decode(message.payload.clone()) else {
            return;
        };
        let letter = dead_letter::letter(
            dead_letter::Original {
                group,
                sequence: m.sequence,
                topic: &m.topic,
                payload: m.payload,
                headers: m.headers,
                attempts,
            },
            crate::engine::Engine::max_message_bytes(self),
            &self.inner.local.stats().dropped_dead_letter_invalid,
        );
        if let Some(letter) = letter
            && let Err(error) = self
                .publish_cluster(letter.message, &mut RouteCache::default(), PublishTime::now())
                .await
        {
            tracing::warn!(consumer_group = group, %error, "dead letter not published; the message is redelivered instead");
            let _ = message.ack_with(AckKind::Nak(None)).await;
            return;
        }
        let _ = message.double_ack().await;
        if remembered {
            self.forget_attempts(message).await;
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

/// What a member's stream needs of its hub.
pub(in crate::cluster) struct MemberLink {
    hub: HubHandle<Nats>,
    engine: ClusterEngine,
    id: Arc<str>,
    ack_mode: AckMode,
}

impl MemberLink {
    /// The member's stream took `delivery`.
    pub(in crate::cluster) fn streamed(&self, delivery: &Delivery) {
        self.hub.streamed(&self.id, self.ack_mode, delivery);
    }

    /// The member's session added credit: it may have room now.
    pub(in crate::cluster) fn credit_added(&self) {
        self.hub.credit_added();
    }
}

impl Drop for MemberLink {
    fn drop(&mut self) {
        {
            let mut members = self.engine.inner.groups.members.lock();
            if members.get(&self.id).is_some_and(|h| h.same(&self.hub)) {
                members.remove(&self.id);
            }
        }
        self.hub.leave(self.id.clone());
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
