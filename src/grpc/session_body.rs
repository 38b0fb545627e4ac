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
//!   session's ready list and wakes the body (once: a flag keeps a key on the
//!   list at most once). A publish reaching 50 of a session's subscriptions
//!   wakes the connection's task once and leaves 50 keys; the body polls
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
use crate::broker::Published;
use crate::engine::{Acked, BrokerError, CloseReason, Delivery, DeliveryStream, Engine, Nacked, StreamEnd};
use crate::ops::metrics::{IgnoredRequest, LocalObserver, Metrics, SessionGauge};
use crate::ops::telemetry;
use crate::pb;
use bytes::{BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::task::{ArcWake, AtomicWaker};
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use prost::encoding::{encode_varint, encoded_len_varint};
use slab::Slab;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::SystemTime;
use tonic::{Code, Status};

/// Most requests read in one poll before the deliveries get their turn.
const REQUESTS_PER_POLL: usize = 1024;
/// Most delivery rounds in one poll (each round polls every ready stream
/// once); the rest wait for the next poll.
const ROUNDS_PER_POLL: usize = 256;

/// `SessionEvent` field keys (field number and wire type 2, one byte each).
const DELIVERY_KEY: u8 = (2 << 3) | 2;
const HANDLES_KEY: u8 = (1 << 3) | 2;
const MESSAGE_KEY: u8 = (2 << 3) | 2;

/// The response body of one `Session` stream (see the module docs).
pub struct SessionBody<E: Engine, R> {
    engine: E,
    /// The client's requests; None once it half-closed (or they failed).
    requests: Option<R>,
    peer: Option<SocketAddr>,
    max_subscriptions: usize,
    metrics: Metrics,
    _gauge: SessionGauge,
    /// Every handle in use, opening or open.
    handles: HashMap<u32, Handle>,
    subs: Slab<Sub<E::Stream>>,
    /// Opens the engine has not answered yet (the cluster engine may wait
    /// for NATS); the in-memory engine answers at once and never lands here.
    opening: FuturesUnordered<Opening<E::Stream>>,
    /// In-band acks and nacks the engine has not answered yet.
    acking: FuturesUnordered<Acking>,
    ready: Arc<Ready>,
    /// Subscriptions that gave a delivery in the last round.
    again: Vec<usize>,
    /// The keys of the round being polled (kept for its allocation).
    keys: Vec<usize>,
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
type Opening<S> = BoxFuture<'static, (u32, Result<S, BrokerError>)>;
/// An in-band ack or nack the engine is answering: how many sequences it
/// named, and how many of them the subscription did not hold.
type Acking = BoxFuture<'static, (u32, Result<u32, BrokerError>)>;

/// What a handle names.
enum Handle {
    /// The engine is opening it: credit granted and a close asked for
    /// meanwhile are applied when it is open.
    Opening {
        credit: Option<u64>,
        /// Credit added meanwhile, for the engine once it is open.
        added: u64,
        close: bool,
    },
    Open(usize),
}

/// One subscription of the session.
struct Sub<S> {
    handle: u32,
    stream: S,
    /// Its id and group, encoded once (at its first delivery naming it
    /// alone: an idle subscription holds none).
    fields: Option<SubscriberFields>,
    group: bool,
    /// Deliveries it may still be sent; None: no limit.
    credit: Option<u64>,
    wake: Arc<SubWake>,
    waker: Waker,
    /// The last round it was polled in.
    round: u64,
}

/// The subscriptions with something to look at, and the body's waker.
#[derive(Default)]
struct Ready {
    keys: Mutex<Vec<usize>>,
    body: AtomicWaker,
}

/// One subscription's waker: puts its key on the ready list.
struct SubWake {
    key: usize,
    queued: AtomicBool,
    ready: Arc<Ready>,
}

impl ArcWake for SubWake {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        if !arc_self.queued.swap(true, Ordering::AcqRel) {
            arc_self.ready.keys.lock().push(arc_self.key);
            arc_self.ready.body.wake();
        }
    }
}

/// What is encoded and not yet handed to h2, and the round being merged.
struct Out {
    buf: BytesMut,
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
    pub fn new(engine: E, requests: R, peer: Option<SocketAddr>, metrics: Metrics) -> Self {
        let max_subscriptions = engine.limits().max_subscriptions_per_session;
        let draining: BoxFuture<'static, ()> = Box::pin(engine.draining());
        Self {
            _gauge: metrics.session_opened(),
            out: Out {
                buf: BytesMut::new(),
                lag_multi: metrics.delivery_lag(false),
                lag_single: metrics.delivery_lag(true),
                shared_fields: SubscriberFields::new("", ""),
                batch: Vec::new(),
                index: HashMap::default(),
                spare: Vec::new(),
            },
            engine,
            requests: Some(requests),
            peer,
            max_subscriptions,
            metrics,
            handles: HashMap::new(),
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

    /// Reads what the client sent, up to [`REQUESTS_PER_POLL`].
    fn read_requests(&mut self, cx: &mut Context<'_>) {
        for _ in 0..REQUESTS_PER_POLL {
            let Some(requests) = &mut self.requests else { return };
            if self.out.buf.len() >= FRAME_THRESHOLD {
                // Hand what is encoded to h2 first; the body is polled again.
                return;
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
                    // the session ends with OK.
                    self.requests = None;
                    self.ending = true;
                    self.close_all();
                    return;
                }
                Poll::Pending => return,
            }
        }
        // More may be buffered: come back to them after the deliveries.
        cx.waker().wake_by_ref();
    }

    fn request(&mut self, request: pb::SessionRequest, cx: &mut Context<'_>) {
        use pb::session_request::Request;
        match request.request {
            None => self.ignored(IgnoredRequest::NoRequest, 1),
            Some(Request::Open(open)) => self.open(open, cx),
            Some(Request::Close(close)) => self.close(close.handle),
            Some(Request::Credit(credit)) => self.credit(credit.handle, credit.messages),
            Some(Request::Ack(ack)) => self.ack(ack.handle, ack.sequences, false, cx),
            Some(Request::Nack(nack)) => self.ack(nack.handle, nack.sequences, true, cx),
        }
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
        self.handles.insert(
            handle,
            Handle::Opening {
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
        let Some(Handle::Opening { credit, added, close }) = self.handles.remove(&handle) else {
            // Only opens insert Opening, and only this removes it.
            return;
        };
        let mut stream = match result {
            Ok(stream) => stream,
            Err(error) => {
                let status = convert::status(error);
                return self.reject(handle, status.code(), status.message().to_owned());
            }
        };
        put_event(
            &mut self.out.buf,
            pb::session_event::Event::Opened(pb::SessionOpened {
                handle,
                subscription_id: stream.id().to_owned(),
            }),
        );
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
            key: entry.key(),
            queued: AtomicBool::new(false),
            ready: self.ready.clone(),
        });
        let key = entry.key();
        entry.insert(Sub {
            handle,
            fields: None,
            stream,
            group,
            credit,
            waker: futures::task::waker(wake.clone()),
            wake,
            round: 0,
        });
        self.handles.insert(handle, Handle::Open(key));
        // Polled in the next round: what was published since it registered.
        self.again.push(key);
    }

    fn reject(&mut self, handle: u32, code: Code, message: String) {
        put_event(
            &mut self.out.buf,
            pb::session_event::Event::Ended(pb::SessionEnded {
                handle,
                reason: "rejected".into(),
                code: code as u32,
                message,
                ..Default::default()
            }),
        );
    }

    fn close(&mut self, handle: u32) {
        match self.handles.get_mut(&handle) {
            None => self.ignored(IgnoredRequest::UnknownHandle, 1),
            Some(Handle::Opening { close, .. }) => *close = true,
            Some(Handle::Open(key)) => {
                let key = *key;
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
        match self.handles.get_mut(&handle) {
            None => self.ignored(IgnoredRequest::UnknownHandle, 1),
            Some(Handle::Opening {
                credit, added: more, ..
            }) => {
                if let Some(credit) = credit {
                    *credit = credit.saturating_add(added);
                    *more = more.saturating_add(added);
                }
            }
            Some(Handle::Open(key)) => {
                let sub = &mut self.subs[*key];
                if let Some(credit) = &mut sub.credit {
                    let was = *credit;
                    *credit = credit.saturating_add(added);
                    if was == 0 && added > 0 {
                        sub.waker.wake_by_ref();
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
        let key = match self.handles.get(&handle) {
            None => return self.ignored(IgnoredRequest::UnknownHandle, 1),
            Some(Handle::Opening { .. }) => {
                // Nothing can be held before it is open.
                return self.ignored(IgnoredRequest::UnknownSequence, sequences.len() as u64);
            }
            Some(Handle::Open(key)) => *key,
        };
        if sequences.is_empty() {
            return self.ignored(IgnoredRequest::NoSequences, 1);
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
            for &key in &keys {
                let Some(sub) = self.subs.get_mut(key) else { continue };
                if sub.round == self.round {
                    continue;
                }
                sub.round = self.round;
                sub.wake.queued.store(false, Ordering::Release);
                let mut sub_cx = Context::from_waker(&sub.waker);
                if sub.credit == Some(0) {
                    if sub.stream.poll_ended(&mut sub_cx).is_ready() {
                        ended.push(key);
                    }
                    continue;
                }
                match sub.stream.poll_next_drained(&mut sub_cx) {
                    Poll::Ready(Some((delivery, drained))) => {
                        if let Some(credit) = &mut sub.credit {
                            *credit -= 1;
                        }
                        self.out.take(key, sub.handle, sub.group, delivery);
                        // Drained: its waker is left, and the next push puts
                        // it on the ready list; else it goes again next round.
                        if !drained {
                            self.again.push(key);
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
        put_event(
            &mut self.out.buf,
            pb::session_event::Event::Ended(pb::SessionEnded {
                handle,
                reason: reason.into(),
                dropped: end.dropped,
                last_sequence: end.last_sequence,
                code: 0,
                message: String::new(),
            }),
        );
    }

    /// Ends the session with `status`: its subscriptions end as a cancelled
    /// `OpenSubscription` does (dropped).
    fn fail(&mut self, status: Status) {
        self.handles.clear();
        self.subs.clear();
        self.opening = FuturesUnordered::new();
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
        let now = SystemTime::now();
        let mut batch = std::mem::take(&mut self.batch);
        for mut b in batch.drain(..) {
            let sub = &mut subs[b.key];
            let fields = match b.handles.len() {
                1 => sub.fields.get_or_insert_with(|| {
                    SubscriberFields::new(sub.stream.id(), sub.stream.consumer_group().unwrap_or_default())
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
            put_delivery(&mut self.buf, &b.handles, &message);
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
fn put_delivery(buf: &mut BytesMut, handles: &[u32], message: &EncodedMessage) {
    let message_len = prost::Message::encoded_len(message);
    let handles_len: usize = handles.iter().map(|&h| encoded_len_varint(u64::from(h))).sum();
    let delivery_len = 1
        + encoded_len_varint(handles_len as u64)
        + handles_len
        + 1
        + encoded_len_varint(message_len as u64)
        + message_len;
    let event_len = 1 + encoded_len_varint(delivery_len as u64) + delivery_len;
    reserve_frame(buf, GRPC_HEADER + event_len);
    buf.put_u8(0);
    // max_message_bytes is far below 4 GiB (config), so this holds.
    buf.put_u32(event_len as u32);
    buf.put_u8(DELIVERY_KEY);
    encode_varint(delivery_len as u64, buf);
    buf.put_u8(HANDLES_KEY);
    encode_varint(handles_len as u64, buf);
    for &handle in handles {
        encode_varint(u64::from(handle), buf);
    }
    buf.put_u8(MESSAGE_KEY);
    encode_varint(message_len as u64, buf);
    prost::Message::encode_raw(message, buf);
}

/// Appends one gRPC frame holding an `opened` or `ended` event.
fn put_event(buf: &mut BytesMut, event: pb::session_event::Event) {
    let event = pb::SessionEvent { event: Some(event) };
    let len = prost::Message::encoded_len(&event);
    reserve_frame(buf, GRPC_HEADER + len);
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
            if this.ending && this.handles.is_empty() {
                this.finish = Some(Status::ok(""));
            }
        }
        if !this.out.buf.is_empty() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(this.out.buf.split().freeze()))));
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
