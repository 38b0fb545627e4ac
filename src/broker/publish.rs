//! Publishing: validation, the memory budget, routing to queues and
//! groups, and dead letters.

use super::close::Eviction;
use super::group::{ConsumerGroup, DeadLetter};
use super::{Broker, Subscription};
use crate::engine::queue::Push;
use crate::engine::validate::{self, truncate};
use crate::engine::{BatchOutcome, BrokerError, NewMessage, PublishOutcome, PublishTime};
use crate::engine::{Delivery, Published};
use crate::group::{backlog, dead_letter};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// A routing target of the trie.
#[derive(Clone)]
pub(super) enum Route {
    Subscription(Arc<Subscription>),
    Group(Arc<ConsumerGroup>),
}

/// A publisher's own memo of topic → routes, valid while the broker's route
/// generation is unchanged. Lets a long `PublishStream` skip the shared trie
/// (and its locks) for topics it has seen. Hashed with foldhash (randomly
/// seeded, a fraction of SipHash's cost per lookup); the cache is the
/// stream's own and bounded, so colliding topics could only slow their
/// own publisher.
#[derive(Default)]
pub struct RouteCache {
    generation: u64,
    routes: HashMap<String, Arc<[Route]>, foldhash::fast::RandomState>,
    /// Sequences set aside for the batch being published
    /// ([`Broker::set_aside_sequences`]): its messages take them in order
    /// instead of the broker-wide counter's next.
    batch_sequences: std::ops::Range<u64>,
}

impl RouteCache {
    const CAPACITY: usize = 256;

    /// Forgets the sequences a batch set aside and did not use (its
    /// messages refused after validation leave them unused).
    pub fn end_batch(&mut self) {
        self.batch_sequences = 0..0;
    }
}

/// Where a message from another cluster replica goes here
/// ([`Broker::remote_routes`]).
pub struct RemoteRoutes(Arc<[Route]>);

impl RemoteRoutes {
    /// No subscription here matches.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Broker {
    /// Validates and routes one message to every matching subscription.
    pub fn publish(&self, message: NewMessage, cache: Option<&mut RouteCache>) -> Result<PublishOutcome, BrokerError> {
        self.publish_at(message, cache, PublishTime::now())
    }

    /// [`Broker::publish`] with the publish time read by the caller, so a
    /// burst of messages received together reads the clocks once.
    pub fn publish_at(
        &self,
        message: NewMessage,
        cache: Option<&mut RouteCache>,
        at: PublishTime,
    ) -> Result<PublishOutcome, BrokerError> {
        self.check_open()?;
        let size = validate::message(&message, self.shared.limits.max_message_bytes)?;
        self.reserve(size, &message.topic)?;
        Ok(self.route(message, size, cache, at))
    }

    /// Publishes a batch (a session's `publish`) in one pass: every message
    /// validated, the memory budget charged once for all that are valid
    /// (message by message, evicting readers far behind as
    /// [`Broker::publish`] does, only when the whole does not fit), one
    /// block of consecutive sequences taken for those accepted, and each
    /// routed through `cache` (one trie look-up per distinct topic). The
    /// subscribers it reaches are woken once, at the end.
    pub fn publish_batch(&self, messages: Vec<NewMessage>, cache: &mut RouteCache, at: PublishTime) -> BatchOutcome {
        if let Err(error) = self.check_open() {
            return BatchOutcome::all_rejected(messages.len(), &error);
        }
        let _burst = crate::engine::WakeBatch::begin();
        let max = self.shared.limits.max_message_bytes;
        let mut rejected = Vec::new();
        let mut valid = Vec::with_capacity(messages.len());
        let mut total = 0usize;
        for (index, message) in messages.into_iter().enumerate() {
            match validate::message(&message, max) {
                Ok(size) => {
                    total = total.saturating_add(size);
                    valid.push((index as u32, message, size));
                }
                Err(error) => rejected.push((index as u32, error)),
            }
        }
        if !self.shared.memory.try_charge(total) {
            let mut refused = false;
            valid.retain(|(index, message, size)| match self.reserve(*size, &message.topic) {
                Ok(()) => true,
                Err(error) => {
                    rejected.push((*index, error));
                    refused = true;
                    false
                }
            });
            if refused {
                rejected.sort_unstable_by_key(|(index, _)| *index);
            }
        }
        let accepted = valid.len() as u64;
        let first = self.shared.sequence.fetch_add(accepted, Ordering::Relaxed) + 1;
        for ((_, message, size), sequence) in valid.into_iter().zip(first..) {
            self.route_as(message, size, Some(&mut *cache), at, sequence);
        }
        BatchOutcome {
            first_sequence: if accepted > 0 { first } else { 0 },
            accepted: accepted as u32,
            rejected,
        }
    }

    /// Sets aside `count` consecutive sequences for the next messages
    /// published through `cache` (a cluster batch, whose messages are
    /// routed one by one: other publishers' messages cannot take sequences
    /// between them). [`RouteCache::end_batch`] forgets what is left.
    pub fn set_aside_sequences(&self, count: usize, cache: &mut RouteCache) {
        let first = self.shared.sequence.fetch_add(count as u64, Ordering::Relaxed) + 1;
        cache.batch_sequences = first..first + count as u64;
    }

    /// Charges a new message of `size` bytes to the memory budget. When the
    /// budget is spent, first evicts the broadcast subscriptions that hold
    /// the most bytes (the readers furthest behind: evicting frees what only
    /// they hold), then refuses the message.
    fn reserve(&self, size: usize, topic: &str) -> Result<(), BrokerError> {
        const MOST_EVICTIONS_PER_MESSAGE: usize = 4;
        let memory = self.shared.memory;
        if memory.try_charge(size) {
            return Ok(());
        }
        for _ in 0..MOST_EVICTIONS_PER_MESSAGE {
            let Some((subscription, depth, bytes)) = self.fullest_broadcast_queue() else {
                break;
            };
            self.evict(&subscription, Eviction::MemoryLimit { depth, bytes });
            if memory.try_charge(size) {
                return Ok(());
            }
        }
        self.shared.stats.refused_memory_limit.fetch_add(1, Ordering::Relaxed);
        Err(BrokerError::ResourceExhausted(format!(
            "the broker's memory limit is reached: messages held for subscribers and consumer groups take {} bytes, and the message to {:?} ({size} bytes) does not fit in their share ({} bytes, 7/8) of max_memory_bytes (TINYBROKER_MAX_MEMORY_BYTES); consumer groups' backlogs hold the rest, try again once their members catch up",
            memory.used(),
            truncate(topic),
            memory.limit().unwrap_or(usize::MAX)
        )))
    }

    /// The broadcast subscription whose queue holds the most bytes (and its
    /// depth and bytes), if one holds enough to be a reader far behind: at
    /// least 1/64 of the message budget (and 1 MiB). A reader that keeps up
    /// holds next to nothing, and is never evicted because consumer groups'
    /// backlogs filled the budget.
    fn fullest_broadcast_queue(&self) -> Option<(Arc<Subscription>, usize, usize)> {
        let budget = self.shared.memory.limit().unwrap_or(usize::MAX);
        let far_behind = (budget / 64).max(1 << 20);
        let subscriptions = self.shared.subscriptions.lock();
        subscriptions
            .iter()
            .map(|s| &s.0)
            .filter(|s| s.is_broadcast())
            .map(|s| (s, s.queue.bytes()))
            .filter(|(_, bytes)| *bytes >= far_behind)
            .max_by_key(|(_, bytes)| *bytes)
            .map(|(s, bytes)| (s.clone(), s.queue_depth(), bytes))
    }

    /// Assigns the sequence and hands the message, already charged `size`
    /// bytes, to every matching subscription and group. Never waits.
    pub(super) fn route(
        &self,
        message: NewMessage,
        size: usize,
        mut cache: Option<&mut RouteCache>,
        at: PublishTime,
    ) -> PublishOutcome {
        let set_aside = cache.as_mut().and_then(|cache| cache.batch_sequences.next());
        let sequence = set_aside.unwrap_or_else(|| self.shared.sequence.fetch_add(1, Ordering::Relaxed) + 1);
        self.route_as(message, size, cache, at, sequence)
    }

    /// [`Broker::route`] with the message's sequence already taken.
    #[inline]
    fn route_as(
        &self,
        message: NewMessage,
        size: usize,
        cache: Option<&mut RouteCache>,
        at: PublishTime,
        sequence: u64,
    ) -> PublishOutcome {
        let routes = match cache {
            Some(cache) => self.routes_cached(&message.topic, cache),
            None => self.shared.routes.read().matches(&message.topic),
        };
        let published = Arc::new(Published::charged(message, sequence, at.wall, size, self.shared.memory));
        let stats = &self.shared.stats;
        stats.published.fetch_add(1, Ordering::Relaxed);
        if routes.is_empty() {
            stats.unrouted.fetch_add(1, Ordering::Relaxed);
        }
        self.fan_out(published, &routes, at)
    }

    /// The subscriptions here a message to `topic` from another cluster
    /// replica goes to, through `cache` as a publisher's routes: found
    /// before its envelope is decoded, which none needs when they are none.
    pub fn remote_routes(&self, topic: &str, cache: &mut RouteCache) -> RemoteRoutes {
        RemoteRoutes(self.routes_cached(topic, cache))
    }

    /// A message another cluster replica published (its sequence and time
    /// are the publisher's), to `routes` ([`Broker::remote_routes`] of its
    /// topic). Charged to the memory budget like a local one, after
    /// evicting readers far behind when it is spent; a message already
    /// published elsewhere is never refused here.
    pub fn deliver_remote(
        &self,
        message: NewMessage,
        sequence: u64,
        publish_time: std::time::SystemTime,
        arrived: PublishTime,
        routes: &RemoteRoutes,
    ) {
        if routes.is_empty() {
            return;
        }
        let published = self.published_elsewhere(message, sequence, publish_time);
        self.fan_out(published, &routes.0, arrived);
    }

    /// A message published elsewhere (another replica, or a cluster group's
    /// stream), charged to the memory budget like [`Broker::deliver_remote`].
    pub fn published_elsewhere(
        &self,
        message: NewMessage,
        sequence: u64,
        publish_time: std::time::SystemTime,
    ) -> Arc<Published> {
        let size = crate::engine::message_size(&message.topic, &message.payload, &message.headers);
        if self.reserve(size, &message.topic).is_err() {
            self.shared.memory.charge(size);
        }
        Arc::new(Published::charged(
            message,
            sequence,
            publish_time,
            size,
            self.shared.memory,
        ))
    }

    /// Hands a published message to each of `routes`.
    fn fan_out(&self, published: Arc<Published>, routes: &[Route], at: PublishTime) -> PublishOutcome {
        let stats = &self.shared.stats;
        let sequence = published.sequence;
        let mut outcome = PublishOutcome {
            sequence,
            matched_subscriptions: 0,
            matched_groups: 0,
        };
        for route in routes.iter() {
            match route {
                Route::Subscription(sub) => {
                    let delivery = Delivery {
                        message: published.clone(),
                        attempt: 1,
                    };
                    match sub.queue.push(delivery) {
                        Push::Queued => outcome.matched_subscriptions += 1,
                        Push::Full { depth, bytes, .. } => self.evict(sub, Eviction::QueueFull { depth, bytes }),
                        Push::Closed(_) => {}
                    }
                }
                Route::Group(group) => {
                    outcome.matched_groups += 1;
                    let dropped = group.offer(published.clone(), at.monotonic);
                    backlog::count_overflow(&stats.dropped_group_overflow, dropped);
                }
            }
        }
        outcome
    }

    /// Publishes dead letters to `_dlq.<group>`, as
    /// [`crate::group::dead_letter`] makes them (one that breaks a message
    /// limit is dropped and counted there). Runs even while shutting down.
    pub(super) fn dead_letter(&self, group: &str, letters: Vec<DeadLetter>) {
        for letter in letters {
            let original = &letter.message;
            let Some(letter) = dead_letter::letter(
                dead_letter::Original {
                    group,
                    sequence: original.sequence,
                    topic: &original.topic,
                    payload: original.payload.clone(),
                    headers: original.headers.clone(),
                    attempts: letter.attempts,
                },
                self.shared.limits.max_message_bytes,
                &self.shared.stats.dropped_dead_letter_invalid,
            ) else {
                continue;
            };
            // The original is released as the letter takes its place: charged
            // whatever the limit, so a dead letter is never lost to it.
            self.shared.memory.charge(letter.size);
            self.route(letter.message, letter.size, None, PublishTime::now());
        }
    }

    fn routes_cached(&self, topic: &str, cache: &mut RouteCache) -> Arc<[Route]> {
        let generation = self.shared.routes_generation.load(Ordering::Acquire);
        if cache.generation != generation {
            cache.routes.clear();
            cache.generation = generation;
        }
        if let Some(routes) = cache.routes.get(topic) {
            return routes.clone();
        }
        let routes = self.shared.routes.read().matches(topic);
        if cache.routes.len() >= RouteCache::CAPACITY {
            cache.routes.clear();
        }
        cache.routes.insert(topic.to_owned(), routes.clone());
        routes
    }
}
