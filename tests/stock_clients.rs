//! Stock gRPC clients against the real broker binary (issue 12, point 1):
//! Python's grpcio and Node's @grpc/grpc-js send every message of a
//! `PublishStream` in its own small HTTP/2 DATA frame. Such a client is never
//! cut off, also while the broker is paused (SIGSTOP, what a CPU limit does),
//! and a subscription on the same channel gets every message in order.
//! And grpcio holds 1,000 subscriptions on one `Session` (issue 26); grpcio
//! and grpc-js publish a batch on a batched `Session` and read its
//! `deliveries` events (issue 43). And grpcio's `PublishStream` on one
//! replica of a two-replica cluster reaches a subscriber on the other,
//! through the replica's outbox, whole and in order.
//!
//! The clients are the scripts in tests/clients/. `.ci/run` installs grpcio,
//! grpcio-tools and (with `npm ci` in tests/clients) @grpc/grpc-js; where
//! one is missing, its tests fail saying how to install it.

mod common;

use common::process::{BrokerProcess, ChildGuard, metric_sum, try_http_get_blocking};
use common::require_tool;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tinybroker::config::{Config, Limits};
use tinybroker::pb;

/// How long the broker stays stopped in the middle of a stream.
const PAUSE: Duration = Duration::from_secs(2);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn clients_dir() -> PathBuf {
    root().join("tests/clients")
}

fn proto_dir() -> String {
    root().join("proto").display().to_string()
}

/// Panics unless python3 imports grpcio and grpcio-tools ([`require_tool`]).
#[track_caller]
fn require_grpcio() {
    require_tool(
        "python3 with grpcio and grpcio-tools",
        "pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2",
        Command::new("python3").args(["-c", "import grpc, grpc_tools.protoc"]),
    );
}

/// Panics unless node loads @grpc/grpc-js and @grpc/proto-loader from
/// tests/clients ([`require_tool`]).
#[track_caller]
fn require_grpc_js() {
    require_tool(
        "node with @grpc/grpc-js and @grpc/proto-loader",
        "cd tests/clients && npm ci",
        Command::new("node")
            .current_dir(clients_dir())
            .args(["-e", "require('@grpc/grpc-js'); require('@grpc/proto-loader')"]),
    );
}

/// A client script's run: its stdout lines as they come, stderr for reports.
struct Script {
    guard: ChildGuard,
    stdout: Receiver<String>,
    stderr: Receiver<String>,
    deadline: Instant,
    stderr_seen: Vec<String>,
}

impl Script {
    fn spawn(command: &mut Command, limit: Duration) -> Self {
        let mut guard =
            ChildGuard::spawn(command.current_dir(clients_dir()).env("PYTHONUNBUFFERED", "1")).reading_stdout();
        Self {
            stdout: guard.stdout.take().expect("stdout"),
            stderr: guard.stderr.take().expect("stderr"),
            guard,
            deadline: Instant::now() + limit,
            stderr_seen: Vec::new(),
        }
    }

    fn stderr_tail(&mut self) -> String {
        self.stderr_seen.extend(self.stderr.try_iter());
        let from = self.stderr_seen.len().saturating_sub(30);
        self.stderr_seen[from..].join("\n")
    }

    /// Waits for the next stdout line starting with one of `prefixes`
    /// (skipping others); panics with the script's stderr if it ends or
    /// times out.
    fn line_starting(&mut self, prefixes: &[&str]) -> String {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) if prefixes.iter().any(|p| line.starts_with(p)) => return line,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no {prefixes:?} line in time; client stderr:\n{}", self.stderr_tail())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.guard.child.wait();
                    panic!(
                        "client exited ({status:?}) before printing {prefixes:?}; stderr:\n{}",
                        self.stderr_tail()
                    )
                }
            }
        }
    }

    /// The final `result {json}` line.
    fn result(&mut self) -> serde_json::Value {
        parse_result(&self.line_starting(&["result "]))
    }
}

fn parse_result(line: &str) -> serde_json::Value {
    serde_json::from_str(&line["result ".len()..]).expect("result JSON")
}

/// Waits for the script's `pause` line, stops the broker for [`PAUSE`], then
/// returns the script's result. Proves the pause happened in the middle of
/// the run: the client asked for it before it ended, the kernel showed the
/// broker stopped, and messages were published after it.
fn pause_broker_when_told(script: &mut Script, broker: &BrokerProcess) -> serde_json::Value {
    let line = script.line_starting(&["pause", "result "]);
    assert!(
        !line.starts_with("result "),
        "the client ended before it asked for the pause, so nothing was paused: {line}"
    );
    let before = published_scraped(broker);
    broker.guard.signal("STOP");
    // A stop signal takes effect a moment after it is sent.
    let stopped_by = Instant::now() + Duration::from_secs(2);
    while process_state(broker.guard.pid()) != 'T' {
        assert!(Instant::now() < stopped_by, "the broker is stopped during the pause");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(PAUSE);
    broker.guard.signal("CONT");
    eprintln!("broker paused for {PAUSE:?} after {before} messages");
    let result = script.result();
    let after = published_scraped(broker);
    assert!(
        after > before,
        "messages were published after the pause: {before} before it, {after} at the end"
    );
    result
}

/// The broker's published total, scraped without an async runtime.
fn published_scraped(broker: &BrokerProcess) -> f64 {
    let (status, body) = try_http_get_blocking(broker.metrics_addr, "/metrics").expect("/metrics answers");
    assert_eq!(status, 200, "{body}");
    metric_sum(&body, "tinybroker_messages_published_total")
}

/// A process's state letter from /proc (R, S, T, ...).
fn process_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    let after_name = &stat[stat.rfind(')').expect("the command's closing parenthesis") + 2..];
    after_name.chars().next().expect("a state")
}

async fn published_total(broker: &BrokerProcess) -> f64 {
    let body = common::scrape(broker.metrics_addr).await;
    metric_sum(&body, "tinybroker_messages_published_total")
}

fn published_total_blocking(broker: &BrokerProcess) -> f64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(published_total(broker))
}

/// Reads `count` messages from `stream`, checking that payload `i` (the
/// message's index, zero-padded) comes `i`-th with increasing sequences.
/// Returns how many arrived and the first problem, if any.
async fn receive_in_order(mut stream: tonic::Streaming<pb::Message>, count: u64) -> (u64, Option<String>) {
    let mut received = 0;
    let mut last_sequence = 0;
    while received < count {
        let message = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return (received, Some("the stream ended (evicted?)".into())),
            Err(status) => return (received, Some(format!("the stream failed: {status}"))),
        };
        let index: u64 = std::str::from_utf8(&message.payload).unwrap().parse().unwrap();
        if index != received || message.sequence <= last_sequence {
            return (
                received,
                Some(format!(
                    "message {received} expected, got payload {index} sequence {} after {last_sequence}",
                    message.sequence
                )),
            );
        }
        last_sequence = message.sequence;
        received += 1;
    }
    (received, None)
}

/// Nothing was evicted or closed for abuse: no WARN or ERROR line.
fn assert_no_warnings(broker: &BrokerProcess) {
    let log: Vec<String> = broker
        .drain_lines()
        .into_iter()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .collect();
    assert!(log.is_empty(), "the broker logged: {log:#?}");
}

/// The assertions every stock-client run shares: the stream ended OK with
/// everything accepted and the same-channel subscription, if there was one
/// (`received`: what it had to get), got its messages in order and was
/// never cut off.
fn assert_nothing_lost(result: &serde_json::Value, count: u64, received: Option<u64>, stderr: &str) {
    let context = format!("client result {result}\nclient stderr:\n{stderr}");
    assert_eq!(result["publish_code"], "OK", "PublishStream failed: {context}");
    assert_eq!(result["accepted"], count, "accepted: {context}");
    if let Some(received) = received {
        assert!(
            result["subscription_error"].is_null(),
            "subscription cut off: {context}"
        );
        assert!(result["out_of_order"].is_null(), "order: {context}");
        assert!(
            result["alive_publish_error"].is_null(),
            "same-channel publish: {context}"
        );
        assert_eq!(result["received"], received, "received: {context}");
    }
}

/// Python grpcio, 1,000,000 × 10 B through one PublishStream (a generator of
/// requests, one DATA frame per message) with a broadcast subscription open
/// on the same channel; the broker is SIGSTOPped for 2 s in the middle. The
/// stream ends OK with everything accepted, the same-channel subscription
/// is alive afterwards, and a subscriber of the test's own gets all
/// 1,000,000 in order. (A Python reader of all of them, sharing the GIL with
/// the publisher, took 110 to 150 s on the 2-core CI machine against 80 to
/// 90 s for the publisher alone: `full` mode of the script does that.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_publish_stream_of_a_million_tiny_messages_survives_a_pause() {
    require_grpcio();
    let started = Instant::now();
    const COUNT: u64 = 1_000_000;
    let broker = BrokerProcess::spawn(&[("TINYBROKER_CONSUMER_CAPACITY", "2000000")]);
    let channel = tonic::transport::Endpoint::from_shared(broker.url())
        .unwrap()
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(16 << 20)
        .connect()
        .await
        .unwrap();
    let (stream, _) = common::subscribe(&mut pb::broker_client::BrokerClient::new(channel), &["stock.grpcio"]).await;
    let reader = tokio::spawn(receive_in_order(stream, COUNT));
    let (result, stderr, broker) = tokio::task::spawn_blocking(move || {
        let mut script = Script::spawn(
            Command::new("python3").args([
                "grpcio_publish.py",
                &broker.grpc_addr,
                &proto_dir(),
                &COUNT.to_string(),
                "10",
                "300000",
                "alive",
            ]),
            Duration::from_secs(240),
        );
        script.line_starting(&["subscribed"]);
        let result = pause_broker_when_told(&mut script, &broker);
        (result, script.stderr_tail(), broker)
    })
    .await
    .unwrap();
    eprintln!("grpcio result: {result}");
    assert_nothing_lost(&result, COUNT, Some(1), &stderr);
    let (received, problem) = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .expect("the test's subscriber got everything within 60 s of the stream's end")
        .unwrap();
    assert_eq!((received, problem), (COUNT, None), "the test's own subscriber");
    assert_eq!(published_total(&broker).await, COUNT as f64 + 1.0);
    assert_no_warnings(&broker);
    eprintln!(
        "grpcio 1,000,000 × 10 B with a 2 s pause: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Python grpcio, 100,000 × 10 B through one PublishStream on replica `a`
/// of a two-replica cluster (one NATS server) while the test's subscriber
/// on replica `b` reads them: every message crosses NATS through `a`'s
/// outbox (`src/cluster/outbox.rs`: the first of a burst straight to the
/// NATS client, the rest queued and sent in runs of one NATS message) and
/// arrives once, in order, none lost, `b` counting no gap. Catches an
/// outbox that drops, repeats or reorders messages of a run, or loses what
/// waits for room, under a stock client's one-frame-per-message stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_publish_stream_on_one_replica_reaches_a_subscriber_on_another_in_order() {
    require_grpcio();
    const COUNT: u64 = 100_000;
    let started = Instant::now();
    let mut cluster = common::start_cluster(Config {
        limits: Limits {
            consumer_capacity: 2 * COUNT as usize,
            ..Limits::default()
        },
        ..common::config()
    })
    .await;
    let (a, b) = (cluster.replica(0), cluster.replica(1));
    let (stream, _) = common::subscribe(&mut cluster.client_on(1).await, &["stock.grpcio"]).await;
    let reader = tokio::spawn(receive_in_order(stream, COUNT));
    let addr = a.grpc_addr.to_string();
    let (result, stderr) = tokio::task::spawn_blocking(move || {
        let mut script = Script::spawn(
            Command::new("python3").args([
                "grpcio_publish.py",
                &addr,
                &proto_dir(),
                &COUNT.to_string(),
                "10",
                "-1",
                "alive",
            ]),
            Duration::from_secs(180),
        );
        let result = script.result();
        (result, script.stderr_tail())
    })
    .await
    .unwrap();
    eprintln!("grpcio result on replica a: {result}");
    assert_nothing_lost(&result, COUNT, Some(1), &stderr);
    let (received, problem) = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .expect("the subscriber on replica b got everything within 60 s of the stream's end")
        .unwrap();
    assert_eq!((received, problem), (COUNT, None), "the subscriber on replica b");
    assert_eq!(
        b.dropped_total("nats_slow_consumer").await,
        0.0,
        "replica b counted no gap in replica a's messages"
    );
    // Fewer NATS messages from replica a than it published: bursts went
    // through the outbox's sender, in runs.
    let connz = cluster.nats_mut().unwrap().monitor(0, "/connz").await.expect("/connz");
    let sent = connz["connections"]
        .as_array()
        .expect("/connz lists connections")
        .iter()
        .find(|c| c["name"] == "tinybroker a")
        .expect("replica a's NATS connection")["in_msgs"]
        .as_u64()
        .unwrap();
    assert!(
        sent < COUNT,
        "replica a sent {sent} NATS messages for {COUNT}: no run was batched"
    );
    eprintln!(
        "grpcio {COUNT} × 10 B across two replicas, {sent} NATS messages from a: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Node @grpc/grpc-js, 200,000 × 100 B through one PublishStream with a
/// subscription on the same client; the broker is SIGSTOPped for 2 s in the
/// middle. Nothing is lost, no RESOURCE_EXHAUSTED.
#[test]
fn grpc_js_publish_stream_survives_a_pause_with_a_subscription_on_the_same_channel() {
    require_grpc_js();
    let started = Instant::now();
    const COUNT: u64 = 200_000;
    let broker = BrokerProcess::spawn(&[("TINYBROKER_CONSUMER_CAPACITY", "400000")]);
    let mut script = Script::spawn(
        Command::new("node").args([
            "grpcjs_publish.js",
            &broker.grpc_addr,
            &proto_dir(),
            &COUNT.to_string(),
            "100",
            "60000",
            "1",
        ]),
        Duration::from_secs(120),
    );
    script.line_starting(&["subscribed"]);
    let result = pause_broker_when_told(&mut script, &broker);
    let stderr = script.stderr_tail();
    eprintln!("grpc-js result: {result}");
    assert_nothing_lost(&result, COUNT, Some(COUNT), &stderr);
    assert_eq!(published_total_blocking(&broker), COUNT as f64);
    assert_no_warnings(&broker);
    eprintln!(
        "grpc-js 200,000 × 100 B with a 2 s pause: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// grpc-js, 100,000 × 10 B and 100,000 × 100 B through PublishStream, and
/// 10 B again with grpc-js's per-call retry buffer cut from 1 MiB to 64 KiB:
/// each run completes with everything accepted and published. (What the
/// runs take is for the benchmark, not a test: grpc-js copies its array of
/// buffered messages on every completed write, BENCHMARKS.md.)
#[test]
fn grpc_js_publish_streams_of_10_and_100_byte_messages_lose_nothing() {
    require_grpc_js();
    const COUNT: u64 = 100_000;
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let small_retry_buffer = r#"{"grpc.per_rpc_retry_buffer_size": 65536}"#;
    let mut published = 0;
    for (size, options) in [(10, "{}"), (100, "{}"), (10, small_retry_buffer)] {
        let mut script = Script::spawn(
            Command::new("node")
                .args([
                    "grpcjs_publish.js",
                    &broker.grpc_addr,
                    &proto_dir(),
                    &COUNT.to_string(),
                    &size.to_string(),
                    "-1",
                    "0",
                ])
                .env("GRPC_JS_CHANNEL_OPTIONS", options),
            Duration::from_secs(90),
        );
        let result = script.result();
        let stderr = script.stderr_tail();
        assert_nothing_lost(&result, COUNT, None, &stderr);
        published += COUNT;
        assert_eq!(
            published_scraped(&broker),
            published as f64,
            "{size} B, channel options {options}"
        );
    }
}

/// Python grpcio, 1,000 subscriptions on one `Session` (issue 26): every
/// handle is opened with an id of its own, gets exactly its messages in
/// order (its own topic's and a wildcard's they all share, which come once
/// naming many handles), 100 are closed one by one, and a half-close ends
/// the other 900 "closed" and the stream with OK. The broker holds one
/// session and 1,000 subscriptions meanwhile, none after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_holds_a_thousand_subscriptions_on_one_session() {
    require_grpcio();
    const COUNT: u64 = 1000;
    const ROUNDS: u64 = 3;
    const CLOSE: u64 = 100;
    let started = Instant::now();
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let addr = broker.grpc_addr.clone();
    let (mut script, line) = tokio::task::spawn_blocking(move || {
        let mut script = Script::spawn(
            Command::new("python3").args([
                "grpcio_session.py",
                &addr,
                &proto_dir(),
                &COUNT.to_string(),
                &ROUNDS.to_string(),
                &CLOSE.to_string(),
            ]),
            Duration::from_secs(120),
        );
        let line = script.line_starting(&["opened ", "result "]);
        (script, line)
    })
    .await
    .unwrap();
    assert_eq!(line, format!("opened {COUNT}"), "stderr:\n{}", script.stderr_tail());
    let opened = started.elapsed();
    let scraped = common::scrape(broker.metrics_addr).await;
    assert_eq!(metric_sum(&scraped, "tinybroker_sessions"), 1.0);
    assert_eq!(metric_sum(&scraped, "tinybroker_subscriptions"), COUNT as f64);

    // One PublishStream: its messages reach each subscription in order.
    let requests: Vec<pb::PublishRequest> = (0..ROUNDS)
        .flat_map(|round| {
            (1..=COUNT)
                .map(move |handle| (format!("load.{handle}"), format!("{handle}-{round}")))
                .chain([("all.x".to_owned(), format!("all-{round}"))])
        })
        .map(|(topic, payload)| pb::PublishRequest {
            topic,
            payload: payload.into(),
            headers: Default::default(),
        })
        .collect();
    let mut publisher = pb::broker_client::BrokerClient::connect(broker.url()).await.unwrap();
    let response = publisher
        .publish_stream(futures::stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.accepted, ROUNDS * (COUNT + 1));
    let published = started.elapsed();

    let (result, stderr) = tokio::task::spawn_blocking(move || (script.result(), script.stderr_tail()))
        .await
        .unwrap();
    eprintln!("grpcio session result: {result}");
    let context = format!("client result {result}\nclient stderr:\n{stderr}");
    assert!(result["problem"].is_null(), "{context}");
    assert_eq!(result["stream_code"], "OK", "{context}");
    assert_eq!(result["distinct_ids"], COUNT, "{context}");
    assert_eq!(
        result["complete"], COUNT,
        "every handle got all its messages: {context}"
    );
    assert_eq!(result["closed_on_close"], CLOSE, "{context}");
    assert_eq!(result["closed_on_half_close"], COUNT - CLOSE, "{context}");
    assert!(
        result["most_handles_in_one_delivery"].as_u64().unwrap() > 1,
        "a wildcard message came once for several handles: {context}"
    );
    let scraped = common::scrape(broker.metrics_addr).await;
    assert_eq!(metric_sum(&scraped, "tinybroker_sessions"), 0.0);
    assert_eq!(metric_sum(&scraped, "tinybroker_subscriptions"), 0.0);
    assert_no_warnings(&broker);
    eprintln!(
        "grpcio session of {COUNT} subscriptions: opened in {:.2} s, {} published by {:.2} s, all done in {:.2} s",
        opened.as_secs_f64(),
        ROUNDS * (COUNT + 1),
        published.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// Python grpcio, 60 `OpenSubscription` streams on one channel: each
/// stream's initial metadata names its subscription (the given id, or a
/// generated UUID of its own), and its first message carries the same id.
/// The broker sends the id header as an HPACK literal that is never indexed
/// (ARCHITECTURE.md, "What an idle subscription holds"); 60 ids are more
/// than a 4 KiB table holds, so a header encoded against the table wrongly
/// would show on a later stream of the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_reads_each_subscriptions_id_from_its_headers_on_one_channel() {
    require_grpcio();
    const COUNT: u64 = 60;
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let addr = broker.grpc_addr.clone();
    let (mut script, line) = tokio::task::spawn_blocking(move || {
        let mut script = Script::spawn(
            Command::new("python3").args(["grpcio_subscription_ids.py", &addr, &proto_dir(), &COUNT.to_string()]),
            Duration::from_secs(90),
        );
        let line = script.line_starting(&["opened ", "result "]);
        (script, line)
    })
    .await
    .unwrap();
    assert_eq!(line, format!("opened {COUNT}"), "stderr:\n{}", script.stderr_tail());
    let mut publisher = pb::broker_client::BrokerClient::connect(broker.url()).await.unwrap();
    for i in 1..=COUNT {
        let published = publisher
            .publish(pb::PublishRequest {
                topic: format!("ids.{i}"),
                payload: format!("{i}").into(),
                headers: Default::default(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(published.matched_subscriptions, 1, "ids.{i}");
    }
    let (result, stderr) = tokio::task::spawn_blocking(move || (script.result(), script.stderr_tail()))
        .await
        .unwrap();
    let context = format!("client result {result}\nclient stderr:\n{stderr}");
    assert_eq!(result["problems"], serde_json::json!([]), "{context}");
    assert_eq!(result["opened"], COUNT, "{context}");
    assert_eq!(result["matched"], COUNT, "{context}");
    assert_no_warnings(&broker);
}

/// The messages each batch script publishes in its first batch.
const BATCH_COUNT: u64 = 500;

/// What a batch script (grpcio_batch.py, grpcjs_batch.js) must report: a
/// Session opened with `tinybroker-batch: 1` got every delivery in
/// `deliveries` events and none bare, each handle its messages in order
/// with the sequences of the `published` answers (consecutive from the
/// first), the first batch accepted whole under its id, the second's bad
/// message rejected by index with INVALID_ARGUMENT; both handles ended
/// "closed" on the half-close and the stream OK. (docs/contract.md,
/// "Batches": stock clients decode the new events through their own proto
/// loading.)
fn assert_batch_run(result: &serde_json::Value, stderr: &str) {
    let context = format!("client result {result}\nclient stderr:\n{stderr}");
    assert!(result["problem"].is_null(), "{context}");
    assert_eq!(result["stream_code"], "OK", "{context}");
    let answers = result["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 2, "{context}");
    assert_eq!(
        (&answers[0]["id"], &answers[0]["accepted"]),
        (&serde_json::json!(7), &serde_json::json!(BATCH_COUNT)),
        "{context}"
    );
    assert_eq!(answers[0]["rejected"], serde_json::json!([]), "{context}");
    assert_eq!(
        (&answers[1]["id"], &answers[1]["accepted"]),
        (&serde_json::json!(8), &serde_json::json!(1)),
        "{context}"
    );
    let rejected = answers[1]["rejected"].as_array().expect("rejections");
    assert_eq!(rejected.len(), 1, "{context}");
    assert_eq!(rejected[0]["index"], 1, "{context}");
    assert_eq!(rejected[0]["code"], tonic::Code::InvalidArgument as i32, "{context}");
    assert!(
        rejected[0]["message"].as_str().unwrap().contains("batch.*"),
        "{context}"
    );
    assert_eq!(result["bare_deliveries"], 0, "{context}");
    assert!(result["deliveries_events"].as_u64().unwrap() >= 1, "{context}");
    assert_eq!(result["received"]["1"], BATCH_COUNT + 1, "{context}");
    assert_eq!(result["received"]["2"], BATCH_COUNT / 2 + 1, "{context}");
    assert!(
        result["shared_deliveries"].as_u64().unwrap() > 0,
        "a message for both handles came once naming both: {context}"
    );
    let mut ended: Vec<(u64, String)> = result["ended"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["handle"].as_u64().unwrap(), e["reason"].as_str().unwrap().to_owned()))
        .collect();
    ended.sort();
    assert_eq!(ended, [(1, "closed".to_owned()), (2, "closed".to_owned())], "{context}");
}

/// Python grpcio opens a batched Session (`tinybroker-batch: 1`), publishes
/// a batch on it and receives the `deliveries` events, decoded by the stubs
/// grpcio-tools generates from the proto.
#[test]
fn grpcio_publishes_a_batch_and_receives_deliveries_events_on_a_batched_session() {
    require_grpcio();
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let mut script = Script::spawn(
        Command::new("python3").args([
            "grpcio_batch.py",
            &broker.grpc_addr,
            &proto_dir(),
            &BATCH_COUNT.to_string(),
        ]),
        Duration::from_secs(90),
    );
    let result = script.result();
    let stderr = script.stderr_tail();
    eprintln!("grpcio batch result: {result}");
    assert_batch_run(&result, &stderr);
    assert_eq!(published_total_blocking(&broker), (BATCH_COUNT + 1) as f64);
    assert_no_warnings(&broker);
}

/// Node @grpc/grpc-js does the same through @grpc/proto-loader.
#[test]
fn grpc_js_publishes_a_batch_and_receives_deliveries_events_on_a_batched_session() {
    require_grpc_js();
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let mut script = Script::spawn(
        Command::new("node").args([
            "grpcjs_batch.js",
            &broker.grpc_addr,
            &proto_dir(),
            &BATCH_COUNT.to_string(),
        ]),
        Duration::from_secs(90),
    );
    let result = script.result();
    let stderr = script.stderr_tail();
    eprintln!("grpc-js batch result: {result}");
    assert_batch_run(&result, &stderr);
    assert_eq!(published_total_blocking(&broker), (BATCH_COUNT + 1) as f64);
    assert_no_warnings(&broker);
}
