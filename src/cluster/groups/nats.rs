//! The hub's [`Backend`] over async-nats: pulls from the group's durable
//! consumer, the acks, naks, progress reports and terms of the JetStream
//! messages it holds, dead letters, offers to the other replicas
//! (`handover.rs`), and the repair of a group whose stream or consumer went
//! missing.

use super::super::ClusterEngine;
use super::hub::{Backend, HubHandle, PULL_EXPIRES, Pull, Pulling};
use super::state::{Outbound, Pulled};
use crate::engine::{AckMode, BrokerError};
use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::StreamExt;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// How often a hub whose pulls fail makes sure its stream and consumer
/// exist.
const HEAL_EVERY: Duration = Duration::from_secs(2);
/// How long offering nacked messages to other replicas may take in all
/// (then the rest is nacked through JetStream): well within the shortest
/// `ack_wait` (2 s), which no one renews meanwhile.
const OFFERS_FOR_AT_MOST: Duration = Duration::from_millis(600);

/// One group's JetStream, as its hub on this replica uses it.
pub(crate) struct Nats {
    engine: ClusterEngine,
    name: String,
    /// The group's patterns, to write the table again if the group was
    /// removed under its members ([`Nats::heal`]).
    patterns: Vec<String>,
    js: jetstream::Context,
    /// Replaced by a repair, or after NATS lost its state. A leaf lock.
    consumer: Mutex<jetstream::consumer::PullConsumer>,
    /// When [`Nats::heal`] last ran. A leaf lock.
    healed_at: Mutex<Instant>,
    /// The consumer's `ack_wait`: JetStream redelivers a message not acked
    /// or progressed for this long (a replica that died).
    pub(crate) ack_wait: Duration,
    /// Turns the replica a nacked message is offered to first.
    offers: AtomicUsize,
}

impl Nats {
    pub(crate) fn new(
        engine: ClusterEngine,
        name: &str,
        patterns: &[String],
        js: jetstream::Context,
        consumer: jetstream::consumer::PullConsumer,
    ) -> Self {
        let ack_wait = consumer.cached_info().config.ack_wait;
        Self {
            engine,
            name: name.to_owned(),
            patterns: patterns.to_vec(),
            js,
            consumer: Mutex::new(consumer),
            healed_at: Mutex::new(Instant::now()),
            ack_wait,
            offers: AtomicUsize::new(0),
        }
    }

    /// Pulls from `consumer` from now on.
    pub(crate) fn set_consumer(&self, consumer: jetstream::consumer::PullConsumer) {
        *self.consumer.lock() = consumer;
    }

    /// After a failed pull, at most every [`HEAL_EVERY`]: while the hub has
    /// members, makes sure its group is in the table and its stream and
    /// consumer exist (a group removed as idle by another replica just as a
    /// member joined here, or a stream lost with its servers), and pulls
    /// from that consumer from now on. Idempotent when all is there.
    async fn heal(&self, members: usize, ack_mode: Option<AckMode>) {
        {
            let mut healed_at = self.healed_at.lock();
            if healed_at.elapsed() < HEAL_EVERY || members == 0 {
                return;
            }
            *healed_at = Instant::now();
        }
        let Some(ready) = self.engine.inner.ready.lock().clone() else {
            return;
        };
        let healed = async {
            let created = self
                .engine
                .fix_patterns(&ready, &self.name, &self.patterns, ack_mode)
                .await?;
            let consumer = self.engine.group_consumer(&ready, &self.name, self.ack_wait).await?;
            Ok::<_, BrokerError>((created, consumer))
        };
        match healed.await {
            Ok((created, consumer)) => {
                self.set_consumer(consumer);
                if created.is_some() {
                    self.engine.announce_group(&ready, &self.name, &self.patterns).await;
                }
            }
            Err(error) => tracing::debug!(group = %self.name, %error, "group stream not checked"),
        }
    }

    /// Hands messages back to JetStream for redelivery at once, in the
    /// order given (lowest sequence first: JetStream redelivers in the
    /// order of the naks, so the backlog's front is in sequence order as
    /// the contract says), after writing down how far each ran ahead of
    /// JetStream's count.
    async fn nak(&self, messages: Vec<(jetstream::Message, u32)>) {
        self.engine
            .remember_attempts(messages.iter().map(|(m, attempt)| (m, *attempt)))
            .await;
        for (message, _) in messages {
            let _ = message.ack_with(AckKind::Nak(None)).await;
        }
    }

    /// Nacked messages no other member here has room for: offered to the
    /// other live replicas in turn (a member there with room takes the
    /// JetStream message itself, [`ClusterEngine::take_offered`]); what none
    /// takes goes back through JetStream, to whichever member pulls first,
    /// the one that nacked it included.
    async fn offer(&self, held: Vec<(jetstream::Message, u32)>) {
        let engine = &self.engine;
        let me = &engine.inner.config.replica_id;
        let mut others = engine.inner.live.lock().clone();
        others.retain(|r| r != me);
        // Alone at the last heartbeat: a replica started since is not
        // known yet; the registry says.
        let ready = engine.inner.ready.lock().clone();
        if others.is_empty()
            && let Some(ready) = ready
        {
            others = engine.live_replicas(&ready).await;
            others.retain(|r| r != me);
        }
        // A replica that refused one has no room now: not asked again for
        // the rest of these.
        let mut refused = vec![false; others.len()];
        let until = Instant::now() + OFFERS_FOR_AT_MOST;
        let mut left = Vec::new();
        for (message, attempt) in held {
            let first = self.offers.fetch_add(1, Ordering::Relaxed);
            let mut taken = false;
            for i in 0..others.len() {
                let at = (first + i) % others.len();
                if refused[at] {
                    continue;
                }
                if Instant::now() >= until || engine.inner.groups.closing.is_cancelled() {
                    break;
                }
                let wait = until.saturating_duration_since(Instant::now());
                if engine.offer(&others[at], &self.name, &message, attempt + 1, wait).await {
                    taken = true;
                    break;
                }
                refused[at] = true;
            }
            if !taken {
                left.push((message, attempt));
            }
        }
        self.nak(left).await;
    }
}

/// What a group message (the publishing replica's envelope) gives the
/// members; None when it does not decode.
pub(crate) fn published(engine: &ClusterEngine, message: &jetstream::Message) -> Option<Arc<crate::engine::Published>> {
    let m = super::super::wire::decode(message.payload.clone()).ok()?;
    let (new_message, sequence, publish_time) = super::super::wire::from_envelope(m);
    Some(
        engine
            .inner
            .local
            .published_elsewhere(new_message, sequence, publish_time),
    )
}

impl Backend for Nats {
    type Message = jetstream::Message;
    type Pull = NatsPull;

    async fn pull(&self, messages: usize) -> Result<NatsPull, String> {
        let consumer = self.consumer.lock().clone();
        NatsPull::start(self, consumer, messages)
            .await
            .map_err(|e| e.to_string())
    }

    async fn pull_failed(&self, members: usize, ack_mode: Option<AckMode>) {
        self.heal(members, ack_mode).await;
    }

    async fn send(&self, operation: Outbound<jetstream::Message>) {
        match operation {
            Outbound::Ack { message, remembered } => {
                let _ = message.ack().await;
                if remembered {
                    self.engine.forget_attempts(&message).await;
                }
            }
            Outbound::Progress(message) => {
                let _ = message.ack_with(AckKind::Progress).await;
            }
            Outbound::Nak(messages) => self.nak(messages).await,
            Outbound::Term(message) => {
                let _ = message.ack_with(AckKind::Term).await;
            }
            Outbound::DeadLetter {
                message,
                attempts,
                remembered,
            } => {
                self.engine
                    .dead_letter(&self.name, &message, attempts, remembered)
                    .await
            }
            Outbound::Offer(messages) => self.offer(messages).await,
            // Done by the hub's sender task itself.
            Outbound::AfterPull | Outbound::Flushed(_) => {}
        }
    }

    fn unregister(&self, hub: &HubHandle<Self>) {
        let mut hubs = self.engine.inner.groups.hubs.lock();
        if hubs.get(hub.name()).is_some_and(|h| h.same(hub)) {
            hubs.remove(hub.name());
        }
    }
}

/// One pull request and the subscription its answer comes to, as
/// async-nats' `Consumer::batch` makes them, with an unsubscribe that is
/// awaited ([`NatsPull::cancel`]): dropping async-nats' `Batch` unsubscribes
/// from a task of its own, so what this replica sends next (a leaving
/// member's naks) could reach the server first and be redelivered to the
/// pull being dropped.
pub(crate) struct NatsPull {
    subscriber: async_nats::Subscriber,
    js: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    engine: ClusterEngine,
    name: String,
    left: usize,
    /// As async-nats: a pull whose expiry never came ends 5 s after it.
    deadline: Instant,
}

impl NatsPull {
    async fn start(
        nats: &Nats,
        consumer: jetstream::consumer::PullConsumer,
        messages: usize,
    ) -> Result<NatsPull, async_nats::Error> {
        let client = &nats.engine.inner.client;
        let inbox = client.new_inbox();
        let subscriber = client.subscribe(inbox.clone()).await?;
        let request = pull::BatchConfig {
            batch: messages,
            expires: Some(PULL_EXPIRES),
            ..Default::default()
        };
        consumer.request_batch(request, inbox.into()).await?;
        Ok(NatsPull {
            subscriber,
            js: nats.js.clone(),
            consumer,
            engine: nats.engine.clone(),
            name: nats.name.clone(),
            left: messages,
            deadline: Instant::now() + PULL_EXPIRES + Duration::from_secs(5),
        })
    }

    /// The next JetStream message of the pull.
    async fn next_message(&mut self) -> Option<Result<jetstream::Message, String>> {
        use async_nats::StatusCode;
        while self.left > 0 {
            let message = tokio::time::timeout_at(self.deadline, self.subscriber.next())
                .await
                .ok()??;
            match message.status.unwrap_or(StatusCode::OK) {
                StatusCode::OK => {
                    self.left -= 1;
                    return Some(Ok(jetstream::Message {
                        message,
                        context: self.js.clone(),
                    }));
                }
                StatusCode::IDLE_HEARTBEAT => {}
                StatusCode::TIMEOUT | StatusCode::NOT_FOUND => return None,
                status => return Some(Err(format!("{status}: {:?}", message.description))),
            }
        }
        None
    }
}

impl Pull<jetstream::Message> for NatsPull {
    /// A redelivery's attempts beyond (or behind) JetStream's count are
    /// read first, in the pull's order (a round trip, only for
    /// redeliveries); none written: JetStream redelivered it on its own
    /// (`attempts.rs`).
    async fn next(&mut self) -> Option<Result<Pulling<jetstream::Message>, String>> {
        let message = match self.next_message().await? {
            Ok(message) => message,
            Err(error) => return Some(Err(error)),
        };
        let delivered = super::super::attempts::delivered(&message);
        let Some(published) = published(&self.engine, &message) else {
            tracing::warn!(group = %self.name, "undecodable group message dropped");
            return Some(Ok(Pulling::Undecodable(message)));
        };
        let recalled = match delivered {
            1 => None,
            _ => self.engine.recall_attempts(&message).await,
        };
        let attempt = i64::from(delivered) + recalled.unwrap_or(0);
        Some(Ok(Pulling::Message(Pulled {
            message,
            published,
            attempt: u32::try_from(attempt.max(1)).unwrap_or(u32::MAX),
            remembered: recalled.is_some(),
        })))
    }

    /// Unsubscribes (sent before anything this replica sends after).
    /// JetStream drops a pull whose inbox lost its subscriber only when it
    /// next goes over its waiting pulls, as a consumer info makes it do;
    /// till then a nacked message could be sent to it, found undeliverable
    /// and queued again behind the others (out of order).
    async fn cancel(mut self) {
        let _ = self.subscriber.unsubscribe().await;
        let _ = tokio::time::timeout(PULL_EXPIRES, self.consumer.info()).await;
    }
}
