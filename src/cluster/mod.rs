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
//! Files: `mod.rs` the engine, its set-up and health; `fanout.rs` messages
//! between the local fan-out and NATS; `groups/` consumer groups (`mod.rs`
//! their map; `table.rs` the group table, `store.rs` publishing into a
//! group's stream, `join.rs` joining, and a file for each other concern;
//! `state.rs` a hub's state, which is the consumer-group state machine
//! both engines share, `group/machine.rs`, run with JetStream's rules;
//! `hub.rs` its tasks; `nats.rs` its JetStream); `attempts.rs` delivery
//! attempts JetStream does not count; `handover.rs` nacked messages offered to
//! other replicas; `interest.rs` which replicas need core-NATS publishes;
//! `liveness.rs` whether NATS answers over an open connection, and
//! broadcast messages that arrive too late; `registry.rs` live replicas,
//! replica ids and subscription ids;
//! `stalls.rs` how long each group went without progress; `rpc.rs` calls
//! between replicas, both ends; `recovery.rs` the buckets, JetStream's
//! refusals explained, and the rebuild after NATS lost its state; `wire.rs`
//! the formats replicas exchange (declared in
//! `proto/tinybroker/cluster/v1/cluster.proto`) and how two versions
//! interoperate.
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
//! Every lock is a plain mutex held for a few instructions, never across an
//! `.await`, unless said otherwise; none is taken while another is held,
//! except:
//! 1. `groups::Groups::table`, then `groups::Groups::routes`;
//! 2. `Inner::recovering` (async, held across a whole check or rebuild),
//!    then any of the others;
//! 3. the interest's own word (`interest.rs`, async, held while it is
//!    announced), then `Inner::live` and the others' words;
//! 4. `Inner::core_sent` (async, held while a message is queued on core
//!    NATS), then none.
//!
//! Leaves: `Inner::ready`, `Inner::live`, `Inner::groups_seen`,
//! `Inner::stalls`, `Inner::beat_revision`, the others' interest, the
//! replicas known to speak protobuf (`rpc.rs`), the groups' `hubs`,
//! `members`, `idle` and `dropped`, and each hub's view and backend
//! locks. A hub's answer may be awaited under 2 (the rebuild asks each hub
//! to forget what it held): no hub takes any of these async locks.

mod attempts;
mod fanout;
mod groups;
mod handover;
mod interest;
mod liveness;
mod nats_server;
mod recovery;
mod registry;
mod rpc;
mod stalls;
mod wire;

use registry::{Release, key};

use crate::broker::{Broker, RouteCache, SubscriptionStream};
use crate::config::{ClusterConfig, Limits};
use crate::engine::validate::truncate;
use crate::engine::{
    Acked, BatchOutcome, BrokerError, ClusterInfo, Confirmation, Delivery, DeliveryMode, DeliveryStream, Engine,
    EngineHealth, EngineInfo, EvictionRecord, GroupInfo, Nacked, NatsStatus, NewMessage, Peaks, PublishOutcome,
    PublishTime, Snapshot, StreamEnd, SubscribeRequest, SubscriptionInfo,
};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::Stream;
use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    /// Messages this replica sent on core NATS. Held from taking the next
    /// number until the message is in the NATS client's queue, so the
    /// numbers go out in order.
    core_sent: tokio::sync::Mutex<u64>,
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
    /// Starts connecting (in the background: the engine is NOT_SERVING until
    /// NATS answers) and returns at once.
    pub async fn start(config: ClusterConfig, limits: Limits) -> anyhow::Result<Self> {
        let (events_tx, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut options = async_nats::ConnectOptions::new()
            .name(format!("tinybroker {}", config.replica_id))
            .no_echo()
            .retry_on_initial_connect()
            // The servers in the order given: the first one first (a
            // Service URL in Kubernetes; the tests give each replica its
            // own first server).
            .retain_servers_order()
            .max_reconnects(None)
            .reconnect_delay_callback(liveness::reconnect_delay)
            .request_timeout(Some(RPC_TIMEOUT))
            .event_callback(move |event| {
                let events_tx = events_tx.clone();
                async move {
                    let _ = events_tx.send(event);
                }
            });
        if let Some(token) = &config.nats_token {
            options = options.token(token.clone());
        }
        if let Some(creds) = &config.nats_creds {
            options = options
                .credentials_file(creds)
                .await
                .map_err(|e| anyhow::anyhow!("TINYBROKER_NATS_CREDS={}: cannot read it: {e}", creds.display()))?;
        }
        if let Some(ca) = &config.nats_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if config.nats_urls.iter().any(|u| u.starts_with("tls://")) {
            options = options.require_tls(true);
        }
        let urls: Vec<async_nats::ServerAddr> = config
            .nats_urls
            .iter()
            .map(|u| u.parse())
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("TINYBROKER_NATS_URL: {e}"))?;
        let client = options.connect(urls).await?;
        let max_message_bytes = limits.max_message_bytes;
        let (health, _) = watch::channel(EngineHealth::NotServing(format!(
            "connecting to NATS at {}",
            config.nats_urls.join(",")
        )));
        let engine = Self {
            inner: Arc::new(Inner {
                message_prefix: format!("{}.m.", config.prefix),
                local: Broker::for_replica(limits, &config.replica_id, 0),
                config,
                client,
                ready: Mutex::new(None),
                max_payload: AtomicUsize::new(usize::MAX),
                max_message_bytes: AtomicUsize::new(max_message_bytes),
                payload_margin_said: AtomicBool::new(false),
                health,
                connected: AtomicBool::new(false),
                reconnects: AtomicU64::new(0),
                slow_consumer_dropped: AtomicU64::new(0),
                state_lost: AtomicU64::new(0),
                liveness: liveness::Liveness::default(),
                recovering: tokio::sync::Mutex::new(()),
                incarnation: AtomicU64::new(0),
                witness: AtomicU64::new(0),
                core_sent: tokio::sync::Mutex::new(0),
                groups: groups::Groups::default(),
                groups_seen: Mutex::new(Vec::new()),
                stalls: stalls::Stalls::default(),
                live: Mutex::new(Vec::new()),
                interest: interest::Interest::default(),
                presence: registry::Presence::of_this_process(),
                beat_revision: Mutex::new(None),
            }),
        };
        let watcher = engine.clone();
        tokio::spawn(async move {
            while let Some(event) = events_rx.recv().await {
                watcher.on_event(event);
            }
        });
        tokio::spawn(engine.clone().set_up());
        Ok(engine)
    }

    fn on_event(&self, event: async_nats::Event) {
        let inner = &self.inner;
        match event {
            async_nats::Event::Connected => {
                inner
                    .max_payload
                    .store(inner.client.server_info().max_payload, Ordering::Relaxed);
                if inner.connected.swap(true, Ordering::AcqRel) {
                    return;
                }
                // What other replicas announced while this one was away
                // did not reach it.
                inner.interest.forget();
                inner.liveness.back();
                let ready = inner.ready.lock().clone();
                if let Some(ready) = ready {
                    inner.reconnects.fetch_add(1, Ordering::Relaxed);
                    // SERVING once it is known that NATS still has this
                    // engine's state (a server that restarted has lost it).
                    tokio::spawn(self.clone().back_online(ready));
                }
            }
            async_nats::Event::Disconnected => {
                inner.connected.store(false, Ordering::Release);
                inner.interest.forget();
                inner.liveness.lost();
                tracing::warn!("NATS connection lost: NOT_SERVING until it is back");
                inner.health.send_replace(EngineHealth::NotServing(
                    "the NATS connection is lost (reconnecting)".into(),
                ));
            }
            // Counted by the gaps they leave (`fanout.rs`): the client
            // reports at most 128 of a burst, and nothing of what a server
            // or a reconnection dropped.
            async_nats::Event::SlowConsumer(_)
            | async_nats::Event::ServerError(async_nats::ServerError::SlowConsumer(_)) => {
                tracing::debug!(event = %event, "NATS slow consumer");
            }
            other => tracing::info!(event = %other, "NATS connection event"),
        }
    }

    /// Creates the buckets, takes an incarnation and the fan-out
    /// subscription, then serves; retried until it works. Each reason it
    /// cannot is logged once (again only if it changes, or every
    /// [`REPEAT_WARNING`] while it lasts); a connection still being made
    /// in the first [`CONNECT_GRACE`] is no reason to warn.
    async fn set_up(self) {
        let started = std::time::Instant::now();
        let mut warned: Option<(String, std::time::Instant)> = None;
        loop {
            match self.try_set_up().await {
                Ok(()) => return,
                Err(SetUpError::Fatal(reason)) => {
                    tracing::error!("{reason}");
                    self.inner.health.send_replace(EngineHealth::Failed(reason));
                    return;
                }
                Err(SetUpError::NotConnected) if started.elapsed() < CONNECT_GRACE => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => {
                    let reason = error.to_string();
                    let repeat = warned
                        .as_ref()
                        .is_none_or(|(said, at)| *said != reason || at.elapsed() >= REPEAT_WARNING);
                    if repeat {
                        tracing::warn!("cluster mode cannot serve yet (retrying every second): {reason}");
                        warned = Some((reason.clone(), std::time::Instant::now()));
                    }
                    self.inner
                        .health
                        .send_replace(EngineHealth::NotServing(format!("NATS is unreachable: {reason}")));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    async fn try_set_up(&self) -> Result<(), SetUpError> {
        let inner = &self.inner;
        let client = &inner.client;
        if client.connection_state() != async_nats::connection::State::Connected {
            return Err(SetUpError::NotConnected);
        }
        inner.connected.store(true, Ordering::Release);
        self.check_nats_server()?;
        let js = jetstream::new(client.clone());
        let prefix = &inner.config.prefix;
        let retry = |e: &dyn std::fmt::Display| SetUpError::Retry(format!("JetStream: {e}"));
        let recovery::Buckets {
            subscriptions,
            replicas,
            groups,
            attempts,
            incarnations,
            losses,
        } = self.create_buckets(&js).await.map_err(SetUpError::from)?;
        let ready = Ready {
            js,
            subscriptions,
            replicas,
            groups,
            attempts,
            incarnations,
            losses,
        };
        // The id first: a second process with it must not answer its calls.
        self.claim_replica_id(&ready).await.map_err(|e| match e {
            registry::BeatError::Taken(registry::IdTaken(why)) => SetUpError::Fatal(why),
            other => retry(&other),
        })?;
        let incarnation = ready
            .incarnations
            .put(key(&inner.config.replica_id), Bytes::new())
            .await
            .map_err(|e| retry(&e))?;
        inner.local.start_sequences_after(incarnation << SEQUENCE_BITS);
        inner.incarnation.store(incarnation, Ordering::Relaxed);
        inner.witness.store(incarnation, Ordering::Relaxed);
        inner.interest.set_incarnation(incarnation).await;
        let remote = client
            .subscribe(format!("{}>", inner.message_prefix))
            .await
            .map_err(|e| retry(&e))?;
        let calls = client
            .subscribe(rpc::subject(prefix, &inner.config.replica_id))
            .await
            .map_err(|e| retry(&e))?;
        let offers = client
            .subscribe(handover::subject(prefix, &inner.config.replica_id))
            .await
            .map_err(|e| retry(&e))?;
        // Every server knows of the fan-out subscription before this
        // replica says it serves: a round trip through each other replica
        // (their servers) proves it (docs/cluster-notes.md).
        client.flush().await.map_err(|e| retry(&e))?;
        // Calls are answered from here on (nothing below fails and retries
        // the set-up): a replica starting at the same time pings this one
        // as this one pings it, and when each answered only after its own
        // pings, both waited RPC_TIMEOUT.
        tokio::spawn(self.clone().answer(calls));
        tokio::spawn(self.clone().answer_offers(offers, ready.js.clone()));
        let live = self.live_replicas(&ready).await;
        *inner.live.lock() = live.clone();
        for replica in live {
            if replica != inner.config.replica_id {
                let _ = rpc::call(client, prefix, &replica, &rpc::Call::Ping).await;
            }
        }
        let groups_known = self.load_groups(&ready).await.map_err(|e| retry(&e))?;
        let shared = Arc::new(ready.clone());
        *inner.ready.lock() = Some(shared.clone());
        tokio::spawn(self.clone().receive(remote));
        tokio::spawn(self.clone().watch_groups(ready.clone()));
        tokio::spawn(self.clone().heartbeat(ready));
        tokio::spawn(self.clone().watch_liveness(shared));
        tracing::info!(
            replica_id = %inner.config.replica_id,
            nats_server = %self.nats_server(),
            incarnation,
            groups_known,
            "cluster mode: connected to NATS; SERVING"
        );
        inner.health.send_replace(EngineHealth::Serving);
        Ok(())
    }

    /// What this replica needs of the NATS server it is connected to
    /// (`nats_server.rs`): version 2.10 or later, and a `max_payload` that
    /// carries its largest message, which it takes as its limit when
    /// `TINYBROKER_MAX_MESSAGE_BYTES` is unset (said at INFO once). Either
    /// failing stops the replica.
    fn check_nats_server(&self) -> Result<(), SetUpError> {
        let inner = &self.inner;
        let info = inner.client.server_info();
        nats_server::check_version(&info.version).map_err(SetUpError::Fatal)?;
        let max_payload = info.max_payload;
        inner.max_payload.store(max_payload, Ordering::Relaxed);
        let configured = inner.local.limits().max_message_bytes;
        let from_nats = inner.config.max_message_bytes_from_nats;
        let limit = nats_server::message_limit(configured, from_nats, max_payload).map_err(SetUpError::Fatal)?;
        inner.max_message_bytes.store(limit, Ordering::Relaxed);
        if inner.payload_margin_said.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        if from_nats {
            let why = match limit < configured {
                true => "the most the NATS server's max_payload carries once encoded",
                false => "the default, which the NATS server's max_payload carries",
            };
            tracing::info!(
                max_message_bytes = limit,
                max_payload,
                "cluster mode: messages of up to {limit} bytes (payload plus headers), {why}: TINYBROKER_MAX_MESSAGE_BYTES is unset"
            );
        } else if configured + ENCODING_ALLOWANCE > max_payload {
            tracing::warn!(
                max_message_bytes = configured,
                max_payload,
                "messages within {ENCODING_ALLOWANCE} bytes of TINYBROKER_MAX_MESSAGE_BYTES do not fit the NATS server's max_payload once encoded, and are refused (RESOURCE_EXHAUSTED): raise max_payload by 2 KiB, or unset TINYBROKER_MAX_MESSAGE_BYTES to take what it carries"
            );
        }
        Ok(())
    }

    fn nats_server(&self) -> String {
        let info = self.inner.client.server_info();
        format!("{}:{} ({})", info.host, info.port, info.server_name)
    }

    /// Ack of a subscription this replica serves: a cluster group's member
    /// through its hub, else the local engine (broadcast: all unknown).
    async fn ack_here(&self, id: &str, sequences: &[u64]) -> Result<Acked, BrokerError> {
        match self.hub_of(id) {
            Some(hub) => Ok(hub.ack(id, sequences).await),
            None => self.inner.local.ack(id, sequences),
        }
    }

    async fn nack_here(&self, id: &str, sequences: &[u64]) -> Result<Nacked, BrokerError> {
        match self.hub_of(id) {
            Some(hub) => Ok(hub.nack(id, sequences).await),
            None => self.inner.local.nack(id, sequences),
        }
    }

    /// Every group of the cluster: the table, each replica's part, and
    /// each group's backlog.
    async fn list_groups_now(&self, ready: &Ready) -> Vec<GroupInfo> {
        self.list_groups_all(ready).await.0
    }

    /// [`ClusterEngine::list_groups_now`], and whether every live replica
    /// answered (so that a group listed without members has none).
    async fn list_groups_all(&self, ready: &Ready) -> (Vec<GroupInfo>, bool) {
        let mut parts = Vec::new();
        let (answers, complete) = self.gather_all(ready, rpc::Call::ListGroups).await;
        for answer in answers {
            if let rpc::Answer::Groups(mut list) = answer {
                parts.append(&mut list);
            }
        }
        (self.cluster_groups(ready, parts).await, complete)
    }

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

    /// A subscription opened here, or UNAVAILABLE at once when NATS does
    /// not answer, or as soon as it is found not to while the open waits
    /// on it (`liveness.rs`).
    async fn subscribe_cluster(&self, request: SubscribeRequest) -> Result<ClusterStream, BrokerError> {
        let ready = self.serving()?;
        self.unless_cut_off(self.subscribe_ready(ready, request))
            .await
            .unwrap_or_else(|| Err(self.cut_off("the subscription was not opened")))
    }

    async fn subscribe_ready(
        &self,
        ready: Arc<Ready>,
        request: SubscribeRequest,
    ) -> Result<ClusterStream, BrokerError> {
        match request.mode {
            DeliveryMode::Single if request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(
                    "DELIVERY_MODE_SINGLE needs a consumer_group; it was empty".into(),
                ));
            }
            DeliveryMode::Single => return self.join_group(&ready, request).await,
            DeliveryMode::Multi if !request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(format!(
                    "consumer_group {:?} was given with DELIVERY_MODE_MULTI (broadcast); consumer groups need DELIVERY_MODE_SINGLE",
                    truncate(&request.consumer_group)
                )));
            }
            DeliveryMode::Multi => {}
        }
        let mut request = request;
        if request.subscription_id.is_empty() {
            request.subscription_id = uuid::Uuid::new_v4().to_string();
        } else {
            crate::engine::validate::name_field("subscription_id", &request.subscription_id)?;
        }
        crate::engine::validate::patterns(&request.topic_patterns)?;
        let id = request.subscription_id.clone();
        self.claim(&ready, &id).await?;
        let release = Release {
            store: ready.subscriptions.clone(),
            id: id.clone(),
        };
        // Every replica sends its publishes on core NATS before this
        // subscription's response headers go out.
        let interested = self.interested().await;
        let inner = self.inner.local.subscribe(request)?;
        Ok(ClusterStream {
            inner,
            release: Some(release),
            member: None,
            _interested: Some(interested),
        })
    }
}

/// Why the set-up did not finish.
enum SetUpError {
    /// No connection to NATS (yet).
    NotConnected,
    /// Tried again in a second: the reason, with what to change when the
    /// answer names it (`recovery::explain`).
    Retry(String),
    /// Not tried again: the replica stops.
    Fatal(String),
}

impl std::fmt::Display for SetUpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotConnected => f.write_str("no connection to NATS yet"),
            Self::Retry(why) | Self::Fatal(why) => f.write_str(why),
        }
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

impl Engine for ClusterEngine {
    type Publisher = RouteCache;
    type Stream = ClusterStream;

    fn limits(&self) -> &Limits {
        self.inner.local.limits()
    }

    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes.load(Ordering::Relaxed)
    }

    fn sequence_scope(&self) -> crate::engine::SequenceScope {
        crate::engine::SequenceScope::Replica
    }

    fn publish(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = Result<PublishOutcome, BrokerError>> + Send {
        self.publish_cluster(message, publisher, at)
    }

    fn publish_routed(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = Result<(PublishOutcome, Option<Confirmation>), BrokerError>> + Send {
        self.publish_cluster_routed(message, publisher, at)
    }

    fn publish_batch(
        &self,
        messages: Vec<NewMessage>,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = BatchOutcome> + Send {
        self.publish_cluster_batch(messages, publisher, at)
    }

    fn subscribe(&self, request: SubscribeRequest) -> impl Future<Output = Result<ClusterStream, BrokerError>> + Send {
        self.subscribe_cluster(request)
    }

    async fn ack(&self, subscription_id: &str, sequences: &[u64]) -> Result<Acked, BrokerError> {
        crate::engine::validate::ack_request("Ack", subscription_id, sequences)?;
        let call = || rpc::Call::Ack {
            id: subscription_id.to_owned(),
            sequences: sequences.to_vec(),
        };
        let here = self.ack_here(subscription_id, sequences).await;
        self.here_or_forwarded(subscription_id, here, call, |answer| match answer {
            rpc::Answer::Acked(acked) => Ok(acked),
            other => Err(other),
        })
        .await
    }

    async fn nack(&self, subscription_id: &str, sequences: &[u64]) -> Result<Nacked, BrokerError> {
        crate::engine::validate::ack_request("Nack", subscription_id, sequences)?;
        let call = || rpc::Call::Nack {
            id: subscription_id.to_owned(),
            sequences: sequences.to_vec(),
        };
        let here = self.nack_here(subscription_id, sequences).await;
        self.here_or_forwarded(subscription_id, here, call, |answer| match answer {
            rpc::Answer::Nacked(nacked) => Ok(nacked),
            other => Err(other),
        })
        .await
    }

    async fn close_subscription(&self, subscription_id: &str) -> Result<(), BrokerError> {
        let call = || rpc::Call::Close {
            id: subscription_id.to_owned(),
        };
        let here = self.inner.local.close_subscription(subscription_id);
        self.here_or_forwarded(subscription_id, here, call, |answer| match answer {
            rpc::Answer::Closed => Ok(()),
            other => Err(other),
        })
        .await
    }

    async fn list_subscriptions(&self) -> Result<Vec<SubscriptionInfo>, BrokerError> {
        let ready = self.serving()?;
        let mut all = Vec::new();
        for answer in self.gather(&ready, rpc::Call::ListSubscriptions).await {
            if let rpc::Answer::Subscriptions(mut list) = answer {
                all.append(&mut list);
            }
        }
        all.sort_by(|a, b| {
            a.opened_at
                .cmp(&b.opened_at)
                .then_with(|| a.subscription_id.cmp(&b.subscription_id))
        });
        Ok(all)
    }

    async fn list_groups(&self) -> Result<Vec<GroupInfo>, BrokerError> {
        let ready = self.serving()?;
        Ok(self.list_groups_now(&ready).await)
    }

    async fn list_evictions(&self) -> Result<Vec<EvictionRecord>, BrokerError> {
        let ready = self.serving()?;
        let mut all = Vec::new();
        for answer in self.gather(&ready, rpc::Call::ListEvictions).await {
            if let rpc::Answer::Evictions(mut list) = answer {
                all.append(&mut list);
            }
        }
        all.sort_by_key(|e| std::cmp::Reverse(e.evicted_at));
        all.truncate(crate::broker::EVICTION_HISTORY);
        Ok(all)
    }

    async fn info(&self) -> Result<EngineInfo, BrokerError> {
        let mut info = self.inner.local.info();
        let connected = self.inner.connected.load(Ordering::Acquire);
        info.cluster = Some(ClusterInfo {
            replica_id: self.inner.config.replica_id.clone(),
            nats_server: if connected { self.nats_server() } else { String::new() },
        });
        Ok(info)
    }

    fn snapshot(&self, peaks: Peaks) -> Snapshot {
        let mut snapshot = self.inner.local.snapshot(peaks);
        self.fill_unacked(&mut snapshot.subscriptions);
        // Gauges cluster-wide (the last gathering), counters this
        // replica's own: summed over the replicas, they are the cluster's.
        let mut groups = self.inner.groups_seen.lock().clone();
        let parts = self.local_groups();
        for group in &mut groups {
            let part = parts.iter().find(|p| p.name == group.name);
            group.redeliveries = part.map_or(0, |p| p.redeliveries);
            group.dead_lettered = part.map_or(0, |p| p.dead_lettered);
            group.acked = part.map_or(0, |p| p.acked);
            group.delivered = part.map_or(0, |p| p.delivered);
            group.dropped = part.map_or(0, |p| p.dropped);
        }
        snapshot.groups = groups;
        snapshot.nats = Some(NatsStatus {
            // Connected, and answering over the connection.
            connected: self.inner.connected.load(Ordering::Acquire) && self.inner.liveness.answering(),
            reconnects: self.inner.reconnects.load(Ordering::Relaxed),
            slow_consumer_dropped: self.inner.slow_consumer_dropped.load(Ordering::Relaxed),
            state_lost: self.inner.state_lost.load(Ordering::Relaxed),
            unreachable_dropped: self.inner.liveness.late_dropped(),
        });
        snapshot
    }

    fn health(&self) -> watch::Receiver<EngineHealth> {
        self.inner.health.subscribe()
    }

    fn draining(&self) -> impl Future<Output = ()> + Send + 'static {
        self.inner.local.draining()
    }

    fn begin_shutdown(&self) {
        self.inner.local.begin_shutdown();
        self.stop_pulling();
    }

    fn drainable(&self) -> usize {
        self.inner.local.drainable()
    }

    /// Only what broadcast subscribers here had queued: what members
    /// here held went back to JetStream (`maintain`, before this), and the
    /// backlogs stay in JetStream for the other replicas.
    fn close_all(&self) -> crate::engine::Discarded {
        self.inner.local.close_all()
    }

    async fn maintain(self, stop: impl Future<Output = ()> + Send + 'static) {
        self.inner.local.clone().maintain(stop).await;
        // The grace period is over: what members here still hold goes back
        // to their groups now, before the process exits (a nak left to a
        // member's stream closing, later, could be lost with the process,
        // and the message would wait for the consumer's ack_wait).
        self.hand_back_groups().await;
        // Leave the cluster: this replica's ids are released as its streams
        // end; say it is gone, and flush what is unsent.
        // Bounded: with NATS unreachable, shutdown must not wait for it.
        const LEAVE_TIMEOUT: Duration = Duration::from_secs(1);
        let ready = self.inner.ready.lock().clone();
        if let Some(ready) = ready {
            let id = key(&self.inner.config.replica_id);
            let _ = tokio::time::timeout(LEAVE_TIMEOUT, ready.replicas.delete(id)).await;
        }
        let _ = tokio::time::timeout(LEAVE_TIMEOUT, self.inner.client.flush()).await;
    }
}
