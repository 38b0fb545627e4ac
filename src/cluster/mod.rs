//! The cluster engine (docs/contract.md, "Cluster mode"): several replicas
//! behind one Service, with a NATS cluster carrying messages between them.
//! This replica is a gRPC front; NATS is the distributed part.
//!
//! What this engine does, and with what:
//! - **Fan-out** stays local: a replica's subscribers are served by its own
//!   embedded [`Broker`] (trie, bounded queues, eviction, streams). A publish
//!   is delivered to this replica's subscribers at once and sent on core NATS
//!   (`<prefix>.m.<topic>`); every replica holds one subscription on
//!   `<prefix>.m.>` (taken before it serves) and hands what arrives to its
//!   own fan-out with the publisher's sequence and time. The connection is
//!   `no_echo`, so a replica never receives its own publishes twice.
//! - **Sequences** are unique in the cluster: each replica start takes an
//!   incarnation number (a revision of the `<prefix>_incarnations` bucket)
//!   and hands out `incarnation << 44 | n`, n counting up from 1.
//! - **Subscription ids** are claimed in the `<prefix>_subscriptions`
//!   bucket (create is a compare-and-set): a second claim of a live id is
//!   ALREADY_EXISTS wherever it comes from. A claim of a replica that is no
//!   longer alive (its key in `<prefix>_replicas`, refreshed every
//!   [`HEARTBEAT`], expired) is taken over.
//! - **Ack, Nack, CloseSubscription** for a subscription served elsewhere are
//!   forwarded to its replica (`<prefix>.rpc.<replica>`, a request), and the
//!   Admin listings gather from every live replica.
//! - **Health**: NOT_SERVING until the connection, the buckets and the
//!   fan-out subscription are up, whenever the connection is lost, and
//!   whenever NATS stops answering over an open connection (a partition:
//!   `liveness.rs`, within 2 to 3 s).
//!
//! - **Consumer groups** run over JetStream: see `groups/mod.rs`.
//!
//! - **Replica ids** are held by one process at a time (`registry.rs`): a
//!   second live holder of an id is refused, loudly.
//! - **Lost NATS state** (memory-storage JetStream restarted) is noticed
//!   and rebuilt, and the loss counted (`recovery.rs`).
//!
//! ARCHITECTURE.md's "Code map" says which file holds what.
//!
//! # Tasks
//!
//! Long-running, one each per replica (spawned by [`ClusterEngine::start`]
//! and the set-up):
//! - the **event watcher**: the NATS client's events (connected, lost),
//!   into `Inner::connected` and the health;
//! - the **set-up** (`set_up`), until it serves; then **back online**
//!   (`back_online`) after each reconnection;
//! - the **receiver** (`fanout.rs`): other replicas' publishes into the
//!   local fan-out;
//! - the **sender** (`outbox.rs`): this replica's publishes, as queued,
//!   to the NATS client, a burst's at once;
//! - the **call answerer** (`rpc.rs`): forwarded calls, each answered on a
//!   task of its own (a call may wait on a hub);
//! - the **offer answerer** (`handover.rs`): nacked messages other replicas
//!   offer, one at a time;
//! - the **group table watch** (`groups/table.rs`): the table into the
//!   local trie;
//! - the **heartbeat** (`registry.rs`): presence, the live replicas, the
//!   groups' listing, idle groups removed, lost NATS state noticed;
//! - the **probe** (`liveness.rs`): a round trip to the NATS server every
//!   half second, and one beyond it (a ping other replicas answer, a
//!   JetStream stream info), into the health; with it, the task answering
//!   other replicas' pings and the one reading the answers to its own.
//!
//! Per consumer group with members here, three (`groups/hub.rs`): the
//! **hub task**, which alone owns the group's state on this replica; the
//! **puller**, which owns the open pull; the **sender**, which owns the
//! ordered queue of what the hub tells JetStream.
//!
//! # Lock order
//!
//! ARCHITECTURE.md, "Locks and their order", is the one statement of it.

mod attempts;
mod engine;
mod fanout;
mod groups;
mod handover;
mod interest;
mod liveness;
mod nats_server;
mod outbox;
mod recovery;
mod registry;
mod rpc;
mod setup;
mod stalls;
mod wire;

use registry::{Release, key};
use setup::SetUpError;

use crate::broker::{Broker, SubscriptionStream};
use crate::config::ClusterConfig;
use crate::engine::{BrokerError, Delivery, DeliveryStream, EngineHealth, GroupInfo, StreamEnd};
use async_nats::jetstream::{self, kv};
use futures::Stream;
use parking_lot::Mutex;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::watch;

/// How often a replica says it is alive.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
/// A replica not heard from for this long is taken as gone.
pub const REPLICA_TTL: Duration = Duration::from_secs(10);
/// How long a forwarded call or a gathering of listings may take.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// Bits of a sequence left for the count within one incarnation.
const SEQUENCE_BITS: u32 = 44;
/// What a message's encoding on NATS adds to its payload and headers at
/// most: topic (256), header framing (64 × 10), tags, time and sequence
/// (946 bytes, 1 KiB), and the headers tracing adds, which count against
/// no limit (`telemetry::TRACING_HEADERS_MAX_ENCODED`, 602 bytes).
pub const ENCODING_ALLOWANCE: usize = 1024 + crate::engine::TRACING_HEADERS_MAX_ENCODED;
/// Most remote messages handed to the local fan-out in one burst.
const REMOTE_BURST: usize = 128;
/// How long a start waits for the NATS connection before it says there is
/// none.
const CONNECT_GRACE: Duration = Duration::from_secs(3);
/// How often a reason the set-up keeps failing for is logged again.
const REPEAT_WARNING: Duration = Duration::from_secs(60);

/// The cluster engine: a handle, cheap to clone.
#[derive(Clone)]
pub struct ClusterEngine {
    inner: Arc<Inner>,
}

struct Inner {
    config: ClusterConfig,
    /// This replica's subscribers.
    local: Broker,
    client: async_nats::Client,
    /// Set once the buckets exist and the fan-out subscription is up.
    /// Shared: every publish takes it (cloning the handles in it was a
    /// fifth of a publishing replica's CPU).
    ready: Mutex<Option<Arc<Ready>>>,
    /// The NATS server's `max_payload`, read when connected: every publish
    /// checks it (`server_info()` copies the whole INFO each time).
    max_payload: AtomicUsize,
    /// The message limit in force: `TINYBROKER_MAX_MESSAGE_BYTES`, or, unset,
    /// at most what `max_payload` carries (`nats_server.rs`), once connected.
    max_message_bytes: AtomicUsize,
    /// The limit taken from max_payload, or the warning that it leaves too
    /// little margin, was logged.
    payload_margin_said: AtomicBool,
    health: watch::Sender<EngineHealth>,
    connected: AtomicBool,
    reconnects: AtomicU64,
    /// Messages from other replicas that NATS dropped on the way here:
    /// gaps in their core-NATS counts (`fanout.rs`).
    slow_consumer_dropped: AtomicU64,
    /// Group messages lost with NATS's memory (`recovery.rs`).
    state_lost: AtomicU64,
    /// Whether NATS answers over the open connection, and the broadcast
    /// messages dropped for arriving too late (`liveness.rs`).
    liveness: liveness::Liveness,
    /// Held while this replica checks for lost NATS state, or rebuilds it:
    /// one at a time (the heartbeat and a reconnection both start one).
    recovering: tokio::sync::Mutex<()>,
    /// The revision of this replica's entry in `<prefix>_incarnations`: its
    /// incarnation, or what a rebuild wrote (`recovery.rs`).
    witness: AtomicU64,
    /// This replica's incarnation, once set up: names its core-NATS count.
    incarnation: AtomicU64,
    /// What this replica sends on core NATS, numbered, until the sender
    /// hands it to the NATS client (`outbox.rs`).
    outbox: outbox::Outbox,
    /// Subject prefix of messages: `<prefix>.m.`.
    message_prefix: String,
    groups: groups::Groups,
    /// Every group of the cluster as last gathered (every [`HEARTBEAT`]),
    /// for the metrics.
    groups_seen: Mutex<Vec<GroupInfo>>,
    /// How long each group has gone without progress, from the gatherings.
    stalls: stalls::Stalls,
    /// The live replicas, this one included, as of the last heartbeat
    /// (where a nacked message is offered: no registry read per Nack).
    live: Mutex<Vec<String>>,
    /// Whether other replicas need this one's publishes on core NATS.
    interest: interest::Interest,
    /// Which process this is, written under its replica id (`registry.rs`).
    presence: registry::Presence,
    /// The revision of this replica's last beat: the next one is written
    /// over it (a compare-and-set), so a second holder of the id is seen.
    beat_revision: Mutex<Option<u64>>,
}

/// What the engine has once it is set up.
#[derive(Clone)]
struct Ready {
    js: jetstream::Context,
    subscriptions: kv::Store,
    replicas: kv::Store,
    /// The consumer-group table.
    groups: kv::Store,
    /// Delivery attempts JetStream does not count (`attempts.rs`).
    attempts: kv::Store,
    /// Each replica start's incarnation (a revision); this replica's own
    /// entry also witnesses that NATS kept its state (`recovery.rs`).
    incarnations: kv::Store,
    /// The groups whose lost backlog a replica counted after NATS lost its
    /// state (`groups/rebuild.rs`).
    losses: kv::Store,
}

impl ClusterEngine {
    /// The engine's state, or UNAVAILABLE saying why it cannot serve.
    fn serving(&self) -> Result<Arc<Ready>, BrokerError> {
        let reason = match &*self.inner.health.borrow() {
            EngineHealth::Serving => None,
            EngineHealth::NotServing(reason) | EngineHealth::Failed(reason) => Some(reason.clone()),
        };
        if let Some(reason) = reason {
            return Err(BrokerError::Unavailable(format!("cluster mode cannot serve: {reason}")));
        }
        self.inner
            .ready
            .lock()
            .clone()
            .ok_or_else(|| BrokerError::Unavailable("cluster mode is not set up yet".into()))
    }
}

/// A subscription of this replica: the local stream, and its claim on the id.
pub struct ClusterStream {
    inner: SubscriptionStream,
    release: Option<Release>,
    /// For group members: the group's hub on this replica.
    member: Option<groups::MemberLink>,
    /// For broadcast subscriptions: this replica says "some" while it is held.
    _interested: Option<interest::Interested>,
}

impl Stream for ClusterStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let (Poll::Ready(Some(delivery)), Some(member)) = (&polled, &self.member) {
            member.streamed(delivery);
        }
        polled
    }
}

impl DeliveryStream for ClusterStream {
    fn id(&self) -> &str {
        DeliveryStream::id(&self.inner)
    }

    fn consumer_group(&self) -> Option<&str> {
        DeliveryStream::consumer_group(&self.inner)
    }

    fn end(&self) -> Option<StreamEnd> {
        self.inner.end()
    }

    fn poll_ended(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.inner.poll_ended(cx)
    }

    fn poll_next_drained(&mut self, cx: &mut Context<'_>) -> Poll<Option<(Delivery, bool)>> {
        let polled = self.inner.poll_delivery(cx, true);
        if let (Poll::Ready(Some((delivery, _))), Some(member)) = (&polled, &self.member) {
            member.streamed(delivery);
        }
        polled
    }

    fn close(&mut self) -> StreamEnd {
        // As when dropped: a member's held messages go back to its group
        // first, then the local subscription closes.
        self.member.take();
        DeliveryStream::close(&mut self.inner)
    }

    fn add_credit(&mut self, messages: u64) {
        self.inner.subscription().queue.add_credit(messages);
        if let Some(member) = &self.member {
            member.credit_added();
        }
    }
}

impl Drop for ClusterStream {
    fn drop(&mut self) {
        // A member's held messages go back to its group first; then the id
        // is released (asynchronously: the local subscription, dropped just
        // after this, is gone from the registry long before).
        self.member.take();
        self.release.take();
    }
}
