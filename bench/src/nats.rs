//! NATS core adapter (async-nats): one client connection per subscriber, a
//! queue group as the consumer-group peer, and a raw-socket stalled
//! subscriber (async-nats always reads its socket and drops messages on the
//! client side, which would hide the back-pressure we want the server to see).

use crate::measure::{Delivery, Recorder, Tally, drive};
use crate::systems::{Server, before, http_get, varz_field, within};
use anyhow::{Context, Result, bail};
use async_nats::{Client, ConnectOptions, Subject};
use bytes::Bytes;
use futures::StreamExt;
use std::convert::Infallible;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const NET: Duration = Duration::from_secs(10);
/// Receive buffer of the stalled subscriber's socket.
const STALLED_RCVBUF: u32 = 64 * 1024;
pub const QUEUE_GROUP: &str = "bench-workers";

impl Delivery for async_nats::Message {
    fn payload(&self) -> &[u8] {
        &self.payload
    }
}

pub async fn connect(server: &Server) -> Result<Client> {
    let opts = ConnectOptions::new()
        .connection_timeout(NET)
        .request_timeout(Some(NET))
        .max_reconnects(Some(1));
    within(NET, "connecting to NATS", opts.connect(server.addr.to_string()))
        .await?
        .with_context(|| format!("connecting to NATS at {}", server.addr))
}

/// A round trip through the server: once it returns, the server has
/// processed everything this client sent before (SUB, PUB).
pub async fn round_trip(client: &Client) -> Result<()> {
    let subject = format!("_bench.ping.{}", client.new_inbox().replace('.', "_"));
    match within(NET, "a NATS round trip", client.request(subject, Bytes::new())).await? {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => Ok(()),
        Err(e) => Err(e).context("NATS round trip"),
    }
}

/// A request to `subject` (a [`Responders`] subject on another server of a
/// cluster), retried while it has no responders, until one answers. When
/// it does, that server has seen every `SUB` this client sent before: the
/// interest and the request travel the same route (docs/cluster-notes.md,
/// "What works").
pub async fn sync_through(client: &Client, subject: &str) -> Result<()> {
    within(NET, &format!("a round trip through {subject}"), async {
        loop {
            match client.request(subject.to_owned(), Bytes::new()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
                Err(e) => return Err(e).with_context(|| format!("NATS request to {subject}")),
            }
        }
    })
    .await?
}

/// One responder per server of a NATS cluster, each answering requests on
/// its own subject ([`Responders::subject`]) with an empty reply, for
/// [`sync_through`].
pub struct Responders {
    subjects: Vec<String>,
    tasks: Vec<JoinHandle<()>>,
}

impl Responders {
    pub async fn start(servers: &[Server]) -> Result<Responders> {
        let mut subjects = Vec::new();
        let mut tasks = Vec::new();
        for (k, server) in servers.iter().enumerate() {
            let client = connect(server).await?;
            let subject = format!("_bench.sync.{k}");
            let mut requests = within(NET, "subscribing a responder", client.subscribe(subject.clone()))
                .await?
                .context("NATS subscribe")?;
            round_trip(&client).await?;
            tasks.push(tokio::spawn(async move {
                while let Some(request) = requests.next().await {
                    if let Some(reply) = request.reply {
                        let _ = client.publish(reply, Bytes::new()).await;
                    }
                }
            }));
            subjects.push(subject);
        }
        Ok(Responders { subjects, tasks })
    }

    /// The subject answered on server `k`.
    pub fn subject(&self, k: usize) -> &str {
        &self.subjects[k]
    }
}

impl Drop for Responders {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Opens a subscriber (in `queue` if given) on its own connection and starts
/// its receive loop; with `sync`, once a round trip through each of those
/// [`Responders`] subjects proves their servers know the subscription.
pub async fn subscribe(
    server: &Server,
    pattern: &str,
    queue: Option<&str>,
    sync: &[String],
    rec: Recorder,
    stop: CancellationToken,
) -> Result<JoinHandle<Tally>> {
    let client = connect(server).await?;
    let sub = match queue {
        Some(q) => {
            within(
                NET,
                "queue-subscribing",
                client.queue_subscribe(pattern.to_owned(), q.to_owned()),
            )
            .await?
        }
        None => within(NET, "subscribing", client.subscribe(pattern.to_owned())).await?,
    }
    .context("NATS subscribe")?;
    round_trip(&client).await?;
    for subject in sync {
        sync_through(&client, subject).await?;
    }
    Ok(tokio::spawn(async move {
        let _client = client;
        drive(sub.map(Ok::<_, Infallible>), rec, stop, |_: &async_nats::Message| {}).await
    }))
}

/// A subscriber that subscribes and then never reads its socket.
pub async fn stalled(server: &Server, pattern: &str) -> Result<Box<dyn Send>> {
    within(NET, "opening the stalled NATS subscriber", async {
        let socket = TcpSocket::new_v4().context("creating a socket")?;
        socket
            .set_recv_buffer_size(STALLED_RCVBUF)
            .context("setting SO_RCVBUF")?;
        let mut s = socket.connect(server.addr).await.context("connecting to NATS")?;
        s.write_all(
            format!(
                "CONNECT {{\"verbose\":false,\"pedantic\":false,\"protocol\":1,\"name\":\"stalled\"}}\r\nSUB {pattern} 1\r\nPING\r\n"
            )
            .as_bytes(),
        )
        .await?;
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("PONG\r\n") {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                bail!("NATS closed the stalled subscriber's connection: {}", String::from_utf8_lossy(&seen));
            }
            seen.extend_from_slice(&buf[..n]);
        }
        anyhow::Ok(Box::new(s) as Box<dyn Send>)
    })
    .await?
}

/// Opens `recs.len()` subscribers that share one client connection (each
/// subscription its own `Subscriber` and its own receive loop), confirmed by
/// one round trip after the last `SUB`.
pub async fn subscribe_shared(
    server: &Server,
    pattern: &str,
    recs: Vec<Recorder>,
    stop: CancellationToken,
) -> Result<Vec<JoinHandle<Tally>>> {
    let client = connect(server).await?;
    let mut subs = Vec::with_capacity(recs.len());
    for _ in 0..recs.len() {
        subs.push(
            within(NET, "subscribing", client.subscribe(pattern.to_owned()))
                .await?
                .context("NATS subscribe")?,
        );
    }
    round_trip(&client).await?;
    Ok(subs
        .into_iter()
        .zip(recs)
        .map(|(sub, rec)| {
            let client = client.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let _client = client;
                drive(sub.map(Ok::<_, Infallible>), rec, stop, |_: &async_nats::Message| {}).await
            })
        })
        .collect())
}

/// `conns` connections with no subscription yet, each confirmed by a round
/// trip, for [`idle_on`].
pub async fn idle_connections(server: &Server, conns: usize) -> Result<Vec<Client>> {
    futures::future::try_join_all((0..conns).map(|_| async {
        let client = connect(server).await?;
        round_trip(&client).await?;
        anyhow::Ok(client)
    }))
    .await
}

/// `count` idle subscriptions on distinct literal subjects (`idle.<i>`),
/// `per_conn` on each of `clients` in turn.
pub async fn idle_on(clients: Vec<Client>, count: usize, per_conn: usize) -> Result<Box<dyn Send>> {
    let opened = futures::future::try_join_all(clients.into_iter().enumerate().map(|(c, client)| async move {
        let mut subs = Vec::with_capacity(per_conn);
        for i in c * per_conn..((c + 1) * per_conn).min(count) {
            subs.push(
                within(NET, "subscribing", client.subscribe(format!("idle.{i}")))
                    .await?
                    .context("NATS subscribe")?,
            );
        }
        round_trip(&client).await?;
        anyhow::Ok((client, subs))
    }))
    .await?;
    Ok(Box::new(opened))
}

/// `count` idle subscriptions on distinct literal subjects, `per_conn` per connection.
pub async fn idle(server: &Server, count: usize, per_conn: usize) -> Result<Box<dyn Send>> {
    let clients = idle_connections(server, count.div_ceil(per_conn)).await?;
    idle_on(clients, count, per_conn).await
}

/// The server's `/varz` document.
pub async fn varz(server: &Server) -> Result<String> {
    let http = server.http.context("NATS runs without a monitoring port")?;
    let (code, body) = http_get(http, "/varz").await?;
    if code != 200 {
        bail!("GET /varz answered {code}");
    }
    Ok(body)
}

pub async fn varz_number(server: &Server, field: &str) -> Result<u64> {
    let body = varz(server).await?;
    varz_field(&body, field).with_context(|| format!("no {field} in /varz"))
}

pub struct Publisher {
    client: Client,
    subject: Subject,
}

impl Publisher {
    pub async fn new(server: &Server, topic: &str) -> Result<Publisher> {
        Ok(Publisher {
            client: connect(server).await?,
            subject: Subject::from(topic),
        })
    }

    pub async fn send(&mut self, payload: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        before(
            deadline,
            "publishing to NATS",
            self.client.publish(self.subject.clone(), payload),
        )
        .await?
        .context("NATS publish")
    }

    /// Flushes and waits until the server has processed every message.
    pub async fn finish(self, _sent: u64) -> Result<()> {
        within(NET, "flushing NATS", self.client.flush())
            .await?
            .context("NATS flush")?;
        round_trip(&self.client).await
    }
}

/// The NATS peer of tinybroker's cluster-wide consumer groups
/// (src/cluster/groups.rs): the stream and consumer tinybroker creates for
/// a group, on [`crate::workloads::TOPIC`] directly.
pub const JS_STREAM: &str = "bench_group";
pub const JS_CONSUMER: &str = "members";
/// What a tinybroker hub asks of one pull (`room.min(256)`, 1 s), one
/// pull at a time.
const JS_PULL_BATCH: usize = 256;
const JS_PULL_EXPIRES: Duration = Duration::from_secs(1);

impl Delivery for async_nats::jetstream::Message {
    fn payload(&self) -> &[u8] {
        &self.message.payload
    }
}

/// Creates the group's stream and its one durable pull consumer as
/// tinybroker's `group_consumer` does: a WorkQueue memory stream of
/// `replicas` (tinybroker's default `TINYBROKER_NATS_REPLICAS` is 3),
/// `group_capacity` 65,536 messages and `group_max_bytes` 128 MiB, oldest
/// discarded, a 120 s duplicate window; explicit acks, `ack_wait` 30 s
/// (the default ack deadline), no limit on deliveries or pending acks.
pub async fn js_group_setup(server: &Server, subject: &str, replicas: usize) -> Result<()> {
    use async_nats::jetstream::{consumer, stream};
    let client = connect(server).await?;
    let js = async_nats::jetstream::new(client);
    let config = stream::Config {
        name: JS_STREAM.into(),
        subjects: vec![subject.to_owned()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::Memory,
        num_replicas: replicas,
        max_messages: 65_536,
        max_bytes: 128 << 20,
        discard: stream::DiscardPolicy::Old,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    // A cluster just started may time the first request out while its
    // stream placement settles (as tinybroker's replicas retry theirs).
    let started = tokio::time::Instant::now();
    let stream = loop {
        match within(NET, "creating the JetStream stream", js.create_stream(config.clone())).await? {
            Ok(stream) => break stream,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("creating the JetStream stream: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e).context("creating the JetStream stream"),
        }
    };
    within(
        NET,
        "creating the JetStream consumer",
        stream.create_consumer(consumer::pull::Config {
            durable_name: Some(JS_CONSUMER.into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: -1,
            ..Default::default()
        }),
    )
    .await?
    .context("creating the JetStream consumer")?;
    Ok(())
}

/// A member of the group on its own connection to `server`: pulls batches
/// of at most 256 from the shared durable consumer, one pull at a time
/// (a tinybroker hub's shape), and acks every message explicitly from a
/// task of its own (the MANUAL member's acker in tb.rs).
pub async fn js_member(server: &Server, rec: Recorder, stop: CancellationToken) -> Result<JoinHandle<Tally>> {
    use async_nats::jetstream::consumer::PullConsumer;
    let client = connect(server).await?;
    let js = async_nats::jetstream::new(client.clone());
    let consumer: PullConsumer = within(NET, "opening the JetStream consumer", async {
        js.get_stream(JS_STREAM)
            .await
            .context("getting the JetStream stream")?
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(JS_CONSUMER)
            .await
            .map_err(|e| anyhow::anyhow!("getting the JetStream consumer: {e}"))
    })
    .await??;
    let batches = futures::stream::unfold(consumer, |c| async move {
        let batch = c
            .batch()
            .max_messages(JS_PULL_BATCH)
            .expires(JS_PULL_EXPIRES)
            .messages()
            .await;
        Some((batch, c))
    });
    let messages = batches.flat_map(|batch| match batch {
        Ok(batch) => batch.map(|m| m.map_err(|e| e.to_string())).left_stream(),
        Err(e) => futures::stream::once(async move { Err(format!("pull failed: {e}")) }).right_stream(),
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Subject>();
    let acker = tokio::spawn(async move {
        let mut failed = 0u64;
        while let Some(reply) = rx.recv().await {
            if client.publish(reply, Bytes::new()).await.is_err() {
                failed += 1;
            }
        }
        let _ = within(NET, "flushing the acks", client.flush()).await;
        failed
    });
    Ok(tokio::spawn(async move {
        let tally = drive(messages, rec, stop, move |m: &async_nats::jetstream::Message| {
            if let Some(reply) = &m.message.reply {
                let _ = tx.send(reply.clone());
            }
        })
        .await;
        match within(NET, "sending the last acks", acker).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => eprintln!("warning: {n} JetStream acks not sent (their messages get redelivered)"),
            Ok(Err(e)) => eprintln!("warning: JetStream ack task failed: {e}"),
            Err(e) => eprintln!("warning: {e:#}"),
        }
        tally
    }))
}

/// The group's publisher: every message a JetStream publish with a message
/// id, its store ack awaited before the next (what a tinybroker replica
/// does for each message of a PublishStream matching a group).
/// Publishes to a JetStream stream with up to [`JsPublisher::WINDOW`]
/// store acks outstanding, awaited in order: what tinybroker's replica does
/// with a PublishStream's messages (it routes a batch of up to 128, then
/// awaits their stores), so both sides overlap their round trips alike.
pub struct JsPublisher {
    js: async_nats::jetstream::Context,
    subject: Subject,
    sent: u64,
    pending: std::collections::VecDeque<async_nats::jetstream::context::PublishAckFuture>,
}

impl JsPublisher {
    pub async fn new(server: &Server, topic: &str) -> Result<JsPublisher> {
        Ok(JsPublisher {
            js: async_nats::jetstream::new(connect(server).await?),
            subject: Subject::from(topic),
            sent: 0,
            pending: Default::default(),
        })
    }

    /// Store acks outstanding at most (tinybroker's `PUBLISH_BATCH`).
    pub const WINDOW: usize = 128;

    pub async fn send(&mut self, payload: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        let message = async_nats::jetstream::message::PublishMessage::build()
            .payload(payload)
            .message_id(format!("bench-{}", self.sent));
        self.sent += 1;
        let ack = before(
            deadline,
            "publishing to JetStream",
            self.js.send_publish(self.subject.clone(), message),
        )
        .await?
        .context("JetStream publish")?;
        self.pending.push_back(ack);
        if self.pending.len() >= Self::WINDOW {
            self.confirm_oldest(deadline).await?;
        }
        Ok(())
    }

    /// Awaits every store ack still outstanding.
    pub async fn finish(mut self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !self.pending.is_empty() {
            self.confirm_oldest(deadline).await?;
        }
        Ok(())
    }

    async fn confirm_oldest(&mut self, deadline: tokio::time::Instant) -> Result<()> {
        if let Some(ack) = self.pending.pop_front() {
            before(deadline, "a JetStream publish ack", ack.into_future())
                .await?
                .context("JetStream publish ack")?;
        }
        Ok(())
    }
}
