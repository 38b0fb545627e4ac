//! A nacked message handed to a member on another replica, when no other
//! member on the nacking member's replica has room: the message is offered
//! to each other live replica in turn on `<prefix>.take.<replica>`, and the
//! first with a member that has room takes the JetStream message itself.
//!
//! What is handed over is the message's JetStream reply subject (its
//! handle: an ack, nak or progress is a publish to it, from any
//! connection) and the stored envelope, unchanged, as the offer's payload
//! (it fitted the NATS server's `max_payload` when it was stored). The
//! offering replica forgets the message once it is taken; otherwise it
//! nacks it through JetStream as before. An offer whose answer is lost
//! after it was taken leaves the message with two holders: it may be
//! delivered twice (at least once, as a redelivery may be anyway).

use super::ClusterEngine;
use super::registry::key;
use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use std::time::Duration;

const GROUP: &str = "Tinybroker-Group";
const REPLY: &str = "Tinybroker-Reply";
const ATTEMPT: &str = "Tinybroker-Attempt";
const TAKEN: &[u8] = b"taken";
const REFUSED: &[u8] = b"refused";

/// The subject replica `replica` takes offered messages on.
pub fn subject(prefix: &str, replica: &str) -> String {
    format!("{prefix}.take.{}", key(replica))
}

/// What an offer carries besides the envelope, read back; None when it is
/// not a well-formed offer of a JetStream message.
fn parse(headers: Option<&async_nats::HeaderMap>) -> Option<(&str, &str, u32)> {
    let headers = headers?;
    let group = headers.get(GROUP)?.as_str();
    let reply = headers.get(REPLY)?.as_str();
    let attempt = headers.get(ATTEMPT)?.as_str().parse().ok()?;
    reply.starts_with("$JS.ACK.").then_some((group, reply, attempt))
}

impl ClusterEngine {
    /// Offers `message` of `group`, for its delivery attempt `attempt`, to
    /// `replica`; true when that replica took it (this one must then leave
    /// it alone). Waits at most `wait` for the answer.
    pub(super) async fn offer(
        &self,
        replica: &str,
        group: &str,
        message: &jetstream::Message,
        attempt: u32,
        wait: Duration,
    ) -> bool {
        let Some(reply) = message.reply.as_ref() else {
            return false;
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(GROUP, group);
        headers.insert(REPLY, reply.as_str());
        headers.insert(ATTEMPT, attempt.to_string().as_str());
        let request = async_nats::Request::new()
            .headers(headers)
            .payload(message.payload.clone())
            .timeout(Some(wait));
        match self
            .inner
            .client
            .send_request(subject(&self.inner.config.prefix, replica), request)
            .await
        {
            Ok(answer) => &answer.payload[..] == TAKEN,
            Err(error) => {
                tracing::debug!(%replica, consumer_group = group, %error, "a nacked message offered to another replica: no answer");
                false
            }
        }
    }

    /// Answers other replicas' offers (see the module's text).
    pub(super) async fn answer_offers(self, mut offers: async_nats::Subscriber, js: jetstream::Context) {
        while let Some(offer) = offers.next().await {
            let Some(answer_to) = offer.reply.clone() else { continue };
            let taken = match parse(offer.headers.as_ref()) {
                Some((group, reply, attempt)) => {
                    let message = jetstream::Message {
                        message: async_nats::Message {
                            subject: offer.subject.clone(),
                            reply: Some(reply.into()),
                            payload: offer.payload.clone(),
                            headers: None,
                            status: None,
                            description: None,
                            length: offer.payload.len(),
                        },
                        context: js.clone(),
                    };
                    self.take_offered(group, message, attempt).await
                }
                None => {
                    tracing::warn!(subject = %offer.subject, "a malformed offer of a group message was refused");
                    false
                }
            };
            let answer = Bytes::from_static(if taken { TAKEN } else { REFUSED });
            let _ = self.inner.client.publish(answer_to, answer).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An offer's headers read back as written; anything else (a missing
    /// header, a bad attempt, a reply subject that is not a JetStream
    /// handle) is refused rather than taken.
    #[test]
    fn offers_read_back_and_malformed_ones_are_refused() {
        let offer = |group: &str, reply: &str, attempt: &str| {
            let mut h = async_nats::HeaderMap::new();
            h.insert(GROUP, group);
            h.insert(REPLY, reply);
            h.insert(ATTEMPT, attempt);
            h
        };
        let good = offer("workers", "$JS.ACK.tb_g_1.tb_c.1.5.9.1.0", "3");
        assert_eq!(
            parse(Some(&good)),
            Some(("workers", "$JS.ACK.tb_g_1.tb_c.1.5.9.1.0", 3))
        );
        assert_eq!(parse(Some(&offer("w", "_INBOX.x", "3"))), None);
        assert_eq!(parse(Some(&offer("w", "$JS.ACK.a", "three"))), None);
        let mut partial = async_nats::HeaderMap::new();
        partial.insert(GROUP, "w");
        assert_eq!(parse(Some(&partial)), None);
        assert_eq!(parse(None), None);
    }
}
