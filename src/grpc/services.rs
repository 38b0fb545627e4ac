//! The tonic services of `tinybroker.v1` over any [`Engine`]: `Broker`
//! (Publish, PublishStream, OpenSubscription, Session, Ack, Nack) and
//! `Admin`. They hold no broker logic: a request is converted
//! ([`super::convert`]), handed to the engine, and its answer or
//! [`BrokerError`](crate::engine::BrokerError) converted back; a subscription's deliveries go out
//! through a response body of its own ([`super::subscription_body`],
//! [`super::session_body`]).

use super::convert::{decoding_limit, new_message, request_stream_error, status, subscribe_request};
use super::framing::publish_span;
use super::session_body::SessionBody;
use super::subscription_body::{NotInstalled, PendingBody, SUBSCRIPTION_ID_METADATA, SubscriptionBody};
use crate::engine::WakeBatch;
use crate::engine::validate::{MAX_HEADERS, MAX_PATTERNS_PER_SUBSCRIPTION};
use crate::engine::{Confirmation, DeliveryStream, Engine, PublishOutcome, PublishTime, TracingHeaders};
use crate::ops::metrics::Metrics;
use crate::ops::telemetry;
use crate::pb;
use futures::FutureExt;
use parking_lot::Mutex;
use std::sync::Arc;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

/// Most messages of one PublishStream routed before the task yields.
const PUBLISH_BATCH: usize = 128;
pub use crate::pb::metadata::{BATCH_METADATA, INSTANCE_METADATA, SEQUENCE_SCOPE_METADATA};
/// The message a `PublishStream` carries, as its decoding errors name it.
const PUBLISH_REQUEST: &str = "tinybroker.v1.PublishRequest";

/// The `Broker` service.
pub struct BrokerService<E: Engine> {
    engine: E,
    metrics: Metrics,
    /// This process's instance id, as [`INSTANCE_METADATA`] sends it.
    instance: MetadataValue<Ascii>,
}

impl<E: Engine> BrokerService<E> {
    pub fn new(engine: E, metrics: Metrics) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let instance = MetadataValue::try_from(id.as_str()).expect("a uuid is ASCII");
        Self {
            engine,
            metrics,
            instance,
        }
    }

    /// Says which instance answers and where its sequences come from, in the
    /// response headers of a stream that delivers messages.
    fn name_instance<T>(&self, response: &mut Response<T>) {
        let metadata = response.metadata_mut();
        metadata.insert(INSTANCE_METADATA, self.instance.clone());
        metadata.insert(
            SEQUENCE_SCOPE_METADATA,
            MetadataValue::from_static(self.engine.sequence_scope().as_str()),
        );
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
        // Sensitive: HPACK sends it as a literal "never indexed" instead of
        // adding it to the connection's table, where a value no later
        // response repeats would only push out ones that are repeated, and
        // keep up to 4 KiB of ids alive per connection (about 60 bytes per
        // idle subscription at 100 a connection).
        if let Ok(mut value) = MetadataValue::try_from(id.as_str()) {
            value.set_sensitive(true);
            response.metadata_mut().insert(SUBSCRIPTION_ID_METADATA, value);
        }
        self.name_instance(&mut response);
        Ok(response)
    }

    type SessionStream = NotInstalled<pb::SessionEvent>;

    async fn session(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let peer = request.remote_addr();
        // The parent of the publish spans of the session's batches.
        let parent = telemetry::tracing_enabled().then(|| telemetry::extract(request.metadata()));
        let batched = match request.metadata().get(BATCH_METADATA) {
            None => false,
            Some(value) if value.as_bytes() == b"1" => true,
            Some(value) => {
                return Err(Status::invalid_argument(format!(
                    "{BATCH_METADATA}: {:?} is not a value of that header: 1 asks for batched deliveries (SessionDeliveries events); leave it out for one delivery per event",
                    String::from_utf8_lossy(value.as_bytes())
                )));
            }
        };
        let body = SessionBody::new(
            self.engine.clone(),
            request.into_inner(),
            peer,
            self.metrics.clone(),
            batched,
        )
        .traced(parent);
        let mut response = Response::new(NotInstalled::new());
        response
            .extensions_mut()
            .insert(PendingBody(Arc::new(Mutex::new(Some(tonic::body::Body::new(body))))));
        self.name_instance(&mut response);
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
        // The counters the metrics read at a scrape (not a count of our own).
        let counters = self.engine.counters();
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
                max_batch_messages: l.max_batch_messages as u64,
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
