//! Whether NATS answers this replica: a replica cut off without a word (a
//! network partition: its connection stays open, packets are dropped,
//! nothing is reset) says so within seconds (docs/contract.md, "Cluster
//! mode", and docs/cluster-notes.md, "Cut off without a word").
//!
//! The NATS client notices such a partition only through its own pings,
//! after three unanswered ones (3 min with its default interval), and a
//! flush proves nothing: it only hands bytes to the socket. So:
//!
//! - **A probe** ([`ClusterEngine::watch_liveness`], one task per replica,
//!   from the set-up on): every [`PROBE_EVERY`] a request to a subject
//!   nobody subscribes to (`<prefix>.alive.<replica>`). The replica's own
//!   NATS server answers it at once with "no responders": a round trip to
//!   that server and nothing else (no JetStream, no other replica), so a
//!   JetStream election does not look like a partition. Bytes read from
//!   the server since the last probe count as an answer too, so a probe
//!   queued behind a burst of messages is no false alarm.
//! - **Beyond the own server** ([`Beyond`], [`probe_quorum`]): the same
//!   tick pings the other replicas (`<prefix>.alive.peers`, each answers
//!   with the id of its NATS server) and asks the buckets' stream leaders
//!   for their info. An answer from a replica on another server, from a
//!   leader on another server, or from a leader here as of when it last
//!   heard from a majority of its peers, is a sign
//!   that this server still reaches its cluster: a server cut off from the
//!   rest of the NATS cluster (its routes blackholed or reset) still
//!   answers the round trip above, so without this its replica served on
//!   while its group publishes could not be stored (docs/cluster-notes.md,
//!   "Partitioned inside NATS").
//! - **Unreachable** after [`SILENT_FOR`] without an answer (each probe
//!   waits [`PROBE_TIMEOUT`]): 2 to 3 s after the last byte. The replica
//!   then goes NOT_SERVING saying NATS is unreachable (a WARN, once), its
//!   `tinybroker_nats_connected` reads 0, and every request already waiting
//!   on NATS for a Publish or an OpenSubscription (a registry claim, a
//!   group's store, a message queued in the client) is answered UNAVAILABLE
//!   at that moment ([`ClusterEngine::unless_cut_off`]); new ones are
//!   answered at once by the health check every request starts with.
//! - **Back** at the first answer: what a reconnection does
//!   ([`ClusterEngine::back_online`]: SERVING once JetStream is seen to
//!   keep this replica's state), within a probe period of NATS answering.
//! - **Broadcast messages** a replica queued on core NATS before it knew it
//!   was cut off wait in its client and its socket, and would reach the
//!   other replicas when the partition heals, however long it lasted. The
//!   receiving replica drops every broadcast message older than
//!   [`DELIVER_WITHIN`] when it arrives (the publisher's time, in the
//!   envelope, against the receiver's clock) and counts it,
//!   `tinybroker_messages_dropped_total{reason="nats_unreachable"}`, once
//!   per replica that had a subscriber for it (as `nats_slow_consumer`
//!   counts what NATS dropped on the way to it). The receiver decides
//!   because only it sees when a message arrives: the sender cannot take
//!   back what its socket holds. This needs the replicas' clocks within a
//!   second or so of each other (NTP); a drop says the age it saw, so a
//!   skewed clock shows in the log. A replica too slow to read what NATS
//!   sends it for 5 s drops the same way (late is late, whatever held it).
//!
//! The connection itself is left open, so the moment the partition heals
//! the same connection carries on (no reconnection to wait for). A
//! connection that is reset goes the usual way (`Event::Disconnected`:
//! NOT_SERVING, and requests waiting on NATS answered, at once); the
//! client then tries to reconnect at least every
//! [`RECONNECT_DELAY_AT_MOST`] ([`reconnect_delay`], instead of its own
//! backoff of up to 4 s), so that it serves again within 5 s of NATS
//! taking connections again.

use super::registry::key;
use super::{ClusterEngine, Ready};
use crate::engine::{BrokerError, EngineHealth};
use crate::retry::Backoff;
use futures::FutureExt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;

/// How often the probe goes out.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);
/// How long one probe waits for its answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long without a byte from the NATS server makes it unreachable.
pub const SILENT_FOR: Duration = Duration::from_secs(2);
/// The longest wait between two attempts to reconnect (the client's own
/// backoff goes up to 4 s): a replica serves again within a second or so
/// of its NATS server taking connections again.
pub const RECONNECT_DELAY_AT_MOST: Duration = Duration::from_secs(1);
/// How old a broadcast message of another replica may be when it arrives
/// here; older, it is dropped and counted (`nats_unreachable`).
pub const DELIVER_WITHIN: Duration = Duration::from_secs(5);

/// What this replica knows of NATS answering, and what it dropped for it.
pub(super) struct Liveness {
    /// True while the probes are answered (and before the first one). A
    /// watch: requests waiting on NATS are answered UNAVAILABLE when it
    /// turns false.
    answering: watch::Sender<bool>,
    /// Broadcast messages of other replicas dropped here because they
    /// arrived later than [`DELIVER_WITHIN`].
    late_dropped: AtomicU64,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            answering: watch::Sender::new(true),
            late_dropped: AtomicU64::new(0),
        }
    }
}

impl Liveness {
    /// Whether NATS answered this replica's probes lately.
    pub(super) fn answering(&self) -> bool {
        *self.answering.borrow()
    }

    /// The connection was lost: requests waiting on NATS are answered at
    /// once, as when the probe finds it silent.
    pub(super) fn lost(&self) {
        self.answering.send_replace(false);
    }

    /// The connection is back (a new one answered the handshake).
    pub(super) fn back(&self) {
        self.answering.send_replace(true);
    }

    /// Broadcast messages dropped here for arriving too late.
    pub(super) fn late_dropped(&self) -> u64 {
        self.late_dropped.load(Ordering::Relaxed)
    }
}

/// How late a message published at `published` (the publisher's clock)
/// is, arriving at `arrived` (this replica's clock), if it is too late to
/// be delivered: None when it is within [`DELIVER_WITHIN`] (or from the
/// future: a clock ahead is no reason to drop).
pub(super) fn too_late(published: SystemTime, arrived: SystemTime) -> Option<Duration> {
    arrived
        .duration_since(published)
        .ok()
        .filter(|age| *age > DELIVER_WITHIN)
}

impl ClusterEngine {
    /// The probe (module docs), until the replica shuts down.
    pub(super) async fn watch_liveness(self, ready: Arc<Ready>) {
        let client = &self.inner.client;
        let subject = format!(
            "{}.alive.{}",
            self.inner.config.prefix,
            key(&self.inner.config.replica_id)
        );
        let beyond = Beyond::start(client, &self.inner.config.prefix).await;
        let streams = super::recovery::bucket_streams(&self.inner.config.prefix);
        let mut last_heard = Instant::now();
        let mut read = client.statistics().in_bytes.load(Ordering::Relaxed);
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.inner.local.is_shutting_down() {
                return;
            }
            if client.connection_state() != async_nats::connection::State::Connected {
                // Lost outright: the event watcher has said so, and a
                // reconnection starts a fresh count.
                last_heard = Instant::now();
                beyond.heard(Duration::ZERO);
                continue;
            }
            // Bytes read since the last look: heard by now (looked at before
            // the probe, so that bytes read before a partition are not
            // taken for an answer after the probe's wait).
            let now_read = client.statistics().in_bytes.load(Ordering::Relaxed);
            if now_read != read {
                last_heard = Instant::now();
            }
            read = now_read;
            beyond.ping(client).await;
            let (own, quorum) = tokio::join!(probe(client, &subject), probe_quorum(client, &streams));
            if own {
                last_heard = Instant::now();
            }
            if let Some(age) = quorum {
                beyond.heard(age);
            }
            let silent = last_heard.elapsed();
            let silent_beyond = beyond.silent();
            let answering = self.inner.liveness.answering();
            if answering && (silent >= SILENT_FOR || silent_beyond >= SILENT_FOR) {
                let why = if silent >= SILENT_FOR {
                    format!(
                        "NATS is unreachable: the NATS server ({}) has not answered for {:.1} s although the connection is open (a network partition?)",
                        self.nats_server(),
                        silent.as_secs_f64()
                    )
                } else {
                    format!(
                        "NATS is unreachable beyond its server: the NATS server ({}) answers, but for {:.1} s nothing beyond it has (no replica on another NATS server, no JetStream quorum): it is cut off from the rest of the NATS cluster (a network partition?)",
                        self.nats_server(),
                        silent_beyond.as_secs_f64()
                    )
                };
                tracing::warn!("{why}: NOT_SERVING until it answers");
                self.inner.health.send_replace(EngineHealth::NotServing(why));
                self.inner.liveness.answering.send_replace(false);
            } else if !answering && silent < SILENT_FOR && silent_beyond < SILENT_FOR {
                tracing::info!(nats_server = %self.nats_server(), "NATS answers again");
                self.inner.liveness.answering.send_replace(true);
                tokio::spawn(self.clone().back_online(ready.clone()));
            }
        }
    }

    /// `work` (NATS calls on a request's path), or None as soon as the
    /// probe finds NATS unreachable: a request then never waits for the
    /// NATS client's own timeouts, or for a partition to heal.
    pub(super) async fn unless_cut_off<F: Future>(&self, work: F) -> Option<F::Output> {
        let mut work = std::pin::pin!(work);
        // Most work is done at once (a message queued in the client):
        // without a watch of its own.
        if let Some(done) = work.as_mut().now_or_never() {
            return Some(done);
        }
        let mut answering = self.inner.liveness.answering.subscribe();
        tokio::select! {
            biased;
            done = work => Some(done),
            _ = answering.wait_for(|answering| !answering) => None,
        }
    }

    /// The UNAVAILABLE a request gets when NATS became unreachable under
    /// it: `what` says what became of it.
    pub(super) fn cut_off(&self, what: &str) -> BrokerError {
        BrokerError::Unavailable(format!(
            "NATS is unreachable (no answer from it for {} s): {what}",
            SILENT_FOR.as_secs()
        ))
    }

    /// Counts a broadcast message of another replica that arrived `late`
    /// and was dropped, and says so when the total crosses a power of two.
    pub(super) fn count_late(&self, sender: u64, late: Duration) {
        let before = self.inner.liveness.late_dropped.fetch_add(1, Ordering::Relaxed);
        let after = before + 1;
        if before == 0 || before.ilog2() != after.ilog2() {
            tracing::warn!(
                dropped_so_far = after,
                sender_incarnation = sender,
                age_ms = late.as_millis() as u64,
                "a broadcast message of another replica arrived {:.1} s after it was published, later than {} s: dropped, not delivered (reason nats_unreachable: its replica was cut off from NATS for a while, this replica read too slowly, or the replicas' clocks differ)",
                late.as_secs_f64(),
                DELIVER_WITHIN.as_secs()
            );
        }
    }
}

/// The wait before reconnection attempt `attempts` (1 after the first
/// failure): at once, then doubling from 2 ms, at most
/// [`RECONNECT_DELAY_AT_MOST`].
pub(super) fn reconnect_delay(attempts: usize) -> Duration {
    match attempts {
        0 | 1 => Duration::ZERO,
        n => Duration::from_millis(1u64 << (n - 1).min(20)).min(RECONNECT_DELAY_AT_MOST),
    }
}

/// One probe: whether the server answered (with no responders, as it
/// should, or anything else) within [`PROBE_TIMEOUT`].
async fn probe(client: &async_nats::Client, subject: &str) -> bool {
    let request = async_nats::Request::new().timeout(Some(PROBE_TIMEOUT));
    // The whole call is bounded: queueing the request waits when the
    // client's queue is full, which a cut-off connection's soon is.
    match tokio::time::timeout(PROBE_TIMEOUT, client.send_request(subject.to_owned(), request)).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => e.kind() == async_nats::RequestErrorKind::NoResponders,
        Err(_) => false,
    }
}

/// Signs from beyond this replica's own NATS server: a replica connected
/// to another server answering a ping, or a JetStream quorum answering
/// ([`probe_quorum`]). Every replica answers pings on
/// `<prefix>.alive.peers` with the id of the NATS server it is connected
/// to; an answer that names another server than this replica's crossed a
/// route both ways.
struct Beyond {
    subject: String,
    inbox: async_nats::Subject,
    /// When something beyond was last heard, in ms since `since`.
    heard_ms: Arc<AtomicU64>,
    since: Instant,
    /// The tasks answering pings and reading the answers end with this.
    _tasks: tokio_util::task::AbortOnDropHandle<()>,
}

impl Beyond {
    async fn start(client: &async_nats::Client, prefix: &str) -> Beyond {
        let subject = format!("{prefix}.alive.peers");
        let inbox = async_nats::Subject::from(client.new_inbox());
        let heard_ms = Arc::new(AtomicU64::new(0));
        let since = Instant::now();
        let answer = {
            let client = client.clone();
            let subject = subject.clone();
            async move {
                let mut pings = subscribe(&client, subject).await;
                while let Some(ping) = futures::StreamExt::next(&mut pings).await {
                    if let Some(reply) = ping.reply {
                        let server = client.server_info().server_id;
                        let _ = client.publish(reply, server.into()).await;
                    }
                }
            }
        };
        let read = {
            let client = client.clone();
            let inbox = inbox.clone();
            let heard_ms = heard_ms.clone();
            async move {
                let mut answers = subscribe(&client, inbox.to_string()).await;
                while let Some(answer) = futures::StreamExt::next(&mut answers).await {
                    // Not a status (a "no responders" when the ping went
                    // out before every replica's subscription was up).
                    let named = answer.status.is_none() && !answer.payload.is_empty();
                    if named && answer.payload != client.server_info().server_id.as_bytes() {
                        heard_ms.fetch_max(since.elapsed().as_millis() as u64, Ordering::Relaxed);
                    }
                }
            }
        };
        let tasks = tokio::spawn(async move {
            tokio::join!(answer, read);
        });
        Beyond {
            subject,
            inbox,
            heard_ms,
            since,
            _tasks: tokio_util::task::AbortOnDropHandle::new(tasks),
        }
    }

    /// Asks every replica which NATS server it is on (answers are read
    /// as they come).
    async fn ping(&self, client: &async_nats::Client) {
        let ping = client.publish_with_reply(self.subject.clone(), self.inbox.clone(), bytes::Bytes::new());
        let _ = tokio::time::timeout(PROBE_TIMEOUT, ping).await;
    }

    /// Something beyond was heard from `age` ago (a stream leader's last
    /// contact with its majority), or now.
    fn heard(&self, age: Duration) {
        let at = self.since.elapsed().saturating_sub(age).as_millis() as u64;
        self.heard_ms.fetch_max(at, Ordering::Relaxed);
    }

    /// How long since something beyond answered.
    fn silent(&self) -> Duration {
        self.since
            .elapsed()
            .saturating_sub(Duration::from_millis(self.heard_ms.load(Ordering::Relaxed)))
    }
}

/// A subscription to `subject`, retried until the client takes it (it
/// refuses one only while the connection is being made): soon at first,
/// then every [`PROBE_EVERY`] or so.
async fn subscribe(client: &async_nats::Client, subject: String) -> async_nats::Subscriber {
    let mut backoff = Backoff::new(PROBE_EVERY / 5, PROBE_EVERY);
    loop {
        match client.subscribe(subject.clone()).await {
            Ok(subscriber) => return subscriber,
            Err(_) => backoff.sleep().await,
        }
    }
}

/// How long a stream info request of [`probe_quorum`] waits: a probe
/// period, so that the probe's ticks stay about that far apart while the
/// leaders beyond do not answer (a missed answer is no alarm: it takes
/// [`SILENT_FOR`] without any).
const QUORUM_TIMEOUT: Duration = PROBE_EVERY;

/// How long ago JetStream was last heard from beyond this replica's server
/// (None: not in this probe): the leader of one of `streams` (the
/// buckets', whose leaders JetStream spreads over the servers) answers its
/// info request within [`QUORUM_TIMEOUT`], and is another server (the
/// answer crossed a route: now), or is this replica's own server, which
/// last heard from a majority of its peers as long ago as its
/// `cluster.replicas[].active` says. A leader cut off with this replica's
/// server answers, and its peers fall silent from the cut on; a leader
/// beyond it does not answer; a server with no leader says "cluster not
/// available" (10008). Any other JetStream answer (the stream not found,
/// after NATS lost its state) comes from the meta leader: now. Several
/// streams, not one: the server that led one of them can die, and while
/// that stream elects a new leader (2 to 9 s) the others answer.
async fn probe_quorum(client: &async_nats::Client, streams: &[String]) -> Option<Duration> {
    let own = client.server_info().server_name;
    let asks = streams.iter().map(|stream| {
        let request = async_nats::Request::new()
            .timeout(Some(QUORUM_TIMEOUT))
            .payload(bytes::Bytes::new());
        let subject = format!("$JS.API.STREAM.INFO.{stream}");
        let own = own.as_str();
        async move {
            let answer = tokio::time::timeout(QUORUM_TIMEOUT, client.send_request(subject, request))
                .await
                .ok()?
                .ok()?;
            let info = serde_json::from_slice::<serde_json::Value>(&answer.payload).ok()?;
            quorum_heard(&info, own)
        }
    });
    futures::future::join_all(asks).await.into_iter().flatten().min()
}

/// [`probe_quorum`]'s reading of a stream info answer: how long ago it
/// shows a majority heard from (None: it does not); `own`: the name of
/// this replica's NATS server.
fn quorum_heard(info: &serde_json::Value, own: &str) -> Option<Duration> {
    if let Some(error) = info.get("error") {
        return (error["err_code"].as_u64() != Some(10008)).then_some(Duration::ZERO);
    }
    let cluster = &info["cluster"];
    let leader = cluster["leader"].as_str().unwrap_or_default();
    if leader.is_empty() {
        // A single server's stream has no cluster leader: it is the quorum.
        return (cluster.is_null() || cluster["replicas"].is_null()).then_some(Duration::ZERO);
    }
    if leader != own {
        // Only the leader answers: this answer crossed a route.
        return Some(Duration::ZERO);
    }
    let peers = cluster["replicas"].as_array().map_or(&[][..], Vec::as_slice);
    // When the leader last heard from each peer it has a route to
    // (`offline`: none, and `active` may then read 0), most recent first.
    let mut heard: Vec<Duration> = peers
        .iter()
        .filter(|p| p["offline"] != true)
        .filter_map(|p| p["active"].as_u64().map(Duration::from_nanos))
        .collect();
    heard.sort_unstable();
    // The leader and the `needed` peers heard from most recently are a
    // majority of all of them; the last of those sets the age.
    let needed = peers.len().div_ceil(2);
    match needed {
        0 => Some(Duration::ZERO),
        n => heard.get(n - 1).copied(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quorum_is_another_servers_leader_or_a_leader_here_and_its_majority() {
        let info = |leader: &str, active_ms: &[u64]| {
            let replicas: Vec<_> = active_ms
                .iter()
                .map(|ms| serde_json::json!({"name": "n", "current": true, "active": ms * 1_000_000}))
                .collect();
            serde_json::json!({"config": {}, "cluster": {"name": "c", "leader": leader, "replicas": replicas}})
        };
        let ms = Duration::from_millis;
        // This replica's server, n1, leads: as old as its majority's contact.
        assert_eq!(quorum_heard(&info("n1", &[300, 400]), "n1"), Some(ms(300)));
        assert_eq!(
            quorum_heard(&info("n1", &[9_000, 300]), "n1"),
            Some(ms(300)),
            "one peer of two is a majority"
        );
        assert_eq!(
            quorum_heard(&info("n1", &[2_500, 9_000]), "n1"),
            Some(ms(2_500)),
            "a leader cut off 2.5 s ago"
        );
        assert_eq!(
            quorum_heard(&info("n1", &[100, 200, 3_000, 4_000]), "n1"),
            Some(ms(200)),
            "two peers of four and the leader: three of five"
        );
        assert_eq!(
            quorum_heard(&info("n2", &[2_500, 9_000]), "n1"),
            Some(Duration::ZERO),
            "another server's answer crossed a route"
        );
        assert_eq!(quorum_heard(&info("", &[300, 400]), "n1"), None, "no leader");
        let mut routes_lost = info("n1", &[0, 0]);
        for peer in routes_lost["cluster"]["replicas"].as_array_mut().unwrap() {
            peer["offline"] = true.into();
        }
        assert_eq!(quorum_heard(&routes_lost, "n1"), None, "peers without a route to them");
        assert_eq!(
            quorum_heard(&info("n1", &[]), "n1"),
            Some(Duration::ZERO),
            "a stream of one server"
        );
        let single = serde_json::json!({"config": {}, "cluster": {"name": "c"}});
        assert_eq!(quorum_heard(&single, "n1"), Some(Duration::ZERO));
        assert_eq!(
            quorum_heard(&serde_json::json!({"config": {}}), "n1"),
            Some(Duration::ZERO)
        );
        let leaderless = serde_json::json!({
            "error": {"code": 503, "err_code": 10008, "description": "JetStream system temporarily unavailable"}
        });
        assert_eq!(quorum_heard(&leaderless, "n1"), None);
        let not_found = serde_json::json!({
            "error": {"code": 404, "err_code": 10059, "description": "stream not found"}
        });
        assert_eq!(quorum_heard(&not_found, "n1"), Some(Duration::ZERO));
    }

    #[test]
    fn reconnection_attempts_back_off_to_a_second_at_most() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(2));
        assert_eq!(reconnect_delay(5), Duration::from_millis(16));
        assert_eq!(reconnect_delay(11), RECONNECT_DELAY_AT_MOST);
        assert_eq!(reconnect_delay(usize::MAX), RECONNECT_DELAY_AT_MOST);
    }

    #[test]
    fn a_broadcast_message_is_too_late_only_past_the_bound() {
        let published = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(too_late(published, published), None);
        assert_eq!(too_late(published, published + DELIVER_WITHIN), None);
        assert_eq!(
            too_late(published, published + DELIVER_WITHIN + Duration::from_millis(1)),
            Some(DELIVER_WITHIN + Duration::from_millis(1))
        );
        assert_eq!(
            too_late(published, published - Duration::from_secs(30)),
            None,
            "a publisher's clock ahead of this one's is no reason to drop"
        );
    }
}
