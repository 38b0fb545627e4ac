//! Messages between this replica's fan-out and NATS: a publish goes to the
//! local subscribers and out on `<prefix>.m.<topic>`; what other replicas
//! publish comes in on `<prefix>.m.>` and goes to the local subscribers with
//! the publisher's sequence and time.

use super::groups::{GroupRoute, backlog_full};
use super::{ClusterEngine, REMOTE_BURST, Ready};
use crate::broker::{RouteCache, WakeBatch};
use crate::engine::validate::truncate;
use crate::engine::{BrokerError, Confirmation, NewMessage, PublishOutcome, PublishTime};
use crate::pb;
use async_nats::jetstream;
use bytes::{BufMut, Bytes, BytesMut};
use futures::{FutureExt, StreamExt};
use prost::Message as _;
use std::sync::Arc;
use std::time::SystemTime;

impl ClusterEngine {
    /// Hands messages other replicas published to this replica's fan-out.
    pub(super) async fn receive(self, mut remote: async_nats::Subscriber) {
        let local = &self.inner.local;
        // The routes of recent topics, as a publisher keeps them.
        let mut routes = RouteCache::default();
        while let Some(first) = remote.next().await {
            let _burst = WakeBatch::begin();
            // One reading of the clocks for what arrived together (two
            // readings per message were 5 % of a receiving replica's CPU).
            let arrived = PublishTime::now();
            self.deliver(first, arrived, &mut routes);
            for _ in 1..REMOTE_BURST {
                match remote.next().now_or_never() {
                    Some(Some(message)) => self.deliver(message, arrived, &mut routes),
                    _ => break,
                }
            }
            drop(_burst);
            if local.is_shutting_down() {
                return;
            }
        }
    }

    pub(super) fn deliver(&self, message: async_nats::Message, arrived: PublishTime, routes: &mut RouteCache) {
        // The subject names the topic: what no subscription here matches
        // is dropped undecoded (the envelope's topic, the same, routes the
        // rest; a route cache hit the second time).
        if let Some(topic) = message.subject.as_str().strip_prefix(&self.inner.message_prefix)
            && !self.inner.local.routes_any(topic, routes)
        {
            return;
        }
        match pb::Message::decode(message.payload) {
            Ok(m) => {
                let (message, sequence, publish_time) = from_envelope(m);
                self.inner
                    .local
                    .deliver_remote(message, sequence, publish_time, arrived, routes);
            }
            Err(error) => tracing::warn!(subject = %message.subject, %error, "undecodable message from NATS dropped"),
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
        let (outcome, routed) = self.route_cluster(message, publisher, at).await?;
        if routed.groups.is_empty() {
            return Ok((outcome, None));
        }
        let id = format!("{}-{}", self.inner.config.replica_id, outcome.sequence);
        let mut sent = Vec::with_capacity(routed.groups.len());
        for route in routed.groups {
            let message = jetstream::message::PublishMessage::build()
                .payload(routed.body.clone())
                .message_id(id.clone());
            let ack = routed.ready.js.send_publish(route.subject.clone(), message).await;
            sent.push((route, ack));
        }
        let engine = self.clone();
        let confirmation = async move {
            let mut took = 0;
            for (route, ack) in sent {
                let first = match ack {
                    Ok(ack) => ack.await.map(|_| ()).map_err(|e| (backlog_full(&e), e.to_string())),
                    Err(e) => Err((false, e.to_string())),
                };
                // The retries' future is boxed only when needed: held
                // inline, it made every message's confirmation large to
                // allocate and copy.
                let stored = first.is_ok()
                    || Box::pin(engine.publish_to_group(&routed.ready, &route, routed.body.clone(), id.clone(), first))
                        .await?;
                took += u32::from(stored);
            }
            Ok(took)
        };
        Ok((outcome, Some(Box::pin(confirmation))))
    }

    /// A publish's work up to the group stores, in order: validated, given
    /// its sequence, delivered to this replica's subscribers, sent to the
    /// other replicas over core NATS, and encoded for the groups it matches.
    async fn route_cluster(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> Result<(PublishOutcome, Routed), BrokerError> {
        let ready = self.serving()?;
        crate::engine::validate::message(&message, self.inner.local.limits().max_message_bytes)?;
        let groups = self.group_routes(&message.topic);
        // Everything but the sequence, which routing assigns; protobuf
        // takes fields in any order, so it is appended after. The message's
        // fields are moved in for the encoding and back out after it.
        let head = pb::Message {
            topic: message.topic,
            payload: message.payload,
            headers: message.headers,
            publish_time: Some(at.wall.into()),
            ..Default::default()
        };
        // Room for the sequence too: one allocation, no growing.
        let mut body = BytesMut::with_capacity(head.encoded_len() + 11);
        let encoded = head.encode(&mut body);
        let message = NewMessage {
            topic: head.topic,
            payload: head.payload,
            headers: head.headers,
        };
        encoded.map_err(|e| BrokerError::InvalidArgument(e.to_string()))?;
        // With its sequence (at most 11 bytes more), before anyone has it.
        let max_payload = self.inner.max_payload.load(std::sync::atomic::Ordering::Relaxed);
        if body.len() + 11 > max_payload {
            return Err(BrokerError::ResourceExhausted(format!(
                "message to {:?} takes {} bytes encoded for NATS, above the NATS server's max_payload {max_payload} (raise it, or keep messages that far below TINYBROKER_MAX_MESSAGE_BYTES)",
                truncate(&message.topic),
                body.len() + 11,
            )));
        }
        // Not on core NATS when no other replica has a broadcast subscriber
        // (interest.rs): decided as routing starts.
        let core = (!self.inner.interest.skip()).then(|| {
            let prefix = &self.inner.message_prefix;
            let mut subject = String::with_capacity(prefix.len() + message.topic.len());
            subject.push_str(prefix);
            subject.push_str(&message.topic);
            subject
        });
        let outcome = self.inner.local.publish_at(message, Some(publisher), at)?;
        body.put_u8(4 << 3); // field 4 (sequence), varint
        prost::encoding::encode_varint(outcome.sequence, &mut body);
        let body = body.freeze();
        if let Some(subject) = core {
            self.inner.client.publish(subject, body.clone()).await.map_err(|e| {
                BrokerError::Unavailable(format!(
                    "NATS is unreachable ({e}): the message reached this replica's subscribers only"
                ))
            })?;
        }
        Ok((outcome, Routed { ready, groups, body }))
    }
}

/// A routed cluster publish: what its group stores need.
pub(super) struct Routed {
    ready: Arc<Ready>,
    groups: Vec<Arc<GroupRoute>>,
    /// The envelope, sequence included.
    body: Bytes,
}

/// What a message the cluster carries (a `Message` envelope, encoded by the
/// publishing replica) gives the local engine: the message, its cluster-wide
/// sequence and its publish time (now, if it has none that converts).
pub(super) fn from_envelope(m: pb::Message) -> (NewMessage, u64, SystemTime) {
    let publish_time = m
        .publish_time
        .and_then(|t| SystemTime::try_from(t).ok())
        .unwrap_or_else(SystemTime::now);
    let message = NewMessage {
        topic: m.topic,
        payload: m.payload,
        headers: m.headers,
    };
    (message, m.sequence, publish_time)
}
