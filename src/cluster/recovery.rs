//! The cluster engine's buckets, and what it does when NATS has lost them:
//! JetStream with memory storage forgets every stream when all of its
//! servers restart (or one lone server does), while the replicas keep
//! running.
//!
//! A replica notices when its connection comes back, or at its next
//! heartbeat (the incarnation count is gone or has fallen below this
//! replica's own incarnation), and, within a few seconds of NATS answering
//! again:
//! - goes NOT_SERVING with one WARN naming the streams that are missing;
//! - creates the buckets again, keeps the incarnation count above its own
//!   (a replica started after the loss must not take an incarnation, and so
//!   sequences, in use), writes its presence, claims again the ids of the
//!   subscriptions it serves, and has every group hub here make its
//!   group's table entry, stream and consumer again (`groups/nats.rs`,
//!   `Nats::heal`);
//! - counts what the lost group streams held, as
//!   `tinybroker_messages_dropped_total{reason="nats_state_lost"}`: each
//!   group's last backlog (from the last gathering before the loss, for
//!   every group of the table, with members or without) by the one replica
//!   that marks it first in `<prefix>_losses`, so the sum over replicas is
//!   the loss, and the messages held by members here (their acks have
//!   nothing left to settle): `groups/rebuild.rs`;
//! - serves again. While any of this fails it stays NOT_SERVING and says
//!   why, once.
//!
//! Also here: [`explain`], which turns JetStream's refusals into what the
//! operator has to change.

use super::registry::{BeatError, IdTaken, key};
use super::{ClusterEngine, Ready};
use crate::engine::EngineHealth;
use crate::retry::Backoff;
use async_nats::jetstream::{self, kv};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The waits of the two recovery loops, between attempts at a rebuild
/// (heavy: every bucket and group stream made again) and between looks at
/// whether JetStream answers again. Both double while it fails, up to
/// [`RECOVERY_DELAY_CAP`]: short, since SERVING waits on them.
const REBUILD_DELAY_FIRST: Duration = Duration::from_millis(400);
const BACK_ONLINE_DELAY_FIRST: Duration = Duration::from_millis(200);
const RECOVERY_DELAY_CAP: Duration = Duration::from_secs(1);

/// The buckets, as made at set-up and again after a loss.
pub(super) struct Buckets {
    pub(super) subscriptions: kv::Store,
    pub(super) replicas: kv::Store,
    pub(super) groups: kv::Store,
    pub(super) attempts: kv::Store,
    pub(super) incarnations: kv::Store,
    pub(super) losses: kv::Store,
}

/// The streams of the buckets (`KV_<prefix>_<name>`), which the liveness
/// probe asks for their leaders (`liveness.rs`).
pub(super) fn bucket_streams(prefix: &str) -> Vec<String> {
    bucket_ages()
        .iter()
        .map(|(name, _)| format!("KV_{prefix}_{name}"))
        .collect()
}

/// Each bucket's name after the prefix, and how long its entries live.
fn bucket_ages() -> [(&'static str, Duration); 6] {
    [
        ("subscriptions", Duration::ZERO),
        ("replicas", super::REPLICA_TTL),
        ("groups", Duration::ZERO),
        ("attempts", super::attempts::REMEMBERED_FOR),
        ("incarnations", Duration::ZERO),
        // One entry per group whose backlog a loss of NATS's memory took,
        // made by the replica that counted it (`groups/rebuild.rs`); the
        // next loss takes them with it.
        ("losses", Duration::ZERO),
    ]
}

/// JetStream refused or did not answer: what it said, and what to change.
#[derive(Debug)]
pub(super) struct Refused(pub(super) String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Refused> for super::SetUpError {
    fn from(refused: Refused) -> Self {
        super::SetUpError::Retry(refused.0)
    }
}

/// An error and its sources, one line, with a hint when JetStream's answer
/// names a setting: the replica count, JetStream being off, its memory.
pub(super) fn explain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    let lower = text.to_ascii_lowercase();
    let hint = if lower.contains("replicas > 1 not supported") || lower.contains("insufficient resources for replicas")
    {
        Some(
            "TINYBROKER_NATS_REPLICAS is more than this NATS deployment can place (a single server, or a cluster with fewer JetStream servers): set TINYBROKER_NATS_REPLICAS=1 for one server, or at most the number of JetStream servers",
        )
    } else if lower.contains("no responders")
        || lower.contains("jetstream not enabled")
        || lower.contains("jetstream unavailable")
        || lower.contains("not enabled for account")
    {
        Some(
            "the NATS server does not answer JetStream requests: start nats-server with JetStream on (`-js`, or a `jetstream {}` block in its configuration; memory storage is enough), and give the account JetStream if accounts are configured",
        )
    } else if lower.contains("insufficient resources") || lower.contains("insufficient storage") {
        Some(
            "the NATS servers have no JetStream memory left: raise max_memory_store (jetstream block) on the NATS servers",
        )
    } else {
        None
    };
    match hint {
        Some(hint) => format!("{text} — {hint}"),
        None => text,
    }
}

impl ClusterEngine {
    /// Creates the buckets (each a no-op when it exists with this config).
    pub(super) async fn create_buckets(&self, js: &jetstream::Context) -> Result<Buckets, Refused> {
        let prefix = &self.inner.config.prefix;
        let mut made = Vec::with_capacity(6);
        for (name, max_age) in bucket_ages() {
            let config = kv::Config {
                bucket: format!("{prefix}_{name}"),
                history: 1,
                max_age,
                storage: jetstream::stream::StorageType::Memory,
                num_replicas: self.inner.config.nats_replicas,
                ..Default::default()
            };
            let store = js
                .create_key_value(config)
                .await
                .map_err(|e| Refused(format!("JetStream: creating bucket {prefix}_{name}: {}", explain(&e))))?;
            made.push(store);
        }
        let mut made = made.into_iter();
        let mut next = || made.next().expect("six buckets");
        Ok(Buckets {
            subscriptions: next(),
            replicas: next(),
            groups: next(),
            attempts: next(),
            incarnations: next(),
            losses: next(),
        })
    }

    /// What NATS has lost of this engine's state, said for a person: None
    /// when all is there, or when JetStream did not answer (asked again at
    /// the next beat). The witness is this replica's entry in the
    /// incarnation bucket, whose entries never expire: it is there, at the
    /// revision this replica wrote, unless JetStream lost it, whether the
    /// stream is gone (a lone server restarted) or came back empty (a
    /// cluster's meta layer keeps stream definitions, not memory-stored
    /// messages).
    async fn lost_state(&self, ready: &Ready) -> StateCheck {
        let prefix = &self.inner.config.prefix;
        let witness = self.inner.witness.load(Ordering::Relaxed);
        match ready.incarnations.entry(key(&self.inner.config.replica_id)).await {
            Ok(Some(entry)) if entry.revision == witness => return StateCheck::Kept,
            Ok(_) => {}
            Err(_) => match ready.js.get_stream(format!("KV_{prefix}_incarnations")).await {
                Err(e) if stream_not_found(&e) => {}
                _ => return StateCheck::Unknown,
            },
        }
        let mut missing = Vec::new();
        for (name, _) in bucket_ages() {
            let stream = format!("KV_{prefix}_{name}");
            if let Err(e) = ready.js.get_stream(&stream).await
                && stream_not_found(&e)
            {
                missing.push(stream);
            }
        }
        StateCheck::Lost(if missing.is_empty() {
            "JetStream's streams came back empty".to_owned()
        } else {
            format!("JetStream streams {} are gone", missing.join(", "))
        })
    }

    /// Whether NATS is seen to still keep this engine's state, as it did
    /// when this replica's witness was `witness` (no rebuild since).
    pub(super) async fn kept_since(&self, ready: &Ready, witness: u64) -> bool {
        matches!(self.lost_state(ready).await, StateCheck::Kept)
            && self.inner.witness.load(Ordering::Relaxed) == witness
    }

    /// At each heartbeat, and when the connection comes back: if NATS has
    /// lost this engine's state, rebuilds what this replica needs (module
    /// docs). Returns once it serves again (whether NATS was seen to keep
    /// its state), or when the id turned out taken.
    pub(super) async fn recover_if_lost(&self, ready: &Ready) -> Result<bool, IdTaken> {
        // One at a time: after another's rebuild, this check finds nothing
        // lost.
        let _recovering = self.inner.recovering.lock().await;
        let lost = match self.lost_state(ready).await {
            StateCheck::Kept => return Ok(true),
            StateCheck::Unknown => return Ok(false),
            StateCheck::Lost(lost) => lost,
        };
        let what = format!(
            "NATS lost what it kept in memory ({lost}): rebuilding this replica's registry entries and group streams"
        );
        tracing::warn!("{what}");
        self.inner.health.send_replace(EngineHealth::NotServing(what));
        let mut said = String::new();
        let mut backoff = Backoff::new(REBUILD_DELAY_FIRST, RECOVERY_DELAY_CAP);
        loop {
            match self.rebuild(ready).await {
                Ok(lost) => {
                    tracing::info!(
                        dropped = lost,
                        "NATS state rebuilt; SERVING (messages the lost group streams held are counted as dropped, reason nats_state_lost)"
                    );
                    self.inner.health.send_replace(EngineHealth::Serving);
                    return Ok(false);
                }
                Err(RebuildError::Taken(taken)) => return Err(taken),
                Err(RebuildError::Failed(why)) => {
                    if why != said {
                        tracing::warn!("rebuilding after NATS lost its state: not done yet, retrying: {why}");
                        said = why.clone();
                    }
                    self.inner.health.send_replace(EngineHealth::NotServing(format!(
                        "NATS lost its state and it is not rebuilt yet: {why}"
                    )));
                    if self.inner.local.is_shutting_down() {
                        return Ok(false);
                    }
                    backoff.sleep().await;
                }
            }
        }
    }

    /// The NATS connection is back, or NATS answers again after a silence
    /// (`liveness.rs`): SERVING once JetStream answers and is seen to still
    /// have this engine's state, or once it is rebuilt; NOT_SERVING
    /// meanwhile (group publishes and joins would fail).
    pub(super) async fn back_online(self, ready: std::sync::Arc<Ready>) {
        let back = std::time::Instant::now();
        let mut said = false;
        let mut backoff = Backoff::new(BACK_ONLINE_DELAY_FIRST, RECOVERY_DELAY_CAP);
        loop {
            // Not while the probe finds NATS silent (`liveness.rs`): it
            // starts this again when NATS answers.
            if !self.inner.connected.load(Ordering::Acquire)
                || !self.inner.liveness.answering()
                || self.inner.local.is_shutting_down()
            {
                return;
            }
            match self.recover_if_lost(&ready).await {
                Err(IdTaken(why)) => return self.stop_serving(why),
                // Rebuilt: SERVING already.
                Ok(false) if matches!(*self.inner.health.borrow(), EngineHealth::Serving) => return,
                Ok(false) => {
                    if !said && back.elapsed() > Duration::from_secs(5) {
                        tracing::warn!(
                            "NATS connection back, but JetStream does not answer yet: NOT_SERVING until it does"
                        );
                        said = true;
                    }
                    backoff.sleep().await;
                }
                Ok(true) => break,
            }
        }
        if !self.inner.liveness.answering() {
            return;
        }
        tracing::info!(nats_server = %self.nats_server(), "NATS connection back: SERVING");
        self.inner.health.send_replace(EngineHealth::Serving);
    }

    /// This replica's id is held by another live process: it stops (the
    /// line names the variable, the id and the other holder).
    pub(super) fn stop_serving(&self, why: String) {
        tracing::error!("{why}");
        self.inner.health.send_replace(EngineHealth::Failed(why));
    }

    /// One attempt at [`ClusterEngine::recover_if_lost`]'s rebuild; what it
    /// counted as lost (counted as it went: an attempt that fails after
    /// counting some leaves them counted, and the next one skips them).
    async fn rebuild(&self, ready: &Ready) -> Result<u64, RebuildError> {
        let failed = |what: &str, e: &dyn std::fmt::Display| RebuildError::Failed(format!("{what}: {e}"));
        let buckets = self
            .create_buckets(&ready.js)
            .await
            .map_err(|e| failed("buckets", &e))?;
        // Keep incarnations (and so sequences) unique: the recreated count
        // starts at 1, below this replica's own.
        let incarnation = self.inner.incarnation.load(Ordering::Relaxed);
        let stream = ready
            .js
            .get_stream(format!("KV_{}_incarnations", self.inner.config.prefix))
            .await
            .map_err(|e| failed("the incarnation count", &e))?;
        if stream.cached_info().state.last_sequence <= incarnation {
            stream
                .purge()
                .sequence(incarnation + 1)
                .await
                .map_err(|e| failed("the incarnation count", &e))?;
        }
        let witness = buckets
            .incarnations
            .put(key(&self.inner.config.replica_id), bytes::Bytes::new())
            .await
            .map_err(|e| failed("the incarnation count", &e))?;
        self.inner.witness.store(witness, Ordering::Relaxed);
        // The old revision went with the bucket.
        *self.inner.beat_revision.lock() = None;
        self.beat(ready).await.map_err(|e| match e {
            BeatError::Taken(taken) => RebuildError::Taken(taken),
            other => failed("this replica's presence", &other),
        })?;
        for id in self.inner.local.subscription_ids() {
            let me = bytes::Bytes::from(self.inner.config.replica_id.clone());
            match ready.subscriptions.create(key(&id), me).await {
                Ok(_) => {}
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                Err(e) => return Err(failed("the subscription registry", &e)),
            }
        }
        self.rebuild_groups(ready)
            .await
            .map_err(|e| failed("group streams", &e))
    }
}

/// What [`ClusterEngine::lost_state`] found.
enum StateCheck {
    /// NATS has this engine's state.
    Kept,
    /// JetStream did not answer.
    Unknown,
    /// Lost: what is missing.
    Lost(String),
}

enum RebuildError {
    Taken(IdTaken),
    Failed(String),
}

fn stream_not_found(error: &jetstream::context::GetStreamError) -> bool {
    matches!(error.kind(), jetstream::context::GetStreamErrorKind::JetStream(e)
        if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

#[cfg(test)]
mod tests {
    use super::explain;

    #[derive(Debug)]
    struct Chain(&'static str, Option<Box<Chain>>);

    impl std::fmt::Display for Chain {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Chain {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|c| c as _)
        }
    }

    #[test]
    fn jetstream_refusals_name_what_to_change() {
        let replicas = Chain(
            "bucket creation failed",
            Some(Box::new(Chain(
                "jetstream error: replicas > 1 not supported in non-clustered mode (code 500, error code 10074)",
                None,
            ))),
        );
        let text = explain(&replicas);
        assert!(text.contains("replicas > 1 not supported"), "{text}");
        assert!(text.contains("TINYBROKER_NATS_REPLICAS=1"), "{text}");

        let off = Chain("JetStream error", Some(Box::new(Chain("no responders", None))));
        let text = explain(&off);
        assert!(text.contains("-js"), "{text}");
        assert!(!text.contains("TINYBROKER_NATS_REPLICAS"), "{text}");

        let other = Chain("timed out", None);
        assert_eq!(explain(&other), "timed out");
    }
}
