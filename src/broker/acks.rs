//! Ack and Nack of manual-ack messages a group member holds.

use super::Broker;
use super::subscription::Subscription;
use crate::engine::validate::{self, truncate};
use crate::engine::{Acked, BrokerError, Nacked};
use std::sync::Arc;

impl Broker {
    /// Acks manual-ack messages held by a group member.
    pub fn ack(&self, subscription_id: &str, sequences: &[u64]) -> Result<Acked, BrokerError> {
        validate::ack_request("Ack", subscription_id, sequences)?;
        let subscription = self.open_subscription(subscription_id)?;
        Ok(self.ack_held(&subscription, sequences))
    }

    /// [`Broker::ack`] through the subscription itself (a session holds
    /// it): no lookup by id.
    pub(super) fn ack_held(&self, subscription: &Subscription, sequences: &[u64]) -> Acked {
        let Some(membership) = subscription.membership() else {
            // Nothing is ever in flight with a broadcast subscription.
            return Acked {
                acked: 0,
                unknown: sequences.len() as u32,
            };
        };
        membership
            .group
            .ack(subscription.key, sequences, tokio::time::Instant::now())
    }

    /// Hands manual-ack messages back for redelivery.
    pub fn nack(&self, subscription_id: &str, sequences: &[u64]) -> Result<Nacked, BrokerError> {
        validate::ack_request("Nack", subscription_id, sequences)?;
        let subscription = self.open_subscription(subscription_id)?;
        Ok(self.nack_held(&subscription, sequences))
    }

    /// [`Broker::nack`] through the subscription itself.
    pub(super) fn nack_held(&self, subscription: &Subscription, sequences: &[u64]) -> Nacked {
        let Some(membership) = subscription.membership() else {
            return Nacked {
                requeued: 0,
                unknown: sequences.len() as u32,
            };
        };
        let group = &membership.group;
        let outcome = group.nack(subscription.key, sequences, tokio::time::Instant::now());
        self.dead_letter(group.name(), outcome.dead_letters);
        outcome.nacked
    }

    /// The open subscription `id`, or NOT_FOUND naming it.
    pub(super) fn open_subscription(&self, id: &str) -> Result<Arc<Subscription>, BrokerError> {
        let subscription = self.shared.subscriptions.lock().get(id).map(|s| s.0.clone());
        subscription.ok_or_else(|| BrokerError::NotFound(format!("no open subscription with id {:?}", truncate(id))))
    }
}
