//! The README's grpcurl examples against a real broker, with the real grpcurl
//! (reflection only, no .proto files). Without grpcurl the tests fail,
//! saying how to install it (`.ci/run` does).

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
    require_grpcurl();
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

/// README's grpcurl session, the block as README shows it (only the
/// address and the pause before the close changed): two subscriptions on
/// one session, their messages tagged with their handles, handle 1 closed,
/// then the end of stdin ends handle 2 and the session, and grpcurl exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_grpcurl_session_opens_two_subscriptions_and_closes_them() {
    require_grpcurl();
    timeout(async {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
        let lines: Vec<&str> = readme.lines().collect();
        let first = lines
            .iter()
            .position(|l| l.starts_with("{ echo '{\"open\": {\"handle\": 1,"))
            .expect("README's session example");
        let last = first
            + lines[first..]
                .iter()
                .position(|l| l.ends_with("tinybroker.v1.Broker/Session"))
                .expect("the end of README's session example");
        let block = lines[first..=last].join("\n");
        assert!(block.contains("sleep 30"), "{block}");
        let broker = start().await;
        let script = block
            .replace("localhost:50051", &broker.grpc_addr.to_string())
            .replace("sleep 30", "sleep 8");
        let mut session = ChildGuard::spawn(Command::new("sh").arg("-c").arg(&script));
        let stdout = session.child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
        std::thread::spawn(move || {
            let mut object = String::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                object.push_str(&line);
                if line == "}" {
                    let _ = tx.send(serde_json::from_str(&std::mem::take(&mut object)).unwrap());
                }
            }
        });
        let next = || {
            rx.recv_timeout(std::time::Duration::from_secs(20))
                .expect("a grpcurl event")
        };
        let mut ids = Vec::new();
        for handle in [1, 2] {
            let opened = next();
            assert_eq!(opened["opened"]["handle"], handle, "{opened}");
            ids.push(opened["opened"]["subscriptionId"].as_str().unwrap().to_owned());
        }
        let listed = broker.subscriptions().await;
        assert!(ids.iter().all(|id| listed.iter().any(|l| &l.subscription_id == id)));
        let mut client = broker.client().await;
        let deploy = client
            .publish(publish_request("deploy.rollout", "hello"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(deploy.matched_subscriptions, 2);
        let audit = client
            .publish(publish_request("audit.login", "hi"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(audit.matched_subscriptions, 1);
        // (handle, sequence) of each delivery, until handle 1 ends.
        let mut delivered = Vec::new();
        let ended = loop {
            let event = next();
            if !event["ended"].is_null() {
                break event;
            }
            let delivery = &event["delivery"];
            let sequence: u64 = delivery["message"]["sequence"].as_str().unwrap().parse().unwrap();
            for handle in delivery["handles"].as_array().unwrap() {
                delivered.push((handle.as_u64().unwrap(), sequence));
            }
        };
        delivered.sort_unstable();
        assert_eq!(
            delivered,
            [(1, deploy.sequence), (2, deploy.sequence), (2, audit.sequence)]
        );
        assert_eq!(ended["ended"]["handle"], 1, "{ended}");
        assert_eq!(ended["ended"]["reason"], "closed", "{ended}");
        let ended = next();
        assert_eq!(ended["ended"]["handle"], 2, "{ended}");
        assert_eq!(ended["ended"]["reason"], "closed", "{ended}");
        assert_eq!(ended["ended"]["lastSequence"], audit.sequence.to_string(), "{ended}");
        let status = common::process::exit_status(&mut session, TEST_TIMEOUT).await;
        assert!(status.success(), "grpcurl exits 0: the session ended with OK");
    })
    .await
}
