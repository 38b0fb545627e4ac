//! Opening subscriptions: broadcast ones into the trie, members into their
//! consumer group (created on first use).

use super::group::{ConsumerGroup, GroupLimits};
use super::publish::Route;
use super::subscription::{ExternalMember, Membership, QueueSlot, Subscription, SubscriptionStream};
use super::{Broker, ById};
use crate::engine::queue::Queue;
use crate::engine::validate::{self, truncate};
use crate::engine::{BrokerError, DeliveryMode, SubscribeRequest};
use crate::group::{BacklogLimits, MemberSettings};
use crate::topic::TopicPattern;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Broker {
    /// Opens a subscription. Registration is complete when this returns: every
    /// message published afterwards that matches reaches the stream.
    pub fn subscribe(&self, request: SubscribeRequest) -> Result<SubscriptionStream, BrokerError> {
        self.check_open()?;
        let patterns = validate::patterns(&request.topic_patterns)?;
        match request.mode {
            DeliveryMode::Multi if !request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(format!(
                    "consumer_group {:?} was given with DELIVERY_MODE_MULTI (broadcast); consumer groups need DELIVERY_MODE_SINGLE",
                    truncate(&request.consumer_group)
                )));
            }
            DeliveryMode::Multi => {}
            DeliveryMode::Single if request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(
                    "DELIVERY_MODE_SINGLE needs a consumer_group; it was empty".into(),
                ));
            }
            DeliveryMode::Single => validate::group_name(&request.consumer_group)?,
        }
        let id: Arc<str> = if request.subscription_id.is_empty() {
            uuid::Uuid::new_v4().to_string().into()
        } else {
            validate::name_field("subscription_id", &request.subscription_id)?;
            request.subscription_id.as_str().into()
        };
        let key = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        if request.mode == DeliveryMode::Single {
            return self.join_group(request, key, id, patterns);
        }
        let subscription = Arc::new(Subscription::new(
            key,
            id,
            patterns,
            request.peer,
            QueueSlot::Own(Queue::new(
                self.shared.limits.consumer_capacity,
                self.shared.limits.consumer_max_bytes,
            )),
            None,
        ));
        self.register(&subscription)?;
        self.add_routes(
            subscription.key,
            subscription.patterns(),
            Route::Subscription(subscription.clone()),
        );
        Ok(SubscriptionStream::new(self.clone(), subscription))
    }

    /// Opens a member of a group another engine runs (cluster mode): in the
    /// registry (ids, the subscription limit, Admin), not in the trie, with
    /// a queue of `max_in_flight` slots that engine fills. The request is
    /// validated by the caller.
    pub fn open_external(
        &self,
        request: &SubscribeRequest,
        max_in_flight: u32,
        member: ExternalMember,
    ) -> Result<SubscriptionStream, BrokerError> {
        self.check_open()?;
        let patterns = validate::patterns(&request.topic_patterns)?;
        let key = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        let mut subscription = Subscription::new(
            key,
            request.subscription_id.as_str().into(),
            patterns,
            request.peer,
            // Shared: the cluster engine's group hub holds it too.
            QueueSlot::Shared(Arc::new(
                Queue::new(max_in_flight as usize, usize::MAX).with_credit(request.credit),
            )),
            None,
        );
        subscription.set_external(member);
        let subscription = Arc::new(subscription);
        self.register(&subscription)?;
        Ok(SubscriptionStream::new(self.clone(), subscription))
    }

    /// Routes `patterns` to `route` and tells publishers' caches.
    pub(super) fn add_routes(&self, key: u64, patterns: &[TopicPattern], route: Route) {
        let mut routes = self.shared.routes.write();
        for pattern in patterns {
            routes.insert(pattern, key, route.clone());
        }
        self.shared.routes_generation.fetch_add(1, Ordering::Release);
    }

    pub(super) fn remove_routes(&self, key: u64, patterns: &[TopicPattern]) {
        let mut routes = self.shared.routes.write();
        for pattern in patterns {
            routes.remove(pattern, key);
        }
        self.shared.routes_generation.fetch_add(1, Ordering::Release);
    }

    /// Adds a subscription to the registry, enforcing unique ids and the
    /// subscription limit.
    fn register(&self, subscription: &Arc<Subscription>) -> Result<(), BrokerError> {
        {
            let mut subs = self.shared.subscriptions.lock();
            // Checked under the registry lock, so a subscription can never
            // slip in after shutdown began closing them all.
            self.check_open()?;
            if subs.contains(subscription.id()) {
                return Err(BrokerError::AlreadyExists(format!(
                    "subscription id {:?} is already open",
                    subscription.id()
                )));
            }
            let max = self.shared.limits.max_subscriptions;
            if subs.len() >= max {
                return Err(BrokerError::ResourceExhausted(format!(
                    "{} subscriptions are open, the limit is max_subscriptions {max} (TINYBROKER_MAX_SUBSCRIPTIONS)",
                    subs.len()
                )));
            }
            subs.insert(ById(subscription.clone()));
        }
        Ok(())
    }

    /// Opens a consumer-group member, creating the group on first use.
    fn join_group(
        &self,
        request: SubscribeRequest,
        key: u64,
        id: Arc<str>,
        patterns: Vec<TopicPattern>,
    ) -> Result<SubscriptionStream, BrokerError> {
        let limits = &self.shared.limits;
        let settings = MemberSettings::of(&request, limits);
        let name = request.consumer_group.as_str();
        let mut groups = self.shared.groups.lock();
        let existing = groups.get(name).cloned();
        if let Some(group) = &existing {
            group.admits(&patterns, settings.ack_mode)?;
        }
        let is_new = existing.is_none();
        let group = existing.unwrap_or_else(|| {
            Arc::new(ConsumerGroup::new(
                self.shared.next_key.fetch_add(1, Ordering::Relaxed),
                name.into(),
                patterns.clone(),
                settings.ack_mode,
                GroupLimits {
                    backlog: BacklogLimits::of(limits),
                    max_delivery_attempts: limits.max_delivery_attempts,
                },
                tokio::time::Instant::now(),
            ))
        });
        let queue = Arc::new(Queue::new(settings.max_in_flight as usize, usize::MAX).with_credit(request.credit));
        let subscription = Arc::new(Subscription::new(
            key,
            id,
            patterns,
            request.peer,
            QueueSlot::Shared(queue.clone()),
            Some(Membership {
                group: group.clone(),
                settings,
            }),
        ));
        // Registered before a new group is published, so a refused member
        // (id in use, too many subscriptions) leaves no group behind.
        self.register(&subscription)?;
        if is_new {
            self.add_routes(group.key, group.patterns(), Route::Group(group.clone()));
            groups.insert(name.into(), group.clone());
        }
        // Under the registry lock, so the idle sweep cannot remove the group
        // between the lookup and the join.
        let joined = group.join(subscription.key, queue, settings, tokio::time::Instant::now());
        debug_assert!(joined, "groups are only removed under the registry lock");
        drop(groups);
        Ok(SubscriptionStream::new(self.clone(), subscription))
    }
}
