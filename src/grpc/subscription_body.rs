//! The response body of an `OpenSubscription` stream ([`SubscriptionBody`]),
//! the trailers that say how it ended, and how a handler's own body takes
//! the place of the one tonic would encode ([`install_subscription_body`];
//! a `Session`'s body, [`super::session_body::SessionBody`], goes the same
//! way).

use super::framing::{EncodedMessage, FRAME_THRESHOLD, GRPC_HEADER, SubscriberFields, deliver_span, reserve_frame};
use crate::engine::{Delivery, DeliveryStream};
use crate::ops::metrics::LocalObserver;
use crate::ops::telemetry;
use crate::pb;
use bytes::{BufMut, Bytes, BytesMut};
use futures::Stream;
use parking_lot::Mutex;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;
use tonic::codegen::http;
use tonic::metadata::MetadataValue;
use tonic::{Response, Status};

pub use crate::pb::metadata::{
    DROPPED_METADATA, END_REASON_METADATA, LAST_SEQUENCE_METADATA, SUBSCRIPTION_ID_METADATA,
};

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
    /// This stream's share of `tinybroker_delivery_lag_seconds`.
    lag: LocalObserver,
    /// Made at the first delivery: an idle subscription holds none.
    out: Option<Box<Frames>>,
    /// Set once the trailers saying how the stream ended were handed out.
    ended: bool,
}

/// A subscription's deliveries being encoded.
struct Frames {
    /// The delivery fields that are this subscription's own, encoded once.
    fields: SubscriberFields,
    /// What is encoded and not yet handed out; its spare room is kept for
    /// the next deliveries.
    buf: BytesMut,
}

impl Frames {
    fn new(stream: &impl DeliveryStream) -> Self {
        Self {
            fields: SubscriberFields::new(stream.id(), stream.consumer_group().unwrap_or_default()),
            buf: BytesMut::new(),
        }
    }

    /// Appends `delivery`, framed (a 0 for "not compressed", the length as
    /// 4 bytes big-endian, the `Message`).
    fn encode(&mut self, delivery: Delivery, now: SystemTime, stream: &impl DeliveryStream, lag: &mut LocalObserver) {
        let m = &delivery.message;
        if let Ok(lag_time) = now.duration_since(m.publish_time) {
            lag.observe(lag_time.as_secs_f64());
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
            inner,
            lag,
            out: None,
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
                    let out = this.out.get_or_insert_with(|| Box::new(Frames::new(&this.inner)));
                    out.encode(delivery, now, &this.inner, &mut this.lag);
                    if out.buf.len() >= FRAME_THRESHOLD {
                        break;
                    }
                }
                Poll::Ready(None) => {
                    this.lag.flush();
                    if this.out.as_ref().is_some_and(|out| !out.buf.is_empty()) {
                        // The deliveries first; the stream says None again
                        // at the next poll, which sends the trailers.
                        break;
                    }
                    this.ended = true;
                    return Poll::Ready(Some(Ok(http_body::Frame::trailers(this.trailers()))));
                }
                Poll::Pending => {
                    this.lag.flush();
                    break;
                }
            }
        }
        match &mut this.out {
            Some(out) if !out.buf.is_empty() => Poll::Ready(Some(Ok(http_body::Frame::data(out.buf.split().freeze())))),
            _ => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// A subscription's body on its way from the handler to
/// [`install_subscription_body`], in the response's extensions (which must
/// be `Clone` and `Sync`; it is taken once).
#[derive(Clone)]
pub(super) struct PendingBody(pub(super) Arc<Mutex<Option<tonic::body::Body>>>);

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
    pub(super) fn new() -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::{Broker, SubscriptionStream};
    use crate::config::Limits;
    use crate::engine::{NewMessage, SubscribeRequest};
    use crate::ops::metrics::Metrics;
    use http_body::Body as _;
    use prost::Message as _;
    use std::task::Waker;
    use tonic::Code;

    /// What an idle `OpenSubscription` holds as its response body (boxed
    /// by tonic): 80 bytes, jemalloc's 80-byte class (it was 96).
    #[test]
    fn a_subscription_body_is_80_bytes() {
        let size = std::mem::size_of::<SubscriptionBody<SubscriptionStream>>();
        assert!(size <= 80, "{size}");
    }

    enum Polled {
        Data(Vec<pb::Message>),
        Trailers(http::HeaderMap),
        End,
        Pending,
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
        assert!(
            body.out.is_none(),
            "an idle subscription holds no buffer and no encoded fields"
        );

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

    /// An idle `OpenSubscription`'s body: the stream, its lag observer and
    /// an empty slot for what its first delivery makes.
    #[test]
    fn an_idle_subscription_body_is_96_bytes() {
        let size = std::mem::size_of::<SubscriptionBody<crate::broker::SubscriptionStream>>();
        assert!(size <= 96, "{size}");
    }
}
