//! One open subscription and the stream of its deliveries.

use super::queue::{CloseReason, Queue};
use super::{Broker, Delivery};
use crate::topic::TopicPattern;
use futures::Stream;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::SystemTime;

/// A subscription: its patterns, its queue, and what it has delivered.
pub struct Subscription {
    /// Key of this subscription's entries in the routing trie.
    pub(crate) key: u64,
    id: Arc<str>,
    patterns: Vec<TopicPattern>,
    peer: Option<SocketAddr>,
    opened_at: SystemTime,
    pub(crate) queue: Queue,
    delivered: AtomicU64,
    last_delivered_sequence: AtomicU64,
    /// Set once the subscription has left routing and the registry.
    pub(crate) detached: AtomicBool,
}

/// A point-in-time view for the Admin API.
#[derive(Debug, Clone)]
pub struct SubscriptionInfo {
    pub subscription_id: String,
    pub topic_patterns: Vec<String>,
    pub queue_depth: usize,
    pub capacity: usize,
    pub delivered: u64,
    pub opened_at: SystemTime,
    pub peer: Option<SocketAddr>,
}

impl Subscription {
    pub(crate) fn new(
        key: u64,
        id: Arc<str>,
        patterns: Vec<TopicPattern>,
        peer: Option<SocketAddr>,
        queue: Queue,
    ) -> Self {
        Self {
            key,
            id,
            patterns,
            peer,
            opened_at: SystemTime::now(),
            queue,
            delivered: AtomicU64::new(0),
            last_delivered_sequence: AtomicU64::new(0),
            detached: AtomicBool::new(false),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn patterns(&self) -> &[TopicPattern] {
        &self.patterns
    }

    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    pub fn opened_at(&self) -> SystemTime {
        self.opened_at
    }

    /// Messages handed to the subscriber's stream so far.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    pub fn last_delivered_sequence(&self) -> u64 {
        self.last_delivered_sequence.load(Ordering::Relaxed)
    }

    /// Live queue depth.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    pub fn capacity(&self) -> usize {
        self.queue.capacity()
    }

    pub fn info(&self) -> SubscriptionInfo {
        SubscriptionInfo {
            subscription_id: self.id.to_string(),
            topic_patterns: self.patterns.iter().map(|p| p.to_string()).collect(),
            queue_depth: self.queue_depth(),
            capacity: self.capacity(),
            delivered: self.delivered(),
            opened_at: self.opened_at,
            peer: self.peer,
        }
    }
}

/// The deliveries of one subscription, in queue order. Ends when the
/// subscription is evicted, closed by an admin, or the broker shuts down.
/// Dropping it (the client went away) closes the subscription at once.
pub struct SubscriptionStream {
    broker: Broker,
    subscription: Arc<Subscription>,
    /// Deliveries not yet added to the broker-wide counter; flushed when the
    /// queue runs dry and on drop, so busy streams don't contend on it.
    unflushed: u64,
}

impl SubscriptionStream {
    pub(crate) fn new(broker: Broker, subscription: Arc<Subscription>) -> Self {
        Self {
            broker,
            subscription,
            unflushed: 0,
        }
    }

    pub fn subscription(&self) -> &Arc<Subscription> {
        &self.subscription
    }

    pub fn id(&self) -> &str {
        self.subscription.id()
    }

    /// Why the stream ended, once it has.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.subscription.queue.close_reason()
    }

    fn flush_delivered(&mut self) {
        if self.unflushed > 0 {
            self.broker
                .stats()
                .delivered_broadcast
                .fetch_add(self.unflushed, Ordering::Relaxed);
            self.unflushed = 0;
        }
    }
}

impl Stream for SubscriptionStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        const FLUSH_EVERY: u64 = 256;
        let polled = self.subscription.queue.poll_pop(cx);
        match &polled {
            Poll::Ready(Some(delivery)) => {
                let sub = &self.subscription;
                sub.delivered.fetch_add(1, Ordering::Relaxed);
                sub.last_delivered_sequence
                    .store(delivery.message.sequence, Ordering::Relaxed);
                self.unflushed += 1;
                if self.unflushed >= FLUSH_EVERY {
                    self.flush_delivered();
                }
            }
            Poll::Ready(None) | Poll::Pending => self.flush_delivered(),
        }
        polled
    }
}

impl Drop for SubscriptionStream {
    fn drop(&mut self) {
        self.flush_delivered();
        self.broker.close_on_drop(&self.subscription);
    }
}
