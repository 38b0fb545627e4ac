//! The client library's subscriptions on a session (issue 26, point 4):
//! every subscriber of one `Client` shares one `Session` stream, credit
//! follows what the application takes (so a stalled application is evicted
//! alone), acks go in-band, and after a lost connection or a restarted
//! broker every subscription is opened again on a new session.

mod common;

use common::*;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tinybroker::client::{Client, ConnectOptions, EndReason, Subscriber, SubscriberEvent};
use tinybroker::config::{Config, Limits};
use tinybroker::pb;
use tinybroker::server::{self, Listeners};
use tokio::net::{TcpListener, TcpStream};

type Publisher = pb::broker_client::BrokerClient<tonic::transport::Channel>;

async fn sessions(metrics_addr: SocketAddr) -> f64 {
    process::metric_sum(&scrape(metrics_addr).await, "tinybroker_sessions")
}

/// What a subscriber said besides its messages, for the test to read.
fn recorded(subscriber: &mut Subscriber) -> Arc<Mutex<Vec<SubscriberEvent>>> {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    subscriber.on_event(move |e| sink.lock().push(e.clone()));
    events
}

/// The next message, which must come within 20 s.
async fn next(subscriber: &mut Subscriber) -> pb::Message {
    tokio::time::timeout(Duration::from_secs(20), subscriber.next())
        .await
        .expect("a message within 20 s")
        .expect("the subscriber did not fail")
        .expect("the subscription did not end")
}

async fn publish(client: &mut Publisher, topic: &str, payload: &str) -> pb::PublishResponse {
    client
        .publish(publish_request(topic, payload))
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscribers_of_one_client_and_its_clones_share_one_session() {
    timeout(async {
        let broker = start().await;
        let client = Client::connect(&broker.url()).await.unwrap();
        let clone = client.clone();
        let mut publisher = broker.client().await;
        let mut subscribers = Vec::new();
        for i in 0..10 {
            // Half of them through a clone of the client.
            let owner = if i % 2 == 0 { &client } else { &clone };
            let mut s = owner.subscriber(subscribe_request(&["shared.>"]), true);
            s.open().await.unwrap();
            subscribers.push(s);
        }
        assert_eq!(
            sessions(broker.metrics_addr).await,
            1.0,
            "one session for ten subscribers"
        );
        let listed = broker.subscriptions().await;
        assert_eq!(listed.len(), 10, "{listed:?}");
        for s in &subscribers {
            let id = s.subscription_id().unwrap();
            assert!(listed.iter().any(|l| l.subscription_id == id), "{id} listed");
        }
        let r = publish(&mut publisher, "shared.news", "to-all").await;
        assert_eq!(r.matched_subscriptions, 10);
        for s in &mut subscribers {
            let m = next(s).await;
            assert_eq!((&m.payload[..], m.sequence), (&b"to-all"[..], r.sequence));
            // One delivery names all ten handles and carries no id: each
            // subscriber still sees its own.
            assert_eq!(m.subscription_id, s.subscription_id().unwrap());
        }
        drop(subscribers);
        wait_until("the dropped subscribers' subscriptions to be closed", || async {
            broker.subscriptions().await.is_empty()
        })
        .await;
        assert_eq!(
            sessions(broker.metrics_addr).await,
            1.0,
            "the session stays while the client lives"
        );
        drop((client, clone));
        wait_until("the session to end with its client", || async {
            sessions(broker.metrics_addr).await == 0.0
        })
        .await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_that_stops_taking_messages_is_evicted_alone() {
    const CAPACITY: usize = 16;
    const COUNT: usize = 300;
    timeout(async {
        let broker = start_with(Config {
            limits: Limits {
                consumer_capacity: CAPACITY,
                ..Limits::default()
            },
            ..config()
        })
        .await;
        let client = Client::connect(&broker.url()).await.unwrap();
        let mut publisher = broker.client().await;
        // Both match every message: they share deliveries while both have
        // credit.
        let mut stalled = client.subscriber(subscribe_request(&["flood.>"]), false);
        let stalled_events = recorded(&mut stalled);
        stalled.open().await.unwrap();
        let mut reader = client.subscriber(subscribe_request(&["flood.*"]), false);
        reader.open().await.unwrap();
        let stalled_id = stalled.subscription_id().unwrap().to_owned();

        let mut last = 0;
        for i in 0..COUNT {
            let r = publish(&mut publisher, "flood.x", &i.to_string()).await;
            // The reader takes each message before the next is published.
            let m = next(&mut reader).await;
            assert_eq!((m.sequence, m.payload.as_ref()), (r.sequence, i.to_string().as_bytes()));
            last = r.sequence;
        }
        let r = publish(&mut publisher, "flood.x", "last").await;
        assert_eq!(
            r.matched_subscriptions, 1,
            "the stalled subscription was evicted, the reader was not"
        );
        assert_eq!(next(&mut reader).await.sequence, r.sequence);
        let mut admin = broker.admin().await;
        let evictions = common::evictions(&mut admin).await;
        let eviction = evictions
            .iter()
            .find(|e| e.subscription_id == stalled_id)
            .expect("the stalled subscription is listed as evicted");
        assert_eq!(eviction.queue_depth, CAPACITY as u64);
        assert!(
            evictions
                .iter()
                .all(|e| e.subscription_id != reader.subscription_id().unwrap())
        );

        // What it was sent before it was evicted is there, in order: its
        // window and no more; then it says it was evicted.
        let mut taken = Vec::new();
        while let Some(m) = tokio::time::timeout(Duration::from_secs(20), stalled.next())
            .await
            .expect("the stalled subscriber's messages and its end")
            .unwrap()
        {
            taken.push(m.sequence);
        }
        assert!(
            !taken.is_empty() && taken.len() <= 64,
            "at most a window of 64 was sent: {}",
            taken.len()
        );
        assert!(taken.windows(2).all(|w| w[0] < w[1]), "{taken:?}");
        assert!(*taken.last().unwrap() < last);
        let events = stalled_events.lock().clone();
        match &events[..] {
            [
                SubscriberEvent::Ended {
                    reason: EndReason::Evicted,
                    dropped: Some(dropped),
                    last_sequence: Some(last_sequence),
                    queue_depth: Some(depth),
                    ..
                },
            ] => {
                assert_eq!(*last_sequence, *taken.last().unwrap());
                assert_eq!(*depth, CAPACITY as u64);
                assert_eq!(*dropped, CAPACITY as u64 + 1, "its queue and the one that did not fit");
            }
            other => panic!("expected one eviction event, got {other:?}"),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_group_member_acks_and_nacks_in_band() {
    timeout(async {
        let broker = start().await;
        let client = Client::connect(&broker.url()).await.unwrap();
        let mut publisher = broker.client().await;
        let mut member = client.subscriber(member_request(&["jobs.*"], "in-band", true, 0), false);
        member.open().await.unwrap();
        let mut published = Vec::new();
        for i in 0..5 {
            published.push(
                publish(&mut publisher, "jobs.build", &format!("job-{i}"))
                    .await
                    .sequence,
            );
        }
        let mut got = Vec::new();
        for _ in 0..5 {
            got.push(next(&mut member).await.sequence);
        }
        assert_eq!(got, published);
        wait_until("five in flight", || async {
            broker.group("in-band").await.is_some_and(|g| g.in_flight == 5)
        })
        .await;
        // A nack hands one back: it comes again, as a second attempt.
        member.nack(vec![got[0]]).unwrap();
        let again = next(&mut member).await;
        assert_eq!((again.sequence, again.delivery_attempt), (got[0], 2));
        member.ack(got[..4].to_vec()).unwrap();
        // Ack by id keeps working beside the in-band one.
        let mut by_id = client.clone();
        let r = by_id
            .ack(member.subscription_id().unwrap(), vec![got[4]])
            .await
            .unwrap();
        assert_eq!((r.acked, r.unknown), (1, 0));
        wait_until("nothing in flight", || async {
            broker.group("in-band").await.is_some_and(|g| g.in_flight == 0)
        })
        .await;
        let g = broker.group("in-band").await.unwrap();
        assert_eq!((g.backlog, g.redeliveries), (0, 1), "{g:?}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_carries_the_token_and_a_refused_one_is_not_retried() {
    timeout(async {
        let broker = start_with(Config {
            auth_token: Some("s3cret".into()),
            ..config()
        })
        .await;
        let options = |token: Option<&str>| ConnectOptions {
            token: token.map(str::to_owned),
            ca: None,
        };
        let client = Client::connect_with(&broker.url(), &options(Some("s3cret")))
            .await
            .unwrap();
        let mut s = client.subscriber(subscribe_request(&["auth.>"]), true);
        s.open().await.unwrap();
        let id = s.subscription_id().unwrap().to_owned();
        let listing = client.clone().list_subscriptions().await.unwrap();
        assert!(listed(listing, &id).is_some());

        let refused = Client::connect_with(&broker.url(), &options(Some("wrong")))
            .await
            .unwrap();
        let mut s = refused.subscriber(subscribe_request(&["auth.>"]), true);
        let events = recorded(&mut s);
        let status = tokio::time::timeout(Duration::from_secs(10), s.open())
            .await
            .expect("a refused session is not retried")
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        assert!(events.lock().is_empty(), "{:?}", events.lock());
    })
    .await
}

/// A TCP proxy in front of the broker whose connections the test can cut.
struct Proxy {
    addr: SocketAddr,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(to: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let held = connections.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                held.lock().push(task.abort_handle());
            }
        });
        Self {
            addr,
            connections,
            accept,
        }
    }

    /// Drops every connection through it, both ways.
    fn cut(&self) {
        for connection in self.connections.lock().drain(..) {
            connection.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_cut_connection_every_subscription_is_opened_again_on_a_new_session() {
    const SUBSCRIBERS: usize = 5;
    timeout(async {
        let broker = start().await;
        let proxy = Proxy::start(broker.grpc_addr).await;
        let client = Client::connect(&format!("http://{}", proxy.addr)).await.unwrap();
        let mut publisher = broker.client().await;
        let mut subscribers = Vec::new();
        let mut events = Vec::new();
        for i in 0..SUBSCRIBERS {
            let mut s = client.subscriber(subscribe_request(&[&format!("cut.{i}")]), true);
            events.push(recorded(&mut s));
            s.open().await.unwrap();
            subscribers.push(s);
        }
        let before: Vec<String> = subscribers
            .iter()
            .map(|s| s.subscription_id().unwrap().to_owned())
            .collect();
        for (i, s) in subscribers.iter_mut().enumerate() {
            publish(&mut publisher, &format!("cut.{i}"), "before").await;
            assert_eq!(&next(s).await.payload[..], b"before");
        }

        proxy.cut();
        // The session task opens them all again on a new session, without
        // the application asking (nobody calls next meanwhile).
        wait_until("every subscription open again under a new id", || async {
            let listed = broker.subscriptions().await;
            listed.len() == SUBSCRIBERS && listed.iter().all(|l| !before.contains(&l.subscription_id))
        })
        .await;
        wait_until("one session, the new one", || async {
            sessions(broker.metrics_addr).await == 1.0
        })
        .await;
        for (i, s) in subscribers.iter_mut().enumerate() {
            let r = publish(&mut publisher, &format!("cut.{i}"), "after").await;
            assert_eq!(r.matched_subscriptions, 1);
            let m = next(s).await;
            assert_eq!((&m.payload[..], m.sequence), (&b"after"[..], r.sequence));
            let said: Vec<String> = events[i].lock().iter().map(|e| e.to_string()).collect();
            let at = |prefix: &str| {
                said.iter()
                    .position(|l| l.starts_with(prefix))
                    .unwrap_or_else(|| panic!("{prefix:?} in {said:#?}"))
            };
            let (lost, retry, back, resumed) = (
                at(&format!("subscription {} lost: ", before[i])),
                at("re-subscribing in "),
                at(&format!("re-subscribed as {}", s.subscription_id().unwrap())),
                at(&format!("receiving again from sequence {}", r.sequence)),
            );
            assert!(lost < retry && retry < back && back < resumed, "{said:#?}");
        }
    })
    .await
}

/// An embedded broker on a given gRPC address, so that a test can start
/// another on the same port.
struct Embedded {
    grpc_addr: SocketAddr,
    metrics_addr: SocketAddr,
    shutdown: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Embedded {
    async fn start(grpc_addr: SocketAddr) -> Self {
        let grpc = TcpListener::bind(grpc_addr).await.unwrap();
        let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_addr = grpc.local_addr().unwrap();
        let metrics_addr = metrics.local_addr().unwrap();
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server::run(config(), Listeners { grpc, metrics }, async {
            let _ = stop.await;
        }));
        Self {
            grpc_addr,
            metrics_addr,
            shutdown,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    async fn stop(self) {
        let _ = self.shutdown.send(());
        self.task.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_broker_restarts_on_the_same_port_every_subscription_receives_again() {
    const SUBSCRIBERS: usize = 3;
    timeout(async {
        let first = Embedded::start("127.0.0.1:0".parse().unwrap()).await;
        let addr = first.grpc_addr;
        let client = Client::connect(&first.url()).await.unwrap();
        // Each subscriber in a task of its own, as an application would run
        // them, reporting (its index, payload).
        let (received_tx, mut received) = tokio::sync::mpsc::unbounded_channel();
        let mut events = Vec::new();
        for i in 0..SUBSCRIBERS {
            let mut s = client.subscriber(subscribe_request(&[&format!("restart.{i}")]), true);
            events.push(recorded(&mut s));
            s.open().await.unwrap();
            let received_tx = received_tx.clone();
            tokio::spawn(async move {
                while let Ok(Some(m)) = s.next().await {
                    let payload = String::from_utf8(m.payload.to_vec()).unwrap();
                    if received_tx.send((i, payload)).is_err() {
                        return;
                    }
                }
                let _ = received_tx.send((i, "(the subscriber gave up)".into()));
            });
        }
        assert_eq!(sessions(first.metrics_addr).await, 1.0);
        first.stop().await;
        let second = Embedded::start(addr).await;
        let mut publisher = pb::broker_client::BrokerClient::connect(second.url()).await.unwrap();
        // Publish to each until it has one: then it is open on the new
        // broker.
        let mut back = [false; SUBSCRIBERS];
        while back.iter().any(|b| !b) {
            for (i, _) in back.iter().enumerate().filter(|(_, b)| !**b) {
                publish(&mut publisher, &format!("restart.{i}"), &format!("after-{i}")).await;
            }
            while let Ok(Some((i, payload))) = tokio::time::timeout(Duration::from_millis(100), received.recv()).await {
                assert_eq!(payload, format!("after-{i}"));
                back[i] = true;
            }
        }
        assert_eq!(sessions(second.metrics_addr).await, 1.0, "all on one new session");
        for (i, e) in events.iter().enumerate() {
            let said: Vec<String> = e.lock().iter().map(|e| e.to_string()).collect();
            assert!(
                said.iter().any(|l| l.ends_with("ended: the broker is shutting down")),
                "{i}: {said:#?}"
            );
            assert!(
                said.iter().any(|l| l.starts_with("re-subscribed as ")),
                "{i}: {said:#?}"
            );
        }
        second.stop().await;
    })
    .await
}
