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
    for sub in [
        &["--help"][..],
        &["serve", "--help"],
        &["publish", "--help"],
        &["subscribe", "--help"],
    ] {
        let (status, text, _) = run_cli(sub, &[]);
        assert!(status.success(), "{sub:?}");
        assert!(text.contains("Usage:"), "{text}");
    }
    let (_, text, _) = run_cli(&["subscribe", "--help"], &[]);
    for flag in ["--group", "--manual-ack", "--json", "--addr"] {
        assert!(text.contains(flag), "{flag} in {text}");
    }
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
