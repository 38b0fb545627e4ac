//! The gRPC layer: adapts an [`Engine`] to the tonic services of
//! `tinybroker.v1`. It holds no broker logic: it converts requests (every
//! proto↔engine conversion is written once, at the end of this file), maps
//! [`BrokerError`]s to status codes, and turns deliveries into messages.

use crate::broker::WakeBatch;
use crate::engine::validate::{MAX_HEADERS, MAX_PATTERNS_PER_SUBSCRIPTION};
use crate::engine::{
    AckMode, BrokerError, Confirmation, Delivery, DeliveryMode, DeliveryStream, Engine, NewMessage, PublishOutcome,
    PublishTime, SubscribeRequest, TracingHeaders,
};
use crate::ops::metrics::{LocalObserver, Metrics};
use crate::pb;
use crate::grpc::session_body::SessionBody;
use crate::ops::telemetry::{self, TRACEPARENT};
use crate::grpc::framing::{ENCODE_CHUNK, EncodedMessage, SubscriberFields};
use bytes::{BufMut, Bytes, BytesMut};
use futures::{FutureExt, Stream};
use parking_lot::Mutex;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;
use tonic::codegen::http;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Most messages of one PublishStream routed before the task yields.
const PUBLISH_BATCH: usize = 128;
/// The message a `PublishStream` carries, as its decoding errors name it.
const PUBLISH_REQUEST: &str = "tinybroker.v1.PublishRequest";

/// Initial response metadata carrying the subscription id.
pub const SUBSCRIPTION_ID_METADATA: &str = "tinybroker-subscription-id";
/// Trailer of a subscription stream the broker ended (status OK): why,
/// `evicted`, `closed_by_admin` or `shutdown`.
pub const END_REASON_METADATA: &str = "tinybroker-end-reason";
/// Trailer beside it: messages queued for the subscription that it lost.
pub const DROPPED_METADATA: &str = "tinybroker-dropped";
/// Trailer beside it: the sequence of the last message handed to the stream.
pub const LAST_SEQUENCE_METADATA: &str = "tinybroker-last-sequence";

/// Maps a core error to the status code docs/contract.md (Errors) gives for it.
pub fn status(error: BrokerError) -> Status {
    let code = match &error {
        BrokerError::InvalidArgument(_) => Code::InvalidArgument,
        BrokerError::FailedPrecondition(_) => Code::FailedPrecondition,
        BrokerError::AlreadyExists(_) => Code::AlreadyExists,
        BrokerError::NotFound(_) => Code::NotFound,
        BrokerError::ResourceExhausted(_) => Code::ResourceExhausted,
        BrokerError::Unavailable(_) => Code::Unavailable,
    };
    Status::new(code, error.to_string())
}

/// The `Broker` service.
pub struct BrokerService<E: Engine> {
    engine: E,
    metrics: Metrics,
}

impl<E: Engine> BrokerService<E> {
    pub fn new(engine: E, metrics: Metrics) -> Self {
        Self { engine, metrics }
    }

    /// Publishes one message with tracing on: in a `publish` span whose
    /// parent is the caller's `traceparent`, and the span's own context goes
    /// into the message's headers (unless the publisher set one) so consumers
    /// can continue it. Without tracing, `publish` and `publish_stream` call
    /// the engine directly: a future of this function's own, built and
    /// dropped per message, cost about 130 instructions a message on the hot
    /// path (BENCHMARKS.md, "Refactor to an engine seam").
    async fn publish_traced(
        &self,
        mut request: pb::PublishRequest,
        parent: &opentelemetry::Context,
        publisher: &mut E::Publisher,
        at: PublishTime,
    ) -> Result<PublishOutcome, Status> {
        let (span, tracing) = publish_span(&mut request, parent);
        let outcome = self
            .engine
            .publish(new_message(request, tracing), publisher, at)
            .instrument(span.clone())
            .await
            .map_err(status);
        if let Ok(o) = &outcome {
            span.record("messaging.message.id", o.sequence);
        }
        outcome
    }

    /// [`BrokerService::publish_traced`] for a stream's message
    /// ([`Engine::publish_routed`]).
    async fn publish_routed_traced(
        &self,
        mut request: pb::PublishRequest,
        parent: &opentelemetry::Context,
        publisher: &mut E::Publisher,
        at: PublishTime,
    ) -> Result<(PublishOutcome, Option<Confirmation>), Status> {
        let (span, tracing) = publish_span(&mut request, parent);
        let routed = self
            .engine
            .publish_routed(new_message(request, tracing), publisher, at)
            .instrument(span.clone())
            .await
            .map_err(status);
        if let Ok((o, _)) = &routed {
            span.record("messaging.message.id", o.sequence);
        }
        routed
    }

    /// The tonic server for this service, with the decoding limit derived
    /// from `max_message_bytes` so no request can make it allocate more.
    pub fn into_server(self) -> pb::broker_server::BrokerServer<Self> {
        let limit = decoding_limit(self.engine.limits().max_message_bytes);
        pb::broker_server::BrokerServer::new(self).max_decoding_message_size(limit)
    }
}

/// A `publish` span whose parent is the caller's `traceparent`; its own
/// context goes into the message's headers, unless the publisher set one
/// ([`telemetry::inject`]: which headers it added, counted against no
/// limit).
fn publish_span(request: &mut pb::PublishRequest, parent: &opentelemetry::Context) -> (tracing::Span, TracingHeaders) {
    let span = tracing::info_span!(
        "publish",
        otel.kind = "producer",
        messaging.system = "tinybroker",
        messaging.operation.type = "publish",
        messaging.destination.name = %request.topic,
        messaging.message.id = tracing::field::Empty,
    );
    let _ = span.set_parent(parent.clone());
    let tracing = match request.headers.contains_key(TRACEPARENT) {
        true => TracingHeaders::default(),
        false => telemetry::inject(&span.context(), &mut request.headers),
    };
    (span, tracing)
}

/// Largest encoded `PublishRequest` that can still hold a valid message:
/// payload and headers within `max_message_bytes`, plus the topic and the
/// protobuf framing of up to the maximal number of headers.
pub fn decoding_limit(max_message_bytes: usize) -> usize {
    max_message_bytes.saturating_add(64 * 1024)
}

/// The message of a request; `tracing`: the headers [`publish_span`] added
/// (none without tracing).
fn new_message(request: pb::PublishRequest, tracing: TracingHeaders) -> NewMessage {
    NewMessage {
        topic: request.topic,
        payload: request.payload,
        headers: request.headers,
        tracing,
    }
}

#[tonic::async_trait]
impl<E: Engine> pb::broker_server::Broker for BrokerService<E> {
    async fn publish(&self, request: Request<pb::PublishRequest>) -> Result<Response<pb::PublishResponse>, Status> {
        let parent = telemetry::tracing_enabled().then(|| telemetry::extract(request.metadata()));
        let at = PublishTime::now();
        let mut publisher = E::Publisher::default();
        let request = request.into_inner();
        let outcome = match &parent {
            None => self
                .engine
                .publish(new_message(request, TracingHeaders::default()), &mut publisher, at)
                .await
                .map_err(status)?,
            Some(parent) => self.publish_traced(request, parent, &mut publisher, at).await?,
        };
        self.metrics.observe_publish(at.monotonic.elapsed().as_secs_f64());
        Ok(Response::new(pb::PublishResponse {
            sequence: outcome.sequence,
            matched_subscriptions: outcome.matched_subscriptions,
            matched_groups: outcome.matched_groups,
        }))
    }

    async fn publish_stream(
        &self,
        request: Request<Streaming<pb::PublishRequest>>,
    ) -> Result<Response<pb::PublishStreamResponse>, Status> {
        let parent = telemetry::tracing_enabled().then(|| telemetry::extract(request.metadata()));
        let mut stream = request.into_inner();
        let mut publisher = E::Publisher::default();
        let mut timer = self.metrics.publish_duration();
        let mut response = pb::PublishStreamResponse::default();
        let draining = self.engine.draining();
        tokio::pin!(draining);
        loop {
            let next = tokio::select! {
                biased;
                _ = &mut draining => {
                    return Err(Status::unavailable(format!(
                        "the broker is shutting down; {} messages of this stream were accepted",
                        response.accepted
                    )));
                }
                next = stream.message() => next,
            };
            let mut next = match next {
                Ok(Some(request)) => request,
                Ok(None) => return Ok(Response::new(response)),
                Err(error) => {
                    return Err(with_accepted(
                        request_stream_error(error, PUBLISH_REQUEST),
                        response.accepted,
                    ));
                }
            };
            // Route what has already arrived as one batch: each subscriber
            // is woken once for it, at the end, and writes it in one go.
            // Received together, published together: one reading of the
            // clocks for the batch, its duration shared among its messages
            // (decoding included) for tinybroker_publish_duration_seconds.
            let at = PublishTime::now();
            let burst = WakeBatch::begin();
            let mut routed = 0;
            // Set when the stream ends inside the batch (Ok: its last
            // message; or an error): returned once the batch is accounted for.
            let mut ended = None;
            // Routed, and waiting for what the engine confirms later (a
            // cluster group's store), oldest first: confirmed at the end of
            // the batch, so the batch's stores overlap.
            let mut unconfirmed: Vec<(u64, Option<Confirmation>)> = Vec::new();
            loop {
                // Untraced, the engine is called here, with no future of
                // our own per message (see `publish_traced`). The batch is
                // not held across a wait of the engine's.
                let outcome = WakeBatch::across_waits(async {
                    match &parent {
                        None => self
                            .engine
                            .publish_routed(new_message(next, TracingHeaders::default()), &mut publisher, at)
                            .await
                            .map_err(status),
                        Some(parent) => self.publish_routed_traced(next, parent, &mut publisher, at).await,
                    }
                })
                .await;
                match outcome {
                    Ok((outcome, None)) if unconfirmed.is_empty() => {
                        accept(&mut response, outcome.sequence);
                        routed += 1;
                    }
                    Ok((outcome, confirmation)) => {
                        unconfirmed.push((outcome.sequence, confirmation));
                        routed += 1;
                    }
                    Err(error) => {
                        ended = Some(Err(error));
                        break;
                    }
                }
                if routed == PUBLISH_BATCH {
                    break;
                }
                next = match stream.message().now_or_never() {
                    Some(Ok(Some(request))) => request,
                    Some(Ok(None)) => {
                        ended = Some(Ok(()));
                        break;
                    }
                    Some(Err(error)) => {
                        ended = Some(Err(request_stream_error(error, PUBLISH_REQUEST)));
                        break;
                    }
                    // Nothing more buffered: end the batch and wait.
                    None => break,
                };
            }
            drop(burst);
            let mut waiting = unconfirmed.len();
            for (sequence, confirmation) in unconfirmed {
                waiting -= 1;
                if let Some(confirmation) = confirmation
                    && let Err(error) = confirmation.await
                {
                    // The first that failed ends the stream; those after it
                    // were published (routed) already.
                    let error = status(error);
                    ended = Some(Err(match waiting {
                        0 => error,
                        n => Status::new(
                            error.code(),
                            format!(
                                "{}; the {n} messages sent after it on this stream reached subscribers too, and may have reached groups",
                                error.message()
                            ),
                        ),
                    }));
                    break;
                }
                accept(&mut response, sequence);
            }
            if routed > 0 {
                timer.observe_many(at.monotonic.elapsed().as_secs_f64() / routed as f64, routed);
                timer.flush();
            }
            match ended {
                Some(Ok(())) => return Ok(Response::new(response)),
                Some(Err(error)) => return Err(with_accepted(error, response.accepted)),
                None => {}
            }
            if routed == PUBLISH_BATCH {
                // Let the subscribers just woken (queued behind this task on
                // its worker) run before routing the next batch.
                tokio::task::yield_now().await;
            }
        }
    }

    type OpenSubscriptionStream = NotInstalled;

    async fn open_subscription(
        &self,
        request: Request<pb::OpenSubscriptionRequest>,
    ) -> Result<Response<Self::OpenSubscriptionStream>, Status> {
        let peer = request.remote_addr();
        let request = subscribe_request(request.into_inner(), peer)?;
        let stream = self.engine.subscribe(request).await.map_err(status)?;
        let id = stream.id().to_owned();
        let group = stream.consumer_group().is_some_and(|g| !g.is_empty());
        let body = SubscriptionBody::new(stream, self.metrics.delivery_lag(group));
        let mut response = Response::new(NotInstalled::new());
        response
            .extensions_mut()
            .insert(PendingBody(Arc::new(Mutex::new(Some(tonic::body::Body::new(body))))));
        // Ids are printable ASCII (validated or generated), so this holds.
        if let Ok(value) = MetadataValue::try_from(id.as_str()) {
            response.metadata_mut().insert(SUBSCRIPTION_ID_METADATA, value);
        }
        Ok(response)
    }

    type SessionStream = NotInstalled<pb::SessionEvent>;

    async fn session(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let peer = request.remote_addr();
        let body = SessionBody::new(self.engine.clone(), request.into_inner(), peer, self.metrics.clone());
        let mut response = Response::new(NotInstalled::new());
        response
            .extensions_mut()
            .insert(PendingBody(Arc::new(Mutex::new(Some(tonic::body::Body::new(body))))));
        Ok(response)
    }

    async fn ack(&self, request: Request<pb::AckRequest>) -> Result<Response<pb::AckResponse>, Status> {
        let request = request.into_inner();
        let acked = self
            .engine
            .ack(&request.subscription_id, &request.sequences)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::AckResponse {
            acked: acked.acked,
            unknown: acked.unknown,
        }))
    }

    async fn nack(&self, request: Request<pb::NackRequest>) -> Result<Response<pb::NackResponse>, Status> {
        let request = request.into_inner();
        let nacked = self
            .engine
            .nack(&request.subscription_id, &request.sequences)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::NackResponse {
            requeued: nacked.requeued,
            unknown: nacked.unknown,
        }))
    }
}

/// The engine's request for an `OpenSubscriptionRequest` (an
/// `OpenSubscription` call's, or a session's `open`).
pub(crate) fn subscribe_request(
    request: pb::OpenSubscriptionRequest,
    peer: Option<std::net::SocketAddr>,
) -> Result<SubscribeRequest, Status> {
    Ok(SubscribeRequest {
        mode: delivery_mode(request.mode)?,
        ack_mode: ack_mode(request.ack_mode)?,
        topic_patterns: request.topic_patterns,
        subscription_id: request.subscription_id,
        consumer_group: request.consumer_group,
        max_in_flight: request.max_in_flight,
        ack_deadline_ms: request.ack_deadline_ms,
        peer,
        credit: None,
    })
}

/// Counts a message of a stream as accepted.
fn accept(response: &mut pb::PublishStreamResponse, sequence: u64) {
    if response.accepted == 0 {
        response.first_sequence = sequence;
    }
    response.last_sequence = sequence;
    response.accepted += 1;
}

fn with_accepted(error: Status, accepted: u64) -> Status {
    Status::new(
        error.code(),
        format!(
            "{}; {accepted} earlier messages of this stream were accepted and stay published",
            error.message()
        ),
    )
}

/// The inverse of [`decoding_limit`]: the `max_message_bytes` a decoding
/// limit was made from.
fn max_message_bytes_of(decoding_limit: usize) -> usize {
    decoding_limit.saturating_sub(64 * 1024)
}

/// The RESOURCE_EXHAUSTED text for a request tonic refused as over the
/// decoding limit, from tonic's own text ("... found N bytes, the limit is:
/// L bytes"): it names the request's size and `max_message_bytes`, not
/// the decoding limit the operator never set. Falls back to tonic's text
/// when it has another shape.
fn oversized_message(tonic_message: &str) -> String {
    let number_after = |label: &str| -> Option<usize> {
        let rest = &tonic_message[tonic_message.find(label)? + label.len()..];
        rest.trim_start().split(' ').next()?.parse().ok()
    };
    match (number_after("found"), number_after("the limit is:")) {
        (Some(found), Some(limit)) => format!(
            "request of {found} bytes is larger than max_message_bytes {} (TINYBROKER_MAX_MESSAGE_BYTES) allows",
            max_message_bytes_of(limit)
        ),
        _ => format!("message larger than max_message_bytes (TINYBROKER_MAX_MESSAGE_BYTES): {tonic_message}"),
    }
}

/// What a failed read of a request stream (`PublishStream`, `Session`)
/// means for the client, named by the message the stream carries
/// (`tinybroker.v1.SessionRequest`).
///
/// tonic reports bytes that are not a gRPC message of that type as INTERNAL
/// (a stream that ends in the middle of a message, a compressed flag other
/// than 0, or 1 with no `grpc-encoding`, bytes that are not its protobuf
/// encoding): the client sent them, so they are INVALID_ARGUMENT, saying
/// what was wrong. A message over the decoding limit is RESOURCE_EXHAUSTED
/// ([`oversized_to_exhausted`]). Anything else (the client reset the
/// stream) is passed on as it is; the client no longer reads it.
pub(crate) fn request_stream_error(error: Status, message: &str) -> Status {
    if error.code() != Code::Internal {
        return oversized_to_exhausted(error);
    }
    let text = error.message();
    let what = if text.starts_with("Unexpected EOF decoding stream") {
        "the stream ended in the middle of a gRPC message (its length prefix announced more bytes than came)"
    } else if text.starts_with("protocol error: received message with compressed-flag but no grpc-encoding") {
        "a gRPC message has its compressed flag set (1) but the request names no grpc-encoding (none is accepted)"
    } else if text.starts_with("protocol error: received message with invalid compression flag") {
        "a gRPC message's compressed flag is neither 0 nor 1"
    } else if text.starts_with("failed to decode Protobuf message") {
        "a gRPC message is not a valid protobuf encoding of it"
    } else if text.starts_with("Error decompressing") {
        "a gRPC message cannot be decompressed"
    } else {
        return error;
    };
    Status::invalid_argument(format!(
        "the request stream cannot be decoded as {message}: {what} ({text})"
    ))
}

/// tonic reports a request over the decoding limit as OUT_OF_RANGE; the
/// contract says an oversized message is RESOURCE_EXHAUSTED.
pub(crate) fn oversized_to_exhausted(error: Status) -> Status {
    if error.code() == Code::OutOfRange && error.message().contains("message length too large") {
        return Status::resource_exhausted(oversized_message(error.message()));
    }
    error
}

/// Rewrites the trailers-only OUT_OF_RANGE response tonic sends for a unary
/// request over the decoding limit into RESOURCE_EXHAUSTED (see
/// [`oversized_to_exhausted`]); used as a tower `map_response` layer.
pub fn map_oversized_response<B>(mut response: http::Response<B>) -> http::Response<B> {
    // Cheap for every other response: only an OUT_OF_RANGE one is read.
    if response.headers().get("grpc-status").is_none_or(|s| s != "11") {
        return response;
    }
    if let Some(status) = Status::from_header_map(response.headers()) {
        let mapped = oversized_to_exhausted(status);
        if mapped.code() == Code::ResourceExhausted {
            // tonic percent-encodes grpc-message.
            let _ = mapped.add_header(response.headers_mut());
        }
    }
    response
}

/// How much a subscription's body encodes before it hands the frame to h2,
/// when more deliveries are ready (tonic's own threshold).
pub(crate) const FRAME_THRESHOLD: usize = 32 * 1024;

/// The response body of an OpenSubscription stream: each poll takes the
/// deliveries that are ready and encodes them, framed for gRPC, into one
/// `Bytes` (issue 16).
///
/// tonic's `EncodeBody` over a `Stream` of messages did the same work in
/// more steps: each message went through a `Stream` item and a generic
/// encoder that reserved room and wrote its length in separate passes, with
/// compression and size checks per message. This body also encodes a
/// stream woken for one message at a time into the same bytes each time
/// (see `Frames::encode`), which is where the paced wide fan-out's CPU went
/// down (BENCHMARKS.md, "A subscription's own response body").
///
/// The generated server still decodes the request, checks it and maps its
/// errors: the handler makes this body and passes it to
/// [`install_subscription_body`] in the response's extensions, in place of
/// the stream tonic would encode ([`NotInstalled`]).
pub struct SubscriptionBody<S> {
    inner: S,
    out: Frames,
    /// Set once the trailers saying how the stream ended were handed out.
    ended: bool,
}

/// A subscription's deliveries being encoded.
struct Frames {
    /// The delivery fields that are this subscription's own, encoded once.
    fields: SubscriberFields,
    /// This stream's share of `tinybroker_delivery_lag_seconds`.
    lag: LocalObserver,
    /// What is encoded and not yet handed out; its spare room is kept for
    /// the next deliveries (empty until the first one, so an idle
    /// subscription holds no buffer).
    buf: BytesMut,
}

impl Frames {
    /// Appends `delivery`, framed (a 0 for "not compressed", the length as
    /// 4 bytes big-endian, the `Message`).
    fn encode(&mut self, delivery: Delivery, now: SystemTime, stream: &impl DeliveryStream) {
        let m = &delivery.message;
        if let Ok(lag) = now.duration_since(m.publish_time) {
            self.lag.observe(lag.as_secs_f64());
        }
        if telemetry::tracing_enabled() {
            deliver_span(
                m,
                stream.consumer_group().unwrap_or_default(),
                stream.id(),
                delivery.attempt,
            );
        }
        let message = EncodedMessage::new(delivery.message, &self.fields, delivery.attempt);
        let len = prost::Message::encoded_len(&message);
        let framed = GRPC_HEADER + len;
        reserve_frame(&mut self.buf, framed);
        self.buf.put_u8(0);
        // max_message_bytes is far below 4 GiB (config), so this holds.
        self.buf.put_u32(len as u32);
        prost::Message::encode_raw(&message, &mut self.buf);
    }
}

impl<S: DeliveryStream> SubscriptionBody<S> {
    pub fn new(inner: S, lag: LocalObserver) -> Self {
        Self {
            out: Frames {
                fields: SubscriberFields::new(inner.id(), inner.consumer_group().unwrap_or_default()),
                lag,
                buf: BytesMut::new(),
            },
            inner,
            ended: false,
        }
    }

    /// The trailers of a stream the engine ended: status OK, and why, how
    /// much it lost and where it stopped, so that a client can tell an
    /// eviction from an admin close or a shutdown.
    fn trailers(&self) -> http::HeaderMap {
        let mut status = Status::ok("");
        if let Some(end) = self.inner.end() {
            let metadata = status.metadata_mut();
            metadata.insert(END_REASON_METADATA, MetadataValue::from_static(end.reason.label()));
            metadata.insert(DROPPED_METADATA, MetadataValue::from(end.dropped));
            metadata.insert(LAST_SEQUENCE_METADATA, MetadataValue::from(end.last_sequence));
        }
        let mut trailers = http::HeaderMap::with_capacity(4);
        // Only a message that is not valid in a header fails; "" is.
        let _ = status.add_header(&mut trailers);
        trailers
    }
}

/// Makes room for `framed` more bytes in a body's encode buffer.
#[inline]
pub(crate) fn reserve_frame(buf: &mut BytesMut, framed: usize) {
    if buf.is_empty() && buf.capacity() < ENCODE_CHUNK {
        // Everything encoded so far was handed out. Once h2 has written it
        // and dropped it, the chunk is this buffer's alone again: encode
        // from its start rather than into the next bytes of it, so that a
        // stream woken for one message at a time writes the same few cache
        // lines each time instead of 8 KiB of them, cold. (Not yet, when h2
        // still holds some of it: then go on after it.)
        let _ = buf.try_reclaim(ENCODE_CHUNK);
    }
    if buf.capacity() - buf.len() < framed {
        // A chunk at a time, so a busy stream encodes many deliveries per
        // allocation; what is handed out shares it.
        buf.reserve(framed.max(ENCODE_CHUNK));
    }
}

/// The `deliver` span of one delivery, a child of the publisher's trace
/// (tracing on only).
pub(crate) fn deliver_span(m: &crate::broker::Published, group: &str, subscription_id: &str, attempt: u32) {
    let span = tracing::info_span!(
        "deliver",
        otel.kind = "consumer",
        messaging.system = "tinybroker",
        messaging.operation.type = "deliver",
        messaging.destination.name = %m.topic,
        messaging.message.id = m.sequence,
        messaging.consumer.group.name = %group,
        subscription_id = %subscription_id,
        delivery_attempt = attempt,
    );
    let _ = span.set_parent(telemetry::extract_headers(&m.headers));
}

/// The length of gRPC's message header: the compressed flag and 4 bytes of
/// length.
pub(crate) const GRPC_HEADER: usize = 5;

impl<S: DeliveryStream> http_body::Body for SubscriptionBody<S> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        // The time of this run of deliveries, read once rather than per message.
        let mut now = None;
        loop {
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(delivery)) => {
                    let now = *now.get_or_insert_with(SystemTime::now);
                    this.out.encode(delivery, now, &this.inner);
                    if this.out.buf.len() >= FRAME_THRESHOLD {
                        break;
                    }
                }
                Poll::Ready(None) => {
                    this.out.lag.flush();
                    if !this.out.buf.is_empty() {
                        // The deliveries first; the stream says None again
                        // at the next poll, which sends the trailers.
                        break;
                    }
                    this.ended = true;
                    return Poll::Ready(Some(Ok(http_body::Frame::trailers(this.trailers()))));
                }
                Poll::Pending => {
                    this.out.lag.flush();
                    break;
                }
            }
        }
        if this.out.buf.is_empty() {
            return Poll::Pending;
        }
        Poll::Ready(Some(Ok(http_body::Frame::data(this.out.buf.split().freeze()))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// A subscription's body on its way from the handler to
/// [`install_subscription_body`], in the response's extensions (which must
/// be `Clone` and `Sync`; it is taken once).
#[derive(Clone)]
struct PendingBody(Arc<Mutex<Option<tonic::body::Body>>>);

/// Puts a subscription's own body in place of the one tonic made
/// ([`NotInstalled`]); a tower `map_response` layer around the services.
pub fn install_subscription_body(mut response: http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> {
    if let Some(PendingBody(body)) = response.extensions_mut().remove::<PendingBody>()
        && let Some(body) = body.lock().take()
    {
        *response.body_mut() = body;
    }
    response
}

/// The body of an OpenSubscription response as the handler returned it,
/// for callers of the service without a server (the fuzz harness, tests).
pub fn take_subscription_body<T>(response: &mut Response<NotInstalled<T>>) -> Option<tonic::body::Body> {
    let PendingBody(body) = response.extensions_mut().remove::<PendingBody>()?;
    body.lock().take()
}

/// What tonic encodes for an OpenSubscription response: nothing, if
/// [`install_subscription_body`] replaced it, as it always does in the
/// server; a stream without it fails rather than ending as if closed.
pub struct NotInstalled<T = pb::Message>(bool, std::marker::PhantomData<fn() -> T>);

impl<T> NotInstalled<T> {
    fn new() -> Self {
        Self(false, std::marker::PhantomData)
    }
}

impl<T> Stream for NotInstalled<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if std::mem::replace(&mut self.0, true) {
            return Poll::Ready(None);
        }
        Poll::Ready(Some(Err(Status::internal(
            "the subscription's body was not installed (grpc::install_subscription_body is missing from the server's layers)",
        ))))
    }
}

/// The `Admin` service: read-mostly views for operators.
pub struct AdminService<E: Engine> {
    engine: E,
    auth_enabled: bool,
    tls_enabled: bool,
    shutdown_grace: std::time::Duration,
    connections: crate::config::ConnectionLimits,
}

impl<E: Engine> AdminService<E> {
    pub fn new(engine: E, auth_enabled: bool, tls_enabled: bool) -> Self {
        Self {
            engine,
            auth_enabled,
            tls_enabled,
            shutdown_grace: std::time::Duration::ZERO,
            connections: crate::config::ConnectionLimits::default(),
        }
    }

    /// Reported by GetBrokerInfo (the engine does not know it).
    pub fn with_shutdown_grace(mut self, grace: std::time::Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// The connection limits GetBrokerInfo reports.
    pub fn with_connection_limits(mut self, connections: crate::config::ConnectionLimits) -> Self {
        self.connections = connections;
        self
    }

    pub fn into_server(self) -> pb::admin_server::AdminServer<Self> {
        pb::admin_server::AdminServer::new(self)
    }
}

#[tonic::async_trait]
impl<E: Engine> pb::admin_server::Admin for AdminService<E> {
    async fn list_subscriptions(
        &self,
        _request: Request<pb::ListSubscriptionsRequest>,
    ) -> Result<Response<pb::ListSubscriptionsResponse>, Status> {
        let subscriptions = self.engine.list_subscriptions().await.map_err(status)?;
        Ok(Response::new(pb::ListSubscriptionsResponse {
            subscriptions: subscriptions.into_iter().map(Into::into).collect(),
        }))
    }

    async fn list_consumer_groups(
        &self,
        _request: Request<pb::ListConsumerGroupsRequest>,
    ) -> Result<Response<pb::ListConsumerGroupsResponse>, Status> {
        let groups = self.engine.list_groups().await.map_err(status)?;
        Ok(Response::new(pb::ListConsumerGroupsResponse {
            groups: groups.into_iter().map(Into::into).collect(),
        }))
    }

    async fn close_subscription(
        &self,
        request: Request<pb::CloseSubscriptionRequest>,
    ) -> Result<Response<pb::CloseSubscriptionResponse>, Status> {
        let id = request.into_inner().subscription_id;
        self.engine.close_subscription(&id).await.map_err(status)?;
        Ok(Response::new(pb::CloseSubscriptionResponse {}))
    }

    async fn list_evictions(
        &self,
        _request: Request<pb::ListEvictionsRequest>,
    ) -> Result<Response<pb::ListEvictionsResponse>, Status> {
        let evictions = self.engine.list_evictions().await.map_err(status)?;
        Ok(Response::new(pb::ListEvictionsResponse {
            evictions: evictions.into_iter().map(Into::into).collect(),
        }))
    }

    async fn get_broker_info(
        &self,
        _request: Request<pb::GetBrokerInfoRequest>,
    ) -> Result<Response<pb::GetBrokerInfoResponse>, Status> {
        let info = self.engine.info().await.map_err(status)?;
        // The counters the metrics read at a scrape (not a count of our own),
        // the peaks left to the scrapes.
        let counters = self.engine.snapshot(crate::engine::Peaks::Keep).counters;
        let l = self.engine.limits();
        Ok(Response::new(pb::GetBrokerInfoResponse {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            uptime: Some(prost_types::Duration {
                seconds: info.uptime.as_secs() as i64,
                nanos: info.uptime.subsec_nanos() as i32,
            }),
            started_at: Some(info.started_at.into()),
            limits: Some(pb::BrokerLimits {
                consumer_capacity: l.consumer_capacity as u64,
                group_capacity: l.group_capacity as u64,
                default_max_in_flight: l.default_max_in_flight,
                default_ack_deadline_ms: l.default_ack_deadline.as_millis() as u32,
                max_delivery_attempts: l.max_delivery_attempts,
                group_idle_ttl_seconds: l.group_idle_ttl.as_secs(),
                max_message_bytes: self.engine.max_message_bytes() as u64,
                max_subscriptions: l.max_subscriptions as u64,
                max_subscriptions_per_session: l.max_subscriptions_per_session as u64,
                shutdown_grace_seconds: self.shutdown_grace.as_secs(),
                max_patterns_per_subscription: MAX_PATTERNS_PER_SUBSCRIPTION as u32,
                max_topic_bytes: crate::topic::MAX_TOPIC_BYTES as u32,
                max_headers: MAX_HEADERS as u32,
                consumer_max_bytes: l.consumer_max_bytes as u64,
                group_max_bytes: l.group_max_bytes as u64,
                max_memory_bytes: l.max_memory_bytes.unwrap_or(0) as u64,
                max_connections: self.connections.max_connections as u64,
                handshake_timeout_seconds: self.connections.handshake_timeout.as_secs(),
            }),
            subscriptions: info.subscriptions,
            consumer_groups: info.consumer_groups,
            last_sequence: info.last_sequence,
            auth_enabled: self.auth_enabled,
            tls_enabled: self.tls_enabled,
            cluster_mode: info.cluster.is_some(),
            replica_id: info.cluster.as_ref().map(|c| c.replica_id.clone()).unwrap_or_default(),
            nats_server: info.cluster.map(|c| c.nats_server).unwrap_or_default(),
            messages_published: counters.published,
            messages_delivered: counters.delivered_multi + counters.delivered_single,
        }))
    }
}

// === proto ↔ engine conversions, each written once ===

fn delivery_mode(raw: i32) -> Result<DeliveryMode, Status> {
    match pb::DeliveryMode::try_from(raw) {
        Ok(pb::DeliveryMode::Unspecified | pb::DeliveryMode::Multi) => Ok(DeliveryMode::Multi),
        Ok(pb::DeliveryMode::Single) => Ok(DeliveryMode::Single),
        Err(_) => Err(Status::invalid_argument(format!(
            "mode {raw} is not a DeliveryMode (0 UNSPECIFIED, 1 MULTI, 2 SINGLE)"
        ))),
    }
}

fn ack_mode(raw: i32) -> Result<AckMode, Status> {
    match pb::AckMode::try_from(raw) {
        Ok(pb::AckMode::Unspecified | pb::AckMode::Auto) => Ok(AckMode::Auto),
        Ok(pb::AckMode::Manual) => Ok(AckMode::Manual),
        Err(_) => Err(Status::invalid_argument(format!(
            "ack_mode {raw} is not an AckMode (0 UNSPECIFIED, 1 AUTO, 2 MANUAL)"
        ))),
    }
}

impl From<DeliveryMode> for pb::DeliveryMode {
    fn from(mode: DeliveryMode) -> Self {
        match mode {
            DeliveryMode::Multi => pb::DeliveryMode::Multi,
            DeliveryMode::Single => pb::DeliveryMode::Single,
        }
    }
}

impl From<Option<AckMode>> for pb::AckMode {
    /// None (a broadcast subscription) is UNSPECIFIED.
    fn from(mode: Option<AckMode>) -> Self {
        match mode {
            None => pb::AckMode::Unspecified,
            Some(AckMode::Auto) => pb::AckMode::Auto,
            Some(AckMode::Manual) => pb::AckMode::Manual,
        }
    }
}

/// A peer address in a proto record: empty when unknown.
fn peer_address(peer: Option<std::net::SocketAddr>) -> String {
    peer.map(|p| p.to_string()).unwrap_or_default()
}

impl From<crate::engine::SubscriptionInfo> for pb::SubscriptionInfo {
    fn from(info: crate::engine::SubscriptionInfo) -> Self {
        pb::SubscriptionInfo {
            subscription_id: info.subscription_id,
            mode: pb::DeliveryMode::from(info.mode) as i32,
            consumer_group: info.consumer_group,
            topic_patterns: info.topic_patterns,
            queue_depth: info.queue_depth as u64,
            capacity: info.capacity as u64,
            delivered: info.delivered,
            opened_at: Some(info.opened_at.into()),
            peer_address: peer_address(info.peer),
            ack_mode: pb::AckMode::from(info.ack_mode) as i32,
            replica_id: info.replica_id,
            unacked: info.unacked,
            oldest_unacked_age: info.oldest_unacked_age.map(duration_to_pb),
        }
    }
}

fn duration_to_pb(age: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: age.as_secs() as i64,
        nanos: age.subsec_nanos() as i32,
    }
}

impl From<crate::engine::GroupInfo> for pb::ConsumerGroupInfo {
    fn from(group: crate::engine::GroupInfo) -> Self {
        pb::ConsumerGroupInfo {
            name: group.name,
            topic_patterns: group.topic_patterns,
            members: group.members as u32,
            backlog: group.backlog as u64,
            in_flight: group.in_flight as u64,
            redeliveries: group.redeliveries,
            dead_lettered: group.dead_lettered,
            dropped: group.dropped,
            oldest_unacked_age: group.oldest_unacked_age.map(duration_to_pb),
        }
    }
}

impl From<crate::engine::EvictionRecord> for pb::EvictionInfo {
    fn from(e: crate::engine::EvictionRecord) -> Self {
        pb::EvictionInfo {
            subscription_id: e.subscription_id,
            evicted_at: Some(e.evicted_at.into()),
            topic_patterns: e.topic_patterns,
            queue_depth: e.queue_depth as u64,
            last_delivered_sequence: e.last_delivered_sequence,
            peer_address: peer_address(e.peer),
            replica_id: e.replica_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::{Broker, SubscriptionStream};
    use crate::config::Limits;
    use http_body::Body as _;
    use prost::Message as _;
    use std::task::Waker;

    enum Polled {
        Data(Vec<pb::Message>),
        Trailers(http::HeaderMap),
        End,
        Pending,
    }

    /// A 2 MB publish is refused naming its size and the configured limit,
    /// not the decoding limit (max_message_bytes + 64 KiB) nobody set.
    #[test]
    fn an_oversized_request_names_its_size_and_max_message_bytes() {
        let tonic = format!(
            "Error, decoded message length too large: found 2000010 bytes, the limit is: {} bytes",
            decoding_limit(1_048_576)
        );
        let status = oversized_to_exhausted(Status::out_of_range(tonic.clone()));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "request of 2000010 bytes is larger than max_message_bytes 1048576 (TINYBROKER_MAX_MESSAGE_BYTES) allows"
        );
        // The unary path: tonic's trailers-only response, percent-encoded.
        let mut response = http::Response::new(());
        Status::out_of_range(tonic).add_header(response.headers_mut()).unwrap();
        let response = map_oversized_response(response);
        assert_eq!(response.headers()["grpc-status"], "8");
        let read = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(read.message(), status.message());
        // Any other response passes as it was.
        let mut other = http::Response::new(());
        Status::out_of_range("sequence out of range")
            .add_header(other.headers_mut())
            .unwrap();
        assert_eq!(map_oversized_response(other).headers()["grpc-status"], "11");
    }

    /// One poll of `body`, its data frame split into gRPC messages as a
    /// client splits it.
    fn poll(body: &mut SubscriptionBody<SubscriptionStream>) -> Polled {
        let mut cx = Context::from_waker(Waker::noop());
        let frame = match Pin::new(body).poll_frame(&mut cx) {
            Poll::Pending => return Polled::Pending,
            Poll::Ready(None) => return Polled::End,
            Poll::Ready(Some(frame)) => frame.expect("the body does not fail"),
        };
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => return Polled::Trailers(frame.into_trailers().expect("data or trailers")),
        };
        let mut messages = Vec::new();
        while !data.is_empty() {
            assert!(data.len() >= GRPC_HEADER, "a whole gRPC header");
            assert_eq!(data[0], 0, "not compressed");
            let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
            assert!(data.len() >= GRPC_HEADER + len, "a whole message in the frame");
            messages.push(pb::Message::decode(&data[GRPC_HEADER..GRPC_HEADER + len]).unwrap());
            data = data.slice(GRPC_HEADER + len..);
        }
        Polled::Data(messages)
    }

    fn publish(broker: &Broker, count: usize, payload: usize) {
        for _ in 0..count {
            let message = NewMessage {
                topic: "t".into(),
                payload: vec![b'p'; payload].into(),
                ..Default::default()
            };
            broker.publish(message, None).unwrap();
        }
    }

    /// A broker and the body of subscription `id` (any id when empty) to `t`.
    fn subscribed(id: &str) -> (Broker, SubscriptionBody<SubscriptionStream>) {
        let broker = Broker::new(Limits::default());
        let metrics = Metrics::new(broker.clone(), false);
        let stream = broker
            .subscribe(SubscribeRequest {
                topic_patterns: vec!["t".into()],
                subscription_id: id.into(),
                ..Default::default()
            })
            .unwrap();
        let body = SubscriptionBody::new(stream, metrics.delivery_lag(false));
        (broker, body)
    }

    /// What is ready goes out in one DATA frame, up to the threshold; the
    /// deliveries come out whole, in order, with the subscription's fields;
    /// a stream the engine ends gets its trailers once, after what was
    /// queued, and then nothing.
    #[test]
    fn a_subscription_body_frames_what_is_ready_together_and_ends_with_its_trailers() {
        let (broker, mut body) = subscribed("s1");
        assert!(matches!(poll(&mut body), Polled::Pending), "nothing to send yet");
        assert!(body.out.buf.capacity() == 0, "an idle subscription holds no buffer");

        publish(&broker, 3, 10);
        let Polled::Data(first) = poll(&mut body) else {
            panic!("a DATA frame")
        };
        assert_eq!(
            first.iter().map(|m| m.sequence).collect::<Vec<_>>(),
            [1, 2, 3],
            "all three, in one frame"
        );
        for m in &first {
            assert_eq!(
                (m.subscription_id.as_str(), m.topic.as_str(), m.payload.len()),
                ("s1", "t", 10)
            );
            assert_eq!(m.delivery_attempt, 1);
            assert!(m.publish_time.is_some());
        }
        assert!(matches!(poll(&mut body), Polled::Pending));

        // 200 of about 1 KiB: more than one frame's threshold.
        publish(&broker, 200, 1000);
        let mut sequences = Vec::new();
        let mut frames = 0;
        // (A stream yields once after its turn of 128 deliveries, waking
        // itself: Pending here, then the rest.)
        for _ in 0..100 {
            if sequences.len() == 200 {
                break;
            }
            let Polled::Data(messages) = poll(&mut body) else {
                continue;
            };
            frames += 1;
            let bytes: usize = messages.iter().map(|m| GRPC_HEADER + m.encoded_len()).sum();
            assert!(
                bytes < FRAME_THRESHOLD + 1100,
                "a frame stops at the threshold: {bytes} bytes"
            );
            sequences.extend(messages.iter().map(|m| m.sequence));
        }
        assert!(
            (7..=10).contains(&frames),
            "200 KiB in frames of about 32 KiB: {frames}"
        );
        assert_eq!(
            sequences,
            (4..204).collect::<Vec<u64>>(),
            "every delivery once, in order"
        );

        publish(&broker, 2, 10);
        broker.close_subscription("s1").unwrap();
        let mut delivered = 0;
        let trailers = loop {
            match poll(&mut body) {
                Polled::Data(messages) => delivered += messages.len(),
                Polled::Trailers(trailers) => break trailers,
                Polled::End | Polled::Pending => panic!("the trailers come before the end"),
            }
        };
        let trailer = |name: &str| trailers.get(name).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(trailer("grpc-status").as_deref(), Some("0"));
        assert_eq!(trailer(END_REASON_METADATA).as_deref(), Some("closed_by_admin"));
        let dropped: usize = trailer(DROPPED_METADATA).unwrap().parse().unwrap();
        assert_eq!(
            delivered + dropped,
            2,
            "each of the last two delivered or counted dropped"
        );
        assert!(body.is_end_stream());
        assert!(
            matches!(poll(&mut body), Polled::End),
            "the trailers once, then the end"
        );
    }

    /// A stream woken for one message at a time encodes each into the same
    /// bytes once h2 has let go of the one before (the same few cache lines
    /// every time, not 8 KiB of them), and after it while h2 still holds it.
    #[test]
    fn a_subscription_body_encodes_from_the_start_of_its_buffer_once_the_last_frame_is_gone() {
        let (broker, mut body) = subscribed("");
        let mut cx = Context::from_waker(Waker::noop());
        let mut next = |body: &mut SubscriptionBody<SubscriptionStream>| {
            publish(&broker, 1, 256);
            match Pin::new(body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => frame.into_data().expect("a DATA frame"),
                _ => panic!("a frame"),
            }
        };
        let first = next(&mut body);
        let at = first.as_ptr();
        let held = next(&mut body);
        assert_eq!(
            held.as_ptr(),
            at.wrapping_add(first.len()),
            "after the frame h2 still holds"
        );
        drop((first, held));
        for _ in 0..100 {
            let frame = next(&mut body);
            assert_eq!(frame.as_ptr(), at, "from the start again once the frames are gone");
        }
    }

    /// Without [`install_subscription_body`], a stream fails instead of
    /// ending as a closed subscription would.
    #[test]
    fn a_subscription_whose_body_was_not_installed_fails() {
        use futures::StreamExt;
        let mut stream = NotInstalled::<pb::Message>::new();
        let mut cx = Context::from_waker(Waker::noop());
        match stream.poll_next_unpin(&mut cx) {
            Poll::Ready(Some(Err(status))) => {
                assert_eq!(status.code(), Code::Internal);
                assert!(status.message().contains("install_subscription_body"));
            }
            _ => panic!("an error"),
        }
        assert!(matches!(stream.poll_next_unpin(&mut cx), Poll::Ready(None)));
    }
}
