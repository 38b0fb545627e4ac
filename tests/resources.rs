//! What no client can exceed (docs/contract.md, "Resource limits"): memory bounded in
//! bytes whatever readers, groups and half-sent requests do, read as the
//! real broker process's peak RSS (VmHWM); connections capped, timed out
//! and counted; the file descriptor limit and the listen backlog.

mod common;

use common::process::{BrokerProcess, metric_sum, metric_with_label};
use common::{TEST_TIMEOUT, member_request, scrape, subscribe_request};
use std::process::{Command, Stdio};
use std::time::Duration;
use tinybroker::pb;
use tinybroker::pb::broker_client::BrokerClient;
use tokio::io::AsyncReadExt;
use tonic::transport::{Channel, Endpoint};

const MIB: usize = 1 << 20;
/// What the peak RSS may exceed the bytes the broker holds by: the runtime,
/// HTTP/2 windows and buffers of the test's own connections, tonic's decode
/// buffers and the allocator's slack. Without the byte limits each scenario
/// peaks hundreds of MiB above its bound.
const SLACK_MIB: usize = 96;
/// A payload that, with its topic and overhead, stays under the default
/// max_message_bytes (1 MiB).
const PAYLOAD: usize = MIB - 1024;

async fn timeout<F: std::future::Future>(body: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT * 2, body)
        .await
        .expect("test timed out")
}

/// Peak resident set of a process so far, in MiB (VmHWM).
fn peak_rss_mib(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM");
    kib / 1024
}

async fn channel(url: &str) -> Channel {
    Endpoint::from_shared(url.to_owned())
        .unwrap()
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(8 << 20)
        .connect()
        .await
        .unwrap()
}

/// A subscription whose client never reads: on a connection of its own
/// with the smallest windows, so the broker's queue takes the rest.
async fn stalled_subscriber(url: &str, pattern: &str) -> (tonic::Streaming<pb::Message>, Channel) {
    let channel = Endpoint::from_shared(url.to_owned())
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .unwrap();
    let stream = BrokerClient::new(channel.clone())
        .open_subscription(subscribe_request(&[pattern]))
        .await
        .unwrap()
        .into_inner();
    (stream, channel)
}

/// Publishes `count` messages of [`PAYLOAD`] bytes to `topic` through one
/// PublishStream; returns its outcome.
async fn publish_big(url: &str, topic: &str, count: usize) -> Result<pb::PublishStreamResponse, tonic::Status> {
    let payload = bytes::Bytes::from(vec![b'x'; PAYLOAD]);
    let topic = topic.to_owned();
    let requests = futures::stream::iter((0..count).map(move |_| pb::PublishRequest {
        topic: topic.clone(),
        payload: payload.clone(),
        headers: Default::default(),
    }));
    let mut client = BrokerClient::new(channel(url).await).max_decoding_message_size(usize::MAX);
    client.publish_stream(requests).await.map(|r| r.into_inner())
}

/// The tests that push hundreds of MiB through a broker take turns: on two
/// cores, side by side they would only slow each other down.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn broker(env: &[(&str, &str)]) -> BrokerProcess {
    let mut all = vec![("RUST_LOG", "warn,tinybroker::server=info")];
    all.extend_from_slice(env);
    BrokerProcess::spawn(&all)
}

#[tokio::test]
async fn a_stalled_reader_is_evicted_at_its_byte_limit_and_memory_stays_bounded() {
    timeout(async {
        let _turn = HEAVY.lock().await;
        // Defaults: 1,024 messages or 64 MiB per subscription.
        let broker = broker(&[]);
        let url = broker.url();
        let base = peak_rss_mib(broker.guard.pid());
        let (_stalled, _c) = stalled_subscriber(&url, "big.one").await;
        let published = publish_big(&url, "big.one", 600).await.unwrap();
        assert_eq!(published.accepted, 600);
        let metrics = scrape(broker.metrics_addr).await;
        assert_eq!(metric_sum(&metrics, "tinybroker_evictions_total"), 1.0, "{metrics}");
        let peak = peak_rss_mib(broker.guard.pid());
        // 600 MiB went through; the subscriber could hold 64 MiB of them.
        assert!(
            peak < base + 64 + SLACK_MIB,
            "peak RSS {peak} MiB, {base} MiB before: more than 64 MiB held + the slack"
        );
        let warn = broker.line_containing("slow consumer evicted");
        assert!(warn.contains("consumer_max_bytes"), "{warn}");
        println!("one stalled reader, 600 x 1 MiB: peak RSS {peak} MiB ({base} MiB at start)");
    })
    .await
}

#[tokio::test]
async fn four_stalled_readers_on_four_topics_are_each_bounded() {
    timeout(async {
        let _turn = HEAVY.lock().await;
        let broker = broker(&[]);
        let url = broker.url();
        let base = peak_rss_mib(broker.guard.pid());
        let mut stalled = Vec::new();
        for i in 0..4 {
            stalled.push(stalled_subscriber(&url, &format!("four.{i}")).await);
        }
        for i in 0..4 {
            let published = publish_big(&url, &format!("four.{i}"), 150).await.unwrap();
            assert_eq!(published.accepted, 150);
        }
        let metrics = scrape(broker.metrics_addr).await;
        assert_eq!(metric_sum(&metrics, "tinybroker_evictions_total"), 4.0, "{metrics}");
        let peak = peak_rss_mib(broker.guard.pid());
        assert!(
            peak < base + 4 * 64 + SLACK_MIB,
            "peak RSS {peak} MiB, {base} MiB before: more than 4 x 64 MiB held + the slack"
        );
        println!("four stalled readers, 4 x 150 x 1 MiB: peak RSS {peak} MiB ({base} MiB at start)");
    })
    .await
}

#[tokio::test]
async fn a_memberless_group_keeps_at_most_its_byte_limit() {
    timeout(async {
        let _turn = HEAVY.lock().await;
        let broker = broker(&[("TINYBROKER_GROUP_MAX_BYTES", "134217728")]);
        let url = broker.url();
        let base = peak_rss_mib(broker.guard.pid());
        // The group's only member leaves; its backlog stays for the idle TTL.
        let mut client = BrokerClient::new(channel(&url).await);
        let member = client
            .open_subscription(member_request(&["jobs.>"], "workers", true, 1))
            .await
            .unwrap();
        drop(member);
        let published = publish_big(&url, "jobs.big", 500).await.unwrap();
        assert_eq!(published.accepted, 500);
        let metrics = scrape(broker.metrics_addr).await;
        let backlog = metric_with_label(
            &metrics,
            "tinybroker_consumer_group_backlog",
            r#"consumer_group="workers""#,
        )
        .unwrap_or(0.0);
        let dropped = metric_with_label(
            &metrics,
            "tinybroker_messages_dropped_total",
            r#"reason="group_overflow""#,
        )
        .unwrap_or(0.0);
        assert!(
            (120.0..=128.0).contains(&backlog),
            "backlog {backlog}: 128 MiB of 1 MiB messages"
        );
        assert_eq!(backlog + dropped, 500.0, "every message kept or counted");
        let peak = peak_rss_mib(broker.guard.pid());
        assert!(peak < base + 128 + SLACK_MIB, "peak RSS {peak} MiB, {base} MiB before");
        println!("memberless group, 500 x 1 MiB: backlog {backlog}, dropped {dropped}, peak RSS {peak} MiB");
    })
    .await
}

#[tokio::test]
async fn the_broker_wide_limit_evicts_the_fullest_queues_then_refuses_publishes() {
    timeout(async {
        let _turn = HEAVY.lock().await;
        let broker = broker(&[
            ("TINYBROKER_MAX_MEMORY_BYTES", &(160 * MIB).to_string()),
            ("TINYBROKER_CONSUMER_MAX_BYTES", &(1024 * MIB).to_string()),
            ("TINYBROKER_CONSUMER_CAPACITY", "100000"),
            ("TINYBROKER_GROUP_MAX_BYTES", &(1024 * MIB).to_string()),
        ]);
        let url = broker.url();
        let base = peak_rss_mib(broker.guard.pid());
        // Two stalled readers share 100 MiB of messages: charged once.
        let (_a, _ca) = stalled_subscriber(&url, "wide.>").await;
        let (_b, _cb) = stalled_subscriber(&url, "wide.>").await;
        assert_eq!(publish_big(&url, "wide.t", 100).await.unwrap().accepted, 100);
        let metrics = scrape(broker.metrics_addr).await;
        let used = metric_sum(&metrics, "tinybroker_memory_used_bytes");
        // (less the message or two each reader's transport buffers took)
        assert!(
            used > 90.0 * MIB as f64 && used < 110.0 * MIB as f64,
            "100 MiB charged once: {used}"
        );
        assert_eq!(metric_sum(&metrics, "tinybroker_evictions_total"), 0.0);

        // A memberless group fills the rest: the readers are evicted (the
        // fullest first), then publishes are refused naming the limit.
        let mut client = BrokerClient::new(channel(&url).await);
        drop(
            client
                .open_subscription(member_request(&["held.>"], "held", true, 1))
                .await
                .unwrap(),
        );
        let refused = publish_big(&url, "held.x", 400).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        assert!(
            refused.message().contains("TINYBROKER_MAX_MEMORY_BYTES"),
            "{}",
            refused.message()
        );
        let metrics = scrape(broker.metrics_addr).await;
        let relevant: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("tinybroker_") && !l.contains("_bucket"))
            .collect();
        assert_eq!(metric_sum(&metrics, "tinybroker_evictions_total"), 2.0, "{relevant:#?}");
        assert_eq!(metric_sum(&metrics, "tinybroker_memory_limit_evictions_total"), 2.0);
        assert!(
            metric_with_label(
                &metrics,
                "tinybroker_requests_refused_total",
                r#"reason="memory_limit""#
            )
            .unwrap_or(0.0)
                >= 1.0
        );
        assert!(metric_sum(&metrics, "tinybroker_memory_used_bytes") <= 160.0 * MIB as f64);
        assert_eq!(
            metric_sum(&metrics, "tinybroker_memory_limit_bytes"),
            160.0 * MIB as f64
        );
        let peak = peak_rss_mib(broker.guard.pid());
        assert!(peak < base + 160 + SLACK_MIB, "peak RSS {peak} MiB, {base} MiB before");
        let warn = broker.line_containing("slow consumer evicted");
        assert!(warn.contains("TINYBROKER_MAX_MEMORY_BYTES"), "{warn}");
        println!("broker-wide limit 160 MiB: peak RSS {peak} MiB ({base} MiB at start)");
    })
    .await
}

#[tokio::test]
async fn half_sent_requests_are_bounded_per_connection() {
    timeout(async {
        let _turn = HEAVY.lock().await;
        let broker = broker(&[]);
        let base = peak_rss_mib(broker.guard.pid());
        let tcp = tokio::net::TcpStream::connect(&broker.grpc_addr).await.unwrap();
        let (mut h2, connection) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .unwrap();
        tokio::spawn(connection);
        // 512 unary Publishes, each sending all of a 1 MiB message but its
        // last byte, and then nothing more.
        let mut responses = Vec::new();
        let mut streams = Vec::new();
        for _ in 0..512 {
            h2 = h2.ready().await.unwrap();
            let request = http::Request::post(format!("http://{}/tinybroker.v1.Broker/Publish", broker.grpc_addr))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
            let (response, mut body) = h2.send_request(request, false).unwrap();
            let mut message = vec![0u8];
            message.extend_from_slice(&(MIB as u32).to_be_bytes());
            message.resize(5 + MIB - 1, 0);
            body.send_data(message.into(), false).unwrap();
            responses.push(response);
            streams.push(body);
        }
        // Each is refused with RESOURCE_EXHAUSTED once its connection holds
        // 16 MiB; a client that keeps sending on its refused streams is cut
        // off by h2's reset-flood protection, which is right too.
        let (mut exhausted, mut cut, mut held) = (0, 0, 0);
        for response in responses {
            match tokio::time::timeout(Duration::from_secs(2), response).await {
                Ok(Ok(r)) if r.headers().get("grpc-status").is_some_and(|s| s == "8") => exhausted += 1,
                Ok(Err(e)) if e.is_io() || e.is_go_away() => cut += 1,
                // Still waiting for its last byte, within the connection's 16 MiB.
                Err(_) => held += 1,
                Ok(outcome) => panic!("a half-sent request neither refused nor cut off: {outcome:?}"),
            }
        }
        assert!(held <= 16, "{held} half-sent requests of 1 MiB held by one connection");
        let metrics = scrape(broker.metrics_addr).await;
        let refused = metric_with_label(&metrics, "tinybroker_requests_refused_total", r#"reason="connection_incoming_limit""#).unwrap_or(0.0);
        // How many are refused before h2 cuts the connection off depends on
        // when it reads the client's data on refused streams (64 to 343 of
        // 512 over runs on 2 cores): refusals must come, not a fixed share.
        assert!(exhausted >= 16, "{exhausted} of 512 refused with RESOURCE_EXHAUSTED");
        // (a refusal whose answer was lost with the connection is counted too)
        assert!(refused >= exhausted as f64, "every refusal counted: {refused} < {exhausted}");
        let peak = peak_rss_mib(broker.guard.pid());
        assert!(peak < base + 16 + 32 + SLACK_MIB, "peak RSS {peak} MiB, {base} MiB before");
        println!(
            "512 half-sent 1 MiB requests on one connection: {held} held, {exhausted} refused, {cut} ended when it was cut off, peak RSS {peak} MiB ({base} MiB at start)"
        );
        drop(streams);
    })
    .await
}

/// Reads until the peer closes; true if it closed within `within`.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn connections_over_the_cap_are_closed_at_once_and_counted() {
    timeout(async {
        let broker = broker(&[("TINYBROKER_MAX_CONNECTIONS", "3"), ("RUST_LOG", "info")]);
        let mut open = Vec::new();
        for _ in 0..3 {
            let c = channel(&broker.url()).await;
            let mut client = BrokerClient::new(c.clone());
            client.publish(common::publish_request("cap.t", "x")).await.unwrap();
            open.push(c);
        }
        let mut fourth = tokio::net::TcpStream::connect(&broker.grpc_addr).await.unwrap();
        assert!(
            closed_within(&mut fourth, Duration::from_secs(5)).await,
            "the fourth is closed"
        );
        let metrics = scrape(broker.metrics_addr).await;
        assert_eq!(
            metric_with_label(
                &metrics,
                "tinybroker_connections_rejected_total",
                r#"reason="connection_limit""#
            )
            .unwrap_or(0.0),
            1.0
        );
        assert_eq!(metric_sum(&metrics, "tinybroker_connections"), 3.0);
        let warn = broker.line_containing("max_connections");
        assert!(warn.contains("WARN") && warn.contains("peer="), "{warn}");
        // A slot freed is a slot to use.
        drop(open.pop());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if metric_sum(&scrape(broker.metrics_addr).await, "tinybroker_connections") == 2.0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the closed connection is counted out"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut client = BrokerClient::new(channel(&broker.url()).await);
        client.publish(common::publish_request("cap.t", "x")).await.unwrap();
    })
    .await
}

#[tokio::test]
async fn silent_and_non_http2_connections_are_closed_after_the_handshake_timeout() {
    timeout(async {
        let broker = broker(&[("TINYBROKER_HANDSHAKE_TIMEOUT_SECONDS", "1")]);
        let pid = broker.guard.pid();
        let fds = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
        let before = fds();
        let mut silent = Vec::new();
        for _ in 0..200 {
            silent.push(tokio::net::TcpStream::connect(&broker.grpc_addr).await.unwrap());
        }
        let mut http1 = tokio::net::TcpStream::connect(&broker.grpc_addr).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut http1, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert!(
            closed_within(&mut http1, Duration::from_secs(5)).await,
            "HTTP/1 is closed"
        );
        for stream in &mut silent {
            assert!(
                closed_within(stream, Duration::from_secs(5)).await,
                "a silent client is closed"
            );
        }
        // Each is counted as its connection closes: wait for the last counts.
        let rejected = |metrics: &str, reason: &str| {
            metric_with_label(
                metrics,
                "tinybroker_connections_rejected_total",
                &format!("reason=\"{reason}\""),
            )
            .unwrap_or(0.0)
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let metrics = loop {
            let metrics = scrape(broker.metrics_addr).await;
            if rejected(&metrics, "handshake_timeout") >= 200.0 || tokio::time::Instant::now() > deadline {
                break metrics;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(rejected(&metrics, "handshake_timeout"), 200.0);
        assert_eq!(rejected(&metrics, "not_http2"), 1.0);
        assert!(
            fds() <= before + 2,
            "descriptors released: {} before, {} after",
            before,
            fds()
        );
        // A real client still gets in.
        let mut client = BrokerClient::new(channel(&broker.url()).await);
        client.publish(common::publish_request("hs.t", "x")).await.unwrap();
    })
    .await
}

#[tokio::test]
async fn the_fd_limit_is_raised_and_the_cap_kept_under_it() {
    timeout(async {
        // Soft limit 256, hard 1024: the broker raises the soft one.
        let raised = broker_under_prlimit("256:1024", &[]);
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", raised.guard.pid())).unwrap();
        let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
        let numbers: Vec<&str> = line.split_whitespace().filter(|w| w.parse::<u64>().is_ok()).collect();
        assert_eq!(numbers, ["1024", "1024"], "{line}");

        // Hard limit 128: max_connections is lowered to fit, so the broker
        // never runs out of descriptors, refuses the rest itself, and
        // /metrics still answers.
        let tight = broker_under_prlimit("128:128", &[]);
        assert!(tight.started.contains("max_connections=64"), "{}", tight.started);
        let mut held = Vec::new();
        for _ in 0..100 {
            held.push(tokio::net::TcpStream::connect(&tight.grpc_addr).await.unwrap());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let metrics = scrape(tight.metrics_addr).await;
            if metric_with_label(
                &metrics,
                "tinybroker_connections_rejected_total",
                r#"reason="connection_limit""#,
            )
            .unwrap_or(0.0)
                == 36.0
            {
                assert_eq!(metric_sum(&metrics, "tinybroker_accept_errors_total"), 0.0);
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "36 connections refused: {metrics}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// `prlimit --nofile=SOFT:HARD tinybroker serve` on ephemeral ports.
fn broker_under_prlimit(nofile: &str, env: &[(&str, &str)]) -> BrokerProcess {
    let mut command = Command::new("prlimit");
    command
        .arg(format!("--nofile={nofile}"))
        .arg(env!("CARGO_BIN_EXE_tinybroker"))
        .arg("serve")
        .env_clear()
        .env("RUST_LOG", "info")
        .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
        .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    BrokerProcess::from_command(command)
}

#[test]
fn the_listen_backlog_is_the_kernels_maximum() {
    let broker = BrokerProcess::spawn(&[("RUST_LOG", "warn,tinybroker::server=info")]);
    let port = broker.grpc_addr.rsplit(':').next().unwrap().to_owned();
    let out = Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    // For a listening socket, ss's Send-Q is the backlog.
    let backlog: u64 = text
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .expect(&text);
    let somaxconn: u64 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(backlog, somaxconn.min(4096), "{text}");
}
