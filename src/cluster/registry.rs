//! Who is alive and who holds which subscription id: the `<prefix>_replicas`
//! bucket (each replica's heartbeat, expiring after [`REPLICA_TTL`]) and the
//! `<prefix>_subscriptions` bucket (id → serving replica, claimed with a
//! compare-and-set).
//!
//! A replica id is held by one process at a time. Each process writes its
//! [`Presence`] (a random instance id, its host and pid) under its id,
//! always with a compare-and-set on the revision it wrote last: a second
//! process started with the same `TINYBROKER_REPLICA_ID` finds the entry
//! taken and, if its holder beats again within [`STALE_AFTER`], refuses to
//! serve ([`IdTaken`]). A process whose entry was taken over while it could
//! not beat (a holder it took for gone) finds out at its next beat and
//! stops. An entry that is not renewed within `STALE_AFTER` (a killed
//! replica restarting under the same name) is taken over.

#[cfg(doc)]
use super::REPLICA_TTL;
use super::{ClusterEngine, HEARTBEAT, Ready};
use crate::engine::BrokerError;
use crate::engine::validate::truncate;
use crate::retry::Backoff;
use async_nats::jetstream::kv;
use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long a replica-id entry held by another process must go without a
/// new beat before this one takes it over: a live holder beats every
/// [`HEARTBEAT`].
pub(super) const STALE_AFTER: Duration = Duration::from_millis(2 * HEARTBEAT.as_millis() as u64 + 1000);

/// How often [`ClusterEngine::claim_replica_id`] looks again at an id held
/// by another process (jittered: at most 240 ms).
const CLAIM_LOOK_EVERY: Duration = Duration::from_millis(200);

/// What a replica writes under its id in `<prefix>_replicas`: which process
/// holds the id. A replica of an earlier version wrote its id alone (read
/// as a holder with no instance).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Presence {
    pub(super) instance: String,
    pub(super) host: String,
    pub(super) pid: u32,
    /// Unix seconds the process started.
    pub(super) started: u64,
}

impl Presence {
    /// This process, with a fresh instance id.
    pub(super) fn of_this_process() -> Self {
        Self {
            instance: uuid::Uuid::new_v4().to_string(),
            host: crate::config::host_name().unwrap_or_else(|| "unknown host".into()),
            pid: std::process::id(),
            started: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        }
    }

    pub(super) fn encode(&self) -> Bytes {
        serde_json::to_vec(self).expect("a presence encodes").into()
    }

    /// Who holds an entry, said for a person.
    fn describe(value: &[u8]) -> String {
        match serde_json::from_slice::<Presence>(value) {
            Ok(p) => format!(
                "pid {} on host {} (instance {}, started at unix {})",
                p.pid, p.host, p.instance, p.started
            ),
            Err(_) => "a replica of an earlier tinybroker version".into(),
        }
    }

    fn holds(&self, value: &[u8]) -> bool {
        serde_json::from_slice::<Presence>(value).is_ok_and(|p| p.instance == self.instance)
    }
}

/// This replica's id is held by another live process.
#[derive(Debug)]
pub(super) struct IdTaken(pub(super) String);

/// Why a beat was not written.
#[derive(Debug)]
pub(super) enum BeatError {
    /// Another process holds this replica's id.
    Taken(IdTaken),
    /// The registry did not answer.
    Unanswered(String),
}

impl std::fmt::Display for BeatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Taken(IdTaken(why)) => f.write_str(why),
            Self::Unanswered(why) => write!(f, "the replica registry (NATS) did not answer: {why}"),
        }
    }
}

impl ClusterEngine {
    /// Says this replica is alive every [`HEARTBEAT`].
    pub(super) async fn heartbeat(self, ready: Ready) {
        let mut interval = tokio::time::interval(HEARTBEAT);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if self.inner.local.is_shutting_down() {
                return;
            }
            match self.beat(&ready).await {
                Ok(()) => {}
                Err(BeatError::Taken(IdTaken(why))) => return self.stop_serving(why),
                Err(BeatError::Unanswered(error)) => tracing::debug!(%error, "heartbeat not written"),
            }
            let kept = match self.recover_if_lost(&ready).await {
                Ok(kept) => kept,
                Err(IdTaken(why)) => return self.stop_serving(why),
            };
            // Kept as it was when the registry does not answer: a list of
            // this replica alone would leave the others out of its offers
            // and its broadcast-interest announcements.
            if let Some(live) = self.read_live_replicas(&ready).await {
                *self.inner.live.lock() = live;
            }
            self.interest_beat().await;
            // The metrics' group gauges are cluster-wide: refreshed here,
            // and groups memberless for their idle TTL removed. Only while
            // NATS is seen to keep its state: the backlogs seen last are
            // what a loss of it is counted as. So a gathering that a loss
            // (or a rebuild) overtook is not kept: it may have read streams
            // made again, empty, and the backlogs from before are the loss.
            let witness = self.inner.witness.load(std::sync::atomic::Ordering::Relaxed);
            if kept
                && let Ok((mut groups, complete)) = tokio::time::timeout(HEARTBEAT, self.list_groups_all(&ready)).await
            {
                self.expire_idle_groups(&ready, &mut groups, complete).await;
                self.inner.stalls.stamp(&mut groups, Instant::now());
                if self.kept_since(&ready, witness).await {
                    *self.inner.groups_seen.lock() = groups;
                }
            }
        }
    }

    /// Writes this replica's presence under its id, over the revision it
    /// wrote last (created when it has none, or its entry expired).
    pub(super) async fn beat(&self, ready: &Ready) -> Result<(), BeatError> {
        let id_key = key(&self.inner.config.replica_id);
        let presence = self.inner.presence.encode();
        let last = *self.inner.beat_revision.lock();
        let written = match last {
            Some(revision) => ready
                .replicas
                .update(&id_key, presence.clone(), revision)
                .await
                .map_err(|e| (e.kind() == kv::UpdateErrorKind::WrongLastRevision, e.to_string())),
            None => ready
                .replicas
                .create(&id_key, presence.clone())
                .await
                .map_err(|e| (e.kind() == kv::CreateErrorKind::AlreadyExists, e.to_string())),
        };
        let revision = match written {
            Ok(revision) => revision,
            Err((false, error)) => return Err(BeatError::Unanswered(error)),
            // Written by someone else since: whose is it now?
            Err((true, _)) => {
                let entry = ready
                    .replicas
                    .entry(&id_key)
                    .await
                    .map_err(|e| BeatError::Unanswered(e.to_string()))?;
                match entry {
                    Some(e) if e.operation == kv::Operation::Put && self.inner.presence.holds(&e.value) => e.revision,
                    Some(e) if e.operation == kv::Operation::Put => {
                        return Err(BeatError::Taken(self.id_taken(&e.value)));
                    }
                    // Expired or deleted: this replica's again.
                    _ => ready
                        .replicas
                        .create(&id_key, presence)
                        .await
                        .map_err(|e| BeatError::Unanswered(e.to_string()))?,
                }
            }
        };
        *self.inner.beat_revision.lock() = Some(revision);
        Ok(())
    }

    fn id_taken(&self, holder: &[u8]) -> IdTaken {
        let id = &self.inner.config.replica_id;
        IdTaken(format!(
            "TINYBROKER_REPLICA_ID={id:?} is already in use by another live replica ({}): this one does not serve; give every replica its own TINYBROKER_REPLICA_ID (replicas on one host, or sharing one TINYBROKER_NATS_PREFIX, need distinct ids)",
            Presence::describe(holder)
        ))
    }

    /// Takes this replica's id in the registry before it serves: at once
    /// when the id is free; when another process holds it, only once that
    /// holder has not beaten for [`STALE_AFTER`] (it is gone), else
    /// [`IdTaken`].
    pub(super) async fn claim_replica_id(&self, ready: &Ready) -> Result<(), BeatError> {
        let id_key = key(&self.inner.config.replica_id);
        let mut seen: Option<(u64, Instant)> = None;
        // Looks again and again while the holder's entry may still be
        // renewed: at a fixed interval, so that a holder gone is taken
        // over soon after STALE_AFTER.
        let mut backoff = Backoff::fixed(CLAIM_LOOK_EVERY);
        loop {
            match self.beat(ready).await {
                Ok(()) => return Ok(()),
                Err(BeatError::Taken(taken)) => {
                    let entry = ready
                        .replicas
                        .entry(&id_key)
                        .await
                        .map_err(|e| BeatError::Unanswered(e.to_string()))?;
                    let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
                        continue;
                    };
                    match seen {
                        // Beaten again: its holder is alive.
                        Some((revision, _)) if revision != entry.revision => return Err(BeatError::Taken(taken)),
                        Some((_, since)) if since.elapsed() >= STALE_AFTER => {
                            // Not renewed: the holder is gone; take it over.
                            if let Ok(revision) = ready
                                .replicas
                                .update(&id_key, self.inner.presence.encode(), entry.revision)
                                .await
                            {
                                tracing::info!(
                                    replica_id = %self.inner.config.replica_id,
                                    previous = %Presence::describe(&entry.value),
                                    "replica id taken over from a holder not heard from for {STALE_AFTER:?}"
                                );
                                *self.inner.beat_revision.lock() = Some(revision);
                                return Ok(());
                            }
                        }
                        Some(_) => {}
                        None => {
                            tracing::info!(
                                replica_id = %self.inner.config.replica_id,
                                holder = %Presence::describe(&entry.value),
                                "replica id held by another process: waiting up to {STALE_AFTER:?} to see whether it is alive"
                            );
                            seen = Some((entry.revision, Instant::now()));
                        }
                    }
                    backoff.sleep().await;
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// Replicas heard from within [`REPLICA_TTL`], this one included (only
    /// this one when the registry does not answer).
    pub(super) async fn live_replicas(&self, ready: &Ready) -> Vec<String> {
        match self.read_live_replicas(ready).await {
            Some(replicas) => replicas,
            None => vec![self.inner.config.replica_id.clone()],
        }
    }

    /// [`ClusterEngine::live_replicas`]; None when the registry does not
    /// answer.
    pub(super) async fn read_live_replicas(&self, ready: &Ready) -> Option<Vec<String>> {
        let Ok(keys) = ready.replicas.keys().await else {
            return None;
        };
        let mut replicas: Vec<String> = keys
            .filter_map(|k| async move { k.ok().and_then(|k| unkey(&k)) })
            .collect()
            .await;
        if !replicas.contains(&self.inner.config.replica_id) {
            replicas.push(self.inner.config.replica_id.clone());
        }
        replicas.sort();
        Some(replicas)
    }

    pub(super) async fn is_live(&self, ready: &Ready, replica: &str) -> bool {
        matches!(ready.replicas.entry(key(replica)).await, Ok(Some(e)) if e.operation == kv::Operation::Put)
    }

    /// The replica serving subscription `id`, from the registry.
    pub(super) async fn owner(&self, ready: &Ready, id: &str) -> Result<Option<String>, BrokerError> {
        match ready.subscriptions.entry(key(id)).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => {
                Ok(Some(String::from_utf8_lossy(&e.value).into_owned()))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(BrokerError::Unavailable(format!(
                "the subscription registry (NATS) did not answer: {e}"
            ))),
        }
    }

    /// Claims subscription id `id` for this replica, cluster-wide.
    pub(super) async fn claim(&self, ready: &Ready, id: &str) -> Result<(), BrokerError> {
        let me = Bytes::from(self.inner.config.replica_id.clone());
        let unavailable = |e: &dyn std::fmt::Display| {
            BrokerError::Unavailable(format!("the subscription registry (NATS) did not answer: {e}"))
        };
        match ready.subscriptions.create(key(id), me.clone()).await {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(unavailable(&e)),
        }
        let entry = ready.subscriptions.entry(key(id)).await.map_err(|e| unavailable(&e))?;
        let Some(entry) = entry else {
            return Err(BrokerError::Unavailable(format!(
                "subscription id {:?} was being claimed at the same moment elsewhere; try again",
                truncate(id)
            )));
        };
        let holder = String::from_utf8_lossy(&entry.value).into_owned();
        if entry.operation == kv::Operation::Put && self.is_live(ready, &holder).await {
            return Err(BrokerError::AlreadyExists(format!(
                "subscription id {:?} is already open (on replica {holder})",
                truncate(id)
            )));
        }
        // Deleted, or held by a replica that is gone: take it over.
        ready
            .subscriptions
            .update(key(id), me, entry.revision)
            .await
            .map(|_| ())
            .map_err(|_| {
                BrokerError::AlreadyExists(format!("subscription id {:?} was just opened elsewhere", truncate(id)))
            })
    }
}

/// A registry key for any id: base64url, which KV keys accept.
pub(super) fn key(id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(id)
}

pub(super) fn unkey(key: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(key).ok()?;
    String::from_utf8(bytes).ok()
}

/// Gives a subscription id back to the registry when its stream ends.
pub(super) struct Release {
    pub(super) store: kv::Store,
    pub(super) id: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        let (store, key) = (self.store.clone(), key(&self.id));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = store.delete(key).await;
            });
        }
    }
}
