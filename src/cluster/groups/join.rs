//! A member joining a group on this replica: its settings and admission
//! (the shared rules, [`crate::group::admission`], against the group
//! table), its claim on its subscription id, its hub, and the link its
//! stream keeps to that hub ([`MemberLink`]) until it leaves.

use super::hub::HubHandle;
use super::nats::Nats;
use crate::broker::ExternalMember;
use crate::cluster::registry::key;
use crate::cluster::{ClusterEngine, ClusterStream, Ready};
use crate::engine::validate;
use crate::engine::{AckMode, BrokerError, Delivery, SubscribeRequest};
use crate::group::MemberSettings;
use std::sync::Arc;

impl ClusterEngine {
    /// Opens a member of a cluster-wide group on this replica.
    pub(in crate::cluster) async fn join_group(
        &self,
        ready: &Ready,
        mut request: SubscribeRequest,
    ) -> Result<ClusterStream, BrokerError> {
        let name = request.consumer_group.clone();
        validate::group_name(&name)?;
        let patterns: Vec<String> = validate::patterns(&request.topic_patterns)?
            .iter()
            .map(|p| p.to_string())
            .collect();
        let settings = MemberSettings::of(&request, self.inner.local.limits());
        let ack_deadline = settings.ack_deadline;
        let created = self
            .fix_patterns(ready, &name, &patterns, Some(request.ack_mode))
            .await?;
        if request.subscription_id.is_empty() {
            request.subscription_id = uuid::Uuid::new_v4().to_string();
        } else {
            validate::name_field("subscription_id", &request.subscription_id)?;
        }
        let id = request.subscription_id.clone();
        let mut hub = match self.hub(ready, &name, &patterns, ack_deadline).await {
            Ok(hub) => hub,
            Err(error) => {
                // A group this join made and could not give a stream (no
                // JetStream memory left) must not stay in the table: every
                // publish to its topics would wait for a stream that is not
                // there.
                if let Some(revision) = created
                    && ready
                        .groups
                        .delete_expect_revision(key(&name), Some(revision))
                        .await
                        .is_ok()
                {
                    self.unroute_group(&name);
                }
                return Err(error);
            }
        };
        if created.is_some() {
            self.announce_group(ready, &name, &patterns).await;
        }
        // A hub this join started and never joined stops by itself (no
        // member for its linger time).
        self.claim(ready, &id).await?;
        let release = crate::cluster::Release {
            store: ready.subscriptions.clone(),
            id: id.clone(),
        };
        let member = ExternalMember {
            group: name.clone(),
            ack_mode: request.ack_mode,
        };
        let inner = self
            .inner
            .local
            .open_external(&request, settings.max_in_flight, member)?;
        // A hub stops LINGER after its last member left (or after it was
        // started, without one); if that moment fell within this join (the
        // claim above waits for NATS), join a new one: a member of a
        // stopped hub would never get a message.
        let id: Arc<str> = id.into();
        while !hub.join(id.clone(), inner.subscription().clone(), settings).await {
            hub = self.hub(ready, &name, &patterns, ack_deadline).await?;
        }
        self.inner.groups.members.lock().insert(id.clone(), hub.clone());
        Ok(ClusterStream {
            inner,
            release: Some(release),
            member: Some(MemberLink {
                hub,
                engine: self.clone(),
                id,
                ack_mode: request.ack_mode,
            }),
            _interested: None,
        })
    }

    /// The hub holding member `id`, if it is on this replica.
    pub(in crate::cluster) fn hub_of(&self, id: &str) -> Option<HubHandle<Nats>> {
        self.inner.groups.members.lock().get(id).cloned()
    }
}

/// What a member's stream needs of its hub.
pub(in crate::cluster) struct MemberLink {
    hub: HubHandle<Nats>,
    engine: ClusterEngine,
    id: Arc<str>,
    ack_mode: AckMode,
}

impl MemberLink {
    /// The member's stream took `delivery`.
    pub(in crate::cluster) fn streamed(&self, delivery: &Delivery) {
        self.hub.streamed(&self.id, self.ack_mode, delivery);
    }

    /// The member's session added credit: it may have room now.
    pub(in crate::cluster) fn credit_added(&self) {
        self.hub.credit_added();
    }
}

impl Drop for MemberLink {
    fn drop(&mut self) {
        {
            let mut members = self.engine.inner.groups.members.lock();
            if members.get(&self.id).is_some_and(|h| h.same(&self.hub)) {
                members.remove(&self.id);
            }
        }
        self.hub.leave(self.id.clone());
    }
}
