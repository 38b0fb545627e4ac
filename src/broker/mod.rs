//! The embedded single-node engine: routing, bounded queues, eviction,
//! consumer groups and the broker's memory budget, all in this process.
//!
//! What happens to a group's messages is decided by [`crate::group`]'s
//! rules, which a cluster hub decides with too; here they run behind each
//! group's lock. ARCHITECTURE.md's "Code map" says which file holds what.
//!
//! # Lock order
//!
//! ARCHITECTURE.md, "Locks and their order", is the one statement of it.

mod acks;
mod close;
mod engine;
mod group;
mod lifecycle;
mod publish;
mod snapshot;
mod subscribe;
pub mod subscription;

pub use publish::{RemoteRoutes, RouteCache};
pub(crate) use snapshot::set_unacked;
#[cfg(test)]
pub(crate) use subscription::QueueSlot;
pub use subscription::{ExternalMember, Subscription, SubscriptionStream};

use crate::config::Limits;
use crate::engine::{EvictionRecord, GroupRemoval};
use crate::memory::{self, MemoryBudget};
use crate::sublist::Sublist;
use group::ConsumerGroup;
use parking_lot::{Mutex, RwLock};
use publish::Route;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

/// Evictions remembered for the Admin API.
pub const EVICTION_HISTORY: usize = 1024;
/// Removals of groups that still held messages, remembered for the metrics.
pub const GROUP_REMOVAL_HISTORY: usize = 64;
/// How often ack deadlines and idle groups are checked.
pub const MAINTENANCE_INTERVAL: Duration = Duration::from_millis(50);

/// Lifetime counters, all plain atomics so the publish path never locks for
/// them. Counts of live subscriptions are read from the subscriptions.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) published: AtomicU64,
    pub(crate) unrouted: AtomicU64,
    pub(crate) evictions: AtomicU64,
    /// Messages handed to broadcast subscribers' streams (flushed by each
    /// stream in batches, so it may trail the live streams by a little).
    pub(crate) delivered_multi: AtomicU64,
    /// The same for consumer-group members.
    pub(crate) delivered_single: AtomicU64,
    /// Messages queued for a subscription when it was evicted (and the one
    /// that did not fit).
    pub(crate) dropped_evicted: AtomicU64,
    /// Messages queued for a subscription its client cancelled or an admin
    /// closed.
    pub(crate) dropped_closed: AtomicU64,
    /// Oldest backlog messages dropped because a group's backlog was full.
    pub(crate) dropped_group_overflow: AtomicU64,
    /// Backlog of groups removed after their idle TTL.
    pub(crate) dropped_group_expired: AtomicU64,
    pub(crate) discarded_on_shutdown: AtomicU64,
    /// Dead letters that would have broken a message limit (more than
    /// [`MAX_HEADERS`](crate::engine::validate::MAX_HEADERS) headers, or over `max_message_bytes`, once the
    /// broker's two headers were added): not published, counted.
    pub(crate) dropped_dead_letter_invalid: AtomicU64,
    /// Publishes refused because the broker's memory budget was spent.
    pub(crate) refused_memory_limit: AtomicU64,
    /// Subscriptions evicted to bring the broker back under its memory
    /// budget (also counted in `evictions`).
    pub(crate) evictions_memory_limit: AtomicU64,
}

/// Handle to the broker; cheap to clone.
#[derive(Clone)]
pub struct Broker {
    shared: Arc<Shared>,
}

struct Shared {
    limits: Limits,
    /// The replica this is the fan-out of (cluster mode; empty otherwise).
    replica_id: Arc<str>,
    /// Last sequence handed out.
    sequence: AtomicU64,
    /// Pattern trie of live subscriptions. Read-locked by publishers that miss
    /// their own route cache, write-locked by subscribe/unsubscribe.
    routes: RwLock<Sublist<Route>>,
    /// Bumped after every change of `routes`; publishers compare it to decide
    /// whether their cached routes are still good.
    routes_generation: AtomicU64,
    /// Open subscriptions by id. Never touched on the publish path.
    subscriptions: Mutex<HashSet<ById>>,
    /// Consumer groups by name, including memberless ones within their idle
    /// TTL. Never touched on the publish path; taken before a group's own
    /// lock, never after it.
    groups: Mutex<HashMap<Arc<str>, Arc<ConsumerGroup>>>,
    next_key: AtomicU64,
    /// Most recent evictions, newest last, at most [`EVICTION_HISTORY`].
    evictions: Mutex<VecDeque<EvictionRecord>>,
    /// Most recent removals of groups with messages left, newest last, at
    /// most [`GROUP_REMOVAL_HISTORY`].
    group_removals: Mutex<VecDeque<GroupRemoval>>,
    stats: Stats,
    /// Set when shutdown begins: new work is refused from then on.
    draining: AtomicBool,
    /// Cancelled when shutdown begins, so that idle publish streams end.
    drain_signal: CancellationToken,
    started_at: SystemTime,
    started: Instant,
    /// Bytes of every message alive: the messages' share (7/8) of
    /// `TINYBROKER_MAX_MEMORY_BYTES` (requests being received have the rest,
    /// in the gRPC layer).
    memory: &'static MemoryBudget,
}

impl Broker {
    pub fn new(limits: Limits) -> Self {
        Self::for_replica(limits, "", 0)
    }

    /// The local fan-out of one cluster replica: records name `replica_id`,
    /// and the sequences it hands out start after `last_sequence` (the
    /// cluster engine gives each replica its own range).
    pub fn for_replica(limits: Limits, replica_id: &str, last_sequence: u64) -> Self {
        let memory = MemoryBudget::leak(memory::split(limits.max_memory_bytes).0);
        Self {
            shared: Arc::new(Shared {
                limits,
                replica_id: replica_id.into(),
                sequence: AtomicU64::new(last_sequence),
                routes: RwLock::new(Sublist::default()),
                routes_generation: AtomicU64::new(0),
                subscriptions: Mutex::new(HashSet::new()),
                groups: Mutex::new(HashMap::new()),
                next_key: AtomicU64::new(1),
                evictions: Mutex::new(VecDeque::new()),
                group_removals: Mutex::new(VecDeque::new()),
                stats: Stats::default(),
                draining: AtomicBool::new(false),
                drain_signal: CancellationToken::new(),
                started_at: SystemTime::now(),
                started: Instant::now(),
                memory,
            }),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.shared.limits
    }

    pub(crate) fn stats(&self) -> &Stats {
        &self.shared.stats
    }

    /// Sequences handed out from now on come after `last` (the cluster
    /// engine's range for this replica start).
    pub fn start_sequences_after(&self, last: u64) {
        self.shared.sequence.fetch_max(last, Ordering::Relaxed);
    }

    /// The last sequence handed out (0 before the first publish).
    pub fn last_sequence(&self) -> u64 {
        self.shared.sequence.load(Ordering::Relaxed)
    }
}

/// A subscription in the registry, found by its id: the set holds one
/// pointer per subscription, and the id is the subscription's own (not a
/// second copy of it as a key).
struct ById(Arc<Subscription>);

impl std::borrow::Borrow<str> for ById {
    fn borrow(&self) -> &str {
        self.0.id()
    }
}

impl std::hash::Hash for ById {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.id().hash(state)
    }
}

impl PartialEq for ById {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for ById {}

#[cfg(test)]
mod tests;
