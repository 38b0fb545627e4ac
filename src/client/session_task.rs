//! The client's `Session` (docs/contract.md, "Sessions"): one task per
//! [`super::Client`] connection owns the session stream and the table of
//! its subscriptions; [`super::Subscriber`]s send it [`Command`]s and each
//! gets its own channel of [`HandleEvent`]s.
//!
//! - **Opening.** The session is started by the first open and kept while
//!   the client lives. Each subscription is opened with a credit of
//!   [`CREDIT_WINDOW`]; its subscriber gives credit back as the application
//!   takes messages, so the broker never sends a subscription more than the
//!   window beyond what its application has taken, and an application that
//!   stops taking stalls only its own subscription (whose queue then
//!   overflows and is evicted by the broker's usual rules).
//! - **Losing it.** When the session stream fails, every subscription hears
//!   [`HandleEvent::Lost`]; those that reconnect stay in the table, and the
//!   task starts a new session after a backoff ([`HandleEvent::Retrying`]
//!   each time) and opens every one of them again on it, with a fresh
//!   window ([`HandleEvent::Opened`] with the next generation). Credit given
//!   for an older generation is not passed on.
//! - **Ends.** An `ended` event (evicted, closed by an admin, shutdown,
//!   rejected) takes the subscription out of the table; whether and when it
//!   is opened again is its subscriber's business, as it was with
//!   `OpenSubscription`.
//! - **Batches.** The session asks for batched deliveries
//!   (`tinybroker-batch: 1`): each element of a `deliveries` event is
//!   forwarded as a delivery. Publishes go out as `SessionPublish` with an
//!   id of the task's own; the broker answers each with one `published`
//!   carrying it, in the order of the requests. A publish with no session
//!   starts one at once (the subscriptions waiting for one are opened on it
//!   too); if none can be started it fails as [`PublishError::NotSent`].
//!   A publish still unanswered when its session is lost fails as
//!   [`PublishError::Unconfirmed`]: it may or may not have been published,
//!   and it is never sent again.
//! - **Acks.** Commands already queued when the task takes one are written
//!   together, consecutive acks (or nacks) of one handle merged into one
//!   request.

use super::buffer::{FlushReport, PublishBuffer};
use super::{ConnectionEvent, PublishError, Shared, connect_backoff};
use crate::pb;
use crate::pb::admin_client::AdminClient;
use crate::pb::broker_client::BrokerClient;
use crate::pb::metadata::{BATCH_METADATA, INSTANCE_METADATA, SEQUENCE_SCOPE_METADATA};
use crate::pb::session_event::Event;
use crate::pb::session_request::Request as SessionRequest;
use crate::retry::Backoff;
use futures::StreamExt;
use futures::channel::mpsc as requests_channel;
use futures::stream::BoxStream;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Deliveries the broker may send one subscription beyond what its
/// application has taken (docs/clients.md: `WINDOW`).
pub(crate) const CREDIT_WINDOW: u32 = 256;
/// Taken messages are given back as credit this many at a time
/// (docs/clients.md: `TOP_UP`).
pub(crate) const CREDIT_BATCH: u32 = CREDIT_WINDOW / 4;
/// How long the broker has to accept a session (it answers at once).
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Most commands already queued that the task writes in one turn (their
/// acks merged) before it looks at the session's events again.
const COMMANDS_PER_TURN: usize = 1024;
/// docs/clients.md `CLOSE_TIMEOUT`: how long closing waits for the publish
/// buffer to be answered.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the sequences of a session's deliveries come from, as its
/// response headers say (docs/clients.md, "Gaps").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SequenceSpace {
    /// `tinybroker-instance`; None from a broker that does not send it
    /// (each of its sessions is then taken for a new instance).
    pub(crate) instance: Option<String>,
    /// `tinybroker-sequence-scope` is `instance`: one counter numbers every
    /// message the instance delivers.
    pub(crate) one_counter: bool,
}

impl SequenceSpace {
    fn of(metadata: &tonic::metadata::MetadataMap) -> Self {
        let header = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Self {
            instance: header(INSTANCE_METADATA),
            one_counter: header(SEQUENCE_SCOPE_METADATA).as_deref() == Some("instance"),
        }
    }
}

/// What a publish is answered with: the broker's `published`, or why
/// there is none.
pub(crate) type PublishAnswer = Result<pb::SessionPublished, PublishError>;

/// What a subscriber asks of the session task.
pub(crate) enum Command {
    /// Open a subscription under `handle` (unique among the client's); its
    /// events go to `events`.
    Open {
        handle: u32,
        request: pb::OpenSubscriptionRequest,
        /// Open it again on a new session after a lost one.
        reconnect: bool,
        events: mpsc::UnboundedSender<HandleEvent>,
        /// Deliveries sent to `events` that the application has not taken:
        /// the task adds, the subscriber takes away.
        held: Arc<AtomicU32>,
    },
    /// The application took `messages` deliveries of `generation`.
    Credit {
        handle: u32,
        generation: u64,
        messages: u32,
    },
    /// In-band Ack (or Nack) for the subscription's current stream.
    Ack {
        handle: u32,
        sequences: Vec<u64>,
        nack: bool,
    },
    /// End the subscription: `ended` (closed) follows, or `Lost` if the
    /// session goes first.
    Close { handle: u32 },
    /// Publish a batch on the session; `answer` hears the broker's
    /// `published`, or why it was not answered.
    Publish {
        messages: Vec<pb::PublishRequest>,
        answer: oneshot::Sender<PublishAnswer>,
    },
    /// Put a message in the publish buffer; it holds `permits` of the
    /// client's buffer bound until it is written.
    Buffer { message: pb::PublishRequest, permits: u32 },
    /// Answer once everything buffered before it has an outcome.
    Flush { answer: oneshot::Sender<FlushReport> },
    /// Close the client: flush (for at most [`CLOSE_TIMEOUT`]), end the
    /// session and the task; `done` hears how many buffered messages were
    /// not sent.
    Shutdown { done: oneshot::Sender<u64> },
}

/// What the session task tells one subscriber, in order.
#[derive(Debug)]
pub(crate) enum HandleEvent {
    /// Open on the current session; `generation` counts the opens.
    Opened {
        subscription_id: String,
        generation: u64,
        /// Which instance the session is on, and how it numbers messages.
        space: SequenceSpace,
    },
    Delivery(pb::Message),
    /// The broker ended the subscription (or rejected its open); it is out
    /// of the table.
    Ended(pb::SessionEnded),
    /// The session failed. With `retrying`, the subscription stays in the
    /// table and is opened again on the next session; without, it is gone.
    Lost {
        status: Status,
        retrying: bool,
    },
    /// A new session is tried in `delay`; `cause`: why the last try failed.
    Retrying {
        delay: Duration,
        cause: Option<Status>,
    },
}

/// Starts the task of one client connection; it ends when every sender of
/// commands is dropped (then the session is half-closed by dropping it).
pub(crate) fn spawn(
    broker: BrokerClient<Channel>,
    admin: AdminClient<Channel>,
    authorization: Option<MetadataValue<Ascii>>,
    shared: Arc<Shared>,
) -> mpsc::UnboundedSender<Command> {
    let (commands, receiver) = mpsc::unbounded_channel();
    let task = SessionTask {
        broker,
        admin: Some(admin),
        authorization,
        shared,
        buffer: PublishBuffer::default(),
        connected_once: false,
        instance: None,
        closing: None,
        session: None,
        entries: HashMap::new(),
        retry_at: None,
        backoff: connect_backoff(),
        publishes: VecDeque::new(),
        last_publish_id: 0,
        acks: None,
    };
    tokio::spawn(task.run(receiver));
    commands
}

/// The task's state: nothing else holds it.
struct SessionTask {
    broker: BrokerClient<Channel>,
    /// Asked for the broker's `max_batch_messages` once, at the first
    /// session; None after.
    admin: Option<AdminClient<Channel>>,
    authorization: Option<MetadataValue<Ascii>>,
    /// The buffer bound, counters and connection events the client reads.
    shared: Arc<Shared>,
    /// What `Client::publish` put in and was not answered yet.
    buffer: PublishBuffer,
    /// A session was open once: the next one is a reconnection.
    connected_once: bool,
    /// The instance the last session was on.
    instance: Option<String>,
    /// The client is closing: by when, and who hears how many were not sent.
    closing: Option<(Instant, oneshot::Sender<u64>)>,
    /// The current session; None before the first open, and between a lost
    /// session and the next.
    session: Option<Live>,
    /// Every subscription the task answers for, by handle.
    entries: HashMap<u32, Entry>,
    /// When to try a new session, after a lost or refused one.
    retry_at: Option<Instant>,
    backoff: Backoff,
    /// Publishes sent on the current session and not answered yet, in the
    /// order they were sent (the order the broker answers them in).
    publishes: VecDeque<Unanswered>,
    /// The id of the last publish sent (ids are never reused while the
    /// client lives).
    last_publish_id: u64,
    /// Acks (or nacks) of one handle not written yet: the commands queued
    /// after them may add to them.
    acks: Option<PendingAcks>,
}

/// A publish sent and not answered.
struct Unanswered {
    id: u64,
    messages: usize,
    answer: oneshot::Sender<PublishAnswer>,
}

/// Consecutive acks (or nacks) of one handle, merged into one request.
struct PendingAcks {
    handle: u32,
    nack: bool,
    sequences: Vec<u64>,
}

struct Live {
    requests: requests_channel::UnboundedSender<pb::SessionRequest>,
    /// What its response headers said.
    space: SequenceSpace,
    /// The session's events (a `tonic::Streaming`; a test's own stream in
    /// the unit tests).
    events: BoxStream<'static, Result<pb::SessionEvent, Status>>,
}

struct Entry {
    request: pb::OpenSubscriptionRequest,
    reconnect: bool,
    events: mpsc::UnboundedSender<HandleEvent>,
    state: State,
    /// The id the broker gave its current stream (filled into deliveries
    /// that name several handles, which carry none).
    subscription_id: String,
    /// How many times it was sent `open`.
    generation: u64,
    /// Its subscriber asked to close it: not opened again.
    closing: bool,
    /// Deliveries sent to `events` and not taken by the application.
    held: Arc<AtomicU32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not on the current session (there is none yet, or the application
    /// holds a whole window of its deliveries: it is opened once it takes
    /// one, so the client never holds more than the window).
    Waiting,
    /// `open` sent, `opened` not yet received.
    Opening,
    Open,
}

enum Step {
    Command(Option<Command>),
    Event(Result<Option<pb::SessionEvent>, Status>),
    Retry,
    /// Closing waited [`CLOSE_TIMEOUT`].
    CloseNow,
}

impl SessionTask {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        loop {
            let step = tokio::select! {
                command = commands.recv() => Step::Command(command),
                event = next_event(&mut self.session) => Step::Event(event),
                () = sleep_until(self.retry_at) => Step::Retry,
                () = sleep_until(self.closing.as_ref().map(|(at, _)| *at)) => Step::CloseNow,
            };
            match step {
                Step::Command(None) => return,
                Step::Command(Some(command)) => {
                    self.command(command).await;
                    // What is queued behind it is written with it, so that
                    // consecutive acks of one handle go out as one request
                    // and buffered messages as few batches.
                    for _ in 1..COMMANDS_PER_TURN {
                        let Ok(command) = commands.try_recv() else {
                            break;
                        };
                        self.command(command).await;
                    }
                    self.send_acks();
                    if self.session.is_none() && self.retry_at.is_none() && self.buffer.has_queued() {
                        self.start().await;
                    }
                }
                Step::Event(event) => self.event(event),
                Step::Retry => {
                    self.retry_at = None;
                    self.start().await;
                }
                Step::CloseNow => {}
            }
            self.write_buffer();
            if let Some((at, _)) = &self.closing
                && (!self.buffer.outstanding() || Instant::now() >= *at)
            {
                self.close();
                return;
            }
        }
    }

    /// Writes what the buffer holds, in batches, while the session is open
    /// and fewer than `BATCHES_IN_FLIGHT` are unanswered.
    fn write_buffer(&mut self) {
        if self.session.is_none() {
            return;
        }
        while let Some(batch) = self.buffer.next_batch() {
            self.last_publish_id += 1;
            let id = self.last_publish_id;
            self.shared.count_out(&batch.messages);
            self.shared.unpend(batch.messages.len(), batch.bytes);
            self.buffer.written(id, batch.first_index, batch.topics);
            self.send(SessionRequest::Publish(pb::SessionPublish {
                id,
                messages: batch.messages,
            }));
            self.shared.room.add_permits(batch.permits as usize);
        }
    }

    /// Ends the client: what is still buffered is not sent, the session is
    /// half-closed (the broker ends its subscriptions), every subscriber's
    /// channel is dropped.
    fn close(&mut self) {
        let (not_sent, bytes) = self.buffer.drop_queued();
        self.shared.unpend(not_sent, bytes);
        self.buffer.lost();
        self.shared.room.close();
        self.session = None;
        self.entries.clear();
        self.unconfirmed(&super::closed());
        if let Some((_, done)) = self.closing.take() {
            let _ = done.send(not_sent as u64);
        }
        let _ = self.shared.events.send(ConnectionEvent::Closed);
    }

    async fn command(&mut self, command: Command) {
        if !matches!(command, Command::Ack { .. }) {
            // Whatever comes after acks is written after them.
            self.send_acks();
        }
        match command {
            Command::Open {
                handle,
                request,
                reconnect,
                events,
                held,
            } => {
                self.entries.insert(
                    handle,
                    Entry {
                        request,
                        reconnect,
                        events,
                        state: State::Waiting,
                        subscription_id: String::new(),
                        generation: 0,
                        closing: false,
                        held,
                    },
                );
                if self.session.is_some() {
                    self.send_open(handle);
                } else if self.retry_at.is_none() {
                    self.start().await;
                }
                // Otherwise it is opened with the others at the next try.
            }
            Command::Credit {
                handle,
                generation,
                messages,
            } => {
                let Some(entry) = self.entries.get(&handle) else {
                    return;
                };
                if entry.state == State::Waiting {
                    // Taken from a full window: it may have room to open now.
                    if self.session.is_some() {
                        self.send_open(handle);
                    }
                } else if entry.generation == generation {
                    self.send(SessionRequest::Credit(pb::SessionCredit { handle, messages }));
                }
            }
            Command::Ack {
                handle,
                sequences,
                nack,
            } => self.queue_ack(handle, sequences, nack),
            Command::Close { handle } => {
                let Some(entry) = self.entries.get_mut(&handle) else {
                    return;
                };
                if entry.state == State::Waiting {
                    let entry = self.entries.remove(&handle).expect("looked up above");
                    let _ = entry.events.send(HandleEvent::Ended(pb::SessionEnded {
                        handle,
                        reason: "closed".into(),
                        ..Default::default()
                    }));
                } else if !entry.closing {
                    entry.closing = true;
                    self.send(SessionRequest::Close(pb::SessionClose { handle }));
                }
            }
            Command::Publish { messages, answer } => self.publish(messages, answer).await,
            Command::Buffer { message, permits } => self.buffer.push(message, permits),
            Command::Flush { answer } => self.buffer.flush(answer),
            Command::Shutdown { done } => {
                // Subscriptions end now; the buffer has CLOSE_TIMEOUT.
                let handles: Vec<u32> = self.entries.keys().copied().collect();
                for handle in handles {
                    self.send(SessionRequest::Close(pb::SessionClose { handle }));
                }
                self.entries.clear();
                self.closing = Some((Instant::now() + CLOSE_TIMEOUT, done));
            }
        }
    }

    /// Keeps an ack (or nack) to be written with the next ones of its
    /// handle, if they come right after it.
    fn queue_ack(&mut self, handle: u32, sequences: Vec<u64>, nack: bool) {
        if let Some(pending) = &mut self.acks
            && pending.handle == handle
            && pending.nack == nack
        {
            pending.sequences.extend(sequences);
            return;
        }
        self.send_acks();
        self.acks = Some(PendingAcks {
            handle,
            nack,
            sequences,
        });
    }

    /// Writes the acks (or nacks) kept by [`Self::queue_ack`].
    fn send_acks(&mut self) {
        let Some(PendingAcks {
            handle,
            nack,
            sequences,
        }) = self.acks.take()
        else {
            return;
        };
        // A message of a lost session is redelivered by the broker anyway;
        // the ack would name a stream that is gone.
        if self.entries.get(&handle).is_some_and(|e| e.state != State::Waiting) {
            self.send(match nack {
                false => SessionRequest::Ack(pb::SessionAck { handle, sequences }),
                true => SessionRequest::Nack(pb::SessionNack { handle, sequences }),
            });
        }
    }

    /// Sends a batch on the session, starting one if there is none.
    async fn publish(&mut self, messages: Vec<pb::PublishRequest>, answer: oneshot::Sender<PublishAnswer>) {
        let count = messages.len();
        if self.session.is_none() {
            match self.connect().await {
                Ok(live) => self.started(live),
                // The subscriptions keep their own schedule of tries.
                Err(cause) => {
                    let _ = answer.send(Err(PublishError::NotSent { messages: count, cause }));
                    return;
                }
            }
        }
        self.last_publish_id += 1;
        let id = self.last_publish_id;
        self.publishes.push_back(Unanswered {
            id,
            messages: count,
            answer,
        });
        self.shared.count_out(&messages);
        self.send(SessionRequest::Publish(pb::SessionPublish { id, messages }));
    }

    fn send(&mut self, request: SessionRequest) {
        if let Some(live) = &self.session {
            // A session that is gone says so on its event stream.
            let _ = live
                .requests
                .unbounded_send(pb::SessionRequest { request: Some(request) });
        }
    }

    /// Opens a waiting subscription on the session with the room its
    /// window has (`WINDOW` less what the application still holds); with
    /// none, it waits for the application to take one (a credit of 0 would
    /// mean no limit).
    fn send_open(&mut self, handle: u32) {
        let Some(entry) = self.entries.get_mut(&handle) else {
            return;
        };
        let room = CREDIT_WINDOW.saturating_sub(entry.held.load(Ordering::Acquire));
        if room == 0 {
            return;
        }
        entry.generation += 1;
        entry.state = State::Opening;
        let open = SessionRequest::Open(pb::SessionOpen {
            handle,
            subscription: Some(entry.request.clone()),
            credit: room,
        });
        self.send(open);
    }

    /// Starts a session and opens every waiting subscription on it, if a
    /// subscription or the publish buffer needs one.
    async fn start(&mut self) {
        if !self.entries.values().any(|e| e.state == State::Waiting) && !self.buffer.has_queued() {
            return;
        }
        match self.connect().await {
            Ok(live) => self.started(live),
            Err(status) => self.lost(status, true),
        }
    }

    /// A new session is up: every waiting subscription is opened on it.
    fn started(&mut self, live: Live) {
        let instance = live.space.instance.clone();
        let event = match self.connected_once {
            false => ConnectionEvent::Connected {
                instance: instance.clone(),
            },
            true => {
                self.shared.reconnects.fetch_add(1, Ordering::Relaxed);
                ConnectionEvent::Reconnected {
                    instance_changed: instance.is_none() || instance != self.instance,
                    instance: instance.clone(),
                }
            }
        };
        self.connected_once = true;
        self.instance = instance;
        let _ = self.shared.events.send(event);
        self.session = Some(live);
        self.retry_at = None;
        self.backoff.reset();
        let waiting: Vec<u32> = self
            .entries
            .iter()
            .filter(|(_, e)| e.state == State::Waiting)
            .map(|(h, _)| *h)
            .collect();
        for handle in waiting {
            self.send_open(handle);
        }
    }

    async fn connect(&mut self) -> Result<Live, Status> {
        let (requests, stream) = requests_channel::unbounded();
        let mut request = tonic::Request::new(stream);
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
            .metadata_mut()
            .insert(BATCH_METADATA, MetadataValue::from_static("1"));
        let response = tokio::time::timeout(START_TIMEOUT, self.broker.session(request))
            .await
            .map_err(|_| Status::deadline_exceeded("the broker did not accept a session within 10 s"))??;
        if let Some(mut admin) = self.admin.take() {
            // Batches no larger than the broker takes (a token without
            // Admin access keeps the default, the broker's own).
            let mut info = tonic::Request::new(pb::GetBrokerInfoRequest {});
            if let Some(auth) = &self.authorization {
                info.metadata_mut().insert("authorization", auth.clone());
            }
            if let Ok(Ok(info)) = tokio::time::timeout(START_TIMEOUT, admin.get_broker_info(info)).await
                && let Some(limits) = info.into_inner().limits
                && limits.max_batch_messages > 0
            {
                self.buffer.batch_messages = limits.max_batch_messages as usize;
            }
        }
        Ok(Live {
            requests,
            space: SequenceSpace::of(response.metadata()),
            events: response.into_inner().boxed(),
        })
    }

    fn event(&mut self, event: Result<Option<pb::SessionEvent>, Status>) {
        match event {
            Ok(Some(pb::SessionEvent { event: Some(event) })) => self.forward(event),
            Ok(Some(_)) => {}
            Ok(None) if self.entries.is_empty() && !self.buffer.outstanding() => {
                self.session = None;
                self.unconfirmed(&Status::unavailable("the broker ended the session"));
                let _ = self.shared.events.send(ConnectionEvent::Disconnected {
                    reason: Status::unavailable("the broker ended the session"),
                });
            }
            Ok(None) => self.lost(Status::unavailable("the broker ended the session"), false),
            Err(status) => self.lost(status, false),
        }
    }

    fn forward(&mut self, event: Event) {
        match event {
            Event::Opened(opened) => {
                let Some(entry) = self.entries.get_mut(&opened.handle) else {
                    return;
                };
                entry.state = State::Open;
                entry.subscription_id = opened.subscription_id.clone();
                let space = self.session.as_ref().map(|s| s.space.clone()).unwrap_or_default();
                let _ = entry.events.send(HandleEvent::Opened {
                    subscription_id: opened.subscription_id,
                    generation: entry.generation,
                    space,
                });
            }
            Event::Delivery(delivery) => {
                let Some(message) = delivery.message else {
                    return;
                };
                let last = delivery.handles.len().saturating_sub(1);
                let mut message = Some(message);
                for (i, handle) in delivery.handles.iter().enumerate() {
                    let Some(entry) = self.entries.get(handle) else {
                        continue;
                    };
                    let mut copy = match i == last {
                        true => message.take().unwrap_or_default(),
                        false => message.clone().unwrap_or_default(),
                    };
                    if copy.subscription_id.is_empty() {
                        copy.subscription_id = entry.subscription_id.clone();
                    }
                    // Counted before it can be taken (and uncounted).
                    entry.held.fetch_add(1, Ordering::AcqRel);
                    self.shared.count_in(copy.payload.len());
                    if entry.events.send(HandleEvent::Delivery(copy)).is_err() {
                        entry.held.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
            Event::Ended(ended) => {
                if let Some(entry) = self.entries.remove(&ended.handle) {
                    let _ = entry.events.send(HandleEvent::Ended(ended));
                }
            }
            Event::Deliveries(batch) => {
                for delivery in batch.deliveries {
                    self.forward(Event::Delivery(delivery));
                }
            }
            Event::Published(published) => {
                if self.publishes.iter().all(|p| p.id != published.id) {
                    if !self.buffer.answered(published) {
                        tracing::debug!("an answer to no publish of this session");
                    }
                    return;
                }
                // Answers come in the order of the requests: the one
                // answered is the oldest, unless the broker skipped one.
                let Some(at) = self.publishes.iter().position(|p| p.id == published.id) else {
                    tracing::debug!(id = published.id, "an answer to no publish of this session");
                    return;
                };
                let publish = self.publishes.remove(at).expect("found above");
                let _ = publish.answer.send(Ok(published));
            }
        }
    }

    /// The session is gone: every publish on it not answered yet is
    /// unconfirmed (never sent again).
    fn unconfirmed(&mut self, cause: &Status) {
        for publish in self.publishes.drain(..) {
            let _ = publish.answer.send(Err(PublishError::Unconfirmed {
                messages: publish.messages,
                cause: cause.clone(),
            }));
        }
    }

    /// The session failed (`starting`: a new one could not be started):
    /// the subscriptions that reconnect wait for the next try, the others
    /// are told and forgotten.
    fn lost(&mut self, status: Status, starting: bool) {
        if self.session.take().is_some() {
            let _ = self
                .shared
                .events
                .send(ConnectionEvent::Disconnected { reason: status.clone() });
        }
        self.unconfirmed(&status);
        self.buffer.lost();
        let retry = retryable(&status);
        self.entries.retain(|_, entry| {
            let keep = retry && entry.reconnect && !entry.closing;
            // A failed start is no news to those already told of the loss.
            if !(starting && keep) {
                let _ = entry.events.send(HandleEvent::Lost {
                    status: status.clone(),
                    retrying: keep,
                });
            }
            entry.state = State::Waiting;
            keep
        });
        if self.entries.is_empty() && !self.buffer.has_queued() {
            return;
        }
        let delay = self.backoff.next_delay();
        let cause = starting.then_some(status);
        for entry in self.entries.values() {
            let _ = entry.events.send(HandleEvent::Retrying {
                delay,
                cause: cause.clone(),
            });
        }
        self.retry_at = Some(Instant::now() + delay);
    }
}

/// Whether a failed session is worth trying again: the broker was away,
/// not refusing.
pub(crate) fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted | Code::DeadlineExceeded | Code::Internal
    )
}

async fn next_event(session: &mut Option<Live>) -> Result<Option<pb::SessionEvent>, Status> {
    match session {
        Some(live) => live.events.next().await.transpose(),
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc as events_channel;
    use tonic::transport::Endpoint;

    /// A session task on a session of the test's own: the requests it
    /// writes, and the events the test feeds it.
    struct Harness {
        commands: mpsc::UnboundedSender<Command>,
        requests: requests_channel::UnboundedReceiver<pb::SessionRequest>,
        events: events_channel::UnboundedSender<Result<pb::SessionEvent, Status>>,
    }

    /// The task, not yet running (so that the commands the test queues are
    /// all there at its first turn), with `handles` open on its session. A
    /// new session would be sought at 127.0.0.1:1, which refuses it.
    fn harness(handles: &[u32]) -> (Harness, impl Future<Output = ()>) {
        let (commands, receiver) = mpsc::unbounded_channel();
        let (requests_tx, requests) = requests_channel::unbounded();
        let (events, events_rx) = events_channel::unbounded();
        let channel = Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let entries = handles
            .iter()
            .map(|&handle| {
                let entry = Entry {
                    request: pb::OpenSubscriptionRequest::default(),
                    reconnect: false,
                    events: mpsc::unbounded_channel().0,
                    state: State::Open,
                    subscription_id: format!("sub-{handle}"),
                    generation: 1,
                    closing: false,
                    held: Arc::default(),
                };
                (handle, entry)
            })
            .collect();
        let task = SessionTask {
            broker: BrokerClient::new(channel),
            admin: None,
            authorization: None,
            shared: Arc::default(),
            buffer: PublishBuffer::default(),
            connected_once: true,
            instance: None,
            closing: None,
            session: Some(Live {
                requests: requests_tx,
                space: SequenceSpace::default(),
                events: events_rx.boxed(),
            }),
            entries,
            retry_at: None,
            backoff: connect_backoff(),
            publishes: VecDeque::new(),
            last_publish_id: 0,
            acks: None,
        };
        let harness = Harness {
            commands,
            requests,
            events,
        };
        (harness, task.run(receiver))
    }

    impl Harness {
        fn send(&self, command: Command) {
            assert!(self.commands.send(command).is_ok());
        }

        async fn request(&mut self) -> SessionRequest {
            tokio::time::timeout(Duration::from_secs(5), self.requests.next())
                .await
                .expect("a request within 5 s")
                .expect("the session is open")
                .request
                .expect("a request with a variant")
        }

        fn publish(&self, messages: usize) -> oneshot::Receiver<PublishAnswer> {
            let (answer, receiver) = oneshot::channel();
            self.send(Command::Publish {
                messages: vec![pb::PublishRequest::default(); messages],
                answer,
            });
            receiver
        }

        fn feed(&self, event: Result<Event, Status>) {
            let event = event.map(|e| pb::SessionEvent { event: Some(e) });
            assert!(self.events.unbounded_send(event).is_ok());
        }
    }

    fn ack(handle: u32, sequences: &[u64], nack: bool) -> Command {
        Command::Ack {
            handle,
            sequences: sequences.to_vec(),
            nack,
        }
    }

    async fn answer(receiver: oneshot::Receiver<PublishAnswer>) -> PublishAnswer {
        tokio::time::timeout(Duration::from_secs(5), receiver)
            .await
            .expect("an answer within 5 s")
            .expect("the task answers every publish")
    }

    /// docs/clients.md, "Room in the window": a subscription opened again
    /// while the application still holds deliveries gets only the room
    /// left, and none at all (not even 1) while it holds a whole window.
    #[tokio::test]
    async fn window_holds_through_evictions() {
        let (mut h, task) = harness(&[]);
        let held = Arc::new(AtomicU32::new(CREDIT_WINDOW));
        h.send(Command::Open {
            handle: 5,
            request: pb::OpenSubscriptionRequest::default(),
            reconnect: true,
            events: mpsc::unbounded_channel().0,
            held: held.clone(),
        });
        // Commands are taken in order: an open would be written before this.
        let _answer = h.publish(1);
        tokio::spawn(task);
        match h.request().await {
            SessionRequest::Publish(_) => {}
            other => panic!("with a full window it wrote {other:?}"),
        }
        // The application takes 56: its subscriber says so with credit.
        held.store(CREDIT_WINDOW - 56, Ordering::Release);
        h.send(Command::Credit {
            handle: 5,
            generation: 0,
            messages: 56,
        });
        match h.request().await {
            SessionRequest::Open(open) => assert_eq!((open.handle, open.credit), (5, 56)),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn acks_are_coalesced() {
        let (mut h, task) = harness(&[1, 2]);
        for command in [
            ack(1, &[1], false),
            ack(1, &[2, 3], false),
            ack(2, &[7], false),
            ack(1, &[4], false),
            ack(1, &[5], true),
            ack(1, &[6], true),
            Command::Credit {
                handle: 1,
                generation: 1,
                messages: 32,
            },
            ack(1, &[8], false),
        ] {
            h.send(command);
        }
        tokio::spawn(task);
        let acked = |handle, sequences: &[u64]| {
            SessionRequest::Ack(pb::SessionAck {
                handle,
                sequences: sequences.to_vec(),
            })
        };
        let mut written = Vec::new();
        for _ in 0..6 {
            written.push(h.request().await);
        }
        assert_eq!(
            written,
            [
                acked(1, &[1, 2, 3]),
                acked(2, &[7]),
                acked(1, &[4]),
                SessionRequest::Nack(pb::SessionNack {
                    handle: 1,
                    sequences: vec![5, 6]
                }),
                SessionRequest::Credit(pb::SessionCredit {
                    handle: 1,
                    messages: 32
                }),
                acked(1, &[8]),
            ]
        );
        assert!(h.requests.try_recv().is_err(), "nothing more was written");
    }

    #[tokio::test]
    async fn publishes_are_answered_by_id_and_those_on_a_lost_session_are_unconfirmed() {
        let (mut h, task) = harness(&[]);
        let answers = [h.publish(2), h.publish(1), h.publish(3)];
        tokio::spawn(task);
        let mut ids = Vec::new();
        for messages in [2, 1, 3] {
            match h.request().await {
                SessionRequest::Publish(p) => {
                    assert_eq!(p.messages.len(), messages);
                    ids.push(p.id);
                }
                other => panic!("a publish, not {other:?}"),
            }
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
        let [first, second, third] = answers;
        let published = |id, first_sequence, accepted| {
            Ok(Event::Published(pb::SessionPublished {
                id,
                first_sequence,
                accepted,
                rejected: Vec::new(),
            }))
        };
        h.feed(published(ids[0], 10, 2));
        h.feed(published(ids[1], 12, 1));
        let a = answer(first).await.unwrap();
        assert_eq!((a.id, a.first_sequence, a.accepted), (ids[0], 10, 2));
        let b = answer(second).await.unwrap();
        assert_eq!((b.id, b.first_sequence, b.accepted), (ids[1], 12, 1));
        // The third is unanswered when the session fails.
        h.feed(Err(Status::unavailable("connection reset")));
        match answer(third).await {
            Err(PublishError::Unconfirmed { messages: 3, cause }) => {
                assert_eq!(cause.code(), Code::Unavailable);
            }
            other => panic!("unconfirmed, not {other:?}"),
        }
        // No session now, and none to be had at 127.0.0.1:1: not sent.
        match answer(h.publish(1)).await {
            Err(PublishError::NotSent { messages: 1, .. }) => {}
            other => panic!("not sent, not {other:?}"),
        }
    }
}
