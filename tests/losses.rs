//! Losses a reader or an operator can see (issue 12, points 4 and 5): the
//! CLI subscriber says on stderr when it is evicted, closed by an admin or
//! cut off by a shutdown, and when it is back; a Prometheus scraper at a 1 s
//! interval sees what a shutdown put at risk and what it lost; start-up
//! names misspelled variables; the CLI takes host:port and names the right
//! scheme. (A dead letter over a message limit, dropped and counted, is
//! part of the group contract: tests/contract/groups.rs.)

mod common;

use common::process::{
    BrokerProcess, ChildGuard, exit_status, free_port, line_containing, metric_sum, next_line, run_cli, spawn_cli,
    try_http_get_blocking,
};
use common::tls::TestPki;
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tinybroker::config::Config;
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tonic::transport::Channel;

/// How long a test waits for one line or state it expects.
const WAIT: Duration = Duration::from_secs(20);
/// Where the CLI's event lines begin.
const PREFIX: &str = "tinybroker subscribe: ";

/// The number right after `label` in `line`.
fn number_after(line: &str, label: &str) -> u64 {
    let start = line.find(label).unwrap_or_else(|| panic!("{label:?} in {line:?}")) + label.len();
    let digits: String = line[start..].chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("a number after {label:?} in {line:?}"))
}

/// The word right after `label` in `line`, without trailing punctuation.
fn word_after(line: &str, label: &str) -> String {
    let start = line.find(label).unwrap_or_else(|| panic!("{label:?} in {line:?}")) + label.len();
    let word = line[start..].split_whitespace().next().expect("a word");
    word.trim_end_matches([';', ',', ':']).to_owned()
}

async fn admin(url: &str) -> AdminClient<Channel> {
    AdminClient::connect(url.to_owned()).await.unwrap()
}

/// Open subscriptions whose patterns are exactly `[pattern]`.
async fn on_pattern(url: &str, pattern: &str) -> Vec<pb::SubscriptionInfo> {
    subscriptions(url)
        .await
        .into_iter()
        .filter(|s| s.topic_patterns == [pattern])
        .collect()
}

/// Waits for the one subscription on `[pattern]` (the CLI's) and returns its id.
async fn wait_listed(url: &str, pattern: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let found = on_pattern(url, pattern).await;
        assert!(found.len() <= 1, "one subscription on {pattern}: {found:?}");
        if let Some(s) = found.first() {
            return s.subscription_id.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no subscription on {pattern} within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the queue of the subscription on `[pattern]` empties within
/// `limit` (false also when it is gone).
async fn queue_empties(url: &str, pattern: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        match on_pattern(url, pattern).await.first() {
            Some(s) if s.queue_depth == 0 => return true,
            Some(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            None => return false,
        }
    }
    false
}

/// One `--json` line of the CLI: (topic, sequence, payload).
fn json_line(line: &str) -> (String, u64, String) {
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    (
        v["topic"].as_str().unwrap().to_owned(),
        v["sequence"].as_u64().unwrap(),
        v["payload"].as_str().unwrap().to_owned(),
    )
}

fn stderr(cli: &ChildGuard) -> &std::sync::mpsc::Receiver<String> {
    cli.stderr.as_ref().expect("stderr captured")
}

// === the CLI subscriber says what happened to it ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_cli_subscriber_says_what_it_lost_and_resumes() {
    const CAPACITY: u64 = 8;
    timeout(async {
        let broker = BrokerProcess::spawn(&[("TINYBROKER_CONSUMER_CAPACITY", CAPACITY.to_string())]);
        let url = broker.url();
        // Nobody reads its stdout: once the pipe is full the CLI blocks
        // writing, stops reading its stream, and the broker evicts it.
        let mut cli = spawn_cli(&["subscribe", "ev.>", "--json", "--addr", &url], &[]);
        let first_id = wait_listed(&url, "ev.>").await;

        let mut client = BrokerClient::connect(url.clone()).await.unwrap();
        let mut admin = admin(&url).await;
        let pad = "x".repeat(4096);
        let mut published = 0u64;
        let mut stalled = false;
        let eviction = loop {
            let payload = format!("{published:08}{pad}");
            client.publish(publish_request("ev.flood", &payload)).await.unwrap();
            published += 1;
            if !stalled {
                // While the CLI keeps up, each message is published once the
                // broker has handed the last one to its stream, so it cannot
                // be evicted early. One not taken within a second means the
                // CLI has stalled: its stdout pipe and HTTP/2 window are full.
                stalled = !queue_empties(&url, "ev.>", Duration::from_secs(1)).await;
                continue;
            }
            let evictions = common::evictions(&mut admin).await;
            if let Some(e) = evictions.into_iter().find(|e| e.subscription_id == first_id) {
                break e;
            }
            assert!(published < 20_000, "the stalled CLI was never evicted");
        };
        assert_eq!(eviction.queue_depth, CAPACITY, "evicted because its queue was full");
        let last = eviction.last_delivered_sequence;
        assert!(last > 0, "it got some messages before it stalled");

        // Now read: it prints what reached it, then says it was evicted.
        let stdout = cli.read_stdout();
        let (ended, before) = line_containing(stderr(&cli), "evicted", WAIT).await;
        assert_eq!(
            before,
            [format!("{PREFIX}subscribed: id={first_id} patterns=ev.>")],
            "nothing on stderr before the eviction but the line saying it subscribed"
        );
        assert!(ended.starts_with(PREFIX), "{ended}");
        assert!(ended.contains(&format!("subscription {first_id} ")), "{ended}");
        assert_eq!(
            number_after(&ended, "; "),
            CAPACITY + 1,
            "the queued messages and the one that did not fit were dropped: {ended}"
        );
        // The queue depth the broker logs and lists, and what was dropped:
        // the queued messages and the one that did not fit.
        assert!(
            ended.contains(&format!(
                ": queue depth {}; {} messages dropped: the {} queued for it and 1 that did not fit",
                eviction.queue_depth,
                CAPACITY + 1,
                eviction.queue_depth
            )),
            "{ended}"
        );
        assert_eq!(number_after(&ended, "last sequence delivered "), last, "{ended}");
        // stdout holds every message up to that sequence, in order, no gap.
        for expected in 1..=last {
            let line = next_line(&stdout, WAIT).await;
            let (topic, sequence, payload) = json_line(&line);
            assert_eq!((topic.as_str(), sequence), ("ev.flood", expected));
            assert_eq!(payload[..8], format!("{:08}", expected - 1));
        }

        let (retry, _) = line_containing(stderr(&cli), "re-subscribing in ", WAIT).await;
        assert!(retry.starts_with(PREFIX), "{retry}");
        number_after(&retry, "re-subscribing in ");
        let (back, _) = line_containing(stderr(&cli), "re-subscribed as ", WAIT).await;
        let second_id = word_after(&back, "re-subscribed as ");
        assert_ne!(second_id, first_id);
        assert_eq!(wait_listed(&url, "ev.>").await, second_id);

        // Messages published from now on arrive, and it says where it resumed.
        let mut sequences = Vec::new();
        for i in 0..3 {
            let r = client
                .publish(publish_request("ev.after", &format!("after-{i}")))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.matched_subscriptions, 1);
            sequences.push(r.sequence);
        }
        for (i, sequence) in sequences.iter().enumerate() {
            let line = next_line(&stdout, WAIT).await;
            assert_eq!(
                json_line(&line),
                ("ev.after".to_owned(), *sequence, format!("after-{i}"))
            );
        }
        let (resumed, _) = line_containing(stderr(&cli), "receiving again from sequence ", WAIT).await;
        assert_eq!(number_after(&resumed, "receiving again from sequence "), sequences[0]);
        assert_eq!(number_after(&resumed, "(last before: "), last, "{resumed}");
        // One broker, one counter: the gap is the range it did not get.
        assert!(
            resumed.ends_with(&format!("; missed sequences {}..{}", last + 1, sequences[0] - 1)),
            "{resumed}"
        );
        drop(broker);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_subscriber_closed_by_an_admin_says_so_exits_0_and_does_not_come_back() {
    timeout(async {
        let broker = BrokerProcess::spawn::<&str, &str>(&[]);
        let url = broker.url();
        let mut cli = spawn_cli(&["subscribe", "adm.>", "--addr", &url], &[]);
        let stdout = cli.read_stdout();
        let id = wait_listed(&url, "adm.>").await;
        let mut client = BrokerClient::connect(url.clone()).await.unwrap();
        client.publish(publish_request("adm.1", "before")).await.unwrap();
        assert_eq!(next_line(&stdout, WAIT).await, "before");

        admin(&url)
            .await
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: id.clone(),
            })
            .await
            .unwrap();
        let (closed, before) = line_containing(stderr(&cli), "closed by an admin", WAIT).await;
        assert_eq!(before, [format!("{PREFIX}subscribed: id={id} patterns=adm.>")]);
        assert!(closed.starts_with(PREFIX), "{closed}");
        assert!(closed.contains(&format!("subscription {id} ")), "{closed}");
        let status = exit_status(&mut cli, WAIT).await;
        assert_eq!(status.code(), Some(0), "{status:?}");
        let rest: Vec<String> = stderr(&cli).try_iter().collect();
        assert!(rest.iter().all(|l| !l.contains("re-subscrib")), "{rest:?}");
        assert!(on_pattern(&url, "adm.>").await.is_empty(), "it did not subscribe again");

        let (log, _) = line_containing(&broker.log, "subscription closed by an admin", WAIT).await;
        assert!(log.contains("INFO"), "{log}");
        assert!(log.contains(&format!("subscription_id=\"{id}\"")), "{log}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_subscriber_says_the_broker_shut_down_retries_and_resubscribes_to_its_successor() {
    timeout(async {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let env = [("TINYBROKER_GRPC_ADDR", addr.as_str())];
        let mut broker = BrokerProcess::spawn(&env);
        // host:port without a scheme, as people type it.
        let mut cli = spawn_cli(&["subscribe", "down.>", "--addr", &addr], &[]);
        let stdout = cli.read_stdout();
        let url = broker.url();
        let first_id = wait_listed(&url, "down.>").await;
        let mut client = BrokerClient::connect(url.clone()).await.unwrap();
        client.publish(publish_request("down.1", "before")).await.unwrap();
        assert_eq!(next_line(&stdout, WAIT).await, "before");

        broker.guard.signal("TERM");
        let (ended, before) = line_containing(stderr(&cli), "the broker is shutting down", WAIT).await;
        assert_eq!(before, [format!("{PREFIX}subscribed: id={first_id} patterns=down.>")]);
        assert!(ended.starts_with(PREFIX), "{ended}");
        assert_eq!(exit_status(&mut broker.guard, WAIT).await.code(), Some(0));
        // While no broker answers, each attempt is reported with its failure.
        line_containing(stderr(&cli), "re-subscribing in ", WAIT).await;
        let (failed, _) = line_containing(stderr(&cli), "(last attempt: Unavailable", WAIT).await;
        assert!(failed.contains("re-subscribing in "), "{failed}");

        let successor = BrokerProcess::spawn(&env);
        let (back, _) = line_containing(stderr(&cli), "re-subscribed as ", WAIT).await;
        let id = word_after(&back, "re-subscribed as ");
        assert_eq!(wait_listed(&url, "down.>").await, id);
        let mut client = BrokerClient::connect(url.clone()).await.unwrap();
        let r = client
            .publish(publish_request("down.2", "after"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_subscriptions, 1);
        assert_eq!(next_line(&stdout, WAIT).await, "after");
        let (resumed, _) = line_containing(stderr(&cli), "receiving again from sequence ", WAIT).await;
        assert_eq!(number_after(&resumed, "receiving again from sequence "), r.sequence);
        drop(successor);
    })
    .await
}

// === shutdown losses, as Prometheus sees them ===

#[derive(Debug, Clone, Copy)]
struct Sample {
    shutting_down: f64,
    pending: f64,
    discarded: f64,
}

/// Scrapes /metrics every second on the second, as Prometheus would with
/// `scrape_interval: 1s`, until told to stop.
struct Scraper {
    samples: Arc<Mutex<Vec<Option<Sample>>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scraper {
    fn start(addr: std::net::SocketAddr) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (samples, stop) = (samples.clone(), stop.clone());
            std::thread::spawn(move || {
                let start = Instant::now();
                for k in 1.. {
                    let sample = try_http_get_blocking(addr, "/metrics")
                        .filter(|(status, _)| *status == 200)
                        .map(|(_, text)| Sample {
                            shutting_down: metric_sum(&text, "tinybroker_shutting_down"),
                            pending: metric_sum(&text, "tinybroker_shutdown_pending_messages"),
                            discarded: metric_sum(&text, "tinybroker_messages_discarded_on_shutdown_total"),
                        });
                    samples.lock().unwrap().push(sample);
                    let next = start + Duration::from_secs(k);
                    while Instant::now() < next {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            })
        };
        Self {
            samples,
            stop,
            thread: Some(thread),
        }
    }

    fn samples(&self) -> Vec<Option<Sample>> {
        self.samples.lock().unwrap().clone()
    }

    async fn finish(mut self) -> Vec<Option<Sample>> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().unwrap();
        tokio::task::spawn_blocking(move || thread.join().unwrap())
            .await
            .unwrap();
        self.samples()
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scraper_every_second_sees_what_a_shutdown_put_at_risk_and_then_lost() {
    const BACKLOG: u64 = 500;
    timeout(async {
        let mut broker = BrokerProcess::spawn(&[("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "2")]);
        let url = broker.url();
        // A stalled worker: a manual-ack member with room for one message
        // that it never acks, so the rest of the work waits in the backlog.
        let mut member_client = BrokerClient::connect(url.clone()).await.unwrap();
        let (mut member, _) = open(&mut member_client, member_request(&["risk.>"], "workers", true, 1)).await;
        let mut client = BrokerClient::connect(url.clone()).await.unwrap();
        let requests: Vec<_> = (0..=BACKLOG)
            .map(|i| publish_request(&format!("risk.{}", i % 5), &i.to_string()))
            .collect();
        client.publish_stream(futures::stream::iter(requests)).await.unwrap();
        let held = member.message().await.unwrap().unwrap();
        assert_eq!(&held.payload[..], b"0");
        let groups = common::groups(&mut admin(&url).await).await;
        let g = groups.iter().find(|g| g.name == "workers").unwrap();
        assert_eq!((g.backlog, g.in_flight), (BACKLOG, 1));
        // At risk: the backlog and the unacked message, which the shutdown
        // takes back from its member and discards with the backlog.
        let at_risk = (BACKLOG + 1) as f64;

        let scraper = Scraper::start(broker.metrics_addr);
        wait_until("a first scrape", || async { !scraper.samples().is_empty() }).await;
        broker.guard.signal("TERM");
        // The member's stream ends cleanly once the grace period is over.
        assert!(member.message().await.expect("ends with OK").is_none());
        let trailers = member.trailers().await.unwrap().expect("trailers");
        assert_eq!(trailers.get("tinybroker-end-reason").unwrap(), "shutdown");
        let exit = exit_status(&mut broker.guard, WAIT).await;
        let samples = scraper.finish().await;
        assert_eq!(exit.code(), Some(0), "{exit:?}");

        let first = samples[0].expect("the first scrape answered");
        assert_eq!((first.shutting_down, first.pending, first.discarded), (0.0, 0.0, 0.0));
        let draining = samples
            .iter()
            .position(|s| s.is_some_and(|s| s.shutting_down == 1.0 && s.discarded == 0.0))
            .unwrap_or_else(|| panic!("no scrape during the grace period: {samples:?}"));
        assert_eq!(
            samples[draining].unwrap().pending,
            at_risk,
            "what the shutdown put at risk: {samples:?}"
        );
        let lost = samples[draining..]
            .iter()
            .flatten()
            .find(|s| s.discarded > 0.0)
            .unwrap_or_else(|| panic!("no scrape saw the loss before the process exited: {samples:?}"));
        assert_eq!(lost.discarded, at_risk, "{samples:?}");
        assert_eq!(lost.shutting_down, 1.0);
        let (log, _) = line_containing(&broker.log, "messages still queued were discarded", WAIT).await;
        assert!(log.contains(&format!("discarded={}", BACKLOG + 1)), "{log}");
    })
    .await
}

// === start-up names what is wrong ===

#[test]
fn an_unknown_variable_is_warned_about_with_the_closest_name_and_service_links_are_not() {
    let broker = BrokerProcess::spawn(&[
        ("TINYBROKER_MAX_MSG_BYTES", "5"),
        ("TINYBROKER_SERVICE_HOST", "x"),
        ("TINYBROKER_PORT_50051_TCP", "tcp://10.0.0.1:50051"),
        ("TINYBROKER_NATS_SERVICE_HOST", "x"),
        ("TINYBROKER_ADDR", "127.0.0.1:50051"),
    ]);
    let mut lines = broker.before_start.clone();
    lines.push(broker.started.clone());
    let named: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("TINYBROKER_MAX_MSG_BYTES"))
        .collect();
    assert_eq!(named.len(), 1, "one line names it: {lines:#?}");
    assert!(named[0].contains("WARN"), "{}", named[0]);
    assert!(
        named[0].contains("did you mean TINYBROKER_MAX_MESSAGE_BYTES"),
        "{}",
        named[0]
    );
    assert!(
        lines
            .iter()
            .all(|l| !l.contains("SERVICE_HOST") && !l.contains("PORT_50051") && !l.contains("TINYBROKER_ADDR")),
        "Kubernetes service links and the clients' TINYBROKER_ADDR are not reported: {lines:#?}"
    );
    // Ignored, as the warning says: the default limit is in force.
    assert_eq!(process::field(&broker.started, "max_message_bytes"), "1048576");
}

/// docs/operations.md, "Configuration": a misspelt variable fails closed.
#[test]
fn a_near_miss_of_a_variable_stops_start_up_with_one_line_naming_both() {
    for (typo, known) in [
        ("TINYBROKER_AUTH_TOKN", "TINYBROKER_AUTH_TOKEN"),
        ("TINYBROKER_CONSUMR_CAPACITY", "TINYBROKER_CONSUMER_CAPACITY"),
        ("TINYBROKER_TLS_CRT", "TINYBROKER_TLS_CERT"),
    ] {
        let (status, _, stderr) = run_cli(
            &["serve"],
            &[
                (typo, "secret"),
                ("TINYBROKER_GRPC_ADDR", "127.0.0.1:0"),
                ("TINYBROKER_METRICS_ADDR", "127.0.0.1:0"),
            ],
        );
        assert!(!status.success(), "{typo}: {status:?}");
        assert_eq!(stderr.trim().lines().count(), 1, "{typo}: {stderr}");
        assert!(stderr.contains(typo) && stderr.contains(known), "{typo}: {stderr}");
        assert!(!stderr.contains("secret"), "{typo}: the value is not shown: {stderr}");
    }
}

#[test]
fn an_empty_auth_token_stops_start_up_with_one_line_naming_it() {
    for token in ["", "  "] {
        let (status, _, stderr) = run_cli(
            &["serve"],
            &[
                ("TINYBROKER_AUTH_TOKEN", token),
                ("TINYBROKER_GRPC_ADDR", "127.0.0.1:0"),
                ("TINYBROKER_METRICS_ADDR", "127.0.0.1:0"),
            ],
        );
        assert!(!status.success(), "{token:?}: {status:?}");
        assert_eq!(stderr.trim().lines().count(), 1, "{token:?}: {stderr}");
        assert!(stderr.contains("TINYBROKER_AUTH_TOKEN"), "{token:?}: {stderr}");
    }
}

// === CLI addresses ===

/// `tinybroker ARGS...` run off the async runtime.
async fn cli(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_cli(&args, &[])
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_takes_host_port_and_names_the_scheme_a_broker_needs() {
    timeout(async {
        let plain = start().await;
        let mut client = plain.client().await;
        let (mut stream, _) = subscribe(&mut client, &["addr.*"]).await;
        let (status, stdout, stderr) =
            cli(&["publish", "addr.a", "no scheme", "--addr", &plain.grpc_addr.to_string()]).await;
        assert!(status.success(), "{stderr}");
        assert!(stdout.starts_with("sequence="), "{stdout}");
        assert_eq!(&stream.message().await.unwrap().unwrap().payload[..], b"no scheme");

        let pki = TestPki::new("losses-scheme");
        let tls = start_with(Config {
            tls: Some(pki.files()),
            ..config()
        })
        .await;
        let http_to_tls = format!("http://{}", tls.grpc_addr);
        let (status, _, stderr) = cli(&["publish", "addr.a", "x", "--addr", &http_to_tls]).await;
        assert!(!status.success());
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("use an https:// address"), "{stderr}");

        let https_to_plain = format!("https://{}", plain.grpc_addr);
        let ca = pki.ca.to_str().unwrap();
        let (status, _, stderr) = cli(&["publish", "addr.a", "x", "--addr", &https_to_plain, "--ca", ca]).await;
        assert!(!status.success());
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("use an http:// address"), "{stderr}");

        // A refused port: each cause once, and no scheme hint.
        let refused = format!("127.0.0.1:{}", free_port());
        for args in [
            vec!["publish", "addr.a", "x", "--addr", &refused],
            vec!["subscribe", "addr.a", "--addr", &refused],
        ] {
            let (status, _, stderr) = cli(&args).await;
            assert!(!status.success(), "{args:?}");
            assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
            assert!(stderr.contains("Connection refused"), "{stderr}");
            assert_eq!(stderr.matches("tcp connect error").count(), 1, "{stderr}");
            assert!(
                !stderr.contains("use an http"),
                "no scheme hint for a refused port: {stderr}"
            );
        }
    })
    .await
}
