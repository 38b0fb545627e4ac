//! Calls between replicas: a NATS request to `<prefix>.rpc.<replica>`,
//! JSON both ways. Used for what only the serving replica can answer: Ack,
//! Nack and CloseSubscription of its subscriptions, and its part of the
//! Admin listings.

use super::{RPC_TIMEOUT, key};
use crate::engine::{Acked, BrokerError, EvictionRecord, Nacked, SubscriptionInfo};
use serde::{Deserialize, Serialize};

/// The subject replica `replica` answers calls on.
pub fn subject(prefix: &str, replica: &str) -> String {
    format!("{prefix}.rpc.{}", key(replica))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum Call {
    Ping,
    Ack {
        id: String,
        sequences: Vec<u64>,
    },
    Nack {
        id: String,
        sequences: Vec<u64>,
    },
    Close {
        id: String,
    },
    ListSubscriptions,
    ListEvictions,
    ListGroups,
    /// A group just made by the calling replica: route it now.
    RouteGroup {
        name: String,
        patterns: Vec<String>,
    },
    /// Whether the calling replica has broadcast subscriptions
    /// (`interest.rs`); answered with a pong.
    Interest {
        replica: String,
        version: super::interest::Version,
        some: bool,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "answer", content = "value", rename_all = "snake_case")]
pub enum Answer {
    Pong,
    Acked(Acked),
    Nacked(Nacked),
    Closed,
    Subscriptions(Vec<SubscriptionInfo>),
    Evictions(Vec<EvictionRecord>),
    Groups(Vec<super::groups::LocalGroup>),
    Routed,
    Error(WireError),
}

impl Answer {
    /// An answer that is not the one the call expects.
    pub fn into_error(self) -> BrokerError {
        match self {
            Answer::Error(e) => e.into(),
            other => BrokerError::Unavailable(format!("a replica gave an unexpected answer: {other:?}")),
        }
    }
}

/// A [`BrokerError`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireError {
    code: String,
    message: String,
}

impl From<BrokerError> for WireError {
    fn from(error: BrokerError) -> Self {
        let code = match &error {
            BrokerError::InvalidArgument(_) => "invalid_argument",
            BrokerError::FailedPrecondition(_) => "failed_precondition",
            BrokerError::AlreadyExists(_) => "already_exists",
            BrokerError::NotFound(_) => "not_found",
            BrokerError::ResourceExhausted(_) => "resource_exhausted",
            BrokerError::Unavailable(_) => "unavailable",
        };
        WireError {
            code: code.into(),
            message: error.to_string(),
        }
    }
}

impl From<WireError> for BrokerError {
    fn from(e: WireError) -> Self {
        match e.code.as_str() {
            "invalid_argument" => BrokerError::InvalidArgument(e.message),
            "failed_precondition" => BrokerError::FailedPrecondition(e.message),
            "already_exists" => BrokerError::AlreadyExists(e.message),
            "not_found" => BrokerError::NotFound(e.message),
            "resource_exhausted" => BrokerError::ResourceExhausted(e.message),
            _ => BrokerError::Unavailable(e.message),
        }
    }
}

/// Sends `call` to `replica` and waits (at most [`RPC_TIMEOUT`]) for its answer.
pub async fn call(
    client: &async_nats::Client,
    prefix: &str,
    replica: &str,
    call: &Call,
) -> Result<Answer, BrokerError> {
    call_within(client, prefix, replica, call, RPC_TIMEOUT).await
}

/// [`call`], waiting at most `timeout`.
pub async fn call_within(
    client: &async_nats::Client,
    prefix: &str,
    replica: &str,
    call: &Call,
    timeout: std::time::Duration,
) -> Result<Answer, BrokerError> {
    let body = serde_json::to_vec(call).map_err(|e| BrokerError::Unavailable(e.to_string()))?;
    let request = async_nats::Request::new().payload(body.into()).timeout(Some(timeout));
    let reply = client
        .send_request(subject(prefix, replica), request)
        .await
        .map_err(|e| BrokerError::Unavailable(format!("replica {replica} did not answer: {e}")))?;
    serde_json::from_slice(&reply.payload)
        .map_err(|e| BrokerError::Unavailable(format!("replica {replica} answered something undecodable: {e}")))
}

// === both ends of a call ===

use super::{ClusterEngine, Ready};
use crate::engine::Peaks;
use futures::StreamExt;

impl ClusterEngine {
    /// Answers calls forwarded by other replicas.
    pub(super) async fn answer(self, mut calls: async_nats::Subscriber) {
        while let Some(request) = calls.next().await {
            let Some(reply) = request.reply.clone() else { continue };
            let engine = self.clone();
            tokio::spawn(async move {
                let answer = match serde_json::from_slice::<Call>(&request.payload) {
                    Ok(call) => engine.answer_one(call).await,
                    Err(e) => Answer::Error(WireError::from(BrokerError::InvalidArgument(format!(
                        "undecodable forwarded call: {e}"
                    )))),
                };
                let body = serde_json::to_vec(&answer).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "bug: a forwarded call's answer cannot be encoded");
                    let error = Answer::Error(WireError::from(BrokerError::Unavailable(format!(
                        "the replica could not encode its answer: {e}"
                    ))));
                    serde_json::to_vec(&error).unwrap_or_default()
                });
                let _ = engine.inner.client.publish(reply, body.into()).await;
            });
        }
    }

    pub(super) async fn answer_one(&self, call: Call) -> Answer {
        let local = &self.inner.local;
        let result = match call {
            Call::Ping => Ok(Answer::Pong),
            Call::Ack { id, sequences } => self.ack_here(&id, &sequences).await.map(Answer::Acked),
            Call::Nack { id, sequences } => self.nack_here(&id, &sequences).await.map(Answer::Nacked),
            Call::Close { id } => local.close_subscription(&id).map(|()| Answer::Closed),
            Call::ListSubscriptions => Ok(Answer::Subscriptions(local.subscriptions(Peaks::Keep))),
            Call::ListEvictions => Ok(Answer::Evictions(local.evictions())),
            Call::ListGroups => Ok(Answer::Groups(self.local_groups())),
            Call::RouteGroup { name, patterns } => {
                self.route_group(&name, patterns);
                Ok(Answer::Routed)
            }
            Call::Interest { replica, version, some } => {
                self.noted_interest(&replica, version, some);
                Ok(Answer::Pong)
            }
        };
        result.unwrap_or_else(|e| Answer::Error(e.into()))
    }

    /// Sends `call` to the replica serving subscription `id`, when that is
    /// another live replica; None when no replica serves it.
    pub(super) async fn forward(&self, ready: &Ready, id: &str, call: Call) -> Result<Option<Answer>, BrokerError> {
        let Some(owner) = self.owner(ready, id).await? else {
            return Ok(None);
        };
        if owner == self.inner.config.replica_id || !self.is_live(ready, &owner).await {
            return Ok(None);
        }
        self::call(&self.inner.client, &self.inner.config.prefix, &owner, &call)
            .await
            .map(Some)
    }

    /// Gathers `call`'s answers from every live replica.
    pub(super) async fn gather(&self, ready: &Ready, call: Call) -> Vec<Answer> {
        self.gather_all(ready, call).await.0
    }

    /// [`ClusterEngine::gather`], and whether every live replica answered.
    pub(super) async fn gather_all(&self, ready: &Ready, call: Call) -> (Vec<Answer>, bool) {
        let replicas = self.live_replicas(ready).await;
        let calls = replicas.iter().map(|replica| {
            let call = call.clone();
            async move {
                if *replica == self.inner.config.replica_id {
                    return Some(self.answer_one(call).await);
                }
                match self::call(&self.inner.client, &self.inner.config.prefix, replica, &call).await {
                    Ok(answer) => Some(answer),
                    Err(error) => {
                        tracing::warn!(replica = %replica, %error, "replica left out of an Admin listing: it did not answer");
                        None
                    }
                }
            }
        });
        let answers: Vec<Answer> = futures::future::join_all(calls).await.into_iter().flatten().collect();
        let complete = answers.len() == replicas.len();
        (answers, complete)
    }

    /// `here`, what this replica answered about subscription `id`, unless it
    /// does not serve it: then the answer of the replica that does, to
    /// `call()`, picked by `pick` (NOT_FOUND when no live replica serves it).
    pub(super) async fn here_or_forwarded<T>(
        &self,
        id: &str,
        here: Result<T, BrokerError>,
        call: impl FnOnce() -> Call,
        pick: impl FnOnce(Answer) -> Result<T, Answer>,
    ) -> Result<T, BrokerError> {
        let Err(BrokerError::NotFound(not_here)) = here else {
            return here;
        };
        let ready = self.serving()?;
        match self.forward(&ready, id, call()).await? {
            Some(answer) => pick(answer).map_err(Answer::into_error),
            None => Err(BrokerError::NotFound(not_here)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{DeliveryMode, SubscriptionInfo};
    use std::time::SystemTime;

    /// Every answer survives the wire (an internally tagged enum cannot
    /// carry a list, which once made listings silently empty).
    #[test]
    fn calls_and_answers_round_trip() {
        let info = SubscriptionInfo {
            subscription_id: "s".into(),
            mode: DeliveryMode::Multi,
            consumer_group: String::new(),
            ack_mode: None,
            topic_patterns: vec!["a.>".into()],
            queue_depth: 1,
            queue_peak: 2,
            capacity: 3,
            delivered: 4,
            opened_at: SystemTime::UNIX_EPOCH,
            peer: Some("127.0.0.1:5".parse().unwrap()),
            replica_id: "r".into(),
        };
        let answers = [
            Answer::Pong,
            Answer::Acked(Acked { acked: 1, unknown: 2 }),
            Answer::Nacked(Nacked {
                requeued: 1,
                unknown: 0,
            }),
            Answer::Closed,
            Answer::Routed,
            Answer::Subscriptions(vec![info]),
            Answer::Evictions(Vec::new()),
            Answer::Error(BrokerError::NotFound("no s".into()).into()),
        ];
        for answer in answers {
            let wire = serde_json::to_vec(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"));
            let back: Answer = serde_json::from_slice(&wire).unwrap();
            assert_eq!(format!("{back:?}"), format!("{answer:?}"));
        }
        let call = Call::Ack {
            id: "s".into(),
            sequences: vec![1, 2],
        };
        let back: Call = serde_json::from_slice(&serde_json::to_vec(&call).unwrap()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{call:?}"));
    }
}
