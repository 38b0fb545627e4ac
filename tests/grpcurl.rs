//! The README's grpcurl examples against a real broker, with the real grpcurl
//! (reflection only, no .proto files). `.ci/run` installs grpcurl and sets
//! `TB_REQUIRE_TEST_TOOLS=1`, which turns a missing grpcurl into a failure.

mod common;

use common::process::ChildGuard;
use common::*;
use std::io::{BufRead, BufReader};
use std::process::Command;

/// `grpcurl -plaintext FLAGS ADDR ARGS`.
fn grpcurl(addr: &str, flags: &[&str], args: &[&str]) -> (bool, String) {
    let output = Command::new("grpcurl")
        .arg("-plaintext")
        .args(flags)
        .arg(addr)
        .args(args)
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_grpcurl_examples_work() {
    if !grpcurl_available() {
        return;
    }
    timeout(async {
        let broker = start().await;
        let addr = broker.grpc_addr.to_string();

        let (ok, list) = grpcurl(&addr, &[], &["list"]);
        assert!(ok, "{list}");
        for service in ["tinybroker.v1.Broker", "tinybroker.v1.Admin", "grpc.health.v1.Health"] {
            assert!(list.lines().any(|l| l == service), "{service} in {list}");
        }
        let (ok, described) = grpcurl(&addr, &[], &["describe", "tinybroker.v1.Broker"]);
        assert!(ok, "{described}");
        for rpc in ["Publish", "PublishStream", "OpenSubscription", "Ack", "Nack"] {
            assert!(described.contains(&format!("rpc {rpc} ")), "{rpc} in {described}");
        }
        let (ok, described) = grpcurl(&addr, &[], &["describe", "tinybroker.v1.OpenSubscriptionRequest"]);
        assert!(ok && described.contains("topic_patterns"), "{described}");

        let mut subscriber = ChildGuard::spawn(
            Command::new("grpcurl")
                .args(["-plaintext", "-d", r#"{"topic_patterns": ["deploy.*"]}"#, &addr])
                .arg("tinybroker.v1.Broker/OpenSubscription"),
        );
        let stdout = subscriber.child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut object = String::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                object.push_str(&line);
                if line == "}" {
                    let _ = tx.send(std::mem::take(&mut object));
                }
            }
        });
        let publish = r#"{"topic": "deploy.rollout", "payload": "aGVsbG8=", "headers": {"team": "web"}}"#;
        let received = loop {
            let (ok, out) = grpcurl(&addr, &["-d", publish], &["tinybroker.v1.Broker/Publish"]);
            assert!(ok, "{out}");
            let response: serde_json::Value = serde_json::from_str(&out).unwrap();
            if response["matchedSubscriptions"] == 1 {
                break rx.recv_timeout(std::time::Duration::from_secs(20)).unwrap();
            }
        };
        subscriber.kill();
        let message: serde_json::Value = serde_json::from_str(&received).unwrap();
        assert_eq!(message["topic"], "deploy.rollout");
        assert_eq!(message["payload"], "aGVsbG8=");
        assert_eq!(message["headers"]["team"], "web");
        assert_eq!(message["deliveryAttempt"], 1);

        let (ok, health) = grpcurl(
            &addr,
            &["-d", r#"{"service": "tinybroker.v1.Broker"}"#],
            &["grpc.health.v1.Health/Check"],
        );
        assert!(ok && health.contains("SERVING"), "{health}");

        let (ok, info) = grpcurl(&addr, &[], &["tinybroker.v1.Admin/GetBrokerInfo"]);
        assert!(ok && info.contains(env!("CARGO_PKG_VERSION")), "{info}");
        let (ok, groups) = grpcurl(&addr, &[], &["tinybroker.v1.Admin/ListConsumerGroups"]);
        assert!(ok, "{groups}");

        let (ok, error) = grpcurl(
            &addr,
            &["-d", r#"{"topic": "bad topic"}"#],
            &["tinybroker.v1.Broker/Publish"],
        );
        assert!(!ok);
        assert!(
            error.contains("InvalidArgument") && error.contains("bad topic"),
            "{error}"
        );
    })
    .await
}
