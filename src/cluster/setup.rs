//! A replica's start: connecting to NATS, its events into the health,
//! and the set-up (buckets, replica id, fan-out subscription, groups) until
//! it serves, again after each reconnection.

use super::registry::key;
use super::{
    CONNECT_GRACE, ClusterEngine, ENCODING_ALLOWANCE, Inner, REPEAT_WARNING, RPC_TIMEOUT, Ready, SEQUENCE_BITS, groups,
    handover, interest, liveness, nats_server, outbox, recovery, registry, rpc, stalls,
};
use crate::broker::Broker;
use crate::config::{ClusterConfig, Limits};
use crate::engine::EngineHealth;
use crate::retry::Backoff;
use async_nats::jetstream::{self};
use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// The longest wait between two attempts at the set-up (before jitter).
const SET_UP_RETRY_CAP: Duration = Duration::from_secs(2);

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
                outbox: outbox::Outbox::default(),
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

    pub(super) fn on_event(&self, event: async_nats::Event) {
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
    pub(super) async fn set_up(self) {
        let started = std::time::Instant::now();
        let mut warned: Option<(String, std::time::Instant)> = None;
        // Polls for a connection being made; retries a failure from half a
        // second, doubling to SET_UP_RETRY_CAP, jittered so that replicas
        // do not ask NATS in step.
        let mut connecting = Backoff::fixed(Duration::from_millis(50));
        let mut retrying = Backoff::new(Duration::from_millis(500), SET_UP_RETRY_CAP);
        loop {
            match self.try_set_up().await {
                Ok(()) => return,
                Err(SetUpError::Fatal(reason)) => {
                    tracing::error!("{reason}");
                    self.inner.health.send_replace(EngineHealth::Failed(reason));
                    return;
                }
                Err(SetUpError::NotConnected) if started.elapsed() < CONNECT_GRACE => {
                    connecting.sleep().await;
                }
                Err(error) => {
                    let reason = error.to_string();
                    let repeat = warned
                        .as_ref()
                        .is_none_or(|(said, at)| *said != reason || at.elapsed() >= REPEAT_WARNING);
                    if repeat {
                        tracing::warn!(
                            "cluster mode cannot serve yet (retrying, about {} s apart at most): {reason}",
                            SET_UP_RETRY_CAP.as_secs()
                        );
                        warned = Some((reason.clone(), std::time::Instant::now()));
                    }
                    self.inner
                        .health
                        .send_replace(EngineHealth::NotServing(format!("NATS is unreachable: {reason}")));
                    retrying.sleep().await;
                }
            }
        }
    }

    pub(super) async fn try_set_up(&self) -> Result<(), SetUpError> {
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
        tokio::spawn(self.clone().send_out());
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
    pub(super) fn check_nats_server(&self) -> Result<(), SetUpError> {
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

    pub(super) fn nats_server(&self) -> String {
        let info = self.inner.client.server_info();
        format!("{}:{} ({})", info.host, info.port, info.server_name)
    }
}

/// Why the set-up did not finish.
pub(super) enum SetUpError {
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
