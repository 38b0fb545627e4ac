//! A group's hub on this replica: one task that owns the group's state
//! here ([`HubCore`]) and takes everything that changes it as a
//! [`Command`], in the order it arrives, plus two I/O tasks that do no
//! bookkeeping of their own:
//!
//! - the **hub task** ([`Hub::run`]) owns the [`HubCore`]: members, what
//!   they hold, what waits, the round-robin cursor, deadlines, counts. It
//!   takes join, leave, streamed (an AUTO member's stream took a message),
//!   credit added (a member's session may send it more), ack, nack, pulled, offered, hand-back and forget commands, and a tick
//!   every [`TICK`] (deadlines, progress reports, stopping after the last
//!   member left). After each step it publishes whether it has members
//!   ([`Open`]) and what the listings read ([`View`]), answers the
//!   puller's request for room once there is some, then queues the step's
//!   JetStream operations;
//! - the **puller** ([`pull`]) asks the hub how much room its members have
//!   ([`Command::Room`], queued behind the messages it pulled before, so
//!   what is on the way is never counted as room), asks JetStream for that
//!   many messages, and passes each on as a [`Command::Pulled`]; it closes
//!   its pull when the last member leaves;
//! - the **sender** ([`send`]) sends the hub's [`Outbound`] queue to
//!   JetStream one operation after another: acks, naks, progress reports,
//!   terms, dead letters and offers to other replicas leave in the order
//!   the hub decided them, and nothing else sends any.
//!
//! The hub's locks are leaves, each held for a copy and never across an
//! `.await`: [`Shared::view`], and the [`Open`] watch. The hub takes
//! `Groups::hubs` (the replica's table of hubs) once, when it stops, to
//! leave it; nothing is taken while that is held.
//!
//! Everything the hub does outside itself goes through [`Backend`]:
//! JetStream over async-nats in production (`nats.rs`), a fake in the tests
//! (`hub_tests.rs`).

use super::state::{HubCore, Outbound, Pulled, Settings, View};
use crate::broker::Subscription;
use crate::engine::Delivery;
use crate::engine::{AckMode, Acked, Nacked};
use crate::retry::Backoff;
use parking_lot::Mutex;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often held messages are checked against their ack deadlines.
pub(crate) const TICK: Duration = Duration::from_millis(100);
/// How long a pull waits for messages before asking again.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How long a hub stays after its last member left (its pull's expiry and
/// a margin): a member joining meanwhile takes over what it holds.
pub(crate) const LINGER: Duration = Duration::from_millis(1250);
/// Most messages one pull asks for.
const PULL_AT_MOST: usize = 256;
/// The wait after a failed pull, doubling while pulls keep failing up to
/// [`PULL_RETRY_CAP`].
const PULL_RETRY_FIRST: Duration = Duration::from_millis(160);
const PULL_RETRY_CAP: Duration = Duration::from_secs(1);
/// Most commands (or outbound operations) taken from a queue at once.
const AT_ONCE: usize = 256;

/// What a hub does outside itself: JetStream, the other replicas, and the
/// replica's table of hubs.
pub(crate) trait Backend: Send + Sync + Sized + 'static {
    /// A JetStream message this replica holds: what an ack, nak, progress
    /// report or term is sent with.
    type Message: Clone + Send + Sync + 'static;
    /// One open pull.
    type Pull: Pull<Self::Message>;

    /// Asks the group's consumer for at most `messages` messages.
    fn pull(&self, messages: usize) -> impl Future<Output = Result<Self::Pull, String>> + Send;
    /// A pull failed: make sure the group, its stream and its consumer
    /// exist (while the hub has members, whose ack mode is given).
    fn pull_failed(&self, members: usize, ack_mode: Option<AckMode>) -> impl Future<Output = ()> + Send;
    /// Sends one operation; returns once it is with the NATS client.
    fn send(&self, operation: Outbound<Self::Message>) -> impl Future<Output = ()> + Send;
    /// The hub stops: it leaves the replica's table of hubs (if it is the
    /// one there).
    fn unregister(&self, hub: &HubHandle<Self>);
}

/// A pull's answers.
pub(crate) trait Pull<M>: Send + 'static {
    /// The next message; None once the pull is answered in full or has
    /// expired.
    fn next(&mut self) -> impl Future<Output = Option<Result<Pulling<M>, String>>> + Send;
    /// Closes the pull (what this replica sends after cannot reach it).
    fn cancel(self) -> impl Future<Output = ()> + Send;
}

/// What a pull brought.
pub(crate) enum Pulling<M> {
    Message(Pulled<M>),
    /// A message that does not decode.
    Undecodable(M),
}

/// What the hub task is asked to do.
pub(crate) enum Command<M> {
    /// Adds a member; answers false when the hub is stopping.
    Join {
        id: Arc<str>,
        subscription: Arc<Subscription>,
        settings: Settings,
        joined: oneshot::Sender<bool>,
    },
    Leave {
        id: Arc<str>,
    },
    /// An AUTO member's stream took a message.
    Streamed {
        id: Arc<str>,
        sequence: u64,
    },
    /// A member's session added credit: it may have room now.
    CreditAdded,
    Ack {
        id: Arc<str>,
        sequences: Vec<u64>,
        acked: oneshot::Sender<Acked>,
    },
    Nack {
        id: Arc<str>,
        sequences: Vec<u64>,
        nacked: oneshot::Sender<Nacked>,
    },
    Pulled(Pulling<M>),
    /// Another replica offers a message; answers whether it was taken.
    Offered {
        pulled: Pulled<M>,
        taken: oneshot::Sender<bool>,
    },
    /// Shutdown: everything held goes back. Answers how many, and a
    /// receiver answered once the naks (and every ack before them) are
    /// with the NATS client.
    HandBack {
        handed: oneshot::Sender<(usize, oneshot::Receiver<()>)>,
    },
    /// NATS lost its state: what members hold is forgotten. Answers how
    /// many.
    ForgetHeld {
        forgotten: oneshot::Sender<usize>,
    },
    /// The puller asks what the members have room for, beyond what waits;
    /// answered once that is more than nothing (dropped unanswered when
    /// the hub stops).
    Room {
        room: oneshot::Sender<usize>,
    },
}

/// Whether a pull may be open, published by the hub when it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Open {
    /// The hub has members.
    pub(crate) members: bool,
    /// The hub is stopping: the puller ends.
    pub(crate) stopped: bool,
}

/// What the hub's handles share.
pub(crate) struct Shared<B: Backend> {
    pub(crate) name: String,
    pub(crate) backend: Arc<B>,
    commands: mpsc::UnboundedSender<Command<B::Message>>,
    /// Written by the hub task after each step; read by the listings. A
    /// leaf lock.
    view: Mutex<View>,
    /// Group messages written to the streams of members here.
    delivered: AtomicU64,
    /// Cancelled once the puller has ended (no pull of it is open).
    pulled: CancellationToken,
}

/// A handle to a hub; cheap to clone. The hub task ends once it has
/// stopped and every handle's commands are answered.
pub(crate) struct HubHandle<B: Backend> {
    shared: Arc<Shared<B>>,
}

impl<B: Backend> Clone for HubHandle<B> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

/// What a hub is set up with.
pub(crate) struct HubConfig {
    pub(crate) max_delivery_attempts: u32,
    /// The consumer's `ack_wait`.
    pub(crate) ack_wait: Duration,
    /// Cancelled when this replica begins to shut down: the hub stops
    /// pulling, and naks what its last pull still brings.
    pub(crate) closing: CancellationToken,
}

/// A hub made and not started yet: [`Starting::start`] spawns its tasks
/// (outside any lock).
pub(crate) struct Starting<B: Backend> {
    hub: Hub<B>,
    commands: mpsc::UnboundedReceiver<Command<B::Message>>,
    open: watch::Receiver<Open>,
    outbound: mpsc::UnboundedReceiver<Outbound<B::Message>>,
    pulling: watch::Sender<bool>,
}

impl<B: Backend> Starting<B> {
    pub(crate) fn start(self) {
        let Starting {
            hub,
            commands,
            open,
            outbound,
            pulling,
        } = self;
        let backend = hub.handle.shared.backend.clone();
        let pulled = hub.handle.shared.pulled.clone();
        let puller = tokio::spawn(pull(
            backend.clone(),
            hub.handle.clone(),
            open,
            pulling.clone(),
            hub.config.closing.clone(),
            pulled,
        ));
        tokio::spawn(send(backend, outbound, pulling.subscribe()));
        tokio::spawn(hub.run(commands, puller));
    }
}

impl<B: Backend> HubHandle<B> {
    /// A new hub of group `name`, not started yet (no member: it stops
    /// after [`LINGER`] unless one joins).
    pub(crate) fn new(name: &str, backend: Arc<B>, config: HubConfig) -> (Self, Starting<B>) {
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let (outbound_tx, outbound) = mpsc::unbounded_channel();
        let (open_tx, open) = watch::channel(Open::default());
        let handle = HubHandle {
            shared: Arc::new(Shared {
                name: name.to_owned(),
                backend,
                commands: commands_tx,
                view: Mutex::new(View::default()),
                delivered: AtomicU64::new(0),
                pulled: CancellationToken::new(),
            }),
        };
        let now = Instant::now();
        let hub = Hub {
            core: HubCore::new(config.max_delivery_attempts, config.ack_wait),
            config,
            handle: handle.clone(),
            outbound: outbound_tx,
            open: open_tx,
            room_asked: None,
            ticked: false,
            empty_since: Some(now),
            stopping: false,
        };
        let starting = Starting {
            hub,
            commands,
            open,
            outbound,
            pulling: watch::Sender::new(false),
        };
        (handle, starting)
    }

    pub(crate) fn name(&self) -> &str {
        &self.shared.name
    }

    pub(crate) fn backend(&self) -> &B {
        &self.shared.backend
    }

    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// What the listings read.
    pub(crate) fn view(&self) -> View {
        self.shared.view.lock().clone()
    }

    pub(crate) fn delivered(&self) -> u64 {
        self.shared.delivered.load(Ordering::Relaxed)
    }

    /// Resolves once the hub's puller has ended.
    pub(crate) async fn pulled(&self) {
        self.shared.pulled.cancelled().await
    }

    fn command(&self, command: Command<B::Message>) -> bool {
        self.shared.commands.send(command).is_ok()
    }

    /// Asks the hub and waits for its answer; None when it has ended.
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command<B::Message>) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        if !self.command(make(tx)) {
            return None;
        }
        rx.await.ok()
    }

    /// Adds a member; false when the hub has stopped (the caller makes a
    /// new one).
    pub(crate) async fn join(&self, id: Arc<str>, subscription: Arc<Subscription>, settings: Settings) -> bool {
        self.ask(|joined| Command::Join {
            id,
            subscription,
            settings,
            joined,
        })
        .await
        .unwrap_or(false)
    }

    pub(crate) fn leave(&self, id: Arc<str>) {
        self.command(Command::Leave { id });
    }

    /// A member's stream took `delivery`.
    pub(crate) fn streamed(&self, id: &Arc<str>, ack_mode: AckMode, delivery: &Delivery) {
        self.shared.delivered.fetch_add(1, Ordering::Relaxed);
        if ack_mode == AckMode::Auto {
            self.command(Command::Streamed {
                id: id.clone(),
                sequence: delivery.message.sequence,
            });
        }
    }

    /// A member's session added credit (its room is read from its queue
    /// when the hub dispatches).
    pub(crate) fn credit_added(&self) {
        self.command(Command::CreditAdded);
    }

    pub(crate) async fn ack(&self, id: &str, sequences: &[u64]) -> Acked {
        let unknown = Acked {
            acked: 0,
            unknown: sequences.len() as u32,
        };
        self.ask(|acked| Command::Ack {
            id: id.into(),
            sequences: sequences.to_vec(),
            acked,
        })
        .await
        .unwrap_or(unknown)
    }

    pub(crate) async fn nack(&self, id: &str, sequences: &[u64]) -> Nacked {
        let unknown = Nacked {
            requeued: 0,
            unknown: sequences.len() as u32,
        };
        self.ask(|nacked| Command::Nack {
            id: id.into(),
            sequences: sequences.to_vec(),
            nacked,
        })
        .await
        .unwrap_or(unknown)
    }

    /// Offers a message another replica nacked; true when a member here
    /// with room took it.
    pub(crate) async fn take(&self, pulled: Pulled<B::Message>) -> bool {
        self.ask(|taken| Command::Offered { pulled, taken })
            .await
            .unwrap_or(false)
    }

    /// Shutdown: see [`Command::HandBack`].
    pub(crate) async fn hand_back(&self) -> Option<(usize, oneshot::Receiver<()>)> {
        self.ask(|handed| Command::HandBack { handed }).await
    }

    pub(crate) async fn forget_held(&self) -> usize {
        self.ask(|forgotten| Command::ForgetHeld { forgotten })
            .await
            .unwrap_or(0)
    }

    /// The puller's way in.
    fn pulled_message(&self, pulling: Pulling<B::Message>) -> bool {
        self.command(Command::Pulled(pulling))
    }

    /// What the members have room for, once they have some; None when the
    /// hub stops.
    async fn room(&self) -> Option<usize> {
        self.ask(|room| Command::Room { room }).await
    }
}

/// The hub task's state.
struct Hub<B: Backend> {
    core: HubCore<B::Message>,
    config: HubConfig,
    handle: HubHandle<B>,
    outbound: mpsc::UnboundedSender<Outbound<B::Message>>,
    open: watch::Sender<Open>,
    /// The puller's request for room, until there is some.
    room_asked: Option<oneshot::Sender<usize>>,
    /// A tick ran since the view was last written in full.
    ticked: bool,
    /// Since when the hub has had no member.
    empty_since: Option<Instant>,
    /// It stopped: it takes no member, and ends once its puller has.
    stopping: bool,
}

impl<B: Backend> Hub<B> {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command<B::Message>>,
        mut puller: tokio::task::JoinHandle<()>,
    ) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut batch = Vec::with_capacity(AT_ONCE);
        loop {
            tokio::select! {
                n = commands.recv_many(&mut batch, AT_ONCE) => {
                    if n == 0 {
                        break;
                    }
                    let now = Instant::now();
                    for command in batch.drain(..) {
                        self.handle(command, now);
                    }
                }
                _ = tick.tick() => self.tick(Instant::now()),
                _ = &mut puller, if self.stopping => break,
            }
            self.step_done();
        }
        // The puller has ended (nothing more is pulled): what is still
        // queued is answered, then what waits goes back.
        commands.close();
        let now = Instant::now();
        while let Ok(command) = commands.try_recv() {
            self.handle(command, now);
        }
        self.core.stop();
        self.step_done();
        // Dropping the outbound sender ends the sender task once it has
        // sent everything.
    }

    /// After each step: what the puller and the listings read, then the
    /// step's JetStream operations. In this order: a puller that saw the
    /// hub open set `pulling` before it looked, so an
    /// [`Outbound::AfterPull`] queued now waits for its pull.
    fn step_done(&mut self) {
        let open = Open {
            members: self.core.members() > 0 && !self.stopping,
            stopped: self.stopping,
        };
        self.open.send_if_modified(|o| {
            let changed = *o != open;
            *o = open;
            changed
        });
        if self.stopping {
            self.room_asked = None;
        } else if self.room_asked.is_some() && open.members {
            let room = self.core.room();
            if room > 0
                && let Some(asked) = self.room_asked.take()
            {
                let _ = asked.send(room);
            }
        }
        let full = std::mem::take(&mut self.ticked);
        self.core.update_view(&mut self.handle.shared.view.lock(), full);
        for operation in self.core.out.drain(..) {
            // Closed only when the sender task panicked: nothing to do.
            let _ = self.outbound.send(operation);
        }
    }

    fn handle(&mut self, command: Command<B::Message>, now: Instant) {
        self.apply(command, now);
        // Without members since now: a leave, or a member whose queue
        // closed taken out of the rotation by a dispatch.
        if self.core.members() > 0 {
            self.empty_since = None;
        } else {
            self.empty_since.get_or_insert(now);
        }
    }

    fn apply(&mut self, command: Command<B::Message>, now: Instant) {
        let closing = self.config.closing.is_cancelled();
        match command {
            Command::Join {
                id,
                subscription,
                settings,
                joined,
            } => {
                if self.stopping {
                    let _ = joined.send(false);
                    return;
                }
                self.core.join(id, subscription, settings, now);
                let _ = joined.send(true);
            }
            Command::Leave { id } => self.core.leave(&id, now),
            Command::Streamed { id, sequence } => {
                self.core.done(&id, sequence, now);
            }
            Command::CreditAdded => self.core.room_made(now),
            Command::Ack { id, sequences, acked } => {
                let _ = acked.send(self.core.ack(&id, &sequences, now));
            }
            Command::Nack { id, sequences, nacked } => {
                let _ = nacked.send(self.core.nack(&id, &sequences, now));
            }
            Command::Room { room } => self.room_asked = Some(room),
            Command::Pulled(pulling) => match pulling {
                Pulling::Message(pulled) => self.core.pulled(pulled, closing, now),
                Pulling::Undecodable(message) => self.core.undecodable(message),
            },
            Command::Offered { pulled, taken } => {
                let _ = taken.send(self.core.take(pulled, closing || self.stopping, now));
            }
            Command::HandBack { handed } => {
                let count = self.core.hand_back();
                let (flushed, sent) = oneshot::channel();
                self.core.out.push(Outbound::Flushed(flushed));
                let _ = handed.send((count, sent));
            }
            Command::ForgetHeld { forgotten } => {
                let _ = forgotten.send(self.core.forget_held(now));
            }
        }
    }

    fn tick(&mut self, now: Instant) {
        self.core.tick(now);
        self.ticked = true;
        // Without a member for LINGER: the hub stops. A join from now on
        // is refused (its caller makes a new hub), and the hub leaves the
        // replica's table so that the next join finds none.
        if !self.stopping
            && self.core.members() == 0
            && self
                .empty_since
                .is_some_and(|since| now.saturating_duration_since(since) >= LINGER)
        {
            self.stopping = true;
            self.handle.shared.backend.unregister(&self.handle);
        }
    }
}

/// The puller: asks for what the members have room for, and passes what
/// comes to the hub. Ends when the hub stops, or when this replica begins
/// to shut down (after the pull then open has been answered: what it
/// brings is nacked by the hub).
async fn pull<B: Backend>(
    backend: Arc<B>,
    hub: HubHandle<B>,
    mut open: watch::Receiver<Open>,
    pulling: watch::Sender<bool>,
    closing: CancellationToken,
    pulled: CancellationToken,
) {
    let _pulled = pulled.drop_guard();
    let mut backoff = Backoff::new(PULL_RETRY_FIRST, PULL_RETRY_CAP);
    loop {
        pulling.send_replace(false);
        if closing.is_cancelled() {
            return;
        }
        // Answered after the hub has taken in all this pulled before.
        let room = tokio::select! {
            room = hub.room() => room,
            _ = closing.cancelled() => None,
        };
        let Some(room) = room else { return };
        // Set before looking again: a hub that closes from now on sees
        // the pull (see `Hub::step_done`).
        pulling.send_replace(true);
        if !open.borrow().members || closing.is_cancelled() {
            continue;
        }
        let mut batch = match backend.pull(room.min(PULL_AT_MOST)).await {
            Ok(batch) => {
                backoff.reset();
                batch
            }
            Err(error) => {
                tracing::debug!(group = %hub.name(), %error, "pull failed; retrying");
                pulling.send_replace(false);
                let view = hub.view();
                backend.pull_failed(view.members, view.ack_mode).await;
                backoff.sleep().await;
                continue;
            }
        };
        loop {
            let message = tokio::select! {
                message = batch.next() => Some(message),
                _ = open.wait_for(|o| !o.members) => None,
            };
            let Some(message) = message else {
                // The last member left: the pull is closed, and what is
                // published now stays in the stream, the backlog, instead
                // of reaching this hub with no member to take it (to be
                // nacked later, using up an attempt).
                batch.cancel().await;
                break;
            };
            match message {
                None => break,
                Some(Ok(pulled)) => {
                    if !hub.pulled_message(pulled) {
                        // The hub task is gone (it outlives the puller
                        // unless it panicked): JetStream redelivers after
                        // its ack_wait.
                        return;
                    }
                }
                Some(Err(error)) => {
                    tracing::debug!(group = %hub.name(), %error, "pull interrupted");
                    let view = hub.view();
                    backend.pull_failed(view.members, view.ack_mode).await;
                    break;
                }
            }
        }
    }
}

/// The sender: the hub's JetStream operations, one after another, in the
/// order queued. Ends when the hub task has ended and all are sent.
async fn send<B: Backend>(
    backend: Arc<B>,
    mut outbound: mpsc::UnboundedReceiver<Outbound<B::Message>>,
    mut pulling: watch::Receiver<bool>,
) {
    let mut batch = Vec::with_capacity(AT_ONCE);
    while outbound.recv_many(&mut batch, AT_ONCE).await > 0 {
        for operation in batch.drain(..) {
            match operation {
                Outbound::AfterPull => {
                    let _ = tokio::time::timeout(2 * PULL_EXPIRES, pulling.wait_for(|p| !*p)).await;
                }
                Outbound::Flushed(flushed) => {
                    let _ = flushed.send(());
                }
                operation => backend.send(operation).await,
            }
        }
    }
}
