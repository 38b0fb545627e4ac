//! What makes a replica serve, or refuse to: without NATS it is not
//! SERVING and says why, then serves once NATS comes; a NATS server older
//! than 2.10, or a message limit above NATS's max_payload, stops it with
//! one line naming both; unset, the limit is what max_payload carries; the
//! real binary's environment turns cluster mode on.

use crate::common;
use crate::common::nats::NatsCluster;
use crate::common::process::metric_sum;
use crate::common::*;
use crate::{replica_config, serving_status, wait_serving};
use std::time::Duration;
use tinybroker::pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nats_a_replica_is_not_serving_and_says_why_then_serves_when_nats_comes() {
    let mut nats = NatsCluster::start(1).await;
    rejoin_timeout(async {
        nats.stop(0).await;
        let mut config = replica_config(nats.urls(), "alone", "late");
        if let Some(c) = config.cluster.as_mut() {
            c.nats_replicas = 1;
        }
        let broker = start_with(config).await;
        wait_until("health NOT_SERVING", || async {
            serving_status(&broker).await == Some(ServingStatus::NotServing)
        })
        .await;
        let err = broker
            .client()
            .await
            .publish(publish_request("a.b", "x"))
            .await
            .expect_err("refused while NATS is down");
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        assert!(err.message().contains("NATS"), "{}", err.message());
        let (_, metrics) = broker.http_get("/metrics").await;
        assert_eq!(metric_sum(&metrics, "tinybroker_nats_connected"), 0.0, "{metrics}");

        nats.restart(0).await;
        wait_serving(&broker).await;
        let info = broker
            .admin()
            .await
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(info.cluster_mode);
        assert_eq!(info.replica_id, "alone");
        assert!(!info.nats_server.is_empty());
        let (_, metrics) = broker.http_get("/metrics").await;
        assert_eq!(metric_sum(&metrics, "tinybroker_nats_connected"), 1.0, "{metrics}");
    })
    .await;
}

/// The real binary, as a pod runs it: a message limit above what NATS
/// carries stops the replica when it connects, with one line naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_limit_above_the_nats_max_payload_stops_the_replica() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let mut replica = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", nats.url(0).as_str()),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_REPLICA_ID", "too-big"),
            ("TINYBROKER_MAX_MESSAGE_BYTES", "4194304"),
        ]);
        // async-nats logs the server's max_payload too, on its own
        // schedule: wait for the replica's own line, which names the variable.
        let line = replica.line_containing("TINYBROKER_MAX_MESSAGE_BYTES=4194304");
        assert!(line.contains("max_payload"), "{line}");
        assert!(line.contains("1048576"), "{line}");
        let status = tokio::task::spawn_blocking(move || replica.wait_exit()).await.unwrap();
        assert!(!status.success(), "{status:?}");
    })
    .await;
}

/// Debian 12's nats-server (2.9.10): `TB_OLD_NATS_SERVER`, or
/// `/usr/sbin/nats-server` when it is older than 2.10. Panics, saying how to
/// install it, when there is none.
fn old_nats_server() -> std::path::PathBuf {
    let path = std::env::var_os("TB_OLD_NATS_SERVER")
        .filter(|p| !p.is_empty())
        .map_or_else(|| std::path::PathBuf::from("/usr/sbin/nats-server"), Into::into);
    let version = std::process::Command::new(&path)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    assert!(
        version
            .as_ref()
            .is_some_and(|v| v.contains("v2.9.") || v.contains("v2.8.")),
        "this test needs a nats-server older than 2.10 at {} (apt-get install nats-server on Debian 12, \
         or TB_OLD_NATS_SERVER=<path>; .ci/run installs it); found {version:?}",
        path.display()
    );
    path
}

/// docs/contract.md, "Cluster mode": a NATS server older than 2.10 makes
/// the replica exit when it connects, with one line naming the version it
/// found and 2.10 (not a JetStream decode error, retried for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_older_than_2_10_stops_the_replica_naming_both_versions() {
    let old = old_nats_server();
    timeout(async {
        let port = common::process::free_port();
        let dir = std::env::temp_dir().join(format!("tb-old-nats-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).unwrap();
        let _nats = common::process::ChildGuard::spawn(std::process::Command::new(&old).args([
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-sd",
            dir.to_str().unwrap(),
        ]));
        wait_until("the old nats-server to accept connections", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
        })
        .await;
        let url = format!("nats://127.0.0.1:{port}");
        let mut replica = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", url.as_str()),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_REPLICA_ID", "old-nats"),
        ]);
        let line = replica.line_containing("2.9.");
        assert!(line.contains("ERROR"), "{line}");
        assert!(line.contains("2.10"), "{line}");
        let status = tokio::task::spawn_blocking(move || {
            let status = replica.wait_exit();
            (status, replica.drain_lines())
        })
        .await
        .unwrap();
        assert!(!status.0.success(), "{status:?}");
        assert!(
            status.1.iter().all(|l| !l.contains("untagged enum")),
            "no JetStream decode error: {:#?}",
            status.1
        );
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await;
}

/// docs/contract.md, "Cluster mode": with TINYBROKER_MAX_MESSAGE_BYTES
/// unset, default NATS (max_payload 1 MiB) and default tinybroker work
/// together without a warning: the replica takes the largest message
/// max_payload carries once encoded, says the figure at INFO once, and
/// GetBrokerInfo reports it; a message of that size reaches a subscriber
/// and a group member on the other replica, one byte more is refused
/// naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_message_limit_is_what_the_nats_max_payload_carries() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let prefix = format!("limit{}", unique());
        let spawn = |id: &str| {
            common::process::BrokerProcess::spawn(&[
                ("TINYBROKER_NATS_URL", nats.url(0).as_str()),
                ("TINYBROKER_NATS_PREFIX", prefix.as_str()),
                ("TINYBROKER_NATS_REPLICAS", "1"),
                ("TINYBROKER_REPLICA_ID", id),
            ])
        };
        let a = spawn("limit-a");
        let b = spawn("limit-b");
        let mut said = Vec::new();
        for replica in [&a, &b] {
            let mut lines = replica.before_start.clone();
            lines.push(replica.started.clone());
            loop {
                let line = replica.line_containing("");
                let serving = line.contains("SERVING");
                lines.push(line);
                if serving {
                    break;
                }
            }
            // async-nats says max_payload when it connects too.
            let payload_lines: Vec<&String> = lines
                .iter()
                .filter(|l| l.contains("max_payload") && l.contains("tinybroker"))
                .collect();
            assert_eq!(payload_lines.len(), 1, "one line about max_payload: {lines:#?}");
            assert!(payload_lines[0].contains("INFO"), "{}", payload_lines[0]);
            assert!(lines.iter().all(|l| !l.contains("WARN")), "no warning: {lines:#?}");
            said.push(common::process::field(payload_lines[0], "max_message_bytes"));
        }
        let connect = |url: String| async move {
            tonic::transport::Endpoint::from_shared(url)
                .unwrap()
                .connect()
                .await
                .unwrap()
        };
        let (channel_a, channel_b) = (connect(a.url()).await, connect(b.url()).await);
        let info = pb::admin_client::AdminClient::new(channel_a.clone())
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        let limit = info.limits.unwrap().max_message_bytes as usize;
        assert_eq!(
            said,
            [limit.to_string(), limit.to_string()],
            "the figure said is the one in force"
        );
        assert!(limit < 1 << 20 && limit > (1 << 20) - 4096, "{limit}");

        let mut subscriber = pb::broker_client::BrokerClient::new(channel_b.clone());
        let mut broadcast = subscriber
            .open_subscription(subscribe_request(&["big.*"]))
            .await
            .unwrap()
            .into_inner();
        let mut member = subscriber
            .open_subscription(member_request(&["big.*"], "bigs", false, 4))
            .await
            .unwrap()
            .into_inner();
        let mut publisher = pb::broker_client::BrokerClient::new(channel_a);
        // The other replica's subscription is known once a message reaches it.
        loop {
            publisher.publish(publish_request("big.probe", "probe")).await.unwrap();
            if tokio::time::timeout(Duration::from_millis(500), broadcast.message())
                .await
                .is_ok()
            {
                break;
            }
        }
        let largest = pb::PublishRequest {
            topic: "big.one".into(),
            payload: vec![7u8; limit].into(),
            headers: Default::default(),
        };
        let sent = publisher.publish(largest.clone()).await.unwrap().into_inner();
        for (what, stream) in [("broadcast", &mut broadcast), ("group member", &mut member)] {
            loop {
                let m = stream.message().await.unwrap().expect(what);
                if m.sequence == sent.sequence {
                    assert_eq!(m.payload.len(), limit, "{what}");
                    break;
                }
            }
        }
        let over = pb::PublishRequest {
            payload: vec![7u8; limit + 1].into(),
            ..largest
        };
        let refused = publisher.publish(over).await.unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains(&limit.to_string()), "{refused:?}");
    })
    .await;
}

/// The real binary's environment turns cluster mode on: GetBrokerInfo and
/// the log say so, and an unknown-variable warning names none of the
/// cluster variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_turns_cluster_mode_on() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let replica = common::process::BrokerProcess::spawn(&[
            ("TINYBROKER_NATS_URL", nats.url(0).as_str()),
            ("TINYBROKER_NATS_PREFIX", "envtest"),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_REPLICA_ID", "pod-a"),
        ]);
        assert!(
            replica.before_start.iter().all(|l| !l.contains("unknown")),
            "{:#?}",
            replica.before_start
        );
        replica.line_containing("SERVING");
        let channel = tonic::transport::Endpoint::from_shared(replica.url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let info = pb::admin_client::AdminClient::new(channel)
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(info.cluster_mode);
        assert_eq!(info.replica_id, "pod-a");
        assert!(info.nats_server.contains(':'), "{}", info.nats_server);
    })
    .await;
}
