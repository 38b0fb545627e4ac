//! Delivery attempts JetStream does not count, and the hand-backs it did
//! not decide. A Nack or an expired deadline hands a message to another
//! member without a round through JetStream (`groups/state.rs`
//! `HubCore::redirect`, `handover.rs`), so its `delivery_attempt` runs
//! ahead of JetStream's delivery count; a message handed back before any
//! member got it (its member left, its replica shut down) runs behind it.
//! So every message a replica sends back through JetStream (a Nak) has
//! the difference written to the `<prefix>_attempts` bucket first, keyed
//! by the message's place in its group's stream (possibly 0, or negative);
//! a replica that gets it redelivered reads it back and adds it to
//! JetStream's count. So `delivery_attempt` keeps counting up,
//! `TINYBROKER_MAX_DELIVERY_ATTEMPTS` holds across replicas, and a
//! redelivery that has no entry is one that no replica handed back: JetStream
//! redelivered it after its ack wait because the replica that had it was
//! cut off or gone, or its ack did not reach JetStream. That one is counted
//! as a redelivery where it is pulled (`groups/state.rs`), since no
//! replica counted the attempt that failed.
//!
//! Entries are few (only messages given back), removed when the message is
//! acked or dead-lettered, and expire after [`REMEMBERED_FOR`] otherwise.
//! Not covered: a replica killed (SIGKILL) while it held a message writes
//! nothing; its redelivery shows JetStream's count and is counted as a
//! redelivery, delivered to a member before or not.

use super::ClusterEngine;
use async_nats::jetstream;
use bytes::Bytes;
use std::time::Duration;

/// How long an entry is kept (the bucket's `max_age`).
pub const REMEMBERED_FOR: Duration = Duration::from_secs(3600);
/// How long a write or a read may take before the message goes on without.
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// JetStream's delivery count of `message` (1 when it cannot be read).
pub(super) fn delivered(message: &jetstream::Message) -> u32 {
    message
        .info()
        .map(|i| u32::try_from(i.delivered.max(1)).unwrap_or(u32::MAX))
        .unwrap_or(1)
}

/// The bucket key of `message`: its stream, its place there and when it
/// was stored (a group made again restarts its stream's sequence).
fn key(message: &jetstream::Message) -> Option<String> {
    let info = message.info().ok()?;
    Some(format!(
        "{}.{}.{}",
        info.stream,
        info.stream_sequence,
        info.published.unix_timestamp_nanos()
    ))
}

impl ClusterEngine {
    /// Before `messages` (each with the attempt its last delivery had) go
    /// back through JetStream: how far each ran ahead of JetStream's count,
    /// for the replica that gets it next. Written together; a write that
    /// fails is logged and the message goes back without it.
    pub(super) async fn remember_attempts<'a>(&self, messages: impl Iterator<Item = (&'a jetstream::Message, u32)>) {
        let Some(ready) = self.inner.ready.lock().clone() else {
            return;
        };
        let writes = messages.filter_map(|(message, attempt)| {
            // The next delivery is one more than both counts.
            let ahead = i64::from(attempt) - i64::from(delivered(message));
            let key = key(message)?;
            let store = &ready.attempts;
            Some(async move {
                match tokio::time::timeout(STORE_TIMEOUT, store.put(&key, Bytes::from(ahead.to_string()))).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => {
                        tracing::warn!(%key, %error, "delivery attempts not written: the redelivery shows JetStream's count")
                    }
                    Err(_) => tracing::warn!(%key, "delivery attempts not written in time: the redelivery shows JetStream's count"),
                }
            })
        });
        futures::future::join_all(writes).await;
    }

    /// How many attempts a redelivered `message` had beyond JetStream's
    /// count (negative: behind it), as the replica that handed it back
    /// wrote; None when no replica wrote any (JetStream redelivered it on
    /// its own), or the bucket does not answer.
    pub(super) async fn recall_attempts(&self, message: &jetstream::Message) -> Option<i64> {
        let (Some(ready), Some(key)) = (self.inner.ready.lock().clone(), key(message)) else {
            return None;
        };
        match tokio::time::timeout(STORE_TIMEOUT, ready.attempts.get(&key)).await {
            Ok(Ok(Some(value))) => Some(
                std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            ),
            Ok(Ok(None)) => None,
            Ok(Err(error)) => {
                tracing::debug!(%key, %error, "delivery attempts not read: JetStream's count is shown");
                None
            }
            Err(_) => None,
        }
    }

    /// `message` is done (acked or dead-lettered): its entry goes. Awaited
    /// by the hub's sender, in its order (rare: only messages given back
    /// have an entry).
    pub(super) async fn forget_attempts(&self, message: &jetstream::Message) {
        let (Some(ready), Some(key)) = (self.inner.ready.lock().clone(), key(message)) else {
            return;
        };
        let _ = tokio::time::timeout(STORE_TIMEOUT, ready.attempts.purge(&key)).await;
    }
}
