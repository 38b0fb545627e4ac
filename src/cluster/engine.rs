//! The cluster engine's [`Engine`] implementation, and the calls it
//! answers for the subscriptions this replica serves.

use super::registry::{Release, key};
use super::{ClusterEngine, ClusterStream, Ready, rpc};
use crate::broker::RouteCache;
use crate::config::Limits;
use crate::engine::validate::truncate;
use crate::engine::{
    Acked, BatchOutcome, BrokerError, ClusterInfo, Confirmation, Counters, DeliveryMode, Engine, EngineHealth,
    EngineInfo, EvictionRecord, GroupInfo, Nacked, NatsStatus, NewMessage, Peaks, PublishOutcome, PublishTime,
    Snapshot, SubscribeRequest, SubscriptionInfo,
};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;

impl ClusterEngine {
    /// Ack of a subscription this replica serves: a cluster group's member
    /// through its hub, else the local engine (broadcast: all unknown).
    pub(super) async fn ack_here(&self, id: &str, sequences: &[u64]) -> Result<Acked, BrokerError> {
        match self.hub_of(id) {
            Some(hub) => Ok(hub.ack(id, sequences).await),
            None => self.inner.local.ack(id, sequences),
        }
    }

    pub(super) async fn nack_here(&self, id: &str, sequences: &[u64]) -> Result<Nacked, BrokerError> {
        match self.hub_of(id) {
            Some(hub) => Ok(hub.nack(id, sequences).await),
            None => self.inner.local.nack(id, sequences),
        }
    }

    /// Every group of the cluster: the table, each replica's part, and
    /// each group's backlog.
    pub(super) async fn list_groups_now(&self, ready: &Ready) -> Vec<GroupInfo> {
        self.list_groups_all(ready).await.0
    }

    /// [`ClusterEngine::list_groups_now`], and whether every live replica
    /// answered (so that a group listed without members has none).
    pub(super) async fn list_groups_all(&self, ready: &Ready) -> (Vec<GroupInfo>, bool) {
        let mut parts = Vec::new();
        let (answers, complete) = self.gather_all(ready, rpc::Call::ListGroups).await;
        for answer in answers {
            if let rpc::Answer::Groups(mut list) = answer {
                parts.append(&mut list);
            }
        }
        (self.cluster_groups(ready, parts).await, complete)
    }

    /// A subscription opened here, or UNAVAILABLE at once when NATS does
    /// not answer, or as soon as it is found not to while the open waits
    /// on it (`liveness.rs`).
    pub(super) async fn subscribe_cluster(&self, request: SubscribeRequest) -> Result<ClusterStream, BrokerError> {
        let ready = self.serving()?;
        self.unless_cut_off(self.subscribe_ready(ready, request))
            .await
            .unwrap_or_else(|| Err(self.cut_off("the subscription was not opened")))
    }

    pub(super) async fn subscribe_ready(
        &self,
        ready: Arc<Ready>,
        request: SubscribeRequest,
    ) -> Result<ClusterStream, BrokerError> {
        match request.mode {
            DeliveryMode::Single if request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(
                    "DELIVERY_MODE_SINGLE needs a consumer_group; it was empty".into(),
                ));
            }
            DeliveryMode::Single => return self.join_group(&ready, request).await,
            DeliveryMode::Multi if !request.consumer_group.is_empty() => {
                return Err(BrokerError::InvalidArgument(format!(
                    "consumer_group {:?} was given with DELIVERY_MODE_MULTI (broadcast); consumer groups need DELIVERY_MODE_SINGLE",
                    truncate(&request.consumer_group)
                )));
            }
            DeliveryMode::Multi => {}
        }
        let mut request = request;
        if request.subscription_id.is_empty() {
            request.subscription_id = uuid::Uuid::new_v4().to_string();
        } else {
            crate::engine::validate::name_field("subscription_id", &request.subscription_id)?;
        }
        crate::engine::validate::patterns(&request.topic_patterns)?;
        let id = request.subscription_id.clone();
        self.claim(&ready, &id).await?;
        let release = Release {
            store: ready.subscriptions.clone(),
            id: id.clone(),
        };
        // Every replica sends its publishes on core NATS before this
        // subscription's response headers go out.
        let interested = self.interested().await;
        let inner = self.inner.local.subscribe(request)?;
        Ok(ClusterStream {
            inner,
            release: Some(release),
            member: None,
            _interested: Some(interested),
        })
    }
}

impl Engine for ClusterEngine {
    type Publisher = RouteCache;
    type Stream = ClusterStream;

    fn limits(&self) -> &Limits {
        self.inner.local.limits()
    }

    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes.load(Ordering::Relaxed)
    }

    fn sequence_scope(&self) -> crate::engine::SequenceScope {
        crate::engine::SequenceScope::Replica
    }

    fn publish(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = Result<PublishOutcome, BrokerError>> + Send {
        self.publish_cluster(message, publisher, at)
    }

    fn publish_routed(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = Result<(PublishOutcome, Option<Confirmation>), BrokerError>> + Send {
        self.publish_cluster_routed(message, publisher, at)
    }

    fn publish_batch(
        &self,
        messages: Vec<NewMessage>,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = BatchOutcome> + Send {
        self.publish_cluster_batch(messages, publisher, at)
    }

    fn subscribe(&self, request: SubscribeRequest) -> impl Future<Output = Result<ClusterStream, BrokerError>> + Send {
        self.subscribe_cluster(request)
    }

    async fn ack(&self, subscription_id: &str, sequences: &[u64]) -> Result<Acked, BrokerError> {
        crate::engine::validate::ack_request("Ack", subscription_id, sequences)?;
        let call = || rpc::Call::Ack {
            id: subscription_id.to_owned(),
            sequences: sequences.to_vec(),
        };
        let here = self.ack_here(subscription_id, sequences).await;
        self.here_or_forwarded(subscription_id, here, call, |answer| match answer {
            rpc::Answer::Acked(acked) => Ok(acked),
            other => Err(other),
        })
        .await
    }

    async fn nack(&self, subscription_id: &str, sequences: &[u64]) -> Result<Nacked, BrokerError> {
        crate::engine::validate::ack_request("Nack", subscription_id, sequences)?;
        let call = || rpc::Call::Nack {
            id: subscription_id.to_owned(),
            sequences: sequences.to_vec(),
        };
        let here = self.nack_here(subscription_id, sequences).await;
        self.here_or_forwarded(subscription_id, here, call, |answer| match answer {
            rpc::Answer::Nacked(nacked) => Ok(nacked),
            other => Err(other),
        })
        .await
    }

    async fn close_subscription(&self, subscription_id: &str) -> Result<(), BrokerError> {
        let call = || rpc::Call::Close {
            id: subscription_id.to_owned(),
        };
        let here = self.inner.local.close_subscription(subscription_id);
        self.here_or_forwarded(subscription_id, here, call, |answer| match answer {
            rpc::Answer::Closed => Ok(()),
            other => Err(other),
        })
        .await
    }

    async fn list_subscriptions(&self) -> Result<Vec<SubscriptionInfo>, BrokerError> {
        let ready = self.serving()?;
        let mut all = Vec::new();
        for answer in self.gather(&ready, rpc::Call::ListSubscriptions).await {
            if let rpc::Answer::Subscriptions(mut list) = answer {
                all.append(&mut list);
            }
        }
        all.sort_by(|a, b| {
            a.opened_at
                .cmp(&b.opened_at)
                .then_with(|| a.subscription_id.cmp(&b.subscription_id))
        });
        Ok(all)
    }

    async fn list_groups(&self) -> Result<Vec<GroupInfo>, BrokerError> {
        let ready = self.serving()?;
        Ok(self.list_groups_now(&ready).await)
    }

    async fn list_evictions(&self) -> Result<Vec<EvictionRecord>, BrokerError> {
        let ready = self.serving()?;
        let mut all = Vec::new();
        for answer in self.gather(&ready, rpc::Call::ListEvictions).await {
            if let rpc::Answer::Evictions(mut list) = answer {
                all.append(&mut list);
            }
        }
        all.sort_by_key(|e| std::cmp::Reverse(e.evicted_at));
        all.truncate(crate::broker::EVICTION_HISTORY);
        Ok(all)
    }

    async fn info(&self) -> Result<EngineInfo, BrokerError> {
        let mut info = self.inner.local.info();
        let connected = self.inner.connected.load(Ordering::Acquire);
        info.cluster = Some(ClusterInfo {
            replica_id: self.inner.config.replica_id.clone(),
            nats_server: if connected { self.nats_server() } else { String::new() },
        });
        Ok(info)
    }

    /// This replica's own (the snapshot's counters are too).
    fn counters(&self) -> Counters {
        self.inner.local.counters()
    }

    fn snapshot(&self, peaks: Peaks) -> Snapshot {
        let mut snapshot = self.inner.local.snapshot(peaks);
        self.fill_unacked(&mut snapshot.subscriptions);
        // Gauges cluster-wide (the last gathering), counters this
        // replica's own: summed over the replicas, they are the cluster's.
        let mut groups = self.inner.groups_seen.lock().clone();
        let parts = self.local_groups();
        for group in &mut groups {
            let part = parts.iter().find(|p| p.name == group.name);
            group.redeliveries = part.map_or(0, |p| p.redeliveries);
            group.dead_lettered = part.map_or(0, |p| p.dead_lettered);
            group.acked = part.map_or(0, |p| p.acked);
            group.delivered = part.map_or(0, |p| p.delivered);
            group.dropped = part.map_or(0, |p| p.dropped);
        }
        snapshot.groups = groups;
        snapshot.nats = Some(NatsStatus {
            // Connected, and answering over the connection.
            connected: self.inner.connected.load(Ordering::Acquire) && self.inner.liveness.answering(),
            reconnects: self.inner.reconnects.load(Ordering::Relaxed),
            slow_consumer_dropped: self.inner.slow_consumer_dropped.load(Ordering::Relaxed),
            state_lost: self.inner.state_lost.load(Ordering::Relaxed),
            unreachable_dropped: self.inner.liveness.late_dropped(),
        });
        snapshot
    }

    fn health(&self) -> watch::Receiver<EngineHealth> {
        self.inner.health.subscribe()
    }

    fn draining(&self) -> impl Future<Output = ()> + Send + 'static {
        self.inner.local.draining()
    }

    fn begin_shutdown(&self) {
        self.inner.local.begin_shutdown();
        self.stop_pulling();
    }

    fn drainable(&self) -> usize {
        self.inner.local.drainable()
    }

    /// Only what broadcast subscribers here had queued: what members
    /// here held went back to JetStream (`maintain`, before this), and the
    /// backlogs stay in JetStream for the other replicas.
    fn close_all(&self) -> crate::engine::Discarded {
        self.inner.local.close_all()
    }

    async fn maintain(self, stop: impl Future<Output = ()> + Send + 'static) {
        self.inner.local.clone().maintain(stop).await;
        // The grace period is over: what members here still hold goes back
        // to their groups now, before the process exits (a nak left to a
        // member's stream closing, later, could be lost with the process,
        // and the message would wait for the consumer's ack_wait).
        self.hand_back_groups().await;
        // Leave the cluster: this replica's ids are released as its streams
        // end; say it is gone, and flush what is unsent.
        // Bounded: with NATS unreachable, shutdown must not wait for it.
        const LEAVE_TIMEOUT: Duration = Duration::from_secs(1);
        let ready = self.inner.ready.lock().clone();
        if let Some(ready) = ready {
            let id = key(&self.inner.config.replica_id);
            let _ = tokio::time::timeout(LEAVE_TIMEOUT, ready.replicas.delete(id)).await;
        }
        let flushed = tokio::time::timeout(LEAVE_TIMEOUT, async {
            // What the sender has not handed to the client yet first.
            self.inner.outbox.emptied().await;
            self.inner.client.flush().await
        })
        .await;
        if flushed.is_err() {
            // NATS did not take it in time: what is still in the outbox
            // dies with the process, a gap the other replicas may never
            // see (nothing after it comes from this replica). Counted;
            // what the NATS client itself still buffers cannot be.
            let unsent = self.inner.outbox.unsent();
            self.inner.local.count_discarded_on_shutdown(unsent);
            tracing::warn!(
                unsent_broadcasts = unsent,
                "NATS did not take this replica's broadcasts within {} s of leaving: {unsent} broadcast messages for the other replicas, accepted and not yet handed to the NATS client, are discarded (counted in tinybroker_messages_discarded_on_shutdown_total); what the NATS client still buffered is lost uncounted",
                LEAVE_TIMEOUT.as_secs()
            );
        }
    }
}
