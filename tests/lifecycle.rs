//! Health, reflection, readiness, graceful shutdown (in-process and of the
//! real binary on SIGTERM) and start-up configuration errors.

mod common;

use common::process::BrokerProcess;
use common::*;
use std::process::Command;
use std::time::Duration;
use tinybroker::config::{Config, Limits};
use tinybroker::pb;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

async fn health_status(channel: tonic::transport::Channel, service: &str) -> Result<ServingStatus, tonic::Status> {
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await?;
    Ok(response.into_inner().status())
}

#[tokio::test]
async fn health_is_serving_for_the_server_and_the_broker_service() {
    timeout(async {
        let broker = start().await;
        let channel = broker.channel().await;
        for service in ["", "tinybroker.v1.Broker"] {
            assert_eq!(
                health_status(channel.clone(), service).await.unwrap(),
                ServingStatus::Serving
            );
        }
        let err = health_status(channel, "no.such.Service").await.unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert_eq!(broker.http_get("/healthz").await.0, 200);
        assert_eq!(broker.http_get("/readyz").await.0, 200);
    })
    .await
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_every_service() {
    use tonic_reflection::pb::{v1, v1alpha};
    timeout(async {
        let broker = start().await;
        let expected = ["grpc.health.v1.Health", "tinybroker.v1.Admin", "tinybroker.v1.Broker"];

        let mut client = v1::server_reflection_client::ServerReflectionClient::new(broker.channel().await);
        let request = v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut responses = client
            .server_reflection_info(futures::stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let response = responses.message().await.unwrap().unwrap();
        let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
            response.message_response
        else {
            panic!("unexpected reflection answer");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        for name in expected {
            assert!(names.iter().any(|n| n == name), "v1 lists {name}: {names:?}");
        }

        let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(broker.channel().await);
        let request = v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol("tinybroker.v1.Broker".into()),
            ),
        };
        let mut responses = client
            .server_reflection_info(futures::stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let response = responses.message().await.unwrap().unwrap();
        let Some(v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(files)) =
            response.message_response
        else {
            panic!("v1alpha must describe tinybroker.v1.Broker");
        };
        assert!(!files.file_descriptor_proto.is_empty());
    })
    .await
}

#[tokio::test]
async fn shutdown_refuses_new_work_drains_then_ends_streams() {
    timeout(async {
        let mut broker = start_with(Config {
            limits: Limits {
                consumer_capacity: 100_000,
                ..Limits::default()
            },
            shutdown_grace: Duration::from_secs(3),
            ..config()
        })
        .await;
        // A subscriber that doesn't read keeps messages queued past its
        // HTTP/2 window, so the drain has to wait out the grace period.
        let mut stalled_client = pb::broker_client::BrokerClient::new(broker.narrow_channel().await);
        let (mut stalled, _) = subscribe(&mut stalled_client, &["busy"]).await;
        let mut client = broker.client().await;
        let pad = "z".repeat(300);
        let requests: Vec<_> = (0..3000)
            .map(|i| publish_request("busy", &format!("{i} {pad}")))
            .collect();
        client.publish_stream(futures::stream::iter(requests)).await.unwrap();
        let queued = broker.subscriptions().await[0].queue_depth;
        assert!(queued > 2000, "most of the 3,000 wait in the broker's queue: {queued}");

        broker.trigger_shutdown();
        let channel = broker.channel().await;
        wait_until("health to go NOT_SERVING", || {
            let channel = channel.clone();
            async move { health_status(channel, "").await.ok() == Some(ServingStatus::NotServing) }
        })
        .await;
        assert_eq!(
            health_status(channel.clone(), "tinybroker.v1.Broker").await.unwrap(),
            ServingStatus::NotServing
        );
        assert_eq!(broker.http_get("/readyz").await.0, 503);
        assert_eq!(broker.http_get("/healthz").await.0, 200);
        let err = client.publish(publish_request("busy", "late")).await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);
        assert!(err.message().contains("shutting down"), "{}", err.message());
        let err = client.open_subscription(subscribe_request(&["x"])).await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);

        // Reading now drains what was queued: all 3,000, in order; then the
        // stream ends with OK, saying shutdown and that nothing was dropped.
        let mut received = 0;
        while let Some(m) = stalled.message().await.expect("stream ends with OK") {
            assert_eq!(m.payload, format!("{received} {pad}").into_bytes());
            received += 1;
        }
        assert_eq!(received, 3000, "the drain delivers every queued message");
        let trailers = stalled.trailers().await.unwrap().expect("trailers");
        assert_eq!(trailers.get("tinybroker-end-reason").unwrap(), "shutdown");
        assert_eq!(trailers.get("tinybroker-dropped").unwrap(), "0");
        broker.join().await;
    })
    .await
}

#[tokio::test]
async fn idle_publish_streams_end_when_shutdown_begins() {
    timeout(async {
        let mut broker = start().await;
        let mut client = broker.client().await;
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::PublishRequest>(1);
        tx.send(publish_request("a", "1")).await.unwrap();
        let call = tokio::spawn(async move {
            client
                .publish_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        });
        let mut sub_client = broker.client().await;
        let (mut stream, _) = subscribe(&mut sub_client, &["never"]).await;
        broker.trigger_shutdown();
        let err = call.await.unwrap().unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);
        assert!(err.message().contains("1 messages"), "{}", err.message());
        assert!(stream.message().await.unwrap().is_none(), "subscription ends cleanly");
        broker.join().await;
        drop(tx);
    })
    .await
}

#[tokio::test]
async fn sigterm_ends_streams_and_the_binary_exits_zero() {
    timeout(async {
        let mut process = BrokerProcess::spawn(&[("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "5")]);
        let url = process.url();
        let mut client = pb::broker_client::BrokerClient::connect(url).await.unwrap();
        let (mut stream, _) = subscribe(&mut client, &["t.>"]).await;
        client.publish(publish_request("t.1", "before")).await.unwrap();
        assert_eq!(&stream.message().await.unwrap().unwrap().payload[..], b"before");

        let status = Command::new("kill")
            .args(["-TERM", &process.guard.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        assert!(stream.message().await.expect("ends with OK").is_none());
        let exit = tokio::task::spawn_blocking(move || {
            let exit = process.wait_exit();
            (exit, process)
        })
        .await
        .unwrap();
        assert_eq!(exit.0.code(), Some(0), "exit status {:?}", exit.0);
    })
    .await
}

/// A SIGTERM the moment the broker says it started (an orchestrator or a
/// test that stops it at once) drains and exits 0: the handler is in place
/// before the listeners are bound, not when the shutdown future is first
/// polled (before, such a SIGTERM could kill the process outright, with no
/// drain and its clients' connections reset).
#[test]
fn a_sigterm_right_after_start_up_drains_and_exits_zero() {
    for attempt in 0..10 {
        let mut process = BrokerProcess::spawn(&[("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "5")]);
        // SAFETY: kill(2) on our own child's pid.
        let sent = unsafe { libc::kill(process.guard.pid() as i32, libc::SIGTERM) };
        assert_eq!(sent, 0);
        let exit = process.wait_exit();
        assert_eq!(exit.code(), Some(0), "attempt {attempt}: exit status {exit:?}");
    }
}

#[test]
fn a_bad_variable_stops_start_up_with_one_line_naming_it() {
    let output = Command::new(env!("CARGO_BIN_EXE_tinybroker"))
        .env("TINYBROKER_CONSUMER_CAPACITY", "0")
        .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
        .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("TINYBROKER_CONSUMER_CAPACITY=\"0\""), "{stderr}");
    assert!(stderr.contains("greater than 0"), "{stderr}");

    let output = Command::new(env!("CARGO_BIN_EXE_tinybroker"))
        .env("TINYBROKER_GRPC_ADDR", "not-an-address")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("TINYBROKER_GRPC_ADDR=\"not-an-address\""), "{stderr}");
}

#[test]
fn a_bad_worker_thread_count_stops_start_up_with_one_line_naming_it() {
    for value in ["0", "two", "-1", "100000"] {
        let output = Command::new(env!("CARGO_BIN_EXE_tinybroker"))
            .env("TOKIO_WORKER_THREADS", value)
            .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{value}: {:?}", output.status);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{value}: {stderr}");
        assert!(
            stderr.contains(&format!("TOKIO_WORKER_THREADS=\"{value}\"")),
            "{value}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{value}: {stderr}");
    }
}

#[tokio::test]
async fn one_worker_thread_serves() {
    timeout(async {
        let process = BrokerProcess::spawn(&[("TOKIO_WORKER_THREADS", "1")]);
        let url = process.url();
        let out = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_tinybroker"))
                .args(["publish", "deploy.one", "hello", "--addr", &url])
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.starts_with("sequence=1"), "{stdout}");
    })
    .await
}

#[test]
fn an_address_in_use_is_named_at_start_up() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let output = Command::new(env!("CARGO_BIN_EXE_tinybroker"))
        .env("TINYBROKER_GRPC_ADDR", &addr)
        .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&format!("TINYBROKER_GRPC_ADDR={addr}")), "{stderr}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let process = BrokerProcess::spawn(&[("TINYBROKER_LOG_FORMAT", "json")]);
    let line = &process.started;
    let value: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(value["level"], "INFO");
    assert_eq!(value["message"], "tinybroker started");
    assert!(value["grpc_addr"].as_str().unwrap().starts_with("127.0.0.1:"), "{line}");
    assert_eq!(value["consumer_capacity"], 1024);
}

#[tokio::test]
async fn a_memberless_groups_backlog_does_not_hold_shutdown_for_the_grace_period() {
    timeout(async {
        let broker = start_with(Config {
            shutdown_grace: Duration::from_secs(30),
            ..config()
        })
        .await;
        let mut client = broker.client().await;
        let (member, _) = open(&mut client, member_request(&["idle.>"], "sleepers", false, 0)).await;
        drop(member);
        wait_until("the member has left", || async {
            broker.group("sleepers").await.is_some_and(|g| g.members == 0)
        })
        .await;
        for i in 0..3 {
            client
                .publish(publish_request(&format!("idle.{i}"), "x"))
                .await
                .unwrap();
        }
        assert_eq!(broker.group("sleepers").await.unwrap().backlog, 3);
        // Nothing can drain that backlog, so shutdown must not wait 30 s for it.
        let stopped = tokio::time::timeout(Duration::from_secs(10), broker.stop()).await;
        assert!(stopped.is_ok(), "shutdown waited for a backlog no member can take");
    })
    .await
}

/// The shutdown WARN names what it discarded, kind by kind, and its counts
/// add up to `tinybroker_messages_discarded_on_shutdown_total`: 4 queued
/// for a broadcast subscriber that reads no further (a session
/// subscription whose credit of 1 is spent), 3 in the backlog of a group
/// without members and 1 in the backlog of a group whose only member is
/// full, and 2 in flight to that MANUAL member, which holds them unacked
/// (once named "the backlogs of consumer groups without members").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_warning_names_each_kind_discarded_with_counts_that_add_up_to_the_metric() {
    use common::process::{exit_status, line_containing, metric_sum};
    use common::session::TestSession;
    timeout(async {
        let mut broker = BrokerProcess::spawn(&[("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1")]);
        let url = broker.url();
        let mut client = pb::broker_client::BrokerClient::connect(url.clone()).await.unwrap();
        let mut session = TestSession::start(&mut client).await;
        let reader = session.open_and_wait(1, subscribe_request(&["queued.>"]), 1).await;
        let (idle, _) = open(&mut client, member_request(&["idle.>"], "idle", false, 0)).await;
        drop(idle);
        let (mut holder, holder_id) = open(&mut client, member_request(&["held.>"], "held", true, 2)).await;
        let mut admin = pb::admin_client::AdminClient::connect(url.clone()).await.unwrap();
        wait_until("the idle group to have no member", || {
            let mut admin = admin.clone();
            async move {
                groups(&mut admin)
                    .await
                    .iter()
                    .any(|g| g.name == "idle" && g.members == 0)
            }
        })
        .await;
        for (topic, n) in [("queued.x", 5), ("idle.x", 3), ("held.x", 3)] {
            for i in 0..n {
                client.publish(publish_request(topic, &i.to_string())).await.unwrap();
            }
        }
        for _ in 0..2 {
            tokio::time::timeout(TEST_TIMEOUT, holder.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
        // As the broker lists it before the SIGTERM.
        let listed = |admin: &mut pb::admin_client::AdminClient<tonic::transport::Channel>| {
            let mut admin = admin.clone();
            let (reader, holder_id, url) = (reader.clone(), holder_id.clone(), url.clone());
            async move {
                let groups = groups(&mut admin).await;
                let group = |name: &str| groups.iter().find(|g| g.name == name).map(|g| (g.backlog, g.in_flight));
                let subscriptions = subscriptions(&url).await;
                let depth = |id: &str| {
                    subscriptions
                        .iter()
                        .find(|s| s.subscription_id == id)
                        .map(|s| s.queue_depth)
                };
                group("idle") == Some((3, 0))
                    && group("held") == Some((1, 2))
                    && depth(&reader) == Some(4)
                    && depth(&holder_id) == Some(0)
            }
        };
        wait_until("4 queued, 3 + 1 in backlogs and 2 in flight", || listed(&mut admin)).await;

        broker.guard.signal("TERM");
        let (warning, _) = line_containing(&broker.log, "discarded", Duration::from_secs(10)).await;
        // /metrics answers a little longer after a shutdown that discarded.
        let metric = metric_sum(
            &scrape(broker.metrics_addr).await,
            "tinybroker_messages_discarded_on_shutdown_total",
        );
        assert!(warning.contains("WARN"), "{warning}");
        for kind in [
            "4 queued for broadcast subscribers",
            "4 in consumer-group backlogs",
            "2 in flight to group members",
        ] {
            assert!(warning.contains(kind), "the warning names {kind:?}: {warning}");
        }
        for field in [
            "queued_broadcast=4",
            "group_backlog=4",
            "in_flight_to_members=2",
            "discarded=10",
        ] {
            assert!(warning.contains(field), "the warning has {field}: {warning}");
        }
        assert_eq!(metric, 10.0, "the kinds add up to the metric: {warning}");
        let exit = exit_status(&mut broker.guard, Duration::from_secs(30)).await;
        assert_eq!(exit.code(), Some(0), "{exit:?}");
        drop(session);
    })
    .await
}
