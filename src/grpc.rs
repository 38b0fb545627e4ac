//! The gRPC layer: adapts the broker core to the tonic services of
//! `tinybroker.v1`. It holds no broker logic: it converts requests, maps
//! [`BrokerError`]s to status codes, and turns deliveries into messages.

use crate::broker::{
    Broker, BrokerError, Delivery, DeliveryMode, NewMessage, RouteCache, SubscribeRequest, SubscriptionStream,
};
use crate::pb;
use futures::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::codegen::http;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status, Streaming};

/// Initial response metadata carrying the subscription id.
pub const SUBSCRIPTION_ID_METADATA: &str = "tinybroker-subscription-id";

/// Maps a core error to the status code API.md gives for it.
pub fn status(error: BrokerError) -> Status {
    let code = match &error {
        BrokerError::InvalidArgument(_) => Code::InvalidArgument,
        BrokerError::FailedPrecondition(_) => Code::FailedPrecondition,
        BrokerError::AlreadyExists(_) => Code::AlreadyExists,
        BrokerError::NotFound(_) => Code::NotFound,
        BrokerError::ResourceExhausted(_) => Code::ResourceExhausted,
        BrokerError::Unavailable(_) => Code::Unavailable,
        BrokerError::Unimplemented(_) => Code::Unimplemented,
    };
    Status::new(code, error.to_string())
}

/// The `Broker` service.
pub struct BrokerService {
    broker: Broker,
}

impl BrokerService {
    pub fn new(broker: Broker) -> Self {
        Self { broker }
    }

    /// The tonic server for this service, with the decoding limit derived
    /// from `max_message_bytes` so no request can make it allocate more.
    pub fn into_server(self) -> pb::broker_server::BrokerServer<Self> {
        let limit = decoding_limit(self.broker.limits().max_message_bytes);
        pb::broker_server::BrokerServer::new(self).max_decoding_message_size(limit)
    }
}

/// Largest encoded `PublishRequest` that can still hold a valid message:
/// payload and headers within `max_message_bytes`, plus the topic and the
/// protobuf framing of up to the maximal number of headers.
pub fn decoding_limit(max_message_bytes: usize) -> usize {
    max_message_bytes.saturating_add(64 * 1024)
}

fn new_message(request: pb::PublishRequest) -> NewMessage {
    NewMessage {
        topic: request.topic,
        payload: request.payload,
        headers: request.headers,
    }
}

#[tonic::async_trait]
impl pb::broker_server::Broker for BrokerService {
    async fn publish(&self, request: Request<pb::PublishRequest>) -> Result<Response<pb::PublishResponse>, Status> {
        let outcome = self
            .broker
            .publish(new_message(request.into_inner()), None)
            .map_err(status)?;
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
        let mut stream = request.into_inner();
        let mut cache = RouteCache::default();
        let mut response = pb::PublishStreamResponse::default();
        let draining = self.broker.draining();
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
            let request = match next {
                Ok(Some(request)) => request,
                Ok(None) => return Ok(Response::new(response)),
                Err(error) => {
                    return Err(with_accepted(oversized_to_exhausted(error), response.accepted));
                }
            };
            match self.broker.publish(new_message(request), Some(&mut cache)) {
                Ok(outcome) => {
                    if response.accepted == 0 {
                        response.first_sequence = outcome.sequence;
                    }
                    response.last_sequence = outcome.sequence;
                    response.accepted += 1;
                }
                Err(error) => return Err(with_accepted(status(error), response.accepted)),
            }
        }
    }

    type OpenSubscriptionStream = MessageStream;

    async fn open_subscription(
        &self,
        request: Request<pb::OpenSubscriptionRequest>,
    ) -> Result<Response<Self::OpenSubscriptionStream>, Status> {
        let peer = request.remote_addr();
        let request = request.into_inner();
        let mode = match pb::DeliveryMode::try_from(request.mode) {
            Ok(pb::DeliveryMode::Unspecified | pb::DeliveryMode::Multi) => DeliveryMode::Broadcast,
            Ok(pb::DeliveryMode::Single) => DeliveryMode::Group,
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "mode {} is not a DeliveryMode (0 UNSPECIFIED, 1 MULTI, 2 SINGLE)",
                    request.mode
                )));
            }
        };
        let stream = self
            .broker
            .subscribe(SubscribeRequest {
                topic_patterns: request.topic_patterns,
                subscription_id: request.subscription_id,
                mode,
                consumer_group: request.consumer_group,
                peer,
            })
            .map_err(status)?;
        let id = stream.id().to_owned();
        let mut response = Response::new(MessageStream {
            inner: stream,
            subscription_id: id.clone(),
            consumer_group: String::new(),
        });
        // Ids are printable ASCII (validated or generated), so this holds.
        if let Ok(value) = MetadataValue::try_from(id.as_str()) {
            response.metadata_mut().insert(SUBSCRIPTION_ID_METADATA, value);
        }
        Ok(response)
    }

    async fn ack(&self, _request: Request<pb::AckRequest>) -> Result<Response<pb::AckResponse>, Status> {
        Err(Status::unimplemented(
            "Ack is for consumer groups with manual ack, which are not implemented yet",
        ))
    }

    async fn nack(&self, _request: Request<pb::NackRequest>) -> Result<Response<pb::NackResponse>, Status> {
        Err(Status::unimplemented(
            "Nack is for consumer groups with manual ack, which are not implemented yet",
        ))
    }
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

/// tonic reports a request over the decoding limit as OUT_OF_RANGE; the
/// contract says an oversized message is RESOURCE_EXHAUSTED.
fn oversized_to_exhausted(error: Status) -> Status {
    if error.code() == Code::OutOfRange && error.message().contains("message length too large") {
        return Status::resource_exhausted(format!(
            "message larger than max_message_bytes (TINYBROKER_MAX_MESSAGE_BYTES): {}",
            error.message()
        ));
    }
    error
}

/// Rewrites the trailers-only OUT_OF_RANGE response tonic sends for a unary
/// request over the decoding limit into RESOURCE_EXHAUSTED (see
/// [`oversized_to_exhausted`]); used as a tower `map_response` layer.
pub fn map_oversized_response<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers();
    let is_oversized = headers.get("grpc-status").is_some_and(|s| s == "11")
        && headers
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .is_some_and(|m| m.contains("message%20length%20too%20large") || m.contains("message length too large"));
    if is_oversized {
        let headers = response.headers_mut();
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
        headers.insert(
            "grpc-message",
            http::HeaderValue::from_static(
                "message%20larger%20than%20max_message_bytes%20(TINYBROKER_MAX_MESSAGE_BYTES)",
            ),
        );
    }
    response
}

/// A subscription's deliveries as `Message`s for tonic.
pub struct MessageStream {
    inner: SubscriptionStream,
    subscription_id: String,
    consumer_group: String,
}

impl MessageStream {
    fn to_message(&self, delivery: Delivery) -> pb::Message {
        let m = &delivery.message;
        pb::Message {
            topic: m.topic.clone(),
            payload: m.payload.clone(),
            headers: m.headers.clone(),
            sequence: m.sequence,
            publish_time: Some(prost_types::Timestamp::from(m.publish_time)),
            subscription_id: self.subscription_id.clone(),
            consumer_group: self.consumer_group.clone(),
            delivery_attempt: delivery.attempt,
        }
    }
}

impl Stream for MessageStream {
    type Item = Result<pb::Message, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(delivery)) => Poll::Ready(Some(Ok(self.to_message(delivery)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}
