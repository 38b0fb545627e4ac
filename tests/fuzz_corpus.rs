//! The fuzz targets' checks under `cargo test`: every file of the checked-in
//! corpus (`fuzz/corpus/<target>/`) is replayed, and proptest throws
//! arbitrary strings, bytes and request structs at the same checks
//! (`fuzz/src/checks.rs`, shared with the cargo-fuzz targets).
//! `PROPTEST_CASES` raises the number of cases (default 64 per property).

#[path = "../fuzz/src/checks.rs"]
mod checks;

use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tinybroker::pb;

/// Runs a synchronous test body on its own thread, failing after a minute.
fn with_timeout(name: &str, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => thread.join().expect("test thread"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{name} timed out"),
    }
}

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 10, "{} holds only {} files", dir.display(), files.len());
    files
        .into_iter()
        .map(|path| {
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, data)
        })
        .collect()
}

/// Replays every file; reports all the files that fail, not just the first.
fn replay(target: &'static str, check: fn(&[u8])) {
    with_timeout(target, move || {
        let mut failed = Vec::new();
        for (path, data) in corpus(target) {
            if std::panic::catch_unwind(|| check(&data)).is_err() {
                failed.push(path.display().to_string());
            }
        }
        assert!(failed.is_empty(), "corpus files that fail the checks: {failed:#?}");
    });
}

#[test]
fn topic_corpus_passes_the_checks() {
    replay("topic", checks::check_topic_input);
}

#[test]
fn requests_corpus_passes_the_checks() {
    replay("requests", checks::check_request_input);
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Topic-like strings: the characters that matter to the grammar.
fn topicish() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[ab*>.]{0,10}",
        1 => "[ab*>. \t\u{0}\u{e9}_]{0,12}",
        1 => proptest::sample::select(checks::WORDS).prop_map(str::to_owned),
        1 => (0usize..3, 250usize..262).prop_map(|(c, n)| ["a", "a.", "*."][c].repeat(n)[..n].to_owned()),
    ]
}

/// Mostly requests that succeed and interact (shared topics, ids and
/// groups), sometimes anything.
fn publish_request() -> impl Strategy<Value = pb::PublishRequest> {
    let good = (
        proptest::sample::select(&["a", "a.b", "b", "a.b.c", "_dlq.g"][..]),
        0usize..40,
    )
        .prop_map(|(topic, len)| pb::PublishRequest {
            topic: topic.into(),
            payload: vec![b'p'; len].into(),
            headers: Default::default(),
        });
    prop_oneof![4 => good, 1 => any_publish_request()]
}

fn any_publish_request() -> impl Strategy<Value = pb::PublishRequest> {
    (
        topicish(),
        prop_oneof![Just(0usize), 0usize..3000],
        proptest::collection::hash_map("[a-c]{0,2}", "[x-z]{0,3}", 0..3),
    )
        .prop_map(|(topic, len, headers)| pb::PublishRequest {
            topic,
            payload: vec![b'p'; len].into(),
            headers,
        })
}

fn open_request() -> impl Strategy<Value = pb::OpenSubscriptionRequest> {
    let pattern = proptest::sample::select(&["a", "a.*", "a.>", ">", "b", "*", "_dlq.>"][..]);
    let good = (
        proptest::collection::vec(pattern, 1..3),
        0i32..3,
        proptest::sample::select(&["", "s1", "s2", "s3", "s4"][..]),
        proptest::sample::select(&["g", "h"][..]),
        prop_oneof![1 => 0i32..2, 2 => Just(2)],
        0u32..4,
        prop_oneof![Just(0u32), 1u32..100],
    )
        .prop_map(
            |(patterns, mode, id, group, ack_mode, max_in_flight, ack_deadline_ms)| {
                // Groups share one pattern set per name, so that members join.
                let group_patterns = if group == "g" {
                    vec!["a.>".to_owned()]
                } else {
                    vec![">".to_owned()]
                };
                pb::OpenSubscriptionRequest {
                    topic_patterns: if mode == 2 {
                        group_patterns
                    } else {
                        patterns.into_iter().map(str::to_owned).collect()
                    },
                    mode,
                    subscription_id: id.into(),
                    consumer_group: if mode == 2 { group.into() } else { String::new() },
                    ack_mode,
                    max_in_flight,
                    ack_deadline_ms,
                }
            },
        );
    prop_oneof![4 => good, 1 => any_open_request()]
}

fn any_open_request() -> impl Strategy<Value = pb::OpenSubscriptionRequest> {
    (
        proptest::collection::vec(topicish(), 0..4),
        prop_oneof![4 => 0i32..3, 1 => any::<i32>()],
        prop_oneof![Just(String::new()), "s[12]", "[ -~]{0,6}"],
        prop_oneof![Just(String::new()), "[gh]", "[ -~]{0,6}"],
        prop_oneof![4 => 0i32..3, 1 => any::<i32>()],
        prop_oneof![0u32..4, any::<u32>()],
        prop_oneof![Just(0u32), 1u32..5000, any::<u32>()],
    )
        .prop_map(
            |(topic_patterns, mode, subscription_id, consumer_group, ack_mode, max_in_flight, ack_deadline_ms)| {
                pb::OpenSubscriptionRequest {
                    topic_patterns,
                    mode,
                    subscription_id,
                    consumer_group,
                    ack_mode,
                    max_in_flight,
                    ack_deadline_ms,
                }
            },
        )
}

#[derive(Debug, Clone)]
enum Request {
    Open(pb::OpenSubscriptionRequest),
    Publish(pb::PublishRequest),
    PublishStream(Vec<pb::PublishRequest>),
    /// Publishes on one session (ids may repeat); batched deliveries.
    SessionPublish(Vec<pb::SessionPublish>, bool),
    Ack(String, Vec<u64>),
    Nack(String, Vec<u64>),
    /// Ack or nack some of what the member holds (by index).
    AckHeld(String, Vec<usize>, bool),
    Close(String),
    PollAll,
    ExpireAll,
}

fn id() -> impl Strategy<Value = String> {
    prop_oneof![1 => Just(String::new()), 6 => "s[1-4]", 1 => "[ -~]{0,6}"]
}

fn sequences() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(prop_oneof![0u64..20, any::<u64>()], 0..4)
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        3 => open_request().prop_map(Request::Open),
        4 => publish_request().prop_map(Request::Publish),
        1 => proptest::collection::vec(publish_request(), 0..5).prop_map(Request::PublishStream),
        2 => (
            proptest::collection::vec((0u64..3, proptest::collection::vec(publish_request(), 0..20)), 0..4),
            any::<bool>(),
        )
            .prop_map(|(publishes, batched)| Request::SessionPublish(
                publishes
                    .into_iter()
                    .map(|(id, messages)| pb::SessionPublish { id, messages })
                    .collect(),
                batched
            )),
        1 => (id(), sequences()).prop_map(|(i, s)| Request::Ack(i, s)),
        1 => (id(), sequences()).prop_map(|(i, s)| Request::Nack(i, s)),
        3 => (id(), proptest::collection::vec(0usize..8, 1..4), any::<bool>())
            .prop_map(|(i, s, nack)| Request::AckHeld(i, s, nack)),
        1 => id().prop_map(Request::Close),
        4 => Just(Request::PollAll),
        1 => Just(Request::ExpireAll),
    ]
}

/// Runs a property under a timeout with [`config`].
fn property<S: Strategy + Send + 'static>(name: &'static str, strategy: S, test: fn(S::Value))
where
    S::Value: std::fmt::Debug,
{
    with_timeout(name, move || {
        // A fixed seed: the same cases on every run (raise PROPTEST_CASES
        // to explore further), so that CI is reproducible.
        let rng = proptest::test_runner::TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha);
        let mut runner = proptest::test_runner::TestRunner::new_with_rng(config(), rng);
        let result = runner.run(&strategy, |value| {
            test(value);
            Ok(())
        });
        if let Err(e) = result {
            panic!("{name}: {e}");
        }
    });
}

#[test]
fn any_string_passes_the_topic_checks() {
    property("any string", any::<String>(), |s| checks::check_topic_str(&s));
}

#[test]
fn topicish_string_sets_pass_the_topic_checks() {
    property(
        "topic-like sets",
        proptest::collection::vec(topicish(), 1..8),
        |parts| checks::check_topic_input(parts.join("\n").as_bytes()),
    );
}

#[test]
fn any_bytes_pass_the_request_checks() {
    property("any bytes", proptest::collection::vec(any::<u8>(), 0..2048), |data| {
        checks::check_request_input(&data)
    });
}

#[test]
fn request_structs_pass_the_model_checks() {
    let strategy = (any::<[u8; 7]>(), proptest::collection::vec(request(), 1..60));
    property("request structs", strategy, |(config, requests)| {
        let config = checks::FuzzConfig {
            consumer_capacity: config[0],
            group_capacity: config[1],
            default_max_in_flight: config[2],
            max_delivery_attempts: config[3],
            max_subscriptions: config[4],
            max_message_bytes: u16::from(config[5]) * 16,
            max_batch_messages: config[6],
        };
        checks::block_on(async move {
            let mut h = checks::Harness::new(config.limits());
            for request in requests {
                match request {
                    Request::Open(r) => h.open(r).await,
                    Request::Publish(r) => h.publish(r).await,
                    Request::PublishStream(r) => h.publish_stream(r).await,
                    Request::SessionPublish(p, batched) => h.session_publish(p, batched).await,
                    Request::Ack(id, s) => h.ack(id, s).await,
                    Request::Nack(id, s) => h.nack(id, s).await,
                    Request::AckHeld(id, picks, nack) => {
                        let held = h.held(&id);
                        let seqs: Vec<u64> = picks
                            .iter()
                            .filter_map(|i| held.get(i % held.len().max(1)).copied())
                            .collect();
                        if nack {
                            h.nack(id, seqs).await
                        } else {
                            h.ack(id, seqs).await
                        }
                    }
                    Request::Close(id) => h.admin_close(id).await,
                    Request::PollAll => h.poll_all().await,
                    Request::ExpireAll => h.expire_all().await,
                }
                h.check_admin().await;
            }
            h.check_metrics();
            h.finish().await;
        });
    });
    let seen = checks::coverage::report();
    println!("model coverage: {seen:?}");
    for (what, n) in seen {
        assert!(n > 0, "no case exercised {what}: {:?}", checks::coverage::report());
    }
}
