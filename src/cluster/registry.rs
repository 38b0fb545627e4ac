//! Who is alive and who holds which subscription id: the `<prefix>_replicas`
//! bucket (each replica's heartbeat, expiring after [`REPLICA_TTL`]) and the
//! `<prefix>_subscriptions` bucket (id → serving replica, claimed with a
//! compare-and-set).

#[cfg(doc)]
use super::REPLICA_TTL;
use super::{ClusterEngine, HEARTBEAT, Ready};
use crate::engine::BrokerError;
use crate::engine::validate::truncate;
use async_nats::jetstream::kv;
use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;

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
            if let Err(error) = self.beat(&ready).await {
                tracing::debug!(%error, "heartbeat not written");
            }
            // Kept as it was when the registry does not answer: a list of
            // this replica alone would leave the others out of its offers
            // and its broadcast-interest announcements.
            if let Some(live) = self.read_live_replicas(&ready).await {
                *self.inner.live.lock() = live;
            }
            self.interest_beat().await;
            // The metrics' group gauges are cluster-wide: refreshed here,
            // and groups memberless for their idle TTL removed.
            if let Ok((mut groups, complete)) = tokio::time::timeout(HEARTBEAT, self.list_groups_all(&ready)).await {
                self.expire_idle_groups(&ready, &mut groups, complete).await;
                *self.inner.groups_seen.lock() = groups;
            }
        }
    }

    pub(super) async fn beat(&self, ready: &Ready) -> Result<u64, kv::PutError> {
        let id = &self.inner.config.replica_id;
        ready.replicas.put(key(id), Bytes::from(id.clone())).await
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
