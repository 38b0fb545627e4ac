//! Dead letters in cluster mode: the replica holding a message that used
//! its last attempt publishes its dead letter (made by the shared rule,
//! [`crate::group::dead_letter`]) to `_dlq.<group>`, then acks it.

use crate::broker::RouteCache;
use crate::cluster::ClusterEngine;
use crate::engine::PublishTime;
use crate::group::dead_letter;
use async_nats::jetstream::{self, AckKind};

impl ClusterEngine {
    /// Publishes a message that used its last attempt to `_dlq.<group>`
    /// (as [`crate::group::dead_letter`] makes it), then acks it: done
    /// with. A dead letter that breaks a message limit is dropped and
    /// counted there, and the message acked all the same; one that NATS
    /// did not take is nacked (redelivered, to be dead-lettered again).
    /// `remembered`: its attempts were read from the `<prefix>_attempts`
    /// bucket, where its entry goes once it is done with.
    pub(super) async fn dead_letter(&self, group: &str, message: &jetstream::Message, attempts: u32, remembered: bool) {
        let Ok(m) = crate::cluster::wire::decode(message.payload.clone()) else {
            return;
        };
        let letter = dead_letter::letter(
            dead_letter::Original {
                group,
                sequence: m.sequence,
                topic: &m.topic,
                payload: m.payload,
                headers: m.headers,
                attempts,
            },
            crate::engine::Engine::max_message_bytes(self),
            &self.inner.local.stats().dropped_dead_letter_invalid,
        );
        if let Some(letter) = letter
            && let Err(error) = self
                .publish_cluster(letter.message, &mut RouteCache::default(), PublishTime::now())
                .await
        {
            tracing::warn!(consumer_group = group, %error, "dead letter not published; the message is redelivered instead");
            let _ = message.ack_with(AckKind::Nak(None)).await;
            return;
        }
        let _ = message.double_ack().await;
        if remembered {
            self.forget_attempts(message).await;
        }
    }
}
