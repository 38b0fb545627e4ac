//! tinybroker client adapter: one tonic `Channel` (one HTTP/2 connection)
//! per subscriber, `PublishStream` for the publisher, batched unary `Ack`s
//! for manual-ack group members; and the batched forms of the contract
//! ("Batches: many messages per gRPC message"): a publisher that sends
//! `SessionPublish` batches of what is ready, and sessions opened with
//! `tinybroker-batch: 1` that read `deliveries` events and ack in bulk.

use crate::measure::{Delivery, Recorder, Tally, drive};
use crate::systems::{Server, before, http_get, prom_sum, within};
use anyhow::{Context, Result, bail};
use bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tinybroker::grpc::services::BATCH_METADATA;
use tinybroker::pb;
use tinybroker::pb::broker_client::BrokerClient;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::codec::Streaming;
use tonic::transport::{Channel, Endpoint};

const NET: Duration = Duration::from_secs(10);
/// Group members' `max_in_flight` (unacked or queued messages per member).
pub const MAX_IN_FLIGHT: u32 = 1024;
/// Most sequences in one `Ack` call, and how many calls a member keeps in flight.
pub const ACK_BATCH: usize = 256;
pub const ACKS_IN_FLIGHT: usize = 4;
/// HTTP/2 receive windows of the stalled subscriber's connection: small, so
/// the broker's queue, not the client's buffers, takes the back-pressure.
const STALLED_WINDOW: u32 = 64 * 1024;

impl Delivery for pb::Message {
    fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// How a subscriber joins.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    Broadcast,
    Group { manual: bool, member: usize },
}

pub async fn connect(server: &Server, window: Option<u32>) -> Result<BrokerClient<Channel>> {
    Ok(BrokerClient::new(channel(server, window).await?))
}

/// One HTTP/2 connection to the broker.
async fn channel(server: &Server, window: Option<u32>) -> Result<Channel> {
    let mut ep = Endpoint::from_shared(format!("http://{}", server.addr))
        .context("building the tinybroker endpoint")?
        .connect_timeout(NET)
        .tcp_nodelay(true);
    if let Some(w) = window {
        ep = ep.initial_stream_window_size(w).initial_connection_window_size(w);
    }
    let channel = within(NET, "connecting to tinybroker", ep.connect())
        .await?
        .with_context(|| format!("connecting to tinybroker at {}", server.addr))?;
    Ok(channel)
}

fn request(pattern: &str, mode: Mode) -> pb::OpenSubscriptionRequest {
    match mode {
        Mode::Broadcast => pb::OpenSubscriptionRequest {
            topic_patterns: vec![pattern.to_owned()],
            mode: pb::DeliveryMode::Multi as i32,
            ..Default::default()
        },
        Mode::Group { manual, member } => pb::OpenSubscriptionRequest {
            topic_patterns: vec![pattern.to_owned()],
            mode: pb::DeliveryMode::Single as i32,
            subscription_id: format!("bench-member-{member}"),
            consumer_group: "bench-workers".into(),
            ack_mode: if manual {
                pb::AckMode::Manual as i32
            } else {
                pb::AckMode::Auto as i32
            },
            max_in_flight: MAX_IN_FLIGHT,
            ack_deadline_ms: 0,
        },
    }
}

async fn open(client: &mut BrokerClient<Channel>, req: pb::OpenSubscriptionRequest) -> Result<Streaming<pb::Message>> {
    // The broker registers the subscription before it answers with headers,
    // so once this returns every later publish reaches it.
    let resp = within(NET, "opening a tinybroker subscription", client.open_subscription(req))
        .await?
        .context("OpenSubscription")?;
    Ok(resp.into_inner())
}

/// Opens a subscriber on its own connection and starts its receive loop.
pub async fn subscribe(
    server: &Server,
    pattern: &str,
    mode: Mode,
    rec: Recorder,
    stop: CancellationToken,
) -> Result<JoinHandle<Tally>> {
    let mut client = connect(server, None).await?;
    let req = request(pattern, mode);
    let id = req.subscription_id.clone();
    let stream = open(&mut client, req).await?;
    Ok(match mode {
        Mode::Group { manual: true, .. } => {
            let (tx, rx) = mpsc::unbounded_channel::<u64>();
            let acker = tokio::spawn(acker(client, id.clone(), rx));
            tokio::spawn(async move {
                let tally = drive(stream, rec, stop, move |m: &pb::Message| {
                    let _ = tx.send(m.sequence);
                })
                .await;
                // The loop dropped the sender: the acker sends what is left and stops.
                match within(NET, "sending the last acks", acker).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => eprintln!("warning: acks of {id}: {e:#}"),
                    Ok(Err(e)) => eprintln!("warning: ack task of {id} failed: {e}"),
                    Err(e) => eprintln!("warning: {e:#}"),
                }
                tally
            })
        }
        _ => tokio::spawn(async move {
            // The client lives as long as its stream, so its connection does too.
            let _client = client;
            drive(stream, rec, stop, |_: &pb::Message| {}).await
        }),
    })
}

/// Acks in batches: whatever sequences have arrived (up to [`ACK_BATCH`]) go
/// in one `Ack` call, with up to [`ACKS_IN_FLIGHT`] calls at once.
async fn acker(client: BrokerClient<Channel>, id: String, mut rx: mpsc::UnboundedReceiver<u64>) -> Result<()> {
    let slots = Arc::new(Semaphore::new(ACKS_IN_FLIGHT));
    let failures = Arc::new(AtomicU64::new(0));
    let mut batch = Vec::with_capacity(ACK_BATCH);
    while rx.recv_many(&mut batch, ACK_BATCH).await > 0 {
        let permit = slots.clone().acquire_owned().await.context("ack slots closed")?;
        let sequences = std::mem::replace(&mut batch, Vec::with_capacity(ACK_BATCH));
        let mut client = client.clone();
        let id = id.clone();
        let failures = failures.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let call = client.ack(pb::AckRequest {
                subscription_id: id,
                sequences,
            });
            if !matches!(tokio::time::timeout(NET, call).await, Ok(Ok(_))) {
                failures.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let _all = slots
        .acquire_many(ACKS_IN_FLIGHT as u32)
        .await
        .context("ack slots closed")?;
    match failures.load(Ordering::Relaxed) {
        0 => Ok(()),
        n => bail!("{n} Ack calls failed or timed out (their messages get redelivered)"),
    }
}

/// A subscriber that opens its stream and never reads it.
pub async fn stalled(server: &Server, pattern: &str) -> Result<Box<dyn Send>> {
    let mut client = connect(server, Some(STALLED_WINDOW)).await?;
    let stream = open(&mut client, request(pattern, Mode::Broadcast)).await?;
    Ok(Box::new((client, stream)))
}

/// Opens `recs.len()` broadcast subscribers that share one connection (one
/// tonic `Channel`, each subscription its own HTTP/2 stream and its own
/// receive loop), confirmed one after the other like [`subscribe`]'s.
pub async fn subscribe_shared(
    server: &Server,
    pattern: &str,
    recs: Vec<Recorder>,
    stop: CancellationToken,
) -> Result<Vec<JoinHandle<Tally>>> {
    let client = connect(server, None).await?;
    let mut loops = Vec::with_capacity(recs.len());
    for rec in recs {
        let mut client = client.clone();
        let stream = open(&mut client, request(pattern, Mode::Broadcast)).await?;
        let stop = stop.clone();
        loops.push(tokio::spawn(async move {
            // Each loop holds a handle on the shared connection, which lives
            // as long as the last of them.
            let _client = client;
            drive(stream, rec, stop, |_: &pb::Message| {}).await
        }));
    }
    Ok(loops)
}

/// `conns` connections with no subscription yet, for [`idle_on`].
pub async fn idle_connections(server: &Server, conns: usize) -> Result<Vec<BrokerClient<Channel>>> {
    futures::future::try_join_all((0..conns).map(|_| connect(server, None))).await
}

/// `count` idle subscriptions on distinct literal topics (`idle.<i>`),
/// `per_conn` on each of `clients` in turn.
pub async fn idle_on(clients: Vec<BrokerClient<Channel>>, count: usize, per_conn: usize) -> Result<Box<dyn Send>> {
    let opened = futures::future::try_join_all(clients.into_iter().enumerate().map(|(c, mut client)| async move {
        let mut streams = Vec::with_capacity(per_conn);
        for i in c * per_conn..((c + 1) * per_conn).min(count) {
            streams.push(open(&mut client, request(&format!("idle.{i}"), Mode::Broadcast)).await?);
        }
        anyhow::Ok((client, streams))
    }))
    .await?;
    Ok(Box::new(opened))
}

/// `count` idle subscriptions on distinct literal topics, `per_conn` per connection.
pub async fn idle(server: &Server, count: usize, per_conn: usize) -> Result<Box<dyn Send>> {
    let clients = idle_connections(server, count.div_ceil(per_conn)).await?;
    idle_on(clients, count, per_conn).await
}

async fn metrics(server: &Server) -> Result<String> {
    let http = server.http.context("tinybroker has no metrics address")?;
    let (code, body) = http_get(http, "/metrics").await?;
    if code != 200 {
        bail!("GET /metrics answered {code}");
    }
    Ok(body)
}

/// Open subscriptions, from the `tinybroker_subscriptions` gauge.
pub async fn subscriptions(server: &Server) -> Result<u64> {
    Ok(prom_sum(&metrics(server).await?, "tinybroker_subscriptions") as u64)
}

/// Open gRPC connections, from the `tinybroker_connections` gauge.
pub async fn connections(server: &Server) -> Result<u64> {
    Ok(prom_sum(&metrics(server).await?, "tinybroker_connections") as u64)
}

/// A connection for the Admin API's counts, which cost the broker little to
/// answer (a `/metrics` scrape with per-subscription series renders all of
/// them, and the memory that takes would be counted as the subscriptions').
pub struct Admin(pb::admin_client::AdminClient<Channel>);

impl Admin {
    pub async fn connect(server: &Server) -> Result<Admin> {
        Ok(Admin(pb::admin_client::AdminClient::new(channel(server, None).await?)))
    }

    /// Open subscriptions, from `GetBrokerInfo`.
    pub async fn subscriptions(&self) -> Result<u64> {
        let mut client = self.0.clone();
        let info = within(
            NET,
            "GetBrokerInfo",
            client.get_broker_info(pb::GetBrokerInfoRequest {}),
        )
        .await?
        .context("GetBrokerInfo")?;
        Ok(info.into_inner().subscriptions)
    }
}

/// Evictions so far, from `tinybroker_evictions_total`.
pub async fn evictions(server: &Server) -> Result<u64> {
    Ok(prom_sum(&metrics(server).await?, "tinybroker_evictions_total") as u64)
}

/// The publisher: one long `PublishStream`.
pub struct Publisher {
    tx: mpsc::Sender<pb::PublishRequest>,
    call: JoinHandle<Result<tonic::Response<pb::PublishStreamResponse>, tonic::Status>>,
    topic: String,
}

impl Publisher {
    pub async fn new(server: &Server, topic: &str) -> Result<Publisher> {
        let mut client = connect(server, None).await?;
        let (tx, rx) = mpsc::channel(1024);
        let call = tokio::spawn(async move { client.publish_stream(ReceiverStream::new(rx)).await });
        Ok(Publisher {
            tx,
            call,
            topic: topic.to_owned(),
        })
    }

    pub async fn send(&mut self, payload: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        let req = pb::PublishRequest {
            topic: self.topic.clone(),
            payload,
            headers: Default::default(),
        };
        match before(deadline, "handing a message to PublishStream", self.tx.send(req)).await? {
            Ok(()) => Ok(()),
            // The call ended early: its status says why.
            Err(_) => match within(NET, "reading the PublishStream status", &mut self.call).await? {
                Ok(Err(status)) => bail!("PublishStream failed: {status}"),
                _ => bail!("PublishStream ended before all messages were sent"),
            },
        }
    }

    /// Ends the stream and checks the broker accepted every message.
    pub async fn finish(self, sent: u64) -> Result<()> {
        drop(self.tx);
        let resp = within(
            Duration::from_secs(60),
            "waiting for the PublishStream response",
            self.call,
        )
        .await?
        .context("PublishStream task")?
        .context("PublishStream")?
        .into_inner();
        if resp.accepted != sent {
            bail!("PublishStream accepted {} of {sent} messages", resp.accepted);
        }
        Ok(())
    }
}

/// Most messages in one `SessionPublish`: the broker's default
/// `TINYBROKER_MAX_BATCH_MESSAGES`.
pub const PUBLISH_BATCH: usize = 1024;
/// Most payload bytes in one `SessionPublish`, far below what one request
/// may hold (`max_message_bytes`, 1 MiB by default, + 64 KiB).
const PUBLISH_BATCH_BYTES: usize = 256 * 1024;
/// `SessionPublish`es sent and not answered yet, at most: the broker reads
/// no further ahead than that (its `PUBLISHES_WAITING`).
const PUBLISHES_IN_FLIGHT: usize = 4;

/// The batched publisher: one `Session` that publishes in `SessionPublish`
/// batches. As a NATS client's buffered writes, it batches what is ready
/// and never waits to fill a batch: the load generator hands messages to a
/// writer task through a channel, and the writer sends whatever is in the
/// channel when it can (up to [`PUBLISH_BATCH`] messages or
/// [`PUBLISH_BATCH_BYTES`]) as one batch, with up to
/// [`PUBLISHES_IN_FLIGHT`] batches unanswered. A lone message leaves at
/// once in a batch of one; under load the batches grow while the answers
/// are awaited.
pub struct BatchPublisher {
    tx: mpsc::Sender<Bytes>,
    /// Gives back the session's request sender when done: the session stays
    /// open (not half-closed) until every answer is in.
    writer: JoinHandle<Result<mpsc::UnboundedSender<pb::SessionRequest>>>,
    reader: JoinHandle<Result<()>>,
    /// One permit per batch that may be sent; an answer gives one back.
    slots: Arc<Semaphore>,
    accepted: Arc<AtomicU64>,
    /// Messages the broker rejected, and the first rejection's text.
    rejected: Arc<std::sync::Mutex<(u64, Option<String>)>>,
    /// Keeps the session's connection open.
    _client: BrokerClient<Channel>,
}

impl BatchPublisher {
    pub async fn new(server: &Server, topic: &str) -> Result<BatchPublisher> {
        let mut client = connect(server, None).await?;
        let session = Session::start(&mut client, false).await?;
        let Session { tx: requests, events } = session;
        let slots = Arc::new(Semaphore::new(PUBLISHES_IN_FLIGHT));
        let accepted = Arc::new(AtomicU64::new(0));
        let rejected = Arc::new(std::sync::Mutex::new((0, None)));
        let (tx, rx) = mpsc::channel(PUBLISH_BATCH);
        let writer = tokio::spawn(write_batches(requests, rx, topic.to_owned(), slots.clone()));
        let reader = tokio::spawn(read_answers(events, slots.clone(), accepted.clone(), rejected.clone()));
        Ok(BatchPublisher {
            tx,
            writer,
            reader,
            slots,
            accepted,
            rejected,
            _client: client,
        })
    }

    pub async fn send(&mut self, payload: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        match before(
            deadline,
            "handing a message to the batch publisher",
            self.tx.send(payload),
        )
        .await?
        {
            Ok(()) => Ok(()),
            // The writer stopped: its result (or the reader's) says why.
            Err(_) => {
                if self.reader.is_finished() {
                    (&mut self.reader).await.context("the answer reader")??;
                }
                within(NET, "reading the batch writer's result", &mut self.writer)
                    .await?
                    .context("the batch writer")??;
                bail!("the batch publisher stopped before all messages were sent")
            }
        }
    }

    /// Sends what is left, waits for every answer and checks the broker
    /// accepted every message.
    pub async fn finish(self, sent: u64) -> Result<()> {
        drop(self.tx);
        let _requests = within(NET, "sending the last batches", self.writer)
            .await?
            .context("the batch writer")??;
        // Every batch answered: all the permits are back.
        let all = within(
            Duration::from_secs(60),
            "waiting for the SessionPublished answers",
            self.slots.acquire_many(PUBLISHES_IN_FLIGHT as u32),
        )
        .await?;
        if all.is_err() {
            // The reader closed the slots: the session failed.
            self.reader.await.context("the answer reader")??;
            bail!("the publishing session ended before every batch was answered");
        }
        self.reader.abort();
        let (rejected, first) = self.rejected.lock().unwrap().clone();
        if rejected > 0 {
            bail!(
                "the broker rejected {rejected} messages of the batches: {}",
                first.unwrap_or_default()
            );
        }
        let accepted = self.accepted.load(Ordering::Relaxed);
        if accepted != sent {
            bail!("the SessionPublished answers accepted {accepted} of {sent} messages");
        }
        Ok(())
    }
}

/// The batch publisher's writer: each batch is what is in `payloads` when
/// a slot is free.
async fn write_batches(
    requests: mpsc::UnboundedSender<pb::SessionRequest>,
    mut payloads: mpsc::Receiver<Bytes>,
    topic: String,
    slots: Arc<Semaphore>,
) -> Result<mpsc::UnboundedSender<pb::SessionRequest>> {
    let message = |payload: Bytes| pb::PublishRequest {
        topic: topic.clone(),
        payload,
        headers: Default::default(),
    };
    let mut id = 0u64;
    while let Some(first) = payloads.recv().await {
        slots
            .acquire()
            .await
            .context("the publishing session ended (no answers)")?
            .forget();
        // What arrived while an answer was awaited goes in the same batch.
        let mut bytes = first.len();
        let mut messages = Vec::with_capacity(payloads.len() + 1);
        messages.push(message(first));
        while messages.len() < PUBLISH_BATCH && bytes < PUBLISH_BATCH_BYTES {
            match payloads.try_recv() {
                Ok(p) => {
                    bytes += p.len();
                    messages.push(message(p));
                }
                Err(_) => break,
            }
        }
        id += 1;
        requests
            .send(pb::SessionRequest {
                request: Some(pb::session_request::Request::Publish(pb::SessionPublish {
                    id,
                    messages,
                })),
            })
            .map_err(|_| anyhow::anyhow!("the publishing session's request stream is closed"))?;
    }
    Ok(requests)
}

/// The batch publisher's reader: counts what each `published` answer
/// accepted and rejected, and frees a slot for each.
async fn read_answers(
    mut events: Streaming<pb::SessionEvent>,
    slots: Arc<Semaphore>,
    accepted: Arc<AtomicU64>,
    rejected: Arc<std::sync::Mutex<(u64, Option<String>)>>,
) -> Result<()> {
    let outcome = loop {
        match events.message().await {
            Ok(Some(pb::SessionEvent {
                event: Some(pb::session_event::Event::Published(p)),
            })) => {
                accepted.fetch_add(u64::from(p.accepted), Ordering::Relaxed);
                if let Some(first) = p.rejected.first() {
                    let mut r = rejected.lock().unwrap();
                    r.0 += p.rejected.len() as u64;
                    r.1.get_or_insert_with(|| format!("message {} of batch {}: {}", first.index, p.id, first.message));
                }
                slots.add_permits(1);
            }
            Ok(Some(_)) => {}
            Ok(None) => break Err(anyhow::anyhow!("the publishing session ended")),
            Err(e) => break Err(anyhow::anyhow!("the publishing session failed: {e}")),
        }
    };
    // Nobody waits for an answer that cannot come.
    slots.close();
    outcome
}

/// A `Session` stream (issue 26): requests go in through a channel.
struct Session {
    tx: mpsc::UnboundedSender<pb::SessionRequest>,
    events: Streaming<pb::SessionEvent>,
}

/// Credit a session's subscriber opens with (0: no credit limit): the
/// broker sends whatever is ready, as `OpenSubscription` does.
const SESSION_CREDIT: u32 = 0;

impl Session {
    /// Opens a session; `batch` asks for `deliveries` events
    /// (`tinybroker-batch: 1`) instead of one `delivery` event each.
    async fn start(client: &mut BrokerClient<Channel>, batch: bool) -> Result<Session> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut request = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        if batch {
            request
                .metadata_mut()
                .insert(BATCH_METADATA, tonic::metadata::MetadataValue::from_static("1"));
        }
        let events = within(NET, "opening a tinybroker session", client.session(request))
            .await?
            .context("Session")?
            .into_inner();
        Ok(Session { tx, events })
    }

    fn send(&self, request: pb::session_request::Request) -> Result<()> {
        self.tx
            .send(pb::SessionRequest { request: Some(request) })
            .map_err(|_| anyhow::anyhow!("the session's request stream is closed"))
    }

    /// Opens every request under handles 1, 2, … and waits for each `opened`
    /// (the broker registers a subscription before it says so).
    async fn open_all(&mut self, requests: Vec<pb::OpenSubscriptionRequest>) -> Result<()> {
        let n = requests.len();
        for (i, subscription) in requests.into_iter().enumerate() {
            self.send(pb::session_request::Request::Open(pb::SessionOpen {
                handle: i as u32 + 1,
                subscription: Some(subscription),
                credit: SESSION_CREDIT,
            }))?;
        }
        let mut opened = 0;
        while opened < n {
            let event = within(NET, "waiting for the session's opened events", self.events.message())
                .await?
                .context("Session")?
                .context("the session ended while opening")?;
            match event.event {
                Some(pb::session_event::Event::Opened(_)) => opened += 1,
                Some(pb::session_event::Event::Ended(e)) => bail!("session open refused: {} ({})", e.message, e.reason),
                other => bail!("unexpected session event while opening: {other:?}"),
            }
        }
        Ok(())
    }
}

/// The receive loop of a session: each delivery is counted once for every
/// handle it names, whether it came alone (`delivery`) or in a `deliveries`
/// event. With `acks` (manual-ack members) the sequences that arrived are
/// acked in-band, in one `SessionAck` per read of the stream: the event
/// read and whatever else had already arrived, at most `acks_per_read`
/// sequences.
async fn drive_session(
    mut session: Session,
    mut recs: Vec<Recorder>,
    stop: CancellationToken,
    acks: Option<usize>,
) -> Vec<Tally> {
    let mut pending: Vec<u64> = Vec::new();
    let cancelled = stop.cancelled();
    let mut cancelled = std::pin::pin!(cancelled);
    let mut ended = None;
    'outer: loop {
        let event = tokio::select! {
            biased;
            _ = &mut cancelled => break,
            event = session.events.message() => event,
        };
        let mut event = event;
        loop {
            match event {
                Ok(Some(pb::SessionEvent { event: Some(e) })) => match e {
                    pb::session_event::Event::Delivery(d) => {
                        take_delivery(d, &mut recs, acks.map(|_| &mut pending));
                    }
                    pb::session_event::Event::Deliveries(ds) => {
                        for d in ds.deliveries {
                            take_delivery(d, &mut recs, acks.map(|_| &mut pending));
                        }
                    }
                    pb::session_event::Event::Ended(e) => {
                        if let Some(rec) = recs.get_mut(e.handle as usize - 1) {
                            rec.ended(format!("ended by the server: {}", e.reason));
                        }
                    }
                    _ => {}
                },
                Ok(Some(_)) => {}
                Ok(None) => {
                    ended = Some("session ended by the server".to_string());
                    break 'outer;
                }
                Err(e) => {
                    ended = Some(format!("session failed: {e}"));
                    break 'outer;
                }
            }
            if acks.is_some_and(|most| pending.len() >= most) {
                break;
            }
            // What else has arrived goes in the same batch of acks.
            match futures::FutureExt::now_or_never(session.events.message()) {
                Some(next) => event = next,
                None => break,
            }
        }
        if !pending.is_empty() {
            let _ = session.send(pb::session_request::Request::Ack(pb::SessionAck {
                handle: 1,
                sequences: std::mem::take(&mut pending),
            }));
        }
    }
    recs.into_iter()
        .map(|mut rec| {
            if let Some(why) = &ended {
                rec.ended(why.clone());
            }
            rec.finish()
        })
        .collect()
}

/// Counts one delivery for every handle it names; its sequence goes to
/// `pending` when the session acks.
fn take_delivery(d: pb::SessionDelivery, recs: &mut [Recorder], pending: Option<&mut Vec<u64>>) {
    let Some(m) = d.message else { return };
    for h in &d.handles {
        if let Some(rec) = recs.get_mut(*h as usize - 1) {
            rec.record(&m.payload);
        }
    }
    if let Some(pending) = pending {
        pending.push(m.sequence);
    }
}

/// Spawns a session's receive loop; one handle per recorder, each giving
/// that subscriber's tally.
fn spawn_session(
    session: Session,
    client: BrokerClient<Channel>,
    recs: Vec<Recorder>,
    stop: CancellationToken,
    acks: Option<usize>,
) -> Vec<JoinHandle<Tally>> {
    let n = recs.len();
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| tokio::sync::oneshot::channel::<Tally>()).unzip();
    tokio::spawn(async move {
        // The client lives as long as the session, so its connection does too.
        let _client = client;
        for (tally, tx) in drive_session(session, recs, stop, acks).await.into_iter().zip(senders) {
            let _ = tx.send(tally);
        }
    });
    receivers
        .into_iter()
        .map(|rx| tokio::spawn(async move { rx.await.expect("the session loop hands every tally back") }))
        .collect()
}

/// [`subscribe_shared`] on one `Session`: the connection's subscribers are
/// handles of one stream (with `batch`, a session of `deliveries` events).
pub async fn subscribe_session_shared(
    server: &Server,
    pattern: &str,
    recs: Vec<Recorder>,
    stop: CancellationToken,
    batch: bool,
) -> Result<Vec<JoinHandle<Tally>>> {
    let mut client = connect(server, None).await?;
    let mut session = Session::start(&mut client, batch).await?;
    session
        .open_all((0..recs.len()).map(|_| request(pattern, Mode::Broadcast)).collect())
        .await?;
    Ok(spawn_session(session, client, recs, stop, None))
}

/// [`subscribe`] as the one handle of a `Session` of its own connection;
/// a manual-ack member acks in-band. With `batch` the session reads
/// `deliveries` events and a member acks everything one read brought in
/// one `SessionAck` (at most its `max_in_flight` can be unacked); without,
/// at most [`ACK_BATCH`] sequences an ack, as before batches.
pub async fn subscribe_session(
    server: &Server,
    pattern: &str,
    mode: Mode,
    rec: Recorder,
    stop: CancellationToken,
    batch: bool,
) -> Result<JoinHandle<Tally>> {
    let mut client = connect(server, None).await?;
    let mut session = Session::start(&mut client, batch).await?;
    session.open_all(vec![request(pattern, mode)]).await?;
    let acks = matches!(mode, Mode::Group { manual: true, .. }).then_some(if batch {
        MAX_IN_FLIGHT as usize
    } else {
        ACK_BATCH
    });
    Ok(spawn_session(session, client, vec![rec], stop, acks).remove(0))
}

/// [`idle_on`] with one `Session` per connection.
pub async fn idle_on_sessions(
    clients: Vec<BrokerClient<Channel>>,
    count: usize,
    per_conn: usize,
) -> Result<Box<dyn Send>> {
    let opened = futures::future::try_join_all(clients.into_iter().enumerate().map(|(c, mut client)| async move {
        let mut session = Session::start(&mut client, false).await?;
        let requests = (c * per_conn..((c + 1) * per_conn).min(count))
            .map(|i| request(&format!("idle.{i}"), Mode::Broadcast))
            .collect();
        session.open_all(requests).await?;
        anyhow::Ok((client, session.tx, session.events))
    }))
    .await?;
    Ok(Box::new(opened))
}

/// [`idle`] with one `Session` per connection.
pub async fn idle_sessions(server: &Server, count: usize, per_conn: usize) -> Result<Box<dyn Send>> {
    let clients = idle_connections(server, count.div_ceil(per_conn)).await?;
    idle_on_sessions(clients, count, per_conn).await
}
