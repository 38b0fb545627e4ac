//! The embedded engine behind the seam: every call is answered in this
//! process, so each future is ready when returned.

use super::subscription::SubscriptionStream;
use super::{Broker, RouteCache};
use crate::config::Limits;
use crate::engine::{
    Acked, BatchOutcome, BrokerError, CloseReason, Counters, DeliveryStream, Engine, EngineHealth, EngineInfo,
    EvictionRecord, GroupInfo, Nacked, NewMessage, Peaks, PublishOutcome, PublishTime, Snapshot, StreamEnd,
    SubscribeRequest, SubscriptionInfo,
};
use std::future::{Future, ready};

impl Engine for Broker {
    type Publisher = RouteCache;
    type Stream = SubscriptionStream;

    fn limits(&self) -> &Limits {
        Broker::limits(self)
    }

    fn publish(
        &self,
        message: NewMessage,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = Result<PublishOutcome, BrokerError>> + Send {
        ready(self.publish_at(message, Some(publisher), at))
    }

    fn publish_batch(
        &self,
        messages: Vec<NewMessage>,
        publisher: &mut RouteCache,
        at: PublishTime,
    ) -> impl Future<Output = BatchOutcome> + Send {
        ready(Broker::publish_batch(self, messages, publisher, at))
    }

    fn subscribe(
        &self,
        request: SubscribeRequest,
    ) -> impl Future<Output = Result<SubscriptionStream, BrokerError>> + Send {
        ready(Broker::subscribe(self, request))
    }

    fn ack(&self, subscription_id: &str, sequences: &[u64]) -> impl Future<Output = Result<Acked, BrokerError>> + Send {
        ready(Broker::ack(self, subscription_id, sequences))
    }

    fn nack(
        &self,
        subscription_id: &str,
        sequences: &[u64],
    ) -> impl Future<Output = Result<Nacked, BrokerError>> + Send {
        ready(Broker::nack(self, subscription_id, sequences))
    }

    fn close_subscription(&self, subscription_id: &str) -> impl Future<Output = Result<(), BrokerError>> + Send {
        ready(Broker::close_subscription(self, subscription_id))
    }

    fn list_subscriptions(&self) -> impl Future<Output = Result<Vec<SubscriptionInfo>, BrokerError>> + Send {
        ready(Ok(self.subscriptions(Peaks::Keep)))
    }

    fn list_groups(&self) -> impl Future<Output = Result<Vec<GroupInfo>, BrokerError>> + Send {
        ready(Ok(self.groups()))
    }

    fn list_evictions(&self) -> impl Future<Output = Result<Vec<EvictionRecord>, BrokerError>> + Send {
        ready(Ok(self.evictions()))
    }

    fn info(&self) -> impl Future<Output = Result<EngineInfo, BrokerError>> + Send {
        ready(Ok(Broker::info(self)))
    }

    fn counters(&self) -> Counters {
        Broker::counters(self)
    }

    fn snapshot(&self, peaks: Peaks) -> Snapshot {
        Broker::snapshot(self, peaks)
    }

    fn health(&self) -> tokio::sync::watch::Receiver<EngineHealth> {
        // Always serving: the sender is dropped, the value stays.
        tokio::sync::watch::channel(EngineHealth::Serving).1
    }

    fn draining(&self) -> impl Future<Output = ()> + Send + 'static {
        Broker::draining(self)
    }

    fn begin_shutdown(&self) {
        Broker::begin_shutdown(self)
    }

    fn drainable(&self) -> usize {
        Broker::drainable(self)
    }

    fn close_all(&self) -> crate::engine::Discarded {
        Broker::close_all(self)
    }

    fn maintain(self, stop: impl Future<Output = ()> + Send + 'static) -> impl Future<Output = ()> + Send + 'static {
        Broker::maintain(self, stop)
    }
}

impl DeliveryStream for SubscriptionStream {
    fn id(&self) -> &str {
        SubscriptionStream::id(self)
    }

    fn consumer_group(&self) -> Option<&str> {
        self.subscription().consumer_group()
    }

    fn end(&self) -> Option<StreamEnd> {
        let subscription = self.subscription();
        subscription.close_reason().map(|reason| StreamEnd {
            reason,
            dropped: subscription.dropped_at_close(),
            last_sequence: subscription.last_delivered_sequence(),
        })
    }

    fn poll_ended(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.subscription().queue.poll_closed(cx)
    }

    fn poll_next_drained(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<(crate::engine::Delivery, bool)>> {
        self.poll_delivery(cx, true)
    }

    fn add_credit(&mut self, messages: u64) {
        let subscription = self.subscription();
        subscription.queue.add_credit(messages);
        if let Some(m) = subscription.membership() {
            m.group.credit_added(tokio::time::Instant::now());
        }
    }

    fn settle(&mut self, sequences: &[u64], nack: bool) -> Option<u32> {
        Some(SubscriptionStream::settle(self, sequences, nack))
    }

    fn close(&mut self) -> StreamEnd {
        SubscriptionStream::close(self);
        self.end().unwrap_or(StreamEnd {
            reason: CloseReason::Cancelled,
            dropped: 0,
            last_sequence: self.subscription().last_delivered_sequence(),
        })
    }
}
