//! Consumer groups in cluster mode, over JetStream. What happens to a
//! message, who may join and what is counted are the rules both engines
//! share ([`crate::group`]); this module is their I/O over NATS.
//!
//! - The group table, `<prefix>_groups` (name → patterns and ack mode), is
//!   written by a group's first member (a compare-and-set: both are fixed
//!   then) and watched by every replica into a local trie, so a publish
//!   knows which groups it matches.
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
//!   both engines share (`group/machine.rs`): round-robin with room, the
//!   member a message failed with passed over, deadlines, attempts, dead
//!   letters. It holds each JetStream message until it is done: acked when
//!   an AUTO member's stream takes it, or by a MANUAL member's Ack. A
//!   message taken back (a Nack, the member's ack deadline, the member
//!   leaving) goes to another member here with room, else to one on
//!   another replica (src/cluster/handover.rs), else is nacked (redelivered
//!   at once, to any member). A replica that dies leaves its messages to
//!   the consumer's `ack_wait`.
//! - A message whose attempt fails after `max_delivery_attempts` is
//!   published to `_dlq.<group>` by the replica holding it, then acked (a
//!   dead letter that breaks a message limit is dropped and counted
//!   instead, and the message acked all the same).
//! - A group without members on any live replica for its idle TTL is
//!   removed cluster-wide ([`ClusterEngine::expire_idle_groups`], from each
//!   replica's heartbeat): table entry, stream and consumer.
//! - A replica shutting down stops pulling, and hands back what its members
//!   still hold before it exits ([`ClusterEngine::hand_back_groups`]).
//!
//! # Files
//!
//! - `mod.rs` (this file): what a replica knows of the groups
//!   ([`Groups`]), and this map;
//! - `table.rs`: the group table, its trie, and new groups announced to
//!   the other replicas;
//! - `stream.rs`: a group's JetStream stream and consumer, named and made;
//! - `store.rs`: publishing into a group's stream, and making room in a
//!   full one;
//! - `join.rs`: a member joining, and its stream's link to its hub;
//! - `hubs.rs`: this replica's hubs: started, offered other replicas'
//!   messages, stopped and handed back at shutdown;
//! - `idle.rs`: idle groups removed cluster-wide;
//! - `listing.rs`: the listings for Admin and the metrics;
//! - `rebuild.rs`: the rebuild after NATS lost its state;
//! - `dead_letters.rs`: dead letters published;
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
//! - a hub's view and its `Open` watch (`hub.rs`), and its backend's
//!   consumer and repair time (`nats.rs`): leaves.
//!
//! [`ClusterEngine::expire_idle_groups`]: crate::cluster::ClusterEngine::expire_idle_groups
//! [`ClusterEngine::hand_back_groups`]: crate::cluster::ClusterEngine::hand_back_groups
//! [`ClusterEngine::make_room`]: crate::cluster::ClusterEngine::make_room
//! [`ClusterEngine::route_group`]: crate::cluster::ClusterEngine::route_group
//! [`ClusterEngine::watch_groups`]: crate::cluster::ClusterEngine::watch_groups

mod dead_letters;
mod hub;
#[cfg(test)]
mod hub_tests;
mod hubs;
mod idle;
mod join;
mod listing;
mod nats;
mod rebuild;
mod state;
mod store;
mod stream;
mod table;

pub(super) use join::MemberLink;
pub(super) use store::{NotStored, stored};
pub(super) use table::GroupRoute;

use crate::sublist::Sublist;
use hub::HubHandle;
use idle::Idle;
use nats::Nats;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;

/// What this replica knows of the cluster's groups.
#[derive(Default)]
pub(super) struct Groups {
    /// Group patterns, from the table: what a publish matches.
    routes: RwLock<Sublist<Arc<GroupRoute>>>,
    /// The table as last seen: name → patterns.
    table: Mutex<HashMap<String, Vec<String>>>,
    /// Groups with members on this replica (and hubs lingering after
    /// their last member left). A leaf lock.
    hubs: Mutex<HashMap<String, HubHandle<Nats>>>,
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
