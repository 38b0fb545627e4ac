//! A `Session` stream as a test drives it: requests go in through a
//! channel, events come out of the generated client's stream.

use futures::channel::mpsc;
use tinybroker::pb;
use tinybroker::pb::broker_client::BrokerClient;
use tinybroker::pb::session_event::Event;
use tinybroker::pb::session_request::Request;
use tonic::transport::Channel;

/// The request metadata a session asks for batched deliveries with.
pub const BATCH_METADATA: &str = "tinybroker-batch";

pub struct TestSession {
    /// None once the test half-closed the session.
    requests: Option<mpsc::UnboundedSender<pb::SessionRequest>>,
    pub events: tonic::Streaming<pb::SessionEvent>,
}

impl TestSession {
    /// Opens a session (the broker answers with its headers at once).
    pub async fn start(client: &mut BrokerClient<Channel>) -> Self {
        Self::try_start(client).await.expect("the session is accepted")
    }

    pub async fn try_start(client: &mut BrokerClient<Channel>) -> Result<Self, tonic::Status> {
        Self::try_start_with(client, None).await
    }

    /// Opens a session that asks for batched deliveries (request metadata
    /// `tinybroker-batch: 1`: `deliveries` events, no bare `delivery`).
    pub async fn start_batched(client: &mut BrokerClient<Channel>) -> Self {
        Self::try_start_with(client, Some("1"))
            .await
            .expect("the batched session is accepted")
    }

    /// Opens a session with `batch` as its `tinybroker-batch` metadata
    /// (None: without the header).
    pub async fn try_start_with(
        client: &mut BrokerClient<Channel>,
        batch: Option<&str>,
    ) -> Result<Self, tonic::Status> {
        let (requests, receiver) = mpsc::unbounded();
        let mut request = tonic::Request::new(receiver);
        if let Some(value) = batch {
            request
                .metadata_mut()
                .insert(BATCH_METADATA, value.parse().expect("an ASCII metadata value"));
        }
        let events = client.session(request).await?.into_inner();
        Ok(Self {
            requests: Some(requests),
            events,
        })
    }

    pub fn send(&self, request: Request) {
        self.requests
            .as_ref()
            .expect("the session was half-closed")
            .unbounded_send(pb::SessionRequest { request: Some(request) })
            .expect("the session's request stream is open");
    }

    /// Sends a request with no variant set.
    pub fn send_empty(&self) {
        self.requests
            .as_ref()
            .expect("the session was half-closed")
            .unbounded_send(pb::SessionRequest { request: None })
            .expect("the session's request stream is open");
    }

    pub fn open(&self, handle: u32, subscription: pb::OpenSubscriptionRequest, credit: u32) {
        self.send(Request::Open(pb::SessionOpen {
            handle,
            subscription: Some(subscription),
            credit,
        }));
    }

    pub fn close(&self, handle: u32) {
        self.send(Request::Close(pb::SessionClose { handle }));
    }

    pub fn credit(&self, handle: u32, messages: u32) {
        self.send(Request::Credit(pb::SessionCredit { handle, messages }));
    }

    pub fn ack(&self, handle: u32, sequences: &[u64]) {
        self.send(Request::Ack(pb::SessionAck {
            handle,
            sequences: sequences.to_vec(),
        }));
    }

    pub fn nack(&self, handle: u32, sequences: &[u64]) {
        self.send(Request::Nack(pb::SessionNack {
            handle,
            sequences: sequences.to_vec(),
        }));
    }

    /// Sends a batch of messages (`SessionPublish`) under `id`.
    pub fn publish(&self, id: u64, messages: Vec<pb::PublishRequest>) {
        self.send(Request::Publish(pb::SessionPublish { id, messages }));
    }

    pub fn half_close(&mut self) {
        self.requests = None;
    }

    /// The next event; None when the session ended with OK; panics when it
    /// ended with an error.
    pub async fn next(&mut self) -> Option<Event> {
        match self.events.message().await {
            Ok(Some(event)) => Some(event.event.expect("every event has its variant set")),
            Ok(None) => None,
            Err(status) => panic!("the session failed: {status:?}"),
        }
    }

    /// The next event, which must be one.
    pub async fn event(&mut self) -> Event {
        self.next().await.expect("the session ended early")
    }

    /// Waits for the `opened` event of `handle` (panics on anything else).
    pub async fn opened(&mut self, handle: u32) -> String {
        match self.event().await {
            Event::Opened(o) if o.handle == handle => o.subscription_id,
            other => panic!("expected opened for handle {handle}, got {other:?}"),
        }
    }

    /// Opens `handle` and waits for its `opened`; the subscription id.
    pub async fn open_and_wait(
        &mut self,
        handle: u32,
        subscription: pb::OpenSubscriptionRequest,
        credit: u32,
    ) -> String {
        self.open(handle, subscription, credit);
        self.opened(handle).await
    }

    /// The next event, which must be a delivery.
    pub async fn delivery(&mut self) -> pb::SessionDelivery {
        match self.event().await {
            Event::Delivery(d) => d,
            other => panic!("expected a delivery, got {other:?}"),
        }
    }

    /// The next event, which must be a `published` answer.
    pub async fn published(&mut self) -> pb::SessionPublished {
        match self.event().await {
            Event::Published(p) => p,
            other => panic!("expected published, got {other:?}"),
        }
    }

    /// The next event, which must be a `deliveries` event.
    pub async fn deliveries(&mut self) -> pb::SessionDeliveries {
        match self.event().await {
            Event::Deliveries(d) => d,
            other => panic!("expected deliveries, got {other:?}"),
        }
    }

    /// The next event, which must be an `ended`.
    pub async fn ended(&mut self) -> pb::SessionEnded {
        match self.event().await {
            Event::Ended(e) => e,
            other => panic!("expected ended, got {other:?}"),
        }
    }
}
