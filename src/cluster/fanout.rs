//! Messages between this replica's fan-out and NATS: a publish goes to the
//! local subscribers and out on `<prefix>.m.<topic>`; what other replicas
//! publish comes in on `<prefix>.m.>` and goes to the local subscribers with
//! the publisher's sequence and time. The envelope's format is `wire.rs`'s.
//!
//! A message that arrives more than [`DELIVER_WITHIN`] after it was
//! published (its replica queued it while cut off from NATS, and the
//! partition healed later) is dropped and counted, not delivered late
//! (`liveness.rs`). The NATS work of a publish is bounded by NATS
//! answering: found unreachable meanwhile, the publish is UNAVAILABLE at
//! that moment, saying what became of the message.
//!
//! [`DELIVER_WITHIN`]: super::liveness::DELIVER_WITHIN

use super::groups::{GroupRoute, NotStored, stored};
use super::wire;
use super::{ClusterEngine, REMOTE_BURST, Ready};
use crate::broker::{RemoteRoutes, RouteCache};
use crate::engine::WakeBatch;
use crate::engine::validate::truncate;
use crate::engine::{BatchOutcome, BrokerError, Confirmation, NewMessage, PublishOutcome, PublishTime};
use async_nats::jetstream;
use bytes::{Bytes, BytesMut};
use futures::{FutureExt, StreamExt};
use std::sync::Arc;

impl ClusterEngine {
    /// Hands messages other replicas published to this replica's fan-out.
    pub(super) async fn receive(self, mut remote: async_nats::Subscriber) {
        let local = &self.inner.local;
        // The routes of recent topics, as a publisher keeps them.
        let mut routes = RouteCache::default();
        let mut gaps = Gaps::default();
        while let Some(first) = remote.next().await {
            let _burst = WakeBatch::begin();
            // One reading of the clocks for what arrived together (two
            // readings per message were 5 % of a receiving replica's CPU).
            let arrived = PublishTime::now();
            self.deliver(first, arrived, &mut routes, &mut gaps);
            for _ in 1..REMOTE_BURST {
                match remote.next().now_or_never() {
                    Some(Some(message)) => self.deliver(message, arrived, &mut routes, &mut gaps),
                    _ => break,
                }
            }
            drop(_burst);
            if local.is_shutting_down() {
                return;
            }
        }
    }

    pub(super) fn deliver(
        &self,
        message: async_nats::Message,
        arrived: PublishTime,
        routes: &mut RouteCache,
        gaps: &mut Gaps,
    ) {
        let batch = message
            .headers
            .as_ref()
            .is_some_and(|h| h.get(wire::BATCH_HEADER).is_some());
        // The subject names the topic (`<prefix>.m.<topic>`: what this
        // replica subscribes to), the same for every envelope of a batch:
        // its routes looked up once, and what no subscription here matches
        // dropped undecoded.
        let subject = &message.subject;
        let topic = subject.as_str().strip_prefix(&self.inner.message_prefix);
        let targets = topic.map(|topic| self.inner.local.remote_routes(topic, routes));
        let to = topic.zip(targets.as_ref());
        // A replica speaking the previous wire reads none, as that version.
        if !batch || wire::speaks_previous() {
            return self.deliver_envelope(subject, to, message.payload, arrived, gaps);
        }
        for envelope in wire::batched(message.payload) {
            match envelope {
                Ok(envelope) => self.deliver_envelope(subject, to, envelope, arrived, gaps),
                Err(error) => {
                    tracing::warn!(subject = %message.subject, %error, "a batch of messages from NATS cut short: the rest of it dropped");
                    break;
                }
            }
        }
    }

    /// One envelope (alone, or of a batch) from another replica, to the
    /// subscribers here: `to`, its topic and their routes (none when its
    /// subject names no topic).
    fn deliver_envelope(
        &self,
        subject: &async_nats::Subject,
        to: Option<(&str, &RemoteRoutes)>,
        payload: Bytes,
        arrived: PublishTime,
        gaps: &mut Gaps,
    ) {
        let mut sender = 0;
        if let Some((incarnation, count)) = wire::count_prefix(&payload) {
            sender = incarnation;
            let lost = gaps.lost_before(sender, count);
            if lost > 0 {
                self.count_nats_drops(sender, lost);
            }
        }
        let Some((topic, targets)) = to else {
            return;
        };
        if targets.is_empty() {
            return;
        }
        match wire::decode(payload) {
            Ok(m) if m.topic == topic => {
                let (message, sequence, publish_time) = wire::from_envelope(m);
                if let Some(late) = super::liveness::too_late(publish_time, arrived.wall) {
                    self.count_late(sender, late);
                    return;
                }
                self.inner
                    .local
                    .deliver_remote(message, sequence, publish_time, arrived, targets);
            }
            Ok(m) => tracing::warn!(
                %subject,
                topic = %truncate(&m.topic),
                "message from NATS whose envelope names another topic than its subject dropped"
            ),
            Err(error) => tracing::warn!(%subject, %error, "undecodable message from NATS dropped"),
        }
    }

    /// Counts `lost` messages of the replica incarnation `sender` that NATS
    /// dropped on their way here, and says so when the total crosses a
    /// power of two.
    fn count_nats_drops(&self, sender: u64, lost: u64) {
        let before = self
            .inner
            .slow_consumer_dropped
            .fetch_add(lost, std::sync::atomic::Ordering::Relaxed);
        let after = before + lost;
        if before == 0 || before.ilog2() != after.ilog2() {
            tracing::warn!(
                dropped = lost,
                dropped_so_far = after,
                sender_incarnation = sender,
                "NATS dropped messages of another replica on their way here (this replica read too slowly, or its connection was moving to another server)"
            );
        }
    }

    pub(super) async fn publish_cluster(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> Result<PublishOutcome, BrokerError> {
        // Each matching group's stream stores it (with an ack), once.
        let (mut outcome, confirmation) = self.publish_cluster_routed(message, publisher, at).await?;
        if let Some(confirmation) = confirmation {
            outcome.matched_groups += confirmation.await?;
        }
        Ok(outcome)
    }

    /// A batch (a session's `publish`): validated first, so the valid
    /// messages take consecutive sequences set aside for them, then each
    /// routed in order (their group stores overlap), and the stores awaited
    /// in order. While every other replica reads batches, the messages of
    /// the batch to one topic go out on core NATS as one NATS message
    /// (`wire.rs`). A message refused after validation (the memory budget,
    /// NATS cut off, a group's store not confirmed) leaves its sequence
    /// unused.
    pub(super) async fn publish_cluster_batch(
        &self,
        messages: Vec<NewMessage>,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> BatchOutcome {
        if let Err(error) = self.serving() {
            return BatchOutcome::all_rejected(messages.len(), &error);
        }
        let max = crate::engine::Engine::max_message_bytes(self);
        let mut rejected = Vec::new();
        let mut valid = Vec::with_capacity(messages.len());
        for (index, message) in messages.into_iter().enumerate() {
            match crate::engine::validate::message(&message, max) {
                Ok(_) => valid.push((index as u32, message)),
                Err(error) => rejected.push((index as u32, error)),
            }
        }
        self.inner.local.set_aside_sequences(valid.len(), publisher);
        let mut routed = Vec::with_capacity(valid.len());
        if valid.len() > 1 && self.inner.interest.batch() {
            // Routed here first, then out on core NATS in runs of one
            // topic, then to the groups.
            let mut locals = Vec::with_capacity(valid.len());
            for (index, message) in valid {
                match self.route_local(message, publisher, at) {
                    Ok(local) => locals.push((index, local)),
                    Err(error) => rejected.push((index, error)),
                }
            }
            let sent = WakeBatch::across_waits(self.send_core_batched(&mut locals)).await;
            for ((index, local), body) in locals.into_iter().zip(sent) {
                let stored = match body {
                    Ok(body) => WakeBatch::across_waits(self.store_in_groups(local.into_routed(body))).await,
                    Err(error) => Err(error),
                };
                match stored {
                    Ok((outcome, confirmation)) => routed.push((index, outcome.sequence, confirmation)),
                    Err(error) => rejected.push((index, error)),
                }
            }
        } else {
            for (index, message) in valid {
                let outcome = WakeBatch::across_waits(self.publish_cluster_routed(message, publisher, at)).await;
                match outcome {
                    Ok((outcome, confirmation)) => routed.push((index, outcome.sequence, confirmation)),
                    Err(error) => rejected.push((index, error)),
                }
            }
        }
        publisher.end_batch();
        let mut outcome = BatchOutcome::default();
        for (index, sequence, confirmation) in routed {
            if let Some(confirmation) = confirmation
                && let Err(error) = WakeBatch::across_waits(confirmation).await
            {
                rejected.push((index, error));
                continue;
            }
            if outcome.accepted == 0 {
                outcome.first_sequence = sequence;
            }
            outcome.accepted += 1;
        }
        rejected.sort_by_key(|(index, _)| *index);
        outcome.rejected = rejected;
        outcome
    }

    /// [`ClusterEngine::publish_cluster`] up to its group stores, which are
    /// sent before this returns; their acks are awaited by the confirmation
    /// (with the retries, and the room made in a full backlog, of
    /// [`ClusterEngine::publish_to_group`]), which counts the groups that
    /// took the message.
    pub(super) async fn publish_cluster_routed(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> Result<(PublishOutcome, Option<Confirmation>), BrokerError> {
        let mut local = self.route_local(message, publisher, at)?;
        let body = match local.core.take() {
            Some((subject, count_at)) => self.send_core(subject, &mut local.body, count_at).await?,
            None => local.body.split().freeze(),
        };
        self.store_in_groups(local.into_routed(body)).await
    }

    /// Sends a routed message to the groups it matches (each store waits
    /// for room in the NATS client's queue, only while NATS answers); the
    /// confirmation awaits their acks.
    async fn store_in_groups(&self, routed: Routed) -> Result<(PublishOutcome, Option<Confirmation>), BrokerError> {
        let outcome = routed.outcome;
        if routed.groups.is_empty() {
            return Ok((outcome, None));
        }
        let id = format!("{}-{}", self.inner.config.replica_id, outcome.sequence);
        let mut sent = Vec::with_capacity(routed.groups.len());
        for route in &routed.groups {
            let message = jetstream::message::PublishMessage::build()
                .payload(routed.body.clone())
                .message_id(id.clone());
            // Waits for room in the client's queue: only while NATS answers.
            let send = routed.ready.js.send_publish(route.subject.clone(), message);
            let Some(ack) = self.unless_cut_off(send).await else {
                return Err(self.cut_off(&match sent.len() {
                    0 => "no consumer group took the message; it reached broadcast subscribers".to_owned(),
                    n => format!(
                        "the message was sent to consumer groups {} and may still be taken by them, not to {}; it reached broadcast subscribers",
                        group_names(&routed.groups[..n]),
                        group_names(&routed.groups[n..])
                    ),
                }));
            };
            sent.push((route.clone(), ack));
        }
        let engine = self.clone();
        let confirmation = async move {
            let confirmed = async {
                let mut took = 0;
                for (route, ack) in sent {
                    let first = match ack {
                        Ok(ack) => stored(ack.await),
                        Err(e) => Err(NotStored::Refused(e.to_string())),
                    };
                    // The retries' future is boxed only when needed: held
                    // inline, it made every message's confirmation large to
                    // allocate and copy.
                    let stored = first.is_ok()
                        || Box::pin(engine.publish_to_group(
                            &routed.ready,
                            &route,
                            routed.body.clone(),
                            id.clone(),
                            first,
                        ))
                        .await?;
                    took += u32::from(stored);
                }
                Ok(took)
            };
            // Found unreachable meanwhile: said at once, not after the
            // retries (JetStream's own timeouts, then 10 s of them).
            match engine.unless_cut_off(confirmed).await {
                Some(took) => took,
                None => Err(engine.cut_off(&format!(
                    "consumer groups {} did not confirm the message: it was sent, and may still have been taken (then a member gets it once NATS answers); it reached broadcast subscribers",
                    group_names(&routed.groups)
                ))),
            }
        };
        Ok((outcome, Some(Box::pin(confirmation))))
    }

    /// A publish's work here, in order: validated, given its sequence,
    /// delivered to this replica's subscribers, and encoded for the other
    /// replicas and the groups it matches; not yet out on NATS.
    fn route_local(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> Result<Local, BrokerError> {
        let ready = self.serving()?;
        crate::engine::validate::message(&message, crate::engine::Engine::max_message_bytes(self))?;
        let groups = self.group_routes(&message.topic);
        // Not on core NATS when no other replica has a broadcast subscriber
        // (interest.rs): decided as routing starts.
        let subject = (!self.inner.interest.skip()).then(|| {
            let prefix = &self.inner.message_prefix;
            let mut subject = String::with_capacity(prefix.len() + message.topic.len());
            subject.push_str(prefix);
            subject.push_str(&message.topic);
            subject
        });
        // Everything but the sequence, which routing assigns, and the count,
        // given as it goes out (`wire.rs`). The message's fields are moved
        // in for the encoding and back out after it.
        let head = wire::pb::Envelope {
            topic: message.topic,
            payload: message.payload,
            headers: message.headers,
            publish_time: Some(at.wall.into()),
            ..Default::default()
        };
        // Sent by this replica's incarnation, when it goes out on core NATS.
        let incarnation = subject
            .is_some()
            .then(|| self.inner.incarnation.load(std::sync::atomic::Ordering::Relaxed));
        let encoded = wire::encode_head(&head, incarnation);
        let message = NewMessage {
            topic: head.topic,
            payload: head.payload,
            headers: head.headers,
            tracing: message.tracing,
        };
        let (mut body, count_at) = encoded.map_err(|e| BrokerError::InvalidArgument(e.to_string()))?;
        // With its sequence, before anyone has it.
        let max_payload = self.inner.max_payload.load(std::sync::atomic::Ordering::Relaxed);
        if body.len() + wire::SEQUENCE_MAX > max_payload {
            return Err(BrokerError::ResourceExhausted(format!(
                "message to {:?} takes {} bytes encoded for NATS, above the NATS server's max_payload {max_payload} (raise it, or keep messages that far below TINYBROKER_MAX_MESSAGE_BYTES)",
                truncate(&message.topic),
                body.len() + wire::SEQUENCE_MAX,
            )));
        }
        let outcome = self.inner.local.publish_at(message, Some(publisher), at)?;
        wire::put_sequence(&mut body, outcome.sequence);
        Ok(Local {
            outcome,
            ready,
            groups,
            body,
            core: subject.zip(count_at),
        })
    }
}

/// A publish routed here and encoded, not yet out on NATS.
pub(super) struct Local {
    outcome: PublishOutcome,
    ready: Arc<Ready>,
    groups: Vec<Arc<GroupRoute>>,
    /// The envelope, sequence included; its count is set as it goes out.
    pub(super) body: BytesMut,
    /// Its subject on core NATS and where its count goes, when it goes out
    /// there.
    pub(super) core: Option<(String, usize)>,
}

impl Local {
    /// What its group stores need, with the envelope as it went out.
    fn into_routed(self, body: Bytes) -> Routed {
        Routed {
            outcome: self.outcome,
            ready: self.ready,
            groups: self.groups,
            body,
        }
    }
}

/// Group names for a message: `"a", "b"`.
fn group_names(routes: &[Arc<GroupRoute>]) -> String {
    let names: Vec<String> = routes.iter().map(|r| format!("{:?}", truncate(&r.name))).collect();
    names.join(", ")
}

/// The highest count heard from each replica incarnation: a count more
/// than one above it means NATS dropped the messages in between.
#[derive(Default)]
pub(super) struct Gaps {
    last: std::collections::HashMap<u64, u64>,
}

impl Gaps {
    /// Incarnations remembered at most (replicas restart; forgetting them
    /// all only makes the next message of each the new starting point).
    const SENDERS: usize = 1024;

    /// How many messages of `sender` NATS dropped before the one numbered
    /// `count`. The first heard from a sender starts its count here.
    fn lost_before(&mut self, sender: u64, count: u64) -> u64 {
        if self.last.len() >= Self::SENDERS && !self.last.contains_key(&sender) {
            self.last.clear();
        }
        let last = self.last.entry(sender).or_insert(count);
        let lost = count.saturating_sub(*last).saturating_sub(1);
        *last = (*last).max(count);
        lost
    }
}

/// A routed cluster publish: what its group stores need.
pub(super) struct Routed {
    outcome: PublishOutcome,
    ready: Arc<Ready>,
    groups: Vec<Arc<GroupRoute>>,
    /// The envelope, sequence included.
    body: Bytes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_count_what_went_missing_between_two_messages_of_a_sender() {
        let mut gaps = Gaps::default();
        assert_eq!(gaps.lost_before(1, 5), 0, "the first heard from starts the count");
        assert_eq!(gaps.lost_before(1, 6), 0);
        assert_eq!(gaps.lost_before(1, 10), 3, "7, 8 and 9 went missing");
        assert_eq!(gaps.lost_before(2, 1), 0, "each sender has its own count");
        assert_eq!(gaps.lost_before(1, 9), 0, "an older one changes nothing");
        assert_eq!(gaps.lost_before(1, 11), 0);
        assert_eq!(gaps.lost_before(2, 3), 1);
    }
}
