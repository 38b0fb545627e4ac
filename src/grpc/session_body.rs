//! Sessions: many subscriptions on one HTTP/2 stream (docs/contract.md,
//! "Sessions").
//!
//! A `Session` stream carries requests one way (open, close, credit, ack,
//! nack, each naming a subscription by the client's own `handle`) and events
//! the other (opened, delivery, ended). Each subscription of a session is an
//! ordinary subscription of the engine: the same [`DeliveryStream`], bounded
//! queue, eviction, id, Admin listing and metrics as one opened with
//! `OpenSubscription`. Only the transport is shared, so what a subscription
//! holds is its queue, its routes and the few words of [`Sub`]; nothing of
//! h2, hyper or tonic (one stream for the whole session).
//!
//! # The delivery path
//!
//! [`SessionBody`] is the response body itself, polled by the connection's
//! task like an `OpenSubscription` body ([`super::subscription_body::SubscriptionBody`]); there is
//! no task or channel of its own.
//!
//! - **Wake-ups.** Each subscription's stream is polled with a waker of its
//!   own ([`SubWake`]), which pushes the subscription's key onto the
//!   session's ready list (once: a flag keeps a key on the list at most
//!   once) and wakes the body if the list was empty. A publish reaching 50
//!   of a session's subscriptions wakes the connection's task once and
//!   leaves 50 keys; the body polls
//!   those 50 streams and no other, however many the session holds.
//! - **Rounds.** The body takes the ready keys and polls each stream once: a
//!   round gives at most one delivery per subscription. Deliveries of one
//!   round that carry the same published message (the same `Arc`, broadcast
//!   only) become one `SessionDelivery` naming all their handles; since a
//!   handle appears at most once in a round and rounds go out in order, each
//!   subscription still sees its messages in its own order. A subscription
//!   that gave a delivery with more queued behind it is polled again in the
//!   next round; one whose delivery emptied its queue
//!   ([`DeliveryStream::poll_next_drained`]: the pop left the waker, as a
//!   `Pending` would) or that was pending is polled again when its waker
//!   fires. A subscriber that keeps up is so polled once per delivery, not
//!   twice. Rounds go on until nothing is ready or [`FRAME_THRESHOLD`]
//!   bytes are encoded.
//! - **Framing.** Deliveries are encoded by hand straight into the body's
//!   buffer ([`put_delivery`]): the `SessionEvent` and `SessionDelivery`
//!   headers, the packed handles, then the `Message` as
//!   [`crate::grpc::framing::EncodedMessage`] writes it for `OpenSubscription`. One
//!   message for 50 subscriptions is one encode and one copy of its payload,
//!   and everything ready goes to h2 as one DATA frame.
//! - **Credit.** A subscription opened with credit is not polled for
//!   deliveries once its credit is spent; what it is not sent waits in its
//!   own queue, which overflows and is evicted by the usual rules. It is
//!   still watched for its end ([`DeliveryStream::poll_ended`]), so an
//!   eviction is reported at once. `SessionCredit` puts it back on the ready
//!   list. A consumer-group member's credit is the engine's too
//!   (`SubscribeRequest::credit`, [`DeliveryStream::add_credit`]): its
//!   group hands it no more than it may send now, so nothing waits in its
//!   queue for credit while another member has room.
//! - **Requests** are read in the same poll, before the deliveries: opens
//!   register their subscription before anything else happens on the
//!   session, and an `opened` event is encoded before any delivery for it.
//!   A `close` encodes `ended` at once, and the handle is polled no more.
//!
//! A client that stops reading stops the body being polled (h2's flow
//! control): nothing is encoded, requests are not read, and each
//! subscription's queue fills and is evicted in turn, freeing what it held.
//! What is left of an evicted subscription until the client reads again is
//! its [`Sub`] and its closed, empty queue.

use super::convert;
use super::framing::{EncodedMessage, FRAME_THRESHOLD, GRPC_HEADER, SubscriberFields, deliver_span, reserve_frame};
use crate::engine::Published;
use crate::engine::WakeBatch;
use crate::engine::{
    Acked, BatchOutcome, BrokerError, CloseReason, Delivery, DeliveryStream, Engine, Nacked, NewMessage, PublishTime,
    StreamEnd, TracingHeaders,
};
use crate::ops::metrics::{IgnoredRequest, LocalObserver, Metrics, SessionGauge};
use crate::ops::telemetry;
use crate::pb;
use bytes::{BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::task::{ArcWake, AtomicWaker, waker_ref};
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use prost::encoding::{encode_varint, encoded_len_varint};
use slab::Slab;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::SystemTime;
use tonic::{Code, Status};

/// Most requests read in one poll before the deliveries get their turn.
const REQUESTS_PER_POLL: usize = 1024;
/// Most delivery rounds in one poll (each round polls every ready stream
/// once); the rest wait for the next poll.
const ROUNDS_PER_POLL: usize = 256;

/// `SessionEvent` field keys (field number and wire type 2, one byte each).
const DELIVERY_KEY: u8 = (2 << 3) | 2;
const DELIVERIES_KEY: u8 = (5 << 3) | 2;
const HANDLES_KEY: u8 = (1 << 3) | 2;
const MESSAGE_KEY: u8 = (2 << 3) | 2;
/// `SessionDeliveries.deliveries`.
const BATCHED_KEY: u8 = (1 << 3) | 2;
/// Room left ahead of a `deliveries` event for its frame header, its key
/// and its length: a varint of 3 bytes for an event within
/// [`DELIVERIES_BOUND`] (below 2 MiB), so that the head of an event of 16
/// KiB or more fills it exactly and nothing moves; of 5 bytes for one
/// delivery larger than the bound (a frame is below 4 GiB).
const DELIVERIES_HEAD: usize = GRPC_HEADER + 1 + 3;
const DELIVERIES_HEAD_LARGE: usize = GRPC_HEADER + 1 + 5;
/// The most bytes of deliveries one `deliveries` event holds (one delivery
/// larger than this alone is an event of its own).
pub const DELIVERIES_BOUND: usize = 64 * 1024;
/// Publishes read and not yet answered, at most: beyond them the session
/// reads no more requests until the oldest is answered (a cluster batch
/// waits for its group stores), so a client cannot queue unbounded work.
const PUBLISHES_WAITING: usize = 4;

/// The response body of one `Session` stream (see the module docs).
pub struct SessionBody<E: Engine, R> {
    engine: E,
    /// The client's requests; None once it half-closed (or they failed).
    requests: Option<R>,
    peer: Option<SocketAddr>,
    max_subscriptions: usize,
    metrics: Metrics,
    _gauge: SessionGauge,
    /// Every handle in use: its subscription's key in `subs`, or
    /// [`OPENING`] (8 bytes a handle; see [`SessionBody::handle`]).
    handles: HashMap<u32, u32, foldhash::fast::RandomState>,
    /// The handles the engine is opening, with what was asked of them
    /// meanwhile (empty unless the engine waits, as the cluster's may).
    openings: HashMap<u32, Opening>,
    subs: Slab<Sub<E::Stream>>,
    /// Opens the engine has not answered yet (the cluster engine may wait
    /// for NATS); the in-memory engine answers at once and never lands here.
    opening: FuturesUnordered<Opened<E::Stream>>,
    /// In-band acks and nacks the engine has not answered yet.
    acking: FuturesUnordered<Acking>,
    /// Acks and nacks read in this poll, applied together per handle
    /// (before any other request, so the order of what they touch holds).
    settling: Vec<Settle>,
    /// The session's publishing state (its route cache); out while a batch
    /// is being published.
    publisher: Option<E::Publisher>,
    /// Publishes read and not yet begun, oldest first.
    publishes: VecDeque<pb::SessionPublish>,
    /// The batch being published (a cluster batch may wait for NATS).
    publishing: Option<Publishing<E::Publisher>>,
    max_batch: usize,
    /// With tracing on: the parent of each batch message's publish span
    /// (the session's `traceparent`, if it had one).
    trace_parent: Option<opentelemetry::Context>,
    publish_duration: LocalObserver,
    publish_batch_size: prometheus::Histogram,
    ready: Arc<Ready>,
    /// Subscriptions that gave a delivery in the last round. (Keys are
    /// `u32` in these lists, as in [`SubWake`]: each list is as long as the
    /// session's subscriptions, at its longest.)
    again: Vec<u32>,
    /// The keys of the round being polled (kept for its allocation).
    keys: Vec<u32>,
    round: u64,
    out: Out,
    /// Resolves when the broker begins to shut down; None once it has.
    draining: Option<BoxFuture<'static, ()>>,
    /// Set when the session is to end once its subscriptions have: the
    /// client half-closed, or the broker is shutting down.
    ending: bool,
    /// The status of the trailers, once decided.
    finish: Option<Status>,
    done: bool,
}

/// An open the engine is answering: the handle and the stream (or why not).
type Opened<S> = BoxFuture<'static, (u32, Result<S, BrokerError>)>;
/// An in-band ack or nack the engine is answering: how many sequences it
/// named, and how many of them the subscription did not hold.
type Acking = BoxFuture<'static, (u32, Result<u32, BrokerError>)>;
/// A batch being published: its id, when it was read, how many messages,
/// what became of them, and the publisher back.
type Publishing<P> = BoxFuture<'static, (u64, PublishTime, usize, BatchOutcome, P)>;

/// Acks (or nacks) of one handle read together.
struct Settle {
    handle: u32,
    nack: bool,
    sequences: Vec<u64>,
}

/// What a handle names.
enum Handle {
    /// Being opened: its state is in `openings`.
    Opening,
    /// Open: its key in `subs`.
    Open(usize),
}

/// In `handles`: the handle is being opened. (A slab key is never this: a
/// session holds fewer than 2^32 subscriptions.)
const OPENING: u32 = u32::MAX;

/// A handle the engine is opening: credit granted and a close asked for
/// meanwhile are applied when it is open.
struct Opening {
    credit: Option<u64>,
    /// Credit added meanwhile, for the engine once it is open.
    added: u64,
    close: bool,
}

/// One subscription of the session.
struct Sub<S> {
    handle: u32,
    stream: S,
    /// Its id and group, encoded once (at its first delivery naming it
    /// alone: an idle subscription holds none).
    fields: Option<Box<SubscriberFields>>,
    group: bool,
    /// Deliveries it may still be sent.
    credit: Credit,
    /// Its waker, made from this when polled (`waker_ref`, no count taken).
    wake: Arc<SubWake>,
    /// The last round it was polled in.
    round: u64,
}

/// Deliveries a subscription may still be sent, in 8 bytes where an
/// `Option<u64>` takes 16: `u64::MAX` is no limit (credit topped up that
/// far saturates there, which is as good as none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Credit(u64);

impl Credit {
    const UNLIMITED: u64 = u64::MAX;

    fn new(credit: Option<u64>) -> Self {
        Self(credit.unwrap_or(Self::UNLIMITED))
    }

    /// None left (never true without a limit).
    #[inline]
    fn spent(self) -> bool {
        self.0 == 0
    }

    /// One delivery sent.
    #[inline]
    fn take_one(&mut self) {
        if self.0 != Self::UNLIMITED {
            self.0 -= 1;
        }
    }

    /// Adds `n`; what there was before, or None without a limit.
    fn add(&mut self, n: u64) -> Option<u64> {
        let was = self.0;
        (was != Self::UNLIMITED).then(|| {
            self.0 = was.saturating_add(n);
            was
        })
    }
}

/// The subscriptions with something to look at, and the body's waker.
#[derive(Default)]
struct Ready {
    keys: Mutex<Vec<u32>>,
    body: AtomicWaker,
}

/// One subscription's waker: puts its key on the ready list (32 bytes
/// with the `Arc`'s counts: the slab's key is a `u32`, since a session
/// holds fewer than 2^32 subscriptions).
struct SubWake {
    ready: Arc<Ready>,
    key: u32,
    queued: AtomicBool,
}

impl ArcWake for SubWake {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        if !arc_self.queued.swap(true, Ordering::AcqRel) {
            let mut keys = arc_self.ready.keys.lock();
            let first = keys.is_empty();
            keys.push(arc_self.key);
            drop(keys);
            // A list that was not empty has woken the body already, and
            // the body takes the whole list after registering its waker
            // (`poll_frame`, `deliver`): a publish reaching 50 of the
            // session's subscriptions wakes it once, not 50 times.
            if first {
                arc_self.ready.body.wake();
            }
        }
    }
}

/// What is encoded and not yet handed to h2, and the round being merged.
struct Out {
    /// The encode buffer. Until the session's first delivery it holds
    /// events only, each frame in an allocation of its own that goes with
    /// it to h2 (an idle session keeps no buffer); from then on, a chunk
    /// of [`crate::pb::codec::ENCODE_CHUNK`] at a time, reused
    /// ([`reserve_frame`]).
    buf: BytesMut,
    /// A delivery has been encoded.
    delivering: bool,
    lag_multi: LocalObserver,
    lag_single: LocalObserver,
    /// The fields of a delivery naming several handles: no id, no group.
    shared_fields: SubscriberFields,
    /// This round's deliveries, in the order they were first taken.
    batch: Vec<Batched>,
    /// Where each broadcast message of this round is in `batch`.
    index: HashMap<usize, usize, foldhash::fast::RandomState>,
    /// Handle lists of earlier rounds, kept for their allocations.
    spare: Vec<Vec<u32>>,
    /// Deliveries go out as `deliveries` events (the client asked).
    batched: bool,
    /// The `deliveries` event being written: where it starts in `buf`, the
    /// room left for its head, and how many deliveries it holds.
    open_batch: Option<(usize, usize, u64)>,
    delivery_batch_size: prometheus::Histogram,
}

/// One delivery of a round.
struct Batched {
    message: Arc<Published>,
    attempt: u32,
    /// The subscription it was first taken from.
    key: usize,
    handles: Vec<u32>,
}

impl<E: Engine, R> Unpin for SessionBody<E, R> {}

impl<E, R> SessionBody<E, R>
where
    E: Engine,
    R: Stream<Item = Result<pb::SessionRequest, Status>> + Send + Unpin + 'static,
{
    /// `batched`: the client asked for `deliveries` events.
    pub fn new(engine: E, requests: R, peer: Option<SocketAddr>, metrics: Metrics, batched: bool) -> Self {
        let max_subscriptions = engine.limits().max_subscriptions_per_session;
        let max_batch = engine.limits().max_batch_messages;
        let draining: BoxFuture<'static, ()> = Box::pin(engine.draining());
        Self {
            _gauge: metrics.session_opened(),
            out: Out {
                buf: BytesMut::new(),
                delivering: false,
                lag_multi: metrics.delivery_lag(false),
                lag_single: metrics.delivery_lag(true),
                shared_fields: SubscriberFields::new("", ""),
                batch: Vec::new(),
                index: HashMap::default(),
                spare: Vec::new(),
                batched,
                open_batch: None,
                delivery_batch_size: metrics.delivery_batch_size(),
            },
            publisher: Some(E::Publisher::default()),
            publishes: VecDeque::new(),
            publishing: None,
            max_batch,
            trace_parent: None,
            publish_duration: metrics.publish_duration(),
            publish_batch_size: metrics.publish_batch_size(),
            settling: Vec::new(),
            engine,
            requests: Some(requests),
            peer,
            max_subscriptions,
            metrics,
            handles: HashMap::default(),
            openings: HashMap::new(),
            subs: Slab::new(),
            opening: FuturesUnordered::new(),
            acking: FuturesUnordered::new(),
            ready: Arc::new(Ready::default()),
            again: Vec::new(),
            keys: Vec::new(),
            round: 0,
            draining: Some(draining),
            ending: false,
            finish: None,
            done: false,
        }
    }

    /// With tracing on (`parent`: the session's request metadata's trace
    /// context), each message of a batch gets a `publish` span, as one
    /// sent with `Publish` does, and its context in the message's headers.
    pub fn traced(mut self, parent: Option<opentelemetry::Context>) -> Self {
        self.trace_parent = parent;
        self
    }

    /// Reads what the client sent, up to [`REQUESTS_PER_POLL`].
    fn read_requests(&mut self, cx: &mut Context<'_>) {
        for _ in 0..REQUESTS_PER_POLL {
            let Some(requests) = &mut self.requests else { return };
            if self.out.buf.len() >= FRAME_THRESHOLD {
                // Hand what is encoded to h2 first; the body is polled again.
                return self.settle(cx);
            }
            if self.publishes.len() >= PUBLISHES_WAITING {
                // Read on once the batch being published is answered (its
                // future wakes the body).
                return self.settle(cx);
            }
            match requests.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(request))) => self.request(request, cx),
                Poll::Ready(Some(Err(error))) => {
                    self.requests = None;
                    self.fail(convert::request_stream_error(error, "tinybroker.v1.SessionRequest"));
                    return;
                }
                Poll::Ready(None) => {
                    // Half-closed: every subscription ends "closed", then
                    // the session ends with OK (once its publishes are
                    // answered).
                    self.settle(cx);
                    self.requests = None;
                    self.ending = true;
                    self.close_all();
                    return;
                }
                Poll::Pending => return self.settle(cx),
            }
        }
        self.settle(cx);
        // More may be buffered: come back to them after the deliveries.
        cx.waker().wake_by_ref();
    }

    fn request(&mut self, request: pb::SessionRequest, cx: &mut Context<'_>) {
        use pb::session_request::Request;
        match request.request {
            Some(Request::Ack(ack)) => return self.queue_settle(ack.handle, ack.sequences, false),
            Some(Request::Nack(nack)) => return self.queue_settle(nack.handle, nack.sequences, true),
            _ => {}
        }
        // Acks read before this request are applied before it.
        self.settle(cx);
        match request.request {
            None => self.ignored(IgnoredRequest::NoRequest, 1),
            Some(Request::Open(open)) => self.open(open, cx),
            Some(Request::Close(close)) => self.close(close.handle),
            Some(Request::Credit(credit)) => self.credit(credit.handle, credit.messages),
            Some(Request::Publish(publish)) => {
                self.publishes.push_back(publish);
                self.publish_next(cx);
            }
            Some(Request::Ack(_) | Request::Nack(_)) => {}
        }
    }

    /// Keeps an ack or nack with the others of its handle read in this
    /// poll: one application per handle (and kind, in order), not one per
    /// request.
    /// An ack without sequences stays a request of its own, to be counted
    /// as one (`no_sequences`).
    fn queue_settle(&mut self, handle: u32, sequences: Vec<u64>, nack: bool) {
        if !sequences.is_empty()
            && let Some(last) = self.settling.iter_mut().rev().find(|s| s.handle == handle)
            && last.nack == nack
            && !last.sequences.is_empty()
        {
            last.sequences.extend_from_slice(&sequences);
            return;
        }
        self.settling.push(Settle {
            handle,
            nack,
            sequences,
        });
    }

    /// Applies the acks and nacks read so far, per handle.
    #[inline]
    fn settle(&mut self, cx: &mut Context<'_>) {
        if self.settling.is_empty() {
            return;
        }
        let mut settling = std::mem::take(&mut self.settling);
        for s in settling.drain(..) {
            self.ack(s.handle, s.sequences, s.nack, cx);
        }
        // Kept for its allocation, unless one read brought very many.
        if settling.capacity() <= REQUESTS_PER_POLL {
            self.settling = settling;
        }
    }

    /// Begins the oldest waiting publish when none is being published:
    /// the embedded engine answers at once, the cluster engine may wait.
    fn publish_next(&mut self, cx: &mut Context<'_>) {
        while self.publishing.is_none() {
            let Some(publish) = self.publishes.pop_front() else {
                return;
            };
            let Some(mut publisher) = self.publisher.take() else {
                return;
            };
            let at = PublishTime::now();
            let len = publish.messages.len();
            self.publish_batch_size.observe(len as f64);
            if len > self.max_batch {
                self.publisher = Some(publisher);
                let answer = over_limit(len, self.max_batch);
                self.published(publish.id, at, len, answer);
                continue;
            }
            let (messages, spans) = match &self.trace_parent {
                None => (
                    publish
                        .messages
                        .into_iter()
                        .map(|m| convert::new_message(m, TracingHeaders::default()))
                        .collect(),
                    Vec::new(),
                ),
                Some(parent) => traced_messages(publish.messages, parent),
            };
            let engine = self.engine.clone();
            let id = publish.id;
            let mut publishing: Publishing<E::Publisher> = Box::pin(async move {
                let outcome = engine.publish_batch(messages, &mut publisher, at).await;
                record_sequences(&spans, &outcome);
                (id, at, len, outcome, publisher)
            });
            let _burst = WakeBatch::begin();
            match publishing.as_mut().poll(cx) {
                Poll::Ready((id, at, len, outcome, publisher)) => {
                    self.publisher = Some(publisher);
                    self.published(id, at, len, outcome);
                }
                Poll::Pending => self.publishing = Some(publishing),
            }
        }
    }

    /// Answers a publish.
    fn published(&mut self, id: u64, at: PublishTime, len: usize, outcome: BatchOutcome) {
        if outcome.accepted > 0 {
            let accepted = outcome.accepted as usize;
            self.publish_duration
                .observe_many(at.monotonic.elapsed().as_secs_f64() / accepted as f64, accepted);
            self.publish_duration.flush();
        }
        debug_assert_eq!(outcome.accepted as usize + outcome.rejected.len(), len);
        let rejected = outcome
            .rejected
            .into_iter()
            .map(|(index, error)| {
                let status = convert::status(error);
                pb::PublishRejection {
                    index,
                    code: status.code() as u32,
                    message: status.message().to_owned(),
                }
            })
            .collect();
        self.out
            .put_event(pb::session_event::Event::Published(pb::SessionPublished {
                id,
                first_sequence: outcome.first_sequence,
                accepted: outcome.accepted,
                rejected,
            }));
    }

    fn ignored(&self, reason: IgnoredRequest, count: u64) {
        self.metrics.session_request_ignored(reason, count);
    }

    fn open(&mut self, open: pb::SessionOpen, cx: &mut Context<'_>) {
        let handle = open.handle;
        if handle == 0 {
            return self.reject(
                handle,
                Code::InvalidArgument,
                "handle 0 is not a handle: a session names its subscriptions by non-zero handles".into(),
            );
        }
        if self.handles.contains_key(&handle) {
            return self.reject(
                handle,
                Code::AlreadyExists,
                format!("handle {handle} is already open on this session (a handle is free again once its ended event was sent)"),
            );
        }
        if self.handles.len() >= self.max_subscriptions {
            return self.reject(
                handle,
                Code::ResourceExhausted,
                format!(
                    "this session holds {} subscriptions, the limit is max_subscriptions_per_session {} (TINYBROKER_MAX_SUBSCRIPTIONS_PER_SESSION)",
                    self.handles.len(),
                    self.max_subscriptions
                ),
            );
        }
        let mut request = match convert::subscribe_request(open.subscription.unwrap_or_default(), self.peer) {
            Ok(request) => request,
            Err(status) => return self.reject(handle, status.code(), status.message().to_owned()),
        };
        let credit = (open.credit > 0).then_some(u64::from(open.credit));
        // A group hands a member no more than its credit lets it send.
        request.credit = credit;
        self.handles.insert(handle, OPENING);
        self.openings.insert(
            handle,
            Opening {
                credit,
                added: 0,
                close: false,
            },
        );
        let engine = self.engine.clone();
        let mut subscribing: BoxFuture<'static, _> = Box::pin(async move { (handle, engine.subscribe(request).await) });
        match subscribing.as_mut().poll(cx) {
            Poll::Ready((handle, result)) => self.opened(handle, result),
            Poll::Pending => self.opening.push(subscribing),
        }
    }

    /// The engine answered an open.
    fn opened(&mut self, handle: u32, result: Result<E::Stream, BrokerError>) {
        let Some(Opening { credit, added, close }) = self.openings.remove(&handle) else {
            // Only opens insert an Opening, and only this removes it.
            return;
        };
        self.handles.remove(&handle);
        let mut stream = match result {
            Ok(stream) => stream,
            Err(error) => {
                let status = convert::status(error);
                return self.reject(handle, status.code(), status.message().to_owned());
            }
        };
        self.out.put_event(pb::session_event::Event::Opened(pb::SessionOpened {
            handle,
            subscription_id: stream.id().to_owned(),
        }));
        if close || self.requests.is_none() {
            let end = stream.close();
            return self.put_ended(handle, end);
        }
        let group = stream.consumer_group().is_some_and(|g| !g.is_empty());
        if added > 0 {
            stream.add_credit(added);
        }
        let entry = self.subs.vacant_entry();
        let wake = Arc::new(SubWake {
            key: u32::try_from(entry.key()).expect("a session holds fewer than 2^32 subscriptions"),
            queued: AtomicBool::new(false),
            ready: self.ready.clone(),
        });
        let slot = wake.key;
        entry.insert(Sub {
            handle,
            fields: None,
            stream,
            group,
            credit: Credit::new(credit),
            wake,
            round: 0,
        });
        self.handles.insert(handle, slot);
        // Polled in the next round: what was published since it registered.
        self.again.push(slot);
    }

    /// What `handle` names, if it is in use.
    #[inline]
    fn handle(&self, handle: u32) -> Option<Handle> {
        self.handles.get(&handle).map(|&key| match key {
            OPENING => Handle::Opening,
            key => Handle::Open(key as usize),
        })
    }

    fn reject(&mut self, handle: u32, code: Code, message: String) {
        self.out.put_event(pb::session_event::Event::Ended(pb::SessionEnded {
            handle,
            reason: "rejected".into(),
            code: code as u32,
            message,
            ..Default::default()
        }));
    }

    fn close(&mut self, handle: u32) {
        match self.handle(handle) {
            None => self.ignored(IgnoredRequest::UnknownHandle, 1),
            Some(Handle::Opening) => {
                if let Some(opening) = self.openings.get_mut(&handle) {
                    opening.close = true;
                }
            }
            Some(Handle::Open(key)) => {
                self.handles.remove(&handle);
                let mut sub = self.subs.remove(key);
                let end = sub.stream.close();
                self.put_ended(sub.handle, end);
            }
        }
    }

    /// Closes every open subscription (the client half-closed); those still
    /// opening close once open.
    fn close_all(&mut self) {
        let handles: Vec<u32> = self.handles.keys().copied().collect();
        for handle in handles {
            self.close(handle);
        }
    }

    fn credit(&mut self, handle: u32, messages: u32) {
        let added = u64::from(messages);
        match self.handle(handle) {
            None => self.ignored(IgnoredRequest::UnknownHandle, 1),
            Some(Handle::Opening) => {
                if let Some(opening) = self.openings.get_mut(&handle)
                    && let Some(credit) = &mut opening.credit
                {
                    *credit = credit.saturating_add(added);
                    opening.added = opening.added.saturating_add(added);
                }
            }
            Some(Handle::Open(key)) => {
                let sub = &mut self.subs[key];
                if let Some(was) = sub.credit.add(added) {
                    if was == 0 && added > 0 {
                        ArcWake::wake_by_ref(&sub.wake);
                    }
                    // A member's group may hand it more now.
                    if sub.group && added > 0 {
                        sub.stream.add_credit(added);
                    }
                }
            }
        }
    }

    fn ack(&mut self, handle: u32, sequences: Vec<u64>, nack: bool, cx: &mut Context<'_>) {
        let key = match self.handle(handle) {
            None => return self.ignored(IgnoredRequest::UnknownHandle, 1),
            Some(Handle::Opening) => {
                // Nothing can be held before it is open.
                return self.ignored(IgnoredRequest::UnknownSequence, sequences.len() as u64);
            }
            Some(Handle::Open(key)) => key,
        };
        if sequences.is_empty() {
            return self.ignored(IgnoredRequest::NoSequences, 1);
        }
        if let Some(unknown) = self.subs[key].stream.settle(&sequences, nack) {
            return self.ignored(IgnoredRequest::UnknownSequence, u64::from(unknown));
        }
        let engine = self.engine.clone();
        let id = self.subs[key].stream.id().to_owned();
        let count = sequences.len() as u32;
        let mut acking: Acking = Box::pin(async move {
            let unknown = if nack {
                engine.nack(&id, &sequences).await.map(|Nacked { unknown, .. }| unknown)
            } else {
                engine.ack(&id, &sequences).await.map(|Acked { unknown, .. }| unknown)
            };
            (count, unknown)
        });
        match acking.as_mut().poll(cx) {
            Poll::Ready((count, result)) => self.acked(result, count),
            Poll::Pending => self.acking.push(acking),
        }
    }

    /// What an in-band ack or nack did: sequences it did not hold are
    /// counted (an engine refusal, e.g. the subscription ended meanwhile,
    /// counts them all).
    fn acked(&self, result: Result<u32, BrokerError>, count: u32) {
        let unknown = match result {
            Ok(unknown) => unknown,
            Err(error) => {
                tracing::debug!(error = %error, "in-band ack or nack refused");
                count
            }
        };
        self.ignored(IgnoredRequest::UnknownSequence, u64::from(unknown));
    }

    fn poll_pending(&mut self, cx: &mut Context<'_>) {
        while let Poll::Ready(Some((handle, result))) = self.opening.poll_next_unpin(cx) {
            self.opened(handle, result);
        }
        while let Poll::Ready(Some((count, result))) = self.acking.poll_next_unpin(cx) {
            self.acked(result, count);
        }
        if let Some(publishing) = &mut self.publishing {
            let _burst = WakeBatch::begin();
            if let Poll::Ready((id, at, len, outcome, publisher)) = publishing.as_mut().poll(cx) {
                self.publishing = None;
                self.publisher = Some(publisher);
                self.published(id, at, len, outcome);
                self.publish_next(cx);
                // Reading may have stopped at PUBLISHES_WAITING, with no
                // waker left on the requests: read on in the next poll.
                cx.waker().wake_by_ref();
            }
        }
        if let Some(draining) = &mut self.draining
            && draining.as_mut().poll(cx).is_ready()
        {
            self.draining = None;
            self.ending = true;
        }
    }

    /// Polls the ready subscriptions, round by round (see the module docs).
    fn deliver(&mut self, cx: &mut Context<'_>) {
        let mut ended: Vec<usize> = Vec::new();
        for _ in 0..ROUNDS_PER_POLL {
            let mut keys = std::mem::take(&mut self.keys);
            keys.clear();
            keys.append(&mut self.again);
            keys.append(&mut self.ready.keys.lock());
            if keys.is_empty() {
                self.keys = keys;
                return;
            }
            self.round += 1;
            for &slot in &keys {
                let key = slot as usize;
                let Some(sub) = self.subs.get_mut(key) else { continue };
                if sub.round == self.round {
                    continue;
                }
                sub.round = self.round;
                sub.wake.queued.store(false, Ordering::Release);
                let waker = waker_ref(&sub.wake);
                let mut sub_cx = Context::from_waker(&waker);
                if sub.credit.spent() {
                    if sub.stream.poll_ended(&mut sub_cx).is_ready() {
                        ended.push(key);
                    }
                    continue;
                }
                match sub.stream.poll_next_drained(&mut sub_cx) {
                    Poll::Ready(Some((delivery, drained))) => {
                        sub.credit.take_one();
                        self.out.take(key, sub.handle, sub.group, delivery);
                        // Drained: its waker is left, and the next push puts
                        // it on the ready list; else it goes again next round.
                        if !drained {
                            self.again.push(slot);
                        }
                    }
                    Poll::Ready(None) => ended.push(key),
                    Poll::Pending => {}
                }
            }
            self.keys = keys;
            self.out.encode_round(&mut self.subs);
            for key in ended.drain(..) {
                let sub = self.subs.remove(key);
                self.handles.remove(&sub.handle);
                let end = sub.stream.end().unwrap_or(StreamEnd {
                    reason: CloseReason::Cancelled,
                    dropped: 0,
                    last_sequence: 0,
                });
                self.put_ended(sub.handle, end);
            }
            if self.out.buf.len() >= FRAME_THRESHOLD {
                return;
            }
        }
        // Rounds left for the next poll.
        cx.waker().wake_by_ref();
    }

    fn put_ended(&mut self, handle: u32, end: StreamEnd) {
        let reason = match end.reason {
            CloseReason::Cancelled => "closed",
            other => other.label(),
        };
        self.out.put_event(pb::session_event::Event::Ended(pb::SessionEnded {
            handle,
            reason: reason.into(),
            dropped: end.dropped,
            last_sequence: end.last_sequence,
            code: 0,
            message: String::new(),
        }));
    }

    /// Ends the session with `status`: its subscriptions end as a cancelled
    /// `OpenSubscription` does (dropped).
    fn fail(&mut self, status: Status) {
        self.handles.clear();
        self.openings.clear();
        self.subs.clear();
        self.opening = FuturesUnordered::new();
        self.publishes.clear();
        self.publishing = None;
        self.settling.clear();
        self.finish = Some(status);
    }

    fn trailers(status: &Status) -> tonic::codegen::http::HeaderMap {
        let mut trailers = tonic::codegen::http::HeaderMap::with_capacity(2);
        // Only a message that is not valid in a header fails; ours are.
        let _ = status.add_header(&mut trailers);
        trailers
    }
}

impl Out {
    /// Appends an `opened`, `ended` or `published` event, after the
    /// `deliveries` event being written (ended first).
    fn put_event(&mut self, event: pb::session_event::Event) {
        self.close_batch();
        put_event(&mut self.buf, event, self.delivering);
    }

    /// What is encoded, for h2: the buffer's chunk stays for the next
    /// deliveries; before the first, the whole buffer goes (see `buf`).
    fn hand_out(&mut self) -> Bytes {
        match self.delivering {
            true => self.buf.split().freeze(),
            false => std::mem::take(&mut self.buf).freeze(),
        }
    }

    /// Appends a delivery to the `deliveries` event being written, or
    /// begins one (when there is none, or this one would take it past
    /// [`DELIVERIES_BOUND`]).
    fn put_batched(&mut self, handles: &[u32], message: &EncodedMessage) {
        let (delivery_len, handles_len, message_len) = delivery_lens(handles, message);
        let element = 1 + encoded_len_varint(delivery_len as u64) + delivery_len;
        if let Some((start, head, _)) = self.open_batch
            && self.buf.len() - start - head + element > DELIVERIES_BOUND
        {
            self.close_batch();
        }
        match &mut self.open_batch {
            Some((_, _, count)) => {
                *count += 1;
                reserve_frame(&mut self.buf, element);
            }
            None => {
                let head = match element <= DELIVERIES_BOUND {
                    true => DELIVERIES_HEAD,
                    false => DELIVERIES_HEAD_LARGE,
                };
                // Room for what one poll writes at most (deliver() stops
                // past FRAME_THRESHOLD), so that an event does not grow by
                // reallocations, each copying what it holds.
                reserve_frame(&mut self.buf, head + element.max(FRAME_THRESHOLD));
                self.open_batch = Some((self.buf.len(), head, 1));
                self.buf.put_bytes(0, head);
            }
        }
        self.buf.put_u8(BATCHED_KEY);
        encode_varint(delivery_len as u64, &mut self.buf);
        put_delivery_fields(&mut self.buf, handles, handles_len, message, message_len);
    }

    /// Ends the `deliveries` event being written, if any: its head written
    /// in front of it, where room was left, and the deliveries moved up to
    /// it by the bytes the head did not need.
    #[inline]
    fn close_batch(&mut self) {
        if self.open_batch.is_some() {
            self.end_batch();
        }
    }

    /// [`Out::close_batch`] of the open event.
    fn end_batch(&mut self) {
        let Some((start, room, count)) = self.open_batch.take() else {
            return;
        };
        let body = start + room;
        let body_len = self.buf.len() - body;
        let event_len = 1 + encoded_len_varint(body_len as u64) + body_len;
        let mut head = [0u8; DELIVERIES_HEAD_LARGE];
        let mut writer = &mut head[..];
        writer.put_u8(0);
        writer.put_u32(event_len as u32);
        writer.put_u8(DELIVERIES_KEY);
        encode_varint(body_len as u64, &mut writer);
        let head_len = DELIVERIES_HEAD_LARGE - writer.len();
        self.buf[start..start + head_len].copy_from_slice(&head[..head_len]);
        // Only an event below 16 KiB (or a large one below 256 MiB) has
        // room to spare: its deliveries move up by a byte or two.
        let gap = room - head_len;
        if gap > 0 {
            self.buf.copy_within(body.., start + head_len);
            self.buf.truncate(self.buf.len() - gap);
        }
        self.delivery_batch_size.observe(count as f64);
    }

    /// Takes one delivery of the round: a broadcast message already taken
    /// in this round gets this handle too.
    fn take(&mut self, key: usize, handle: u32, group: bool, delivery: Delivery) {
        if !group {
            let at = Arc::as_ptr(&delivery.message) as usize;
            if let Some(&i) = self.index.get(&at) {
                self.batch[i].handles.push(handle);
                return;
            }
            self.index.insert(at, self.batch.len());
        }
        let mut handles = self.spare.pop().unwrap_or_default();
        handles.push(handle);
        self.batch.push(Batched {
            message: delivery.message,
            attempt: delivery.attempt,
            key,
            handles,
        });
    }

    /// Encodes the round's deliveries, in the order they were taken.
    fn encode_round<S: DeliveryStream>(&mut self, subs: &mut Slab<Sub<S>>) {
        if self.batch.is_empty() {
            return;
        }
        self.delivering = true;
        let now = SystemTime::now();
        let mut batch = std::mem::take(&mut self.batch);
        for mut b in batch.drain(..) {
            let sub = &mut subs[b.key];
            let fields = match b.handles.len() {
                1 => sub.fields.get_or_insert_with(|| {
                    Box::new(SubscriberFields::new(
                        sub.stream.id(),
                        sub.stream.consumer_group().unwrap_or_default(),
                    ))
                }),
                _ => &self.shared_fields,
            };
            if let Ok(lag) = now.duration_since(b.message.publish_time) {
                let lag = lag.as_secs_f64();
                match sub.group {
                    true => self.lag_single.observe(lag),
                    false => self.lag_multi.observe_many(lag, b.handles.len()),
                }
            }
            if telemetry::tracing_enabled() {
                // Named by the first of its handles' subscriptions.
                let group = sub.stream.consumer_group().unwrap_or_default();
                deliver_span(&b.message, group, sub.stream.id(), b.attempt);
            }
            let message = EncodedMessage::new(b.message, fields, b.attempt);
            match self.batched {
                false => put_delivery(&mut self.buf, &b.handles, &message),
                true => self.put_batched(&b.handles, &message),
            }
            b.handles.clear();
            self.spare.push(b.handles);
        }
        self.batch = batch;
        self.index.clear();
        self.lag_multi.flush();
        self.lag_single.flush();
    }
}

/// Appends one gRPC frame holding a `SessionEvent { delivery: SessionDelivery
/// { handles, message } }`, encoded by hand (see the module docs).
#[inline]
fn put_delivery(buf: &mut BytesMut, handles: &[u32], message: &EncodedMessage) {
    let (delivery_len, handles_len, message_len) = delivery_lens(handles, message);
    let event_len = 1 + encoded_len_varint(delivery_len as u64) + delivery_len;
    reserve_frame(buf, GRPC_HEADER + event_len);
    buf.put_u8(0);
    // max_message_bytes is far below 4 GiB (config), so this holds.
    buf.put_u32(event_len as u32);
    buf.put_u8(DELIVERY_KEY);
    encode_varint(delivery_len as u64, buf);
    put_delivery_fields(buf, handles, handles_len, message, message_len);
}

/// A `SessionDelivery`'s encoded length, and its handles' and message's.
#[inline]
fn delivery_lens(handles: &[u32], message: &EncodedMessage) -> (usize, usize, usize) {
    let message_len = prost::Message::encoded_len(message);
    let handles_len: usize = handles.iter().map(|&h| encoded_len_varint(u64::from(h))).sum();
    let delivery_len = 1
        + encoded_len_varint(handles_len as u64)
        + handles_len
        + 1
        + encoded_len_varint(message_len as u64)
        + message_len;
    (delivery_len, handles_len, message_len)
}

/// A `SessionDelivery`'s fields: the packed handles, then the message.
#[inline(always)]
fn put_delivery_fields(
    buf: &mut BytesMut,
    handles: &[u32],
    handles_len: usize,
    message: &EncodedMessage,
    message_len: usize,
) {
    buf.put_u8(HANDLES_KEY);
    encode_varint(handles_len as u64, buf);
    for &handle in handles {
        encode_varint(u64::from(handle), buf);
    }
    buf.put_u8(MESSAGE_KEY);
    encode_varint(message_len as u64, buf);
    prost::Message::encode_raw(message, buf);
}

/// The answer to a batch of `len` messages, over the limit of `max`: every
/// index rejected, RESOURCE_EXHAUSTED naming the limit. In a batch of more
/// than 4 times the limit only the first rejection carries the text (the
/// others the code), so that the answer to a huge count of tiny messages
/// stays small.
fn over_limit(len: usize, max: usize) -> BatchOutcome {
    let message = format!(
        "a batch of {len} messages is over max_batch_messages {max} (TINYBROKER_MAX_BATCH_MESSAGES): nothing in it was published; split it"
    );
    let texts = if len > max.saturating_mul(4) { 1 } else { len };
    BatchOutcome {
        first_sequence: 0,
        accepted: 0,
        rejected: (0..len as u32)
            .map(|i| {
                let text = if (i as usize) < texts {
                    message.clone()
                } else {
                    String::new()
                };
                (i, BrokerError::ResourceExhausted(text))
            })
            .collect(),
    }
}

/// A batch's messages with tracing on: each in a `publish` span whose parent
/// is the session's trace context, that span's context in its headers
/// (unless the publisher set one), as `Publish` does.
fn traced_messages(
    requests: Vec<pb::PublishRequest>,
    parent: &opentelemetry::Context,
) -> (Vec<NewMessage>, Vec<tracing::Span>) {
    requests
        .into_iter()
        .map(|mut request| {
            let (span, tracing) = super::framing::publish_span(&mut request, parent);
            (convert::new_message(request, tracing), span)
        })
        .unzip()
}

/// Records each accepted message's sequence in its span (the accepted
/// ones took consecutive sequences, in order, skipping the rejected).
fn record_sequences(spans: &[tracing::Span], outcome: &BatchOutcome) {
    if spans.is_empty() || outcome.accepted == 0 {
        return;
    }
    let mut rejected = outcome.rejected.iter().map(|(index, _)| *index as usize).peekable();
    let mut sequence = outcome.first_sequence;
    for (index, span) in spans.iter().enumerate() {
        if rejected.peek() == Some(&index) {
            rejected.next();
            continue;
        }
        span.record("messaging.message.id", sequence);
        sequence += 1;
    }
}

/// Appends one gRPC frame holding an `opened`, `ended` or `published`
/// event; into the delivery chunk once `delivering`, else into no more room
/// than the events take (see [`Out`]'s `buf`).
fn put_event(buf: &mut BytesMut, event: pb::session_event::Event, delivering: bool) {
    let event = pb::SessionEvent { event: Some(event) };
    let len = prost::Message::encoded_len(&event);
    match delivering {
        true => reserve_frame(buf, GRPC_HEADER + len),
        // Many events in one poll grow it as a `Vec` does.
        false => buf.reserve(GRPC_HEADER + len),
    }
    buf.put_u8(0);
    buf.put_u32(len as u32);
    prost::Message::encode_raw(&event, buf);
}

impl<E, R> http_body::Body for SessionBody<E, R>
where
    E: Engine,
    R: Stream<Item = Result<pb::SessionRequest, Status>> + Send + Unpin + 'static,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.finish.is_none() {
            this.ready.body.register(cx.waker());
            this.read_requests(cx);
        }
        if this.finish.is_none() {
            this.poll_pending(cx);
            this.deliver(cx);
            if this.ending && this.handles.is_empty() && this.publishing.is_none() && this.publishes.is_empty() {
                this.finish = Some(Status::ok(""));
            }
        }
        this.out.close_batch();
        if !this.out.buf.is_empty() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(this.out.hand_out()))));
        }
        if let Some(status) = this.finish.take() {
            this.done = true;
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(Self::trailers(&status)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    //! The session body driven by hand over the in-memory engine: requests
    //! in through a channel, events out of `poll_frame`, decoded as a
    //! client decodes them. Each test names what it would see on a broken
    //! body.

    use super::*;
    use crate::broker::Broker;
    use crate::config::Limits;
    use crate::engine::{NewMessage, Peaks};
    use futures::channel::mpsc;
    use http_body::Body as _;
    use pb::session_event::Event;
    use pb::session_request::Request;
    use prost::Message as _;

    type Requests = mpsc::UnboundedReceiver<Result<pb::SessionRequest, Status>>;

    /// One session on a broker of its own.
    struct Session {
        broker: Broker,
        metrics: Metrics,
        requests: mpsc::UnboundedSender<Result<pb::SessionRequest, Status>>,
        body: SessionBody<Broker, Requests>,
        trailers: Option<Status>,
    }

    fn session() -> Session {
        session_with(Limits::default())
    }

    fn session_with(limits: Limits) -> Session {
        session_batched(limits, false)
    }

    fn session_batched(limits: Limits, batched: bool) -> Session {
        let broker = Broker::new(limits);
        let metrics = Metrics::new(broker.clone(), false);
        let (requests, received) = mpsc::unbounded();
        let body = SessionBody::new(broker.clone(), received, None, metrics.clone(), batched);
        Session {
            broker,
            metrics,
            requests,
            body,
            trailers: None,
        }
    }

    fn subscription(patterns: &[&str]) -> pb::OpenSubscriptionRequest {
        pb::OpenSubscriptionRequest {
            topic_patterns: patterns.iter().map(|p| (*p).to_owned()).collect(),
            ..Default::default()
        }
    }

    fn member(group: &str, pattern: &str) -> pb::OpenSubscriptionRequest {
        pb::OpenSubscriptionRequest {
            mode: pb::DeliveryMode::Single as i32,
            consumer_group: group.into(),
            ..subscription(&[pattern])
        }
    }

    impl Session {
        fn send(&self, request: Request) {
            self.requests
                .unbounded_send(Ok(pb::SessionRequest { request: Some(request) }))
                .unwrap();
        }

        fn open(&self, handle: u32, subscription: pb::OpenSubscriptionRequest, credit: u32) {
            self.send(Request::Open(pb::SessionOpen {
                handle,
                subscription: Some(subscription),
                credit,
            }));
        }

        fn credit(&self, handle: u32, messages: u32) {
            self.send(Request::Credit(pb::SessionCredit { handle, messages }));
        }

        fn publish(&self, topic: &str, payload: &str) -> u64 {
            let message = NewMessage {
                topic: topic.into(),
                payload: payload.as_bytes().to_vec().into(),
                ..Default::default()
            };
            self.broker.publish(message, None).unwrap().sequence
        }

        /// Polls the body until it has nothing more to give now: the events
        /// it sent, in order (the trailers, if it ended, in `trailers`).
        fn events(&mut self) -> Vec<Event> {
            self.events_waking(std::task::Waker::noop())
        }

        /// [`Session::events`], polled with `waker`.
        fn events_waking(&mut self, waker: &std::task::Waker) -> Vec<Event> {
            let mut cx = Context::from_waker(waker);
            let mut events = Vec::new();
            for _ in 0..1000 {
                let frame = match Pin::new(&mut self.body).poll_frame(&mut cx) {
                    Poll::Pending | Poll::Ready(None) => return events,
                    Poll::Ready(Some(frame)) => frame.expect("the body does not fail"),
                };
                let mut data = match frame.into_data() {
                    Ok(data) => data,
                    Err(frame) => {
                        let trailers = frame.into_trailers().expect("data or trailers");
                        self.trailers = Some(Status::from_header_map(&trailers).expect("a grpc-status"));
                        return events;
                    }
                };
                while !data.is_empty() {
                    assert_eq!(data[0], 0, "not compressed");
                    let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
                    let event = pb::SessionEvent::decode(&data[GRPC_HEADER..GRPC_HEADER + len]).unwrap();
                    events.push(event.event.expect("an event"));
                    data = data.slice(GRPC_HEADER + len..);
                }
            }
            panic!("the body never stopped giving frames");
        }

        /// The deliveries among `events()`, as (handles, sequence); those
        /// of a `deliveries` event as if each came alone.
        fn deliveries(&mut self) -> Vec<(Vec<u32>, u64)> {
            self.events()
                .into_iter()
                .flat_map(|e| match e {
                    Event::Delivery(d) => vec![d],
                    Event::Deliveries(b) => b.deliveries,
                    _ => vec![],
                })
                .map(|d| (d.handles, d.message.unwrap().sequence))
                .collect()
        }

        fn publish_batch(&self, id: u64, topics: &[&str]) {
            let messages = topics
                .iter()
                .map(|t| pb::PublishRequest {
                    topic: (*t).into(),
                    payload: Bytes::from_static(b"p"),
                    ..Default::default()
                })
                .collect();
            self.send(Request::Publish(pb::SessionPublish { id, messages }));
        }

        /// The sequences delivered to `handle` alone, in order.
        fn sequences_for(&mut self, handle: u32) -> Vec<u64> {
            self.deliveries()
                .into_iter()
                .map(|(handles, sequence)| {
                    assert_eq!(handles, [handle], "a delivery to {handle} alone");
                    sequence
                })
                .collect()
        }

        /// `tinybroker_session_requests_ignored_total{reason}`.
        fn ignored(&self, reason: IgnoredRequest) -> u64 {
            let line = format!(
                "tinybroker_session_requests_ignored_total{{reason=\"{}\"}} ",
                reason.label()
            );
            let text = self.metrics.render();
            text.lines()
                .find_map(|l| l.strip_prefix(&line))
                .unwrap_or_else(|| panic!("{line} in\n{text}"))
                .parse()
                .unwrap()
        }

        /// The queue depth of the one subscription on the broker.
        fn queued(&self) -> usize {
            let subscriptions = self.broker.subscriptions(Peaks::Keep);
            assert_eq!(subscriptions.len(), 1, "one subscription");
            subscriptions[0].queue_depth
        }
    }

    /// The `published` answers among `events`.
    fn published(events: &[Event]) -> Vec<pb::SessionPublished> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Published(p) => Some(p.clone()),
                _ => None,
            })
            .collect()
    }

    /// The sequences of the (bare) deliveries among `events`.
    fn delivered(events: &[Event]) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Delivery(d) => Some(d.message.as_ref().unwrap().sequence),
                _ => None,
            })
            .collect()
    }

    fn opened(event: &Event) -> u32 {
        match event {
            Event::Opened(o) => o.handle,
            other => panic!("an opened event, not {other:?}"),
        }
    }

    fn ended(event: &Event) -> &pb::SessionEnded {
        match event {
            Event::Ended(e) => e,
            other => panic!("an ended event, not {other:?}"),
        }
    }

    /// Credit 2: two deliveries, then nothing while the rest wait in the
    /// subscription's queue; each top-up sends that many more, in order.
    /// (Without the decrement all five go at once; without the wake on a
    /// top-up from zero the waiting ones never go.)
    #[test]
    fn credit_is_spent_per_delivery_and_a_top_up_sends_what_waited() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 2);
        let events = s.events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(opened(&events[0]), 1);

        let sent: Vec<u64> = (0..5).map(|i| s.publish("t", &format!("m{i}"))).collect();
        assert_eq!(s.sequences_for(1), sent[..2], "two, for a credit of two");
        assert_eq!(s.sequences_for(1), [0u64; 0], "none while the credit is spent");
        assert_eq!(s.queued(), 3, "the other three wait in the queue");

        s.credit(1, 2);
        assert_eq!(s.sequences_for(1), sent[2..4], "two more for a top-up of two");
        assert_eq!(s.queued(), 1);
        s.credit(1, 10);
        assert_eq!(s.sequences_for(1), sent[4..], "the last");
        // Eight left of the ten: what comes next goes at once.
        let later = s.publish("t", "later");
        assert_eq!(s.sequences_for(1), [later]);
    }

    /// Credit 0 is no limit, and credit for such a handle changes nothing.
    #[test]
    fn zero_credit_at_open_means_no_limit() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 0);
        s.events();
        let sent: Vec<u64> = (0..300).map(|i| s.publish("t", &format!("m{i}"))).collect();
        assert_eq!(s.sequences_for(1), sent);
        s.credit(1, 1);
        let sent: Vec<u64> = (0..3).map(|i| s.publish("t", &format!("n{i}"))).collect();
        assert_eq!(s.sequences_for(1), sent, "still no limit");
        assert_eq!(s.ignored(IgnoredRequest::UnknownHandle), 0, "a known handle");
    }

    /// Credit granted while the engine opens the handle counts from the
    /// start, and a top-up of zero sends nothing.
    #[test]
    fn a_top_up_of_nothing_sends_nothing_and_credit_is_per_handle() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 1);
        s.open(2, subscription(&["t"]), 3);
        s.events();
        let sent: Vec<u64> = (0..4).map(|i| s.publish("t", &format!("m{i}"))).collect();
        let mut to = HashMap::<u32, Vec<u64>>::new();
        for (handles, sequence) in s.deliveries() {
            for h in handles {
                to.entry(h).or_default().push(sequence);
            }
        }
        assert_eq!(to[&1], sent[..1], "handle 1's credit is 1");
        assert_eq!(to[&2], sent[..3], "handle 2's credit is 3");
        s.credit(1, 0);
        s.credit(2, 0);
        assert_eq!(s.deliveries(), [], "a top-up of 0 adds nothing");
        s.credit(2, 1);
        assert_eq!(s.sequences_for(2), sent[3..]);
    }

    /// A subscription whose credit is spent is still watched for its end:
    /// closed by an admin, its `ended` event comes at once, counting what
    /// it never sent.
    #[test]
    fn a_subscription_without_credit_still_reports_its_end() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 1);
        let Event::Opened(o) = &s.events()[0] else {
            panic!("opened")
        };
        let id = o.subscription_id.clone();
        let first = s.publish("t", "a");
        s.publish("t", "b");
        s.publish("t", "c");
        assert_eq!(s.sequences_for(1), [first]);
        s.broker.close_subscription(&id).unwrap();
        let events = s.events();
        assert_eq!(events.len(), 1, "{events:?}");
        let end = ended(&events[0]);
        assert_eq!(
            (end.handle, end.reason.as_str(), end.dropped),
            (1, "closed_by_admin", 2),
            "{end:?}"
        );
        // The handle is free again.
        s.open(1, subscription(&["t"]), 0);
        assert_eq!(opened(&s.events()[0]), 1);
    }

    /// A consumer-group member's credit is its group's too: the group hands
    /// it no more than its credit, the rest stays in the group's backlog
    /// (for another member), and a top-up lets the group hand it more.
    #[test]
    fn a_members_credit_holds_the_rest_in_its_groups_backlog_until_a_top_up() {
        let mut s = session();
        s.open(1, member("g", "jobs"), 1);
        s.events();
        let sent: Vec<u64> = (0..3).map(|i| s.publish("jobs", &format!("j{i}"))).collect();
        assert_eq!(s.sequences_for(1), sent[..1]);
        let broker = s.broker.clone();
        let group = || broker.groups().into_iter().next().unwrap();
        assert_eq!(group().backlog, 2, "{:?}", group());
        s.credit(1, 2);
        assert_eq!(s.sequences_for(1), sent[1..]);
        assert_eq!(group().backlog, 0);
    }

    /// An idle session holds no encode buffer: its `opened` events go to h2
    /// with their allocation (it held 8 KiB, 82 bytes of each of 100 idle
    /// subscriptions). Once it delivers, the buffer's chunk stays between
    /// frames, to be encoded into again.
    #[test]
    fn an_idle_session_keeps_no_encode_buffer_and_a_delivering_one_keeps_its_chunk() {
        let mut s = session();
        for handle in 1..=100 {
            s.open(handle, subscription(&[&format!("idle.{handle}")]), 0);
        }
        assert_eq!(s.events().len(), 100);
        assert_eq!(s.body.out.buf.capacity(), 0, "an idle session holds a buffer");
        s.publish("idle.7", "first");
        assert_eq!(s.deliveries().len(), 1);
        assert!(s.body.out.buf.capacity() > 0, "the delivery chunk was given back");
    }

    /// A subscription's waker wakes the body when it puts the first key on
    /// the ready list, and only then: a publish to three handles wakes the
    /// idle body once, and once more after the body took the list. (A body
    /// that missed a wake-up would stall until the next request.)
    #[test]
    fn the_first_key_on_the_ready_list_wakes_the_body() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count(Default::default()));
        let waker = std::task::Waker::from(count.clone());
        let woken = || count.0.load(Ordering::SeqCst);
        let mut s = session();
        for handle in 1..=3 {
            s.open(handle, subscription(&["t"]), 0);
        }
        s.open(4, subscription(&["u"]), 0);
        assert_eq!(s.events_waking(&waker).len(), 4);
        let before = woken();
        s.publish("t", "one");
        assert_eq!(woken(), before + 1, "the idle body is woken once");
        assert_eq!(s.events_waking(&waker).len(), 1);
        s.publish("t", "two");
        assert_eq!(woken(), before + 2, "and again once it took the list");
        // Handle 4's key joins the three on the list, which have woken the
        // body already.
        s.publish("u", "three");
        assert_eq!(woken(), before + 2);
        let mut got = s.deliveries();
        got.iter_mut().for_each(|(handles, _)| handles.sort_unstable());
        assert_eq!(
            got.iter().map(|(h, _)| h.clone()).collect::<Vec<_>>(),
            [vec![1, 2, 3], vec![4]]
        );
    }

    /// One published message matched by several handles of the session is
    /// one delivery naming them all, without a subscription id (it is
    /// several); a message for one handle names it and carries its id.
    #[test]
    fn one_message_for_several_handles_is_one_delivery_naming_them_all() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 0);
        s.open(2, subscription(&["t", "only.two"]), 0);
        s.open(3, subscription(&["*"]), 0);
        s.open(4, subscription(&["elsewhere"]), 0);
        let ids: HashMap<u32, String> = s
            .events()
            .into_iter()
            .map(|e| match e {
                Event::Opened(o) => (o.handle, o.subscription_id),
                other => panic!("{other:?}"),
            })
            .collect();
        let shared = s.publish("t", "to three");
        let events = s.events();
        assert_eq!(events.len(), 1, "one delivery: {events:?}");
        let Event::Delivery(d) = &events[0] else {
            panic!("{events:?}")
        };
        let mut handles = d.handles.clone();
        handles.sort_unstable();
        assert_eq!(handles, [1, 2, 3]);
        let m = d.message.as_ref().unwrap();
        assert_eq!((m.sequence, m.subscription_id.as_str()), (shared, ""));
        assert_eq!(&m.payload[..], b"to three");

        let alone = s.publish("only.two", "to two");
        let events = s.events();
        assert_eq!(events.len(), 1, "{events:?}");
        let Event::Delivery(d) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(d.handles, [2]);
        let m = d.message.as_ref().unwrap();
        assert_eq!((m.sequence, &m.subscription_id), (alone, &ids[&2]));
    }

    /// A handle appears once per round, so a handle with more queued than
    /// another does not pull a later message into an earlier delivery:
    /// each handle sees its own messages in order, and a message reaches
    /// each of its handles exactly once.
    #[test]
    fn merged_deliveries_keep_each_handles_order() {
        let mut s = session();
        s.open(1, subscription(&["a.*"]), 0);
        s.open(2, subscription(&["a.x"]), 0);
        s.events();
        let y1 = s.publish("a.y", "y1");
        let x = s.publish("a.x", "x");
        let y2 = s.publish("a.y", "y2");
        let mut to = HashMap::<u32, Vec<u64>>::new();
        for (handles, sequence) in s.deliveries() {
            for h in handles {
                to.entry(h).or_default().push(sequence);
            }
        }
        assert_eq!(to[&1], [y1, x, y2]);
        assert_eq!(to[&2], [x]);
    }

    /// A message that reaches a broadcast handle and a group member of the
    /// same session is two deliveries: the member's names it alone, with
    /// its id and group (never merged: a group delivery is one member's).
    #[test]
    fn a_group_members_delivery_is_never_merged_with_a_broadcast_one() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 0);
        s.open(2, member("g", "t"), 0);
        s.events();
        let sequence = s.publish("t", "both");
        let events = s.events();
        let mut deliveries: Vec<(Vec<u32>, pb::Message)> = events
            .into_iter()
            .map(|e| match e {
                Event::Delivery(d) => (d.handles, d.message.unwrap()),
                other => panic!("{other:?}"),
            })
            .collect();
        deliveries.sort_by_key(|(h, _)| h.clone());
        assert_eq!(deliveries.len(), 2, "{deliveries:?}");
        assert_eq!(deliveries[0].0, [1]);
        assert_eq!(deliveries[1].0, [2]);
        let m = &deliveries[1].1;
        assert_eq!((m.sequence, m.consumer_group.as_str()), (sequence, "g"));
        assert!(!m.subscription_id.is_empty());
    }

    /// Credit, close, ack and nack for a handle that is not open are
    /// counted as `unknown_handle` and change nothing; an ack without
    /// sequences as `no_sequences`.
    #[test]
    fn requests_for_an_unknown_handle_are_counted_and_ignored() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 1);
        s.events();
        s.credit(9, 5);
        s.send(Request::Close(pb::SessionClose { handle: 9 }));
        s.send(Request::Ack(pb::SessionAck {
            handle: 9,
            sequences: vec![1],
        }));
        s.send(Request::Nack(pb::SessionNack {
            handle: 9,
            sequences: vec![1],
        }));
        s.send(Request::Ack(pb::SessionAck {
            handle: 1,
            sequences: vec![],
        }));
        assert_eq!(s.events(), [], "no event for an ignored request");
        assert_eq!(s.ignored(IgnoredRequest::UnknownHandle), 4);
        assert_eq!(s.ignored(IgnoredRequest::NoSequences), 1);
        // Handle 1's credit is still its own 1.
        let first = s.publish("t", "a");
        s.publish("t", "b");
        assert_eq!(s.sequences_for(1), [first]);
    }

    /// A handle already open is refused (ALREADY_EXISTS) and the first
    /// subscription under it carries on; handle 0 is refused too. A closed
    /// handle may be opened again.
    #[test]
    fn a_duplicate_handle_is_rejected_and_the_first_keeps_its_subscription() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 0);
        s.events();
        s.open(1, subscription(&["other"]), 0);
        s.open(0, subscription(&["t"]), 0);
        let events = s.events();
        assert_eq!(events.len(), 2, "{events:?}");
        let duplicate = ended(&events[0]);
        assert_eq!(
            (duplicate.handle, duplicate.reason.as_str(), duplicate.code),
            (1, "rejected", Code::AlreadyExists as u32)
        );
        let zero = ended(&events[1]);
        assert_eq!((zero.handle, zero.code), (0, Code::InvalidArgument as u32));
        assert_eq!(s.broker.subscriptions(Peaks::Keep).len(), 1, "one subscription");
        let sequence = s.publish("t", "still");
        assert_eq!(s.sequences_for(1), [sequence], "the first still delivers");

        s.send(Request::Close(pb::SessionClose { handle: 1 }));
        let events = s.events();
        assert_eq!(ended(&events[0]).reason, "closed");
        s.open(1, subscription(&["other"]), 0);
        assert_eq!(opened(&s.events()[0]), 1, "a closed handle is free again");
    }

    /// A session holds at most max_subscriptions_per_session handles.
    #[test]
    fn handles_beyond_the_sessions_limit_are_rejected() {
        let mut s = session_with(Limits {
            max_subscriptions_per_session: 2,
            ..Limits::default()
        });
        for handle in 1..=3 {
            s.open(handle, subscription(&["t"]), 0);
        }
        let events = s.events();
        assert_eq!((opened(&events[0]), opened(&events[1])), (1, 2));
        let third = ended(&events[2]);
        assert_eq!((third.handle, third.code), (3, Code::ResourceExhausted as u32));
        assert!(third.message.contains("max_subscriptions_per_session 2"), "{third:?}");
    }

    /// A batch's valid messages are published with consecutive sequences,
    /// in order, and each bad one is rejected by its index with the status
    /// Publish gives (a wildcard topic: INVALID_ARGUMENT naming it); the
    /// answer echoes the id. (Without the block of sequences, another
    /// publisher's message between two of the batch's would break the
    /// consecutive run; without rejection by index a bad message would
    /// fail the batch.)
    #[test]
    fn a_batch_publishes_its_valid_messages_with_consecutive_sequences_and_rejects_the_rest_by_index() {
        let mut s = session();
        s.open(1, subscription(&["t.>"]), 0);
        s.events();
        let before = s.publish("t.before", "x");
        s.events();
        s.publish_batch(7, &["t.a", "t.*", "t.b", "", "t.c"]);
        let events = s.events();
        let answers = published(&events);
        assert_eq!(answers.len(), 1, "{answers:?}");
        let a = &answers[0];
        assert_eq!((a.id, a.accepted, a.first_sequence), (7, 3, before + 1), "{a:?}");
        let rejected: Vec<(u32, u32)> = a.rejected.iter().map(|r| (r.index, r.code)).collect();
        assert_eq!(
            rejected,
            [(1, Code::InvalidArgument as u32), (3, Code::InvalidArgument as u32)]
        );
        assert!(a.rejected[0].message.contains("t.*"), "{:?}", a.rejected[0]);
        // The subscriber got the three, in order, with those sequences.
        assert_eq!(delivered(&events), [before + 1, before + 2, before + 3]);
        assert_eq!(
            s.broker.stats().published.load(Ordering::Relaxed),
            4,
            "messages counted, not batches (the one before and three)"
        );
    }

    /// An empty batch is answered `accepted: 0`; a batch over
    /// max_batch_messages is rejected whole (every index,
    /// RESOURCE_EXHAUSTED naming the variable) and publishes nothing, and
    /// the session goes on; answers come in request order.
    #[test]
    fn an_empty_batch_and_one_over_the_limit_publish_nothing_and_the_session_goes_on() {
        let mut s = session_with(Limits {
            max_batch_messages: 2,
            ..Limits::default()
        });
        s.open(1, subscription(&["t"]), 0);
        s.events();
        s.publish_batch(1, &[]);
        s.publish_batch(2, &["t", "t", "t"]);
        s.publish_batch(3, &["t", "t"]);
        let events = s.events();
        let answers = published(&events);
        assert_eq!(answers.iter().map(|a| a.id).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!((answers[0].accepted, answers[0].rejected.len()), (0, 0));
        let over = &answers[1];
        assert_eq!(over.accepted, 0);
        assert_eq!(over.rejected.iter().map(|r| r.index).collect::<Vec<_>>(), [0, 1, 2]);
        for r in &over.rejected {
            assert_eq!(r.code, Code::ResourceExhausted as u32);
            assert!(r.message.contains("TINYBROKER_MAX_BATCH_MESSAGES"), "{r:?}");
            assert!(r.message.contains("max_batch_messages 2"), "{r:?}");
        }
        assert_eq!(answers[2].accepted, 2);
        assert_eq!(delivered(&events).len(), 2, "only the last batch's two");
        assert!(s.trailers.is_none(), "the session goes on");
    }

    /// With batched deliveries, everything ready when the body writes goes
    /// out as `deliveries` events and never as bare `delivery` events, each
    /// event at most DELIVERIES_BOUND bytes of deliveries (or one), every
    /// handle's messages in order; a message for several handles is still
    /// one delivery naming them.
    #[test]
    fn batched_deliveries_come_in_events_within_the_byte_bound_in_order() {
        let mut s = session_batched(Limits::default(), true);
        s.open(1, subscription(&["a.*"]), 0);
        s.open(2, subscription(&["a.x"]), 0);
        s.events();
        let payload = "p".repeat(1000);
        let sent: Vec<u64> = (0..200)
            .map(|i| s.publish(if i % 2 == 0 { "a.x" } else { "a.y" }, &payload))
            .collect();
        let events = s.events();
        let mut to = HashMap::<u32, Vec<u64>>::new();
        let mut batches = 0;
        for event in &events {
            let Event::Deliveries(b) = event else {
                panic!("only deliveries events: {event:?}")
            };
            batches += 1;
            let bytes: usize = b.deliveries.iter().map(prost::Message::encoded_len).sum();
            assert!(
                bytes <= DELIVERIES_BOUND || b.deliveries.len() == 1,
                "{bytes} bytes in one event"
            );
            for d in &b.deliveries {
                for &h in &d.handles {
                    to.entry(h).or_default().push(d.message.as_ref().unwrap().sequence);
                }
            }
        }
        assert_eq!(to[&1], sent, "handle 1 got all, in order");
        let evens: Vec<u64> = sent.iter().step_by(2).copied().collect();
        assert_eq!(to[&2], evens, "handle 2 the a.x ones, in order");
        assert!(batches >= 3, "200 KB of deliveries in 64 KiB events: {batches}");
        assert!(batches < 20, "not one event per delivery: {batches}");
        // Low rate: a batch of one, at once.
        let one = s.publish("a.y", "alone");
        let events = s.events();
        assert!(
            matches!(&events[..], [Event::Deliveries(b)] if b.deliveries.len() == 1 && b.deliveries[0].message.as_ref().unwrap().sequence == one),
            "{events:?}"
        );
    }

    /// A delivery larger than the bound is an event of its own between the
    /// events before and after it, each whole (its head has room for a
    /// larger length), and the one after it small again.
    #[test]
    fn a_delivery_over_the_bound_is_an_event_of_its_own() {
        let mut s = session_batched(Limits::default(), true);
        s.open(1, subscription(&["t"]), 0);
        s.events();
        let small = s.publish("t", "a");
        let large = s.publish("t", &"L".repeat(3 * DELIVERIES_BOUND));
        let after = s.publish("t", "b");
        let events = s.events();
        let sizes: Vec<Vec<(u64, usize)>> = events
            .iter()
            .map(|e| match e {
                Event::Deliveries(b) => b
                    .deliveries
                    .iter()
                    .map(|d| {
                        let m = d.message.as_ref().unwrap();
                        (m.sequence, m.payload.len())
                    })
                    .collect(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            sizes,
            [vec![(small, 1)], vec![(large, 3 * DELIVERIES_BOUND)], vec![(after, 1)]]
        );
    }

    /// An event other than a delivery (here `ended`, for a subscription an
    /// admin closed) ends the `deliveries` event being written: it comes
    /// after the deliveries before it, and both decode. (Written inside the
    /// open event, it would corrupt it.)
    #[test]
    fn an_ended_event_follows_the_deliveries_before_it() {
        let mut s = session_batched(Limits::default(), true);
        s.open(1, subscription(&["t"]), 0);
        s.open(2, subscription(&["t"]), 0);
        let two = match &s.events()[1] {
            Event::Opened(o) => o.subscription_id.clone(),
            other => panic!("{other:?}"),
        };
        let first = s.publish("t", "a");
        s.broker.close_subscription(&two).unwrap();
        let events = s.events();
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(
            matches!(&events[0], Event::Deliveries(b) if b.deliveries.len() == 1 && b.deliveries[0].handles == [1] && b.deliveries[0].message.as_ref().unwrap().sequence == first),
            "{events:?}"
        );
        assert_eq!(
            (ended(&events[1]).handle, ended(&events[1]).reason.as_str()),
            (2, "closed_by_admin")
        );
    }

    /// Acks of one handle read together are applied together, through the
    /// subscription the session holds: held sequences are acked (the
    /// member gets more room), others counted as unknown.
    #[test]
    fn in_band_acks_read_together_settle_through_the_held_subscription() {
        let mut s = session();
        s.open(
            1,
            pb::OpenSubscriptionRequest {
                ack_mode: pb::AckMode::Manual as i32,
                max_in_flight: 2,
                ..member("g", "jobs")
            },
            0,
        );
        s.events();
        let sent: Vec<u64> = (0..4).map(|i| s.publish("jobs", &format!("j{i}"))).collect();
        assert_eq!(s.sequences_for(1), sent[..2], "two in flight");
        // An ack without sequences read with the others is still counted
        // as one (not merged away into the next).
        s.send(Request::Ack(pb::SessionAck {
            handle: 1,
            sequences: vec![],
        }));
        for &sequence in &sent[..2] {
            s.send(Request::Ack(pb::SessionAck {
                handle: 1,
                sequences: vec![sequence],
            }));
        }
        s.send(Request::Ack(pb::SessionAck {
            handle: 1,
            sequences: vec![999],
        }));
        assert_eq!(s.sequences_for(1), sent[2..], "room for the next two");
        assert_eq!(s.ignored(IgnoredRequest::UnknownSequence), 1);
        assert_eq!(s.ignored(IgnoredRequest::NoSequences), 1);
    }

    /// A client that half-closes ends every handle "closed", counting what
    /// each had queued and not sent (for want of credit), then the session
    /// with OK.
    #[test]
    fn a_half_close_ends_every_handle_then_the_session() {
        let mut s = session();
        s.open(1, subscription(&["t"]), 1);
        s.open(2, subscription(&["t"]), 0);
        s.events();
        for i in 0..3 {
            s.publish("t", &format!("m{i}"));
        }
        s.events();
        s.requests.close_channel();
        let mut ends: Vec<(u32, String, u64)> = s
            .events()
            .iter()
            .map(|e| {
                let e = ended(e);
                (e.handle, e.reason.clone(), e.dropped)
            })
            .collect();
        ends.sort();
        assert_eq!(ends, [(1, "closed".into(), 2), (2, "closed".into(), 0)]);
        assert_eq!(s.trailers.as_ref().map(Status::code), Some(Code::Ok));
        assert!(s.body.is_end_stream());
    }

    /// What a session holds per subscription: its slot and its handle
    /// (ARCHITECTURE.md, "What an idle subscription holds").
    #[test]
    fn a_session_holds_72_bytes_a_32_byte_waker_and_an_8_byte_handle_per_subscription() {
        use std::mem::size_of;
        assert!(size_of::<super::Sub<crate::broker::SubscriptionStream>>() <= 72);
        // With the Arc's two counts: jemalloc's 32-byte class, not 48.
        assert_eq!(size_of::<super::SubWake>() + 16, 32);
        fn entry<K, V, S>(_: &HashMap<K, V, S>) -> usize {
            size_of::<(K, V)>()
        }
        assert_eq!(entry(&session().body.handles), 8);
    }
}
