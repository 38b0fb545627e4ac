//! How the contract suite opens subscriptions, picked by `TB_TRANSPORT`:
//! `stream` (the default) opens each with `OpenSubscription`; `session`
//! opens each as a handle of a `Session` stream of its own, so that every
//! broadcast and group behaviour of the contract is checked through
//! sessions too (docs/contract.md, "Sessions": a session's subscription is
//! every bit a subscription); `batched` does the same on sessions opened
//! with `tinybroker-batch: 1`, whose deliveries come in `deliveries` events
//! (docs/contract.md, "Batches"), so that eviction, order and every group
//! behaviour are checked through batched deliveries too. A test reads a
//! [`Sub`] as it would read the
//! stream: `message()` gives the next delivery, and `Ok(None)` once the
//! broker ended the subscription (an `ended` event, or the stream's end).
//! Many subscriptions on one session are `tests/sessions.rs`'s.

use crate::common::session::TestSession;
use tinybroker::pb;
use tinybroker::pb::broker_client::BrokerClient;
use tinybroker::pb::session_event::Event;
use tonic::transport::Channel;
use tonic::{Code, Status};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Stream,
    Session,
    Batched,
}

pub fn transport() -> Transport {
    match std::env::var("TB_TRANSPORT").as_deref() {
        Err(_) | Ok("" | "stream") => Transport::Stream,
        Ok("session") => Transport::Session,
        Ok("batched") => Transport::Batched,
        Ok(other) => panic!("TB_TRANSPORT={other:?}: the transports are stream (the default), session and batched"),
    }
}

/// The handle each test subscription has on its session.
const HANDLE: u32 = 1;

/// One open subscription, on the transport [`transport`] picks.
pub enum Sub {
    Stream(tonic::Streaming<pb::Message>),
    Session {
        session: TestSession,
        ended: bool,
        /// The rest of a `deliveries` event (batched sessions), oldest last.
        batch: Vec<pb::SessionDelivery>,
    },
}

impl std::fmt::Debug for Sub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sub::Stream(_) => "Sub::Stream",
            Sub::Session { .. } => "Sub::Session",
        })
    }
}

impl Sub {
    /// The next delivery; `Ok(None)` once the subscription ended.
    pub async fn message(&mut self) -> Result<Option<pb::Message>, Status> {
        match self {
            Sub::Stream(stream) => stream.message().await,
            Sub::Session { session, ended, batch } => {
                if let Some(d) = batch.pop() {
                    assert_eq!(d.handles, [HANDLE], "a delivery names the session's one handle");
                    return Ok(Some(d.message.expect("a delivery carries its message")));
                }
                if *ended {
                    return Ok(None);
                }
                let Some(event) = session.events.message().await? else {
                    *ended = true;
                    return Ok(None);
                };
                let batched = transport() == Transport::Batched;
                match event.event {
                    Some(Event::Delivery(d)) => {
                        assert!(!batched, "a bare delivery on a batched session: {d:?}");
                        assert_eq!(d.handles, [HANDLE], "a delivery names the session's one handle");
                        Ok(Some(d.message.expect("a delivery carries its message")))
                    }
                    Some(Event::Deliveries(b)) => {
                        assert!(batched, "a deliveries event on a session that did not ask: {b:?}");
                        assert!(!b.deliveries.is_empty(), "an empty deliveries event");
                        *batch = b.deliveries;
                        batch.reverse();
                        let d = batch.pop().expect("one at least");
                        assert_eq!(d.handles, [HANDLE], "a delivery names the session's one handle");
                        Ok(Some(d.message.expect("a delivery carries its message")))
                    }
                    Some(Event::Ended(e)) => {
                        assert_eq!(e.handle, HANDLE);
                        assert_ne!(e.reason, "rejected", "{e:?}");
                        *ended = true;
                        Ok(None)
                    }
                    other => panic!("unexpected session event {other:?}"),
                }
            }
        }
    }
}

/// Opens a subscription; its id, or the status the broker refused it with.
pub async fn try_open(
    client: &mut BrokerClient<Channel>,
    request: pb::OpenSubscriptionRequest,
) -> Result<(Sub, String), Status> {
    match transport() {
        Transport::Stream => {
            let response = client.open_subscription(request).await?;
            let id = response
                .metadata()
                .get("tinybroker-subscription-id")
                .expect("subscription id metadata")
                .to_str()
                .unwrap()
                .to_owned();
            Ok((Sub::Stream(response.into_inner()), id))
        }
        Transport::Session | Transport::Batched => {
            let mut session = match transport() {
                Transport::Batched => TestSession::try_start_with(client, Some("1")).await?,
                _ => TestSession::try_start(client).await?,
            };
            session.open(HANDLE, request, 0);
            match session.events.message().await?.and_then(|e| e.event) {
                Some(Event::Opened(o)) => {
                    assert_eq!(o.handle, HANDLE);
                    let sub = Sub::Session {
                        session,
                        ended: false,
                        batch: Vec::new(),
                    };
                    Ok((sub, o.subscription_id))
                }
                Some(Event::Ended(e)) if e.reason == "rejected" => {
                    assert_eq!(e.handle, HANDLE);
                    Err(Status::new(Code::from(e.code as i32), e.message))
                }
                other => panic!("expected opened or rejected, got {other:?}"),
            }
        }
    }
}

/// Opens a subscription from a full request; its [`Sub`] and id.
pub async fn open(client: &mut BrokerClient<Channel>, request: pb::OpenSubscriptionRequest) -> (Sub, String) {
    try_open(client, request).await.expect("the subscription opens")
}

/// Opens a broadcast subscription; its [`Sub`] and id.
pub async fn subscribe(client: &mut BrokerClient<Channel>, patterns: &[&str]) -> (Sub, String) {
    open(client, crate::common::subscribe_request(patterns)).await
}
