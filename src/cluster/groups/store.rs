//! Publishing into a group's stream, and making room in a full one. A
//! message matching a group is written once per group by the publishing
//! replica, with an ack and a message id, and retried over a leader
//! election. A full stream refuses it (discard new); the publishing
//! replica then deletes the oldest message never delivered, counts it
//! (`group_overflow`, [`crate::group::backlog`]) and stores the new one:
//! JetStream discarding the oldest itself would say nothing, and every
//! loss must be counted.

use super::stream::stream_name;
use super::table::GroupRoute;
use crate::cluster::{ClusterEngine, Ready};
use crate::engine::BrokerError;
use crate::engine::validate::truncate;
use crate::group::backlog;
use crate::retry::Backoff;
use async_nats::jetstream::{self, consumer::pull};
use bytes::Bytes;
use std::time::Duration;
use tokio::time::Instant;

/// How long a publish to a group's stream is retried (a stream leader's
/// election takes 4 to 7 s, docs/cluster-notes.md).
const PUBLISH_RETRY_FOR: Duration = Duration::from_secs(10);
/// The wait between two of those attempts, doubling up to
/// [`PUBLISH_RETRY_CAP`]: kept short, a publisher waits on it.
const PUBLISH_RETRY_FIRST: Duration = Duration::from_millis(80);
const PUBLISH_RETRY_CAP: Duration = Duration::from_millis(250);

/// Most messages one publish deletes from a full group backlog to make room
/// (a large message in a backlog full of bytes needs several); beyond it,
/// the new message is the one dropped.
const MAKE_ROOM_AT_MOST: usize = 64;

/// Why a message is not (known to be) stored in a group's stream.
pub(in crate::cluster) enum NotStored {
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
    pub(in crate::cluster) fn of_answer(error: &jetstream::context::PublishError) -> Self {
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

/// Whether a store's answer says the message is stored: a sequence, new
/// or that of the same message id stored before. A duplicate answer with
/// no sequence is not a store: a stream leader answers so for an id it has
/// proposed and not yet stored on a quorum, and a leader cut off from its
/// cluster's majority never will (docs/cluster-notes.md, "Partitioned
/// inside NATS"). The message may still be stored by then (by a leader
/// that took it before losing its majority), so it is unconfirmed, and a
/// retry with the same id is idempotent.
pub(in crate::cluster) fn stored(
    answer: Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
) -> Result<(), NotStored> {
    match answer {
        Ok(ack) if ack.duplicate && ack.sequence == 0 => Err(NotStored::Unconfirmed(format!(
            "stream {} answered that it has seen the message id, with no sequence: not stored on a quorum",
            ack.stream
        ))),
        Ok(_) => Ok(()),
        Err(e) => Err(NotStored::of_answer(&e)),
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

impl ClusterEngine {
    /// Stores `body` in a group's stream after its first store, sent by
    /// [`ClusterEngine::publish_cluster_routed`], ended with `first`: makes
    /// room in a full backlog, and retries over a leader election. `id`
    /// makes retries idempotent. False when the group was removed meanwhile
    /// (its idle TTL): the message matched no group. An error says whether
    /// the message may still have been taken (an attempt was sent and not
    /// confirmed).
    pub(in crate::cluster) async fn publish_to_group(
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
        let mut backoff = Backoff::new(PUBLISH_RETRY_FIRST, PUBLISH_RETRY_CAP);
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
                        Ok(ack) => stored(ack.await),
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
                    backoff.sleep().await;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(sequence: u64, duplicate: bool) -> jetstream::publish::PublishAck {
        serde_json::from_value(serde_json::json!({"stream": "g", "seq": sequence, "duplicate": duplicate}))
            .expect("a PubAck")
    }

    #[test]
    fn a_duplicate_answer_without_a_sequence_is_not_a_store() {
        assert!(stored(Ok(ack(7, false))).is_ok());
        assert!(stored(Ok(ack(7, true))).is_ok(), "a retry of a message stored before");
        match stored(Ok(ack(0, true))) {
            Err(NotStored::Unconfirmed(why)) => assert!(why.contains("no sequence"), "{why}"),
            Err(_) => panic!("refused: would not say the message may still be taken"),
            Ok(()) => panic!("taken as stored: a leader cut off from its quorum answers so and never stores it"),
        }
    }
}
