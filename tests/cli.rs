//! The `tinybroker` command line against a real broker.

mod common;

use common::process::{ChildGuard, cli, exit_status, run_cli, spawn_cli_subscriber};
use common::*;
use std::io::{Read, Write};
use std::process::Stdio;
use std::time::Duration;

/// Publishes through the CLI until the subscriber prints a line.
async fn publish_until_received(url: &str, topic: &str, rx: &std::sync::mpsc::Receiver<String>) -> String {
    loop {
        let (status, stdout, stderr) = run_cli(
            &["publish", topic, "hello world", "--header", "k=v", "--addr", url],
            &[],
        );
        assert!(status.success(), "{stderr}");
        assert!(stdout.starts_with("sequence="), "{stdout}");
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            return line;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_prints_payloads_and_publish_reports_the_sequence() {
    timeout(async {
        let broker = start().await;
        let url = broker.url();
        let mut child = spawn_cli_subscriber(&url, &["cli.*", "--count", "2"]);
        let rx = child.stdout.take().expect("stdout");
        let line = publish_until_received(&url, "cli.a", &rx).await;
        assert_eq!(line, "hello world");

        // Payload from stdin when absent.
        let mut publisher = ChildGuard::new(
            cli(&["publish", "cli.b", "--addr", &url])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        publisher.child.stdin.take().unwrap().write_all(b"from stdin").unwrap();
        let mut stdout = String::new();
        publisher
            .child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .unwrap();
        assert!(publisher.child.wait().unwrap().success());
        assert!(stdout.contains("matched_subscriptions=1"));
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), "from stdin");
        let status = exit_status(&mut child, TEST_TIMEOUT).await;
        assert!(status.success(), "exits after --count messages");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_json_prints_one_object_per_line() {
    timeout(async {
        let broker = start().await;
        let url = broker.url();
        let mut child = spawn_cli_subscriber(&url, &["j.>", "--json", "--count", "1"]);
        let rx = child.stdout.take().expect("stdout");
        let line = publish_until_received(&url, "j.x.y", &rx).await;
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["topic"], "j.x.y");
        assert_eq!(value["payload"], "hello world");
        assert_eq!(value["headers"]["k"], "v");
        assert!(value["sequence"].as_u64().unwrap() > 0);
        let _ = exit_status(&mut child, TEST_TIMEOUT).await;
    })
    .await
}

#[test]
fn help_and_version() {
    let (status, stdout, _) = run_cli(&["--version"], &[]);
    assert!(status.success());
    assert_eq!(stdout.trim(), format!("tinybroker {}", env!("CARGO_PKG_VERSION")));
    let (_, help, _) = run_cli(&["--help"], &[]);
    assert!(!help.contains("single-node,"), "{help}");
    assert!(help.contains("single-node or clustered over NATS"), "{help}");
    assert!(help.contains("command-line client"), "{help}");
    let subcommands = [
        "serve",
        "publish",
        "subscribe",
        "subscriptions",
        "groups",
        "evictions",
        "info",
        "close",
        "top",
    ];
    for sub in subcommands {
        // Each is listed with a line of help, and has its own --help.
        let listed = help
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{sub} ")))
            .unwrap_or_else(|| panic!("{sub} in {help}"));
        assert!(listed.split_whitespace().count() > 2, "{sub} has help: {listed}");
        let (status, text, _) = run_cli(&[sub, "--help"], &[]);
        assert!(status.success(), "{sub}");
        assert!(text.contains("Usage:"), "{text}");
        if sub != "serve" {
            assert!(text.contains("--addr"), "{sub}: {text}");
        }
    }
    let (_, text, _) = run_cli(&["top", "--help"], &[]);
    assert!(text.contains("--once"), "{text}");
    for sub in ["subscriptions", "groups", "evictions", "info"] {
        let (_, text, _) = run_cli(&[sub, "--help"], &[]);
        assert!(text.contains("--json"), "{sub}: {text}");
    }
    let (_, text, _) = run_cli(&["subscribe", "--help"], &[]);
    for flag in ["--group", "--manual-ack", "--json", "--addr"] {
        assert!(text.contains(flag), "{flag} in {text}");
    }
    let (_, text, _) = run_cli(&["publish", "--help"], &[]);
    for flag in ["--header", "--lines", "--batch", "--addr"] {
        assert!(text.contains(flag), "{flag} in {text}");
    }
    // --lines takes no PAYLOAD, and --batch is for --lines.
    let (status, _, stderr) = run_cli(&["publish", "t", "x", "--lines"], &[]);
    assert!(!status.success() && stderr.contains("cannot be used with"), "{stderr}");
    let (status, _, stderr) = run_cli(&["publish", "t", "x", "--batch", "5"], &[]);
    assert!(
        !status.success() && stderr.contains("--batch is for --lines"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_errors_name_the_problem() {
    timeout(async {
        let broker = start().await;
        let (status, _, stderr) = run_cli(&["publish", "bad topic", "x", "--addr", &broker.url()], &[]);
        assert!(!status.success());
        assert!(
            stderr.contains("InvalidArgument") || stderr.contains("Invalid argument"),
            "{stderr}"
        );
        assert!(stderr.contains("bad topic"), "{stderr}");
        let (status, _, stderr) = run_cli(&["publish", "a", "x", "--addr", "http://127.0.0.1:1"], &[]);
        assert!(!status.success());
        assert!(stderr.contains("cannot connect"));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_with_a_group_and_manual_ack_acks_what_it_prints() {
    timeout(async {
        let broker = start().await;
        let url = broker.url();
        let mut child = spawn_cli_subscriber(
            &url,
            &["work.*", "--group", "cli-workers", "--manual-ack", "--count", "2"],
        );
        let rx = child.stdout.take().expect("stdout");
        wait_until("the CLI member to join", || async {
            broker.group("cli-workers").await.is_some_and(|g| g.members == 1)
        })
        .await;
        let mut client = broker.client().await;
        for payload in ["one", "two"] {
            let r = client
                .publish(publish_request("work.x", payload))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.matched_groups, 1);
        }
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), "one");
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), "two");
        let status = exit_status(&mut child, TEST_TIMEOUT).await;
        assert!(status.success());
        let g = broker.group("cli-workers").await.unwrap();
        assert_eq!(
            (g.in_flight, g.redeliveries, g.backlog),
            (0, 0, 0),
            "both were acked before exit"
        );
    })
    .await
}

// === the Admin subcommands ===

/// A broker holding one of everything the Admin views list: a broadcast
/// subscription `watcher` whose reader stalled (narrow HTTP/2 windows) with
/// 3 of its 8 queue slots taken, a manual-ack group `workers` whose one
/// member `worker-1` holds its max_in_flight of 2 with 3 more in the
/// backlog, a group `idle` with nothing, and an eviction (`laggard`, queue
/// depth 8).
struct Scene {
    broker: TestBroker,
    _streams: Vec<tonic::Streaming<tinybroker::pb::Message>>,
    /// A second subscription `closable`, for `close`.
    closable: tonic::Streaming<tinybroker::pb::Message>,
}

async fn queue_depth(broker: &TestBroker, id: &str) -> u64 {
    listed(broker.subscriptions().await, id).map_or(0, |s| s.queue_depth)
}

async fn scene() -> Scene {
    let broker = start_with_limits(tinybroker::config::Limits {
        consumer_capacity: 8,
        ..tinybroker::config::Limits::default()
    })
    .await;
    let mut client = broker.client().await;
    let mut request = member_request(&["work.*"], "workers", true, 2);
    request.subscription_id = "worker-1".into();
    let (worker, _) = open(&mut client, request).await;
    let mut request = member_request(&["idle.*"], "idle", false, 0);
    request.subscription_id = "idler".into();
    let (idler, _) = open(&mut client, request).await;
    let mut request = subscribe_request(&["other.>"]);
    request.subscription_id = "closable".into();
    let (closable, _) = open(&mut client, request).await;
    for i in 0..5 {
        client
            .publish(publish_request("work.x", &format!("job {i}")))
            .await
            .unwrap();
    }
    wait_until("2 in flight and 3 in the backlog", || async {
        broker
            .group("workers")
            .await
            .is_some_and(|g| (g.in_flight, g.backlog) == (2, 3))
    })
    .await;

    // One message at a time until the stalled watcher's queue holds 3.
    let mut stalled = tinybroker::pb::broker_client::BrokerClient::new(broker.narrow_channel().await);
    let mut request = subscribe_request(&["watch.>"]);
    request.subscription_id = "watcher".into();
    let (watcher, _) = open(&mut stalled, request).await;
    while queue_depth(&broker, "watcher").await < 3 {
        client
            .publish(publish_request("watch.x", &"w".repeat(16 * 1024)))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(queue_depth(&broker, "watcher").await, 3, "one publish adds one");

    let mut stalled = tinybroker::pb::broker_client::BrokerClient::new(broker.narrow_channel().await);
    let mut request = subscribe_request(&["slow.>"]);
    request.subscription_id = "laggard".into();
    let (laggard, _) = open(&mut stalled, request).await;
    let mut admin = broker.admin().await;
    while evictions(&mut admin).await.is_empty() {
        let requests: Vec<_> = (0..100).map(|_| publish_request("slow.x", &"s".repeat(4096))).collect();
        client.publish_stream(futures::stream::iter(requests)).await.unwrap();
    }
    Scene {
        broker,
        _streams: vec![worker, idler, watcher, laggard],
        closable,
    }
}

/// `tinybroker ARGS --addr URL`, which must succeed; its stdout.
fn cli_ok(url: &str, args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--addr", url]);
    let (status, stdout, stderr) = run_cli(&all, &[]);
    assert!(status.success(), "tinybroker {args:?}: {stderr}");
    stdout
}

/// One JSON object per line.
fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

/// The cell of `row` under `column` of a table printed by the CLI (cells
/// are separated by two or more spaces; the header names the columns).
fn cell(table: &str, row_starting: &str, column: &str) -> String {
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap()
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    let row = lines
        .find(|l| l.starts_with(row_starting))
        .unwrap_or_else(|| panic!("no row {row_starting} in\n{table}"));
    let cells: Vec<&str> = row.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    assert_eq!(cells.len(), header.len(), "{row} under {header:?}");
    let i = header
        .iter()
        .position(|h| *h == column)
        .unwrap_or_else(|| panic!("no {column} in {header:?}"));
    cells[i].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_lists_what_admin_lists_fullest_queue_first() {
    timeout(async {
        let scene = scene().await;
        let url = scene.broker.url();
        let listed = scene.broker.subscriptions().await;
        assert_eq!(listed.len(), 4, "{listed:?}");

        let rows = json_lines(&cli_ok(&url, &["subscriptions", "--json"]));
        assert_eq!(rows.len(), listed.len());
        // worker-1 holds its max_in_flight (2) unacked: full; the watcher's
        // queue holds 3 of 8, the others' none.
        assert_eq!(rows[0]["subscription_id"], "worker-1");
        assert_eq!(rows[1]["subscription_id"], "watcher");
        for s in &listed {
            let row = rows
                .iter()
                .find(|r| r["subscription_id"] == s.subscription_id.as_str())
                .unwrap_or_else(|| panic!("{} in {rows:?}", s.subscription_id));
            assert_eq!(row["queue_depth"], s.queue_depth, "{row}");
            assert_eq!(row["capacity"], s.capacity, "{row}");
            assert_eq!(row["delivered"], s.delivered, "{row}");
            assert_eq!(row["consumer_group"], s.consumer_group.as_str(), "{row}");
            assert_eq!(row["topic_patterns"], serde_json::json!(s.topic_patterns), "{row}");
            assert_eq!(row["peer_address"], s.peer_address.as_str(), "{row}");
            assert_eq!(row["unacked"], s.unacked, "{row}");
        }
        let worker = rows.iter().find(|r| r["subscription_id"] == "worker-1").unwrap();
        assert_eq!(
            (&worker["mode"], &worker["ack_mode"]),
            (&"single".into(), &"manual".into())
        );
        assert_eq!(worker["unacked"], 2, "{worker}");
        assert!(worker["oldest_unacked_age_seconds"].as_f64().is_some(), "{worker}");
        assert_eq!((&rows[1]["mode"], &rows[1]["ack_mode"]), (&"multi".into(), &"".into()));

        let table = cli_ok(&url, &["subscriptions"]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("ID "), "{table}");
        assert!(lines[1].starts_with("worker-1 "), "fullest first: {table}");
        assert!(lines[2].starts_with("watcher "), "fullest first: {table}");
        assert!(!lines[0].contains("REPLICA"), "no replica column on one node: {table}");
        assert_eq!(cell(&table, "watcher", "QUEUE"), "3/8", "{table}");
        assert_eq!(cell(&table, "watcher", "FILL"), "38%", "{table}");
        assert_eq!(cell(&table, "watcher", "GROUP"), "-", "{table}");
        assert_eq!(cell(&table, "worker-1", "GROUP"), "workers", "{table}");
        assert_eq!(cell(&table, "worker-1", "QUEUE"), "0/2", "{table}");
        assert_eq!(cell(&table, "worker-1", "MODE"), "single/manual", "{table}");
        assert_eq!(cell(&table, "worker-1", "UNACKED"), "2", "{table}");
        assert_eq!(cell(&table, "worker-1", "FILL"), "100%", "{table}");
        assert_eq!(cell(&table, "watcher", "UNACKED"), "-", "{table}");

        let rows = json_lines(&cli_ok(&url, &["subscriptions", "--group", "workers", "--json"]));
        let ids: Vec<&str> = rows.iter().map(|r| r["subscription_id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["worker-1"]);
        let text = cli_ok(&url, &["subscriptions", "--group", "nobody"]);
        assert!(text.contains("no open subscriptions in group \"nobody\""), "{text}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_and_evictions_list_what_admin_lists() {
    timeout(async {
        let scene = scene().await;
        let url = scene.broker.url();
        let mut admin = scene.broker.admin().await;
        let listed = groups(&mut admin).await;
        let rows = json_lines(&cli_ok(&url, &["groups", "--json"]));
        assert_eq!(rows.len(), listed.len());
        assert_eq!(rows[0]["name"], "workers", "largest backlog first: {rows:?}");
        for g in &listed {
            let row = rows.iter().find(|r| r["name"] == g.name.as_str()).unwrap();
            assert_eq!(row["backlog"], g.backlog, "{row}");
            assert_eq!(row["in_flight"], g.in_flight, "{row}");
            assert_eq!(row["members"], g.members, "{row}");
            assert_eq!(row["redeliveries"], g.redeliveries, "{row}");
            assert_eq!(row["dead_lettered"], g.dead_lettered, "{row}");
            assert_eq!(row["dropped"], g.dropped, "{row}");
        }
        // Manual ack with 2 delivered and unacked: it has an age; the
        // auto-ack group has none.
        let workers = listed.iter().find(|g| g.name == "workers").unwrap();
        assert!(workers.oldest_unacked_age.is_some(), "{workers:?}");
        assert!(rows[0]["oldest_unacked_age_seconds"].as_f64().unwrap() >= 0.0);
        assert!(rows[1]["oldest_unacked_age_seconds"].is_null(), "{rows:?}");
        let table = cli_ok(&url, &["groups"]);
        assert!(table.lines().nth(1).unwrap().starts_with("workers "), "{table}");
        assert_eq!(cell(&table, "workers", "BACKLOG"), "3", "{table}");
        assert_eq!(cell(&table, "workers", "IN FLIGHT"), "2", "{table}");
        assert_eq!(cell(&table, "idle", "BACKLOG"), "0", "{table}");

        let listed = evictions(&mut admin).await;
        let rows = json_lines(&cli_ok(&url, &["evictions", "--json"]));
        assert_eq!(rows.len(), listed.len());
        let e = &listed[0];
        assert_eq!(rows[0]["subscription_id"], "laggard");
        assert_eq!(rows[0]["queue_depth"], e.queue_depth);
        assert_eq!(rows[0]["last_delivered_sequence"], e.last_delivered_sequence);
        assert_eq!(rows[0]["peer_address"], e.peer_address.as_str());
        assert_eq!(rows[0]["evicted_at"], e.evicted_at.unwrap().to_string());
        let table = cli_ok(&url, &["evictions"]);
        assert_eq!(cell(&table, "", "QUEUE DEPTH"), "8", "{table}");
        assert_eq!(cell(&table, "", "ID"), "laggard", "{table}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_reports_the_metrics_published_and_delivered_totals() {
    timeout(async {
        let scene = scene().await;
        let url = scene.broker.url();
        let mut admin = scene.broker.admin().await;
        let info = admin
            .get_broker_info(tinybroker::pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        let metrics = scrape(scene.broker.metrics_addr).await;
        let published = common::process::metric_sum(&metrics, "tinybroker_messages_published_total");
        let delivered = common::process::metric_sum(&metrics, "tinybroker_messages_delivered_total");
        assert!(info.messages_published > 5, "{info:?}");
        assert_eq!(info.messages_published as f64, published);
        assert_eq!(info.messages_delivered as f64, delivered);
        assert!(info.messages_delivered >= 2, "worker-1's two at least: {info:?}");

        let rows = json_lines(&cli_ok(&url, &["info", "--json"]));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["messages_published"], info.messages_published);
        assert_eq!(rows[0]["messages_delivered"], info.messages_delivered);
        assert_eq!(rows[0]["limits"]["consumer_capacity"], 8);
        assert_eq!(rows[0]["cluster_mode"], false);
        let text = cli_ok(&url, &["info"]);
        let line = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("{name}:")))
                .unwrap_or_else(|| panic!("{name} in {text}"))
                .split_once(':')
                .unwrap()
                .1
                .trim()
                .to_owned()
        };
        assert_eq!(line("messages published"), info.messages_published.to_string());
        assert_eq!(line("consumer capacity"), "8");
        assert_eq!(line("mode"), "single node");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_ends_a_subscription_and_an_unknown_id_fails_with_the_brokers_message() {
    timeout(async {
        let mut scene = scene().await;
        let url = scene.broker.url();
        let out = cli_ok(&url, &["close", "closable"]);
        assert_eq!(out.trim(), "closed subscription closable");
        assert!(scene.closable.message().await.unwrap().is_none(), "its stream ended");
        let trailers = scene.closable.trailers().await.unwrap().unwrap();
        assert_eq!(trailers.get("tinybroker-end-reason").unwrap(), "closed_by_admin");

        for args in [&["close", "no-such-id"][..], &["close", "closable"]] {
            let (status, stdout, stderr) = run_cli(&[args, &["--addr", &url]].concat(), &[]);
            assert!(!status.success(), "{args:?}: {stdout}");
            assert!(stderr.contains("close failed: NotFound"), "{stderr}");
            assert!(stderr.contains(&format!("\"{}\"", args[1])), "names the id: {stderr}");
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_subcommands_send_the_token_and_say_when_it_is_refused() {
    timeout(async {
        let broker = start_with(tinybroker::config::Config {
            auth_token: Some("s3cret".into()),
            ..config()
        })
        .await;
        let url = broker.url();
        for sub in ["subscriptions", "groups", "evictions", "info"] {
            let (status, _, stderr) = run_cli(&[sub, "--addr", &url], &[]);
            assert!(!status.success(), "{sub} without the token");
            assert!(stderr.contains("Unauthenticated"), "{sub}: {stderr}");
            assert!(stderr.contains("set TINYBROKER_AUTH_TOKEN"), "{sub}: {stderr}");
            let (status, _, stderr) = run_cli(&[sub, "--addr", &url], &[("TINYBROKER_AUTH_TOKEN", "wrong")]);
            assert!(!status.success(), "{sub} with a wrong token");
            assert!(
                stderr.contains("the token in TINYBROKER_AUTH_TOKEN is not the broker's"),
                "{sub}: {stderr}"
            );
            let (status, stdout, stderr) = run_cli(&[sub, "--addr", &url], &[("TINYBROKER_AUTH_TOKEN", "s3cret")]);
            assert!(status.success(), "{sub} with the token: {stderr}");
            assert!(!stdout.is_empty(), "{sub}");
        }
        // The address from TINYBROKER_ADDR, as the client libraries read it.
        let (status, stdout, stderr) = run_cli(
            &["info"],
            &[("TINYBROKER_ADDR", url.as_str()), ("TINYBROKER_AUTH_TOKEN", "s3cret")],
        );
        assert!(status.success(), "info with TINYBROKER_ADDR: {stderr}");
        assert!(stdout.contains("version"), "{stdout}");
        let (status, _, stderr) = run_cli(&["groups", "--addr", "http://127.0.0.1:1"], &[]);
        assert!(!status.success());
        assert!(stderr.contains("cannot connect to http://127.0.0.1:1"), "{stderr}");
    })
    .await
}

/// `tinybroker subscriptions --json | head -n 1`: the reader goes away
/// after one line while the CLI still has rows to write (more than a pipe
/// holds, so it cannot have finished before), and the CLI ends as a Unix
/// filter does: killed by SIGPIPE, nothing on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_goes_away_ends_the_cli_quietly() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        // 8 subscriptions of 64 patterns of 250 bytes: over 128 KiB of JSON.
        let patterns: Vec<String> = (0..64).map(|i| format!("p{i:03}.{}", "x".repeat(245))).collect();
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        let mut streams = Vec::new();
        for _ in 0..8 {
            streams.push(subscribe(&mut client, &patterns).await);
        }
        let mut child = ChildGuard::new(
            cli(&["subscriptions", "--json", "--addr", &broker.url()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut stdout = std::io::BufReader::new(child.child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        assert!(first.starts_with('{'), "{first}");
        drop(stdout);
        let mut stderr = String::new();
        child.child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        let status = exit_status(&mut child, TEST_TIMEOUT).await;
        assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}, stderr: {stderr}");
        assert_eq!(stderr, "", "nothing on stderr");
    })
    .await
}

// === subscribe says who it is ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_says_its_id_group_and_patterns_once_open() {
    timeout(async {
        let broker = start().await;
        let url = broker.url();
        for (args, group) in [
            (&["said.>", "said.*"][..], None),
            (&["job.*", "--group", "said-workers"], Some("said-workers")),
        ] {
            let child = spawn_cli_subscriber(&url, args);
            let stderr = child.stderr.as_ref().unwrap();
            let line = common::process::next_line(stderr, Duration::from_secs(20)).await;
            let id = line
                .strip_prefix("tinybroker subscribe: subscribed: id=")
                .unwrap_or_else(|| panic!("{line}"))
                .split(' ')
                .next()
                .unwrap()
                .to_owned();
            let listed = listed(broker.subscriptions().await, &id).unwrap_or_else(|| panic!("{id} listed: {line}"));
            assert_eq!(listed.consumer_group, group.unwrap_or(""));
            match group {
                Some(g) => assert!(line.contains(&format!(" group={g} patterns=job.*")), "{line}"),
                None => {
                    assert!(!line.contains("group="), "{line}");
                    assert!(line.ends_with(" patterns=said.>,said.*"), "{line}");
                }
            }
        }
    })
    .await
}

// === README's grpcurl subscriber says why its stream ended ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_grpcurl_subscriber_with_v_shows_why_its_stream_ended() {
    require_grpcurl();
    timeout(async {
        let broker = start().await;
        let url = broker.url();
        // README's example, with an id to close it by.
        let mut subscriber = ChildGuard::spawn(
            std::process::Command::new("grpcurl")
                .args(["-plaintext", "-v", "-d"])
                .arg(r#"{"topic_patterns": ["deploy.*"], "subscription_id": "readme-demo"}"#)
                .arg(broker.grpc_addr.to_string())
                .arg("tinybroker.v1.Broker/OpenSubscription"),
        );
        let stdout = subscriber.read_stdout();
        wait_until("grpcurl's subscription", || async {
            listed(broker.subscriptions().await, "readme-demo").is_some()
        })
        .await;
        cli_ok(&url, &["publish", "deploy.rollout", "hello"]);
        cli_ok(&url, &["close", "readme-demo"]);
        let status = common::process::exit_status(&mut subscriber, TEST_TIMEOUT).await;
        assert!(status.success(), "grpcurl exits 0: the stream ended with OK");
        // Every line, up to the end of its output.
        let text = tokio::task::spawn_blocking(move || stdout.iter().collect::<Vec<_>>().join("\n"))
            .await
            .unwrap();
        for line in [
            "tinybroker-subscription-id: readme-demo",
            "\"payload\": \"aGVsbG8=\"",
            "Response trailers received:",
            "tinybroker-end-reason: closed_by_admin",
            "tinybroker-dropped: 0",
            "tinybroker-last-sequence: 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    })
    .await
}

// === cluster mode: the replica column ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_cluster_mode_tables_name_the_replica_of_each_subscription() {
    timeout(async {
        let broker = start_cluster(config()).await;
        let mut streams = Vec::new();
        for (i, id) in [(0, "on-a"), (1, "on-b")] {
            let mut client = tinybroker::pb::broker_client::BrokerClient::connect(broker.replica(i).url())
                .await
                .unwrap();
            let mut request = subscribe_request(&["where.>"]);
            request.subscription_id = id.into();
            streams.push(open(&mut client, request).await.0);
        }
        let url = broker.replica(0).url();
        wait_until("both subscriptions listed on replica a", || async {
            let listed = subscriptions(&url).await;
            ["on-a", "on-b"]
                .iter()
                .all(|id| listed.iter().any(|s| s.subscription_id == *id))
        })
        .await;
        let table = cli_ok(&url, &["subscriptions"]);
        assert_eq!(cell(&table, "on-a", "REPLICA"), "a", "{table}");
        assert_eq!(cell(&table, "on-b", "REPLICA"), "b", "{table}");
        let rows = json_lines(&cli_ok(&url, &["subscriptions", "--json"]));
        let replica = |id: &str| rows.iter().find(|r| r["subscription_id"] == id).unwrap()["replica_id"].clone();
        assert_eq!((replica("on-a"), replica("on-b")), ("a".into(), "b".into()));
        let info = cli_ok(&url, &["info"]);
        assert!(
            info.lines()
                .any(|l| l.starts_with("mode:") && l.ends_with("cluster (over NATS)")),
            "{info}"
        );
        assert!(
            info.lines().any(|l| l.starts_with("replica:") && l.ends_with(" a")),
            "{info}"
        );
        let frame = cli_ok(&url, &["top", "--once"]);
        assert!(frame.lines().next().unwrap().contains("cluster, replica a"), "{frame}");
        assert!(frame.contains("(this replica)"), "{frame}");
        assert!(frame.contains("REPLICA"), "{frame}");
        // The header's totals are the lists': the cluster's 2 subscriptions,
        // not replica a's 1 (GetBrokerInfo's count).
        assert!(frame.contains(" · subscriptions 2 · groups 0 · "), "{frame}");
    })
    .await
}

// === publish --lines ===

/// Runs `tinybroker publish ARGS...` with `input` on its stdin, to
/// completion: (status, stdout, stderr).
async fn publish_lines(args: &[&str], input: Vec<u8>) -> (std::process::ExitStatus, String, String) {
    let mut all = vec!["publish"];
    all.extend_from_slice(args);
    let mut child = ChildGuard::new(
        cli(&all)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stdin = child.child.stdin.take().unwrap();
    std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let read = |mut from: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = from.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.child.stderr.take().unwrap()));
    let status = exit_status(&mut child, TEST_TIMEOUT).await;
    (status, stdout.join().unwrap(), stderr.join().unwrap())
}

/// The next `n` messages of `stream`, each within 20 s.
async fn messages(stream: &mut tonic::Streaming<tinybroker::pb::Message>, n: usize) -> Vec<tinybroker::pb::Message> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        let m = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("a message within 20 s")
            .unwrap()
            .expect("the stream goes on");
        got.push(m);
    }
    got
}

async fn publish_batches(broker: &TestBroker) -> (f64, f64) {
    let metrics = scrape(broker.metrics_addr).await;
    (
        process::metric_sum(&metrics, "tinybroker_publish_batch_size_count"),
        process::metric_sum(&metrics, "tinybroker_publish_batch_size_sum"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_lines_sends_every_line_in_batches_and_the_subscriber_sees_them_in_order() {
    const LINES: usize = 5000;
    timeout(async {
        let broker = start_with_limits(tinybroker::config::Limits {
            consumer_capacity: 2 * LINES,
            ..Default::default()
        })
        .await;
        let (mut stream, _) = subscribe(&mut broker.client().await, &["lines.x"]).await;
        let input: String = (1..=LINES).map(|i| format!("line {i}\n")).collect();
        let (status, stdout, stderr) = publish_lines(
            &["lines.x", "--lines", "--header", "k=v", "--addr", &broker.url()],
            input.into_bytes(),
        )
        .await;
        assert!(status.success(), "{stdout}{stderr}");
        assert_eq!(stderr, "");
        let got = messages(&mut stream, LINES).await;
        let first = got[0].sequence;
        assert_eq!(
            stdout,
            format!(
                "published={LINES} first_sequence={first} last_sequence={} rejected=0 unconfirmed=0 not_sent=0\n",
                first + LINES as u64 - 1
            )
        );
        for (i, m) in got.iter().enumerate() {
            assert_eq!(
                (std::str::from_utf8(&m.payload).unwrap(), m.sequence),
                (&format!("line {}", i + 1)[..], first + i as u64)
            );
            assert_eq!(
                m.headers.get("k").map(String::as_str),
                Some("v"),
                "--header on every line"
            );
        }
        // All in SessionPublish batches of at most 1024 (what the pipe gave
        // at once goes together: a few batches, not one per line).
        let (batches, messages) = publish_batches(&broker).await;
        assert_eq!(messages, LINES as f64);
        assert!(
            (LINES.div_ceil(1024) as f64..=20.0).contains(&batches),
            "{batches} batches"
        );
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_lines_names_each_rejected_line_by_number_and_exits_non_zero() {
    const MAX_MESSAGE_BYTES: usize = 100;
    timeout(async {
        let broker = start_with_limits(tinybroker::config::Limits {
            max_message_bytes: MAX_MESSAGE_BYTES,
            ..Default::default()
        })
        .await;
        let (mut stream, _) = subscribe(&mut broker.client().await, &["lines.y"]).await;
        // Line 2 is too large for the broker; line 4 too large for any
        // request it reads (the CLI rejects it; the session goes on); line
        // 3 ends in CRLF; line 5 has no line end.
        let input = format!(
            "one\n{}\nthree\r\n{}\nfive",
            "x".repeat(2 * MAX_MESSAGE_BYTES),
            "y".repeat(70 * 1024)
        );
        let (status, stdout, stderr) =
            publish_lines(&["lines.y", "--lines", "--addr", &broker.url()], input.into_bytes()).await;
        assert_eq!(status.code(), Some(2), "{stdout}{stderr}");
        let got = messages(&mut stream, 3).await;
        let payloads: Vec<&[u8]> = got.iter().map(|m| &m.payload[..]).collect();
        assert_eq!(payloads, [&b"one"[..], b"three", b"five"]);
        assert_eq!(
            stdout,
            format!(
                "published=3 first_sequence={} last_sequence={} rejected=2 unconfirmed=0 not_sent=0\n",
                got[0].sequence, got[2].sequence
            )
        );
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 3, "{stderr}");
        assert!(
            lines[0].starts_with("tinybroker publish: line 2 rejected: ResourceExhausted: ")
                && lines[0].contains("max_message_bytes 100"),
            "{stderr}"
        );
        assert!(
            lines[1].starts_with("tinybroker publish: line 4 rejected: ResourceExhausted: ")
                && lines[1].contains("not sent"),
            "{stderr}"
        );
        assert_eq!(lines[2], "tinybroker: publish --lines: 2 lines rejected");
    })
    .await
}
