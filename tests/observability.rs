//! Metrics, the Admin API and OpenTelemetry traces, against a real broker.

mod common;

use common::*;
use std::collections::HashMap;
use tinybroker::config::Limits;
use tinybroker::pb;
use tonic::Code;

/// Parses the Prometheus text exposition into `series → value`, failing on
/// any line that is not a comment or `name{labels} value`.
fn parse_exposition(text: &str) -> HashMap<String, f64> {
    let mut series = HashMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let metric = name.split('{').next().unwrap();
        assert!(
            metric
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        if let Some(labels) = name.strip_prefix(metric) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{line:?}"
            );
        }
        series.insert(name.to_owned(), value);
    }
    series
}

async fn series(broker: &TestBroker) -> HashMap<String, f64> {
    parse_exposition(&scrape(broker.metrics_addr).await)
}

fn value(series: &HashMap<String, f64>, name: &str) -> f64 {
    *series.get(name).unwrap_or_else(|| {
        let mut names: Vec<_> = series.keys().filter(|k| k.starts_with("tinybroker")).collect();
        names.sort();
        panic!("no series {name}; have {names:#?}")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_a_publish_evict_and_redeliver_scenario() {
    timeout(async {
        let broker = start_with_limits(Limits {
            consumer_capacity: 4,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let m = series(&broker).await;
        assert_eq!(value(&m, "tinybroker_messages_published_total"), 0.0);
        assert_eq!(value(&m, r#"tinybroker_build_info{version="0.1.0"}"#), 1.0);
        assert!(m.keys().any(|k| k.starts_with("process_resident_memory_bytes")));

        // Two unrouted publishes, then a reader that takes three messages.
        for _ in 0..2 {
            client.publish(publish_request("nobody.home", "x")).await.unwrap();
        }
        let (mut reader, reader_id) = subscribe(&mut client, &["m.*"]).await;
        for _ in 0..3 {
            client.publish(publish_request("m.a", "x")).await.unwrap();
        }
        for _ in 0..3 {
            reader.message().await.unwrap().unwrap();
        }
        // A stalled subscriber on a narrow connection is evicted.
        let mut stalled_client = pb::broker_client::BrokerClient::new(broker.narrow_channel().await);
        let (_stalled, stalled_id) = subscribe(&mut stalled_client, &["flood"]).await;
        let mut flooded = 0;
        while broker
            .admin()
            .await
            .list_evictions(pb::ListEvictionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .evictions
            .is_empty()
        {
            let requests: Vec<_> = (0..100).map(|_| publish_request("flood", &"f".repeat(4096))).collect();
            client.publish_stream(futures::stream::iter(requests)).await.unwrap();
            flooded += 100;
            assert!(flooded < 100_000, "never evicted");
        }
        // A manual-ack group member nacks once.
        let (mut member, member_id) = open(&mut client, member_request(&["g.*"], "grp", true, 4)).await;
        let published_at = std::time::Instant::now();
        client.publish(publish_request("g.1", "x")).await.unwrap();
        let first = member.message().await.unwrap().unwrap();
        client
            .nack(pb::NackRequest {
                subscription_id: member_id.clone(),
                sequences: vec![first.sequence],
            })
            .await
            .unwrap();
        let again = member.message().await.unwrap().unwrap();
        let redelivered_at = std::time::Instant::now();
        assert_eq!(again.delivery_attempt, 2);

        let published = (2 + 3 + flooded + 1) as f64;
        wait_until("the delivered counters to be flushed", || async {
            let m = series(&broker).await;
            m.get(r#"tinybroker_messages_delivered_total{mode="single"}"#) == Some(&2.0)
                && m.get(r#"tinybroker_messages_delivered_total{mode="multi"}"#)
                    .is_some_and(|v| *v >= 3.0)
        })
        .await;
        // The redelivered message has been unacked at least since it
        // arrived, and at most since it was first published.
        let unacked_at_least = redelivered_at.elapsed().as_secs_f64();
        let m = series(&broker).await;
        let unacked_at_most = published_at.elapsed().as_secs_f64();
        assert_eq!(value(&m, "tinybroker_messages_published_total"), published);
        // The two, plus flood messages published after the eviction.
        let unrouted = value(&m, "tinybroker_messages_unrouted_total");
        assert!((2.0..=2.0 + flooded as f64).contains(&unrouted), "{unrouted}");
        assert_eq!(value(&m, "tinybroker_evictions_total"), 1.0);
        assert!(value(&m, r#"tinybroker_messages_dropped_total{reason="evicted"}"#) >= 1.0);
        assert_eq!(
            value(&m, r#"tinybroker_messages_dropped_total{reason="group_overflow"}"#),
            0.0
        );
        assert_eq!(value(&m, r#"tinybroker_subscriptions{mode="multi"}"#), 1.0);
        assert_eq!(value(&m, r#"tinybroker_subscriptions{mode="single"}"#), 1.0);
        assert_eq!(value(&m, r#"tinybroker_redeliveries_total{consumer_group="grp"}"#), 1.0);
        assert_eq!(
            value(&m, r#"tinybroker_dead_lettered_total{consumer_group="grp"}"#),
            0.0
        );
        assert_eq!(
            value(&m, r#"tinybroker_consumer_group_members{consumer_group="grp"}"#),
            1.0
        );
        assert_eq!(
            value(&m, r#"tinybroker_consumer_group_in_flight{consumer_group="grp"}"#),
            1.0
        );
        assert_eq!(
            value(&m, r#"tinybroker_consumer_group_backlog{consumer_group="grp"}"#),
            0.0
        );
        let age = value(
            &m,
            r#"tinybroker_consumer_group_oldest_unacked_age_seconds{consumer_group="grp"}"#,
        );
        assert!(
            (unacked_at_least..=unacked_at_most).contains(&age),
            "oldest unacked age {age} s, expected {unacked_at_least} to {unacked_at_most} s"
        );
        assert_eq!(
            value(
                &m,
                &format!(r#"tinybroker_subscription_queue_depth{{consumer_group="",subscription_id="{reader_id}"}}"#)
            ),
            0.0
        );
        assert!(
            !m.keys()
                .any(|k| k.contains(&stalled_id) && !k.starts_with("tinybroker_recent_eviction_timestamp_seconds{")),
            "the evicted subscription's series are gone"
        );
        assert!(
            m.keys()
                .any(|k| k.starts_with("tinybroker_recent_eviction_timestamp_seconds{")
                    && k.contains(&format!(r#"subscription_id="{stalled_id}""#))
                    && k.contains(r#"topic_patterns="flood""#)),
            "it is named among the recent evictions"
        );
        assert_eq!(value(&m, "tinybroker_publish_duration_seconds_count"), published);
        assert!(value(&m, r#"tinybroker_delivery_lag_seconds_count{mode="multi"}"#) >= 3.0);
        // The two open subscriptions, plus the evicted one (full) while the
        // eviction is within the last two scrape intervals.
        let ratios = value(&m, "tinybroker_queue_fill_ratio_count");
        assert!(ratios == 2.0 || ratios == 3.0, "{ratios}");
        series(&broker).await;
        assert_eq!(value(&series(&broker).await, "tinybroker_queue_fill_ratio_count"), 2.0);
        assert_eq!(value(&m, "tinybroker_messages_discarded_on_shutdown_total"), 0.0);

        // Closing the reader and acking removes their traces.
        drop(reader);
        client
            .ack(pb::AckRequest {
                subscription_id: member_id,
                sequences: vec![first.sequence],
            })
            .await
            .unwrap();
        wait_until("the closed reader's series to disappear", || async {
            !series(&broker).await.keys().any(|k| k.contains(&reader_id))
        })
        .await;
        let m = series(&broker).await;
        assert_eq!(
            value(&m, r#"tinybroker_consumer_group_in_flight{consumer_group="grp"}"#),
            0.0
        );
        assert_eq!(value(&m, r#"tinybroker_subscriptions{mode="multi"}"#), 0.0);
    })
    .await
}

#[tokio::test]
async fn per_subscription_series_can_be_turned_off() {
    timeout(async {
        let broker = start_with(tinybroker::config::Config {
            metrics_per_subscription: false,
            ..config()
        })
        .await;
        let mut client = broker.client().await;
        let (_s, id) = subscribe(&mut client, &["a"]).await;
        let m = series(&broker).await;
        assert!(!m.keys().any(|k| k.contains(&id)));
        assert_eq!(value(&m, r#"tinybroker_queued_messages{mode="multi"}"#), 0.0);
    })
    .await
}

#[tokio::test]
async fn admin_lists_what_is_open_and_closes_subscriptions() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let mut admin = broker.admin().await;
        let mut request = subscribe_request(&["b.*", "a.>"]);
        request.subscription_id = "watcher".into();
        let (mut watcher, _) = open(&mut client, request).await;
        let (_member, member_id) = open(&mut client, member_request(&["jobs"], "workers", true, 7)).await;

        let subs = admin
            .list_subscriptions(pb::ListSubscriptionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .subscriptions;
        assert_eq!(subs.len(), 2);
        let w = subs.iter().find(|s| s.subscription_id == "watcher").unwrap();
        assert_eq!(w.topic_patterns, vec!["a.>", "b.*"]);
        assert_eq!(w.mode, pb::DeliveryMode::Multi as i32);
        assert_eq!(w.capacity, 1024);
        assert!(w.peer_address.starts_with("127.0.0.1:"), "{}", w.peer_address);
        assert!(w.opened_at.is_some());
        let m = subs.iter().find(|s| s.subscription_id == member_id).unwrap();
        assert_eq!((m.consumer_group.as_str(), m.capacity), ("workers", 7));
        assert_eq!(m.ack_mode, pb::AckMode::Manual as i32);

        let groups = common::groups(&mut admin).await;
        assert_eq!(groups.len(), 1);
        assert_eq!((groups[0].name.as_str(), groups[0].members), ("workers", 1));

        let info = admin
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(info.subscriptions, 2);
        let limits = info.limits.unwrap();
        assert_eq!((limits.consumer_capacity, limits.max_message_bytes), (1024, 1_048_576));
        assert_eq!(limits.shutdown_grace_seconds, 2);

        client.publish(publish_request("b.x", "before close")).await.unwrap();
        admin
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: "watcher".into(),
            })
            .await
            .unwrap();
        // Closing discards what was queued and ends the stream with OK.
        loop {
            match watcher.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => panic!("expected a clean end, got {e}"),
            }
        }
        let err = admin
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: "watcher".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert!(err.message().contains("watcher"), "{}", err.message());
    })
    .await
}

#[tokio::test]
async fn evictions_are_listed_with_id_patterns_depth_and_peer() {
    timeout(async {
        let broker = start_with_limits(Limits {
            consumer_capacity: 8,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let mut stalled_client = pb::broker_client::BrokerClient::new(broker.narrow_channel().await);
        let mut request = subscribe_request(&["slow.>"]);
        request.subscription_id = "laggard".into();
        let (_stalled, _) = open(&mut stalled_client, request).await;
        let mut admin = broker.admin().await;
        let eviction = loop {
            let requests: Vec<_> = (0..100).map(|_| publish_request("slow.x", &"s".repeat(4096))).collect();
            client.publish_stream(futures::stream::iter(requests)).await.unwrap();
            let evictions = common::evictions(&mut admin).await;
            if let Some(e) = evictions.into_iter().next() {
                break e;
            }
        };
        assert_eq!(eviction.subscription_id, "laggard");
        assert_eq!(eviction.topic_patterns, vec!["slow.>"]);
        assert_eq!(eviction.queue_depth, 8);
        assert!(eviction.last_delivered_sequence < eviction_sequence_bound(&mut client).await);
        assert!(eviction.peer_address.starts_with("127.0.0.1:"));
        assert!(eviction.evicted_at.is_some());
    })
    .await
}

/// A sequence no eviction can have seen yet.
async fn eviction_sequence_bound(client: &mut pb::broker_client::BrokerClient<tonic::transport::Channel>) -> u64 {
    client
        .publish(publish_request("bound", "x"))
        .await
        .unwrap()
        .into_inner()
        .sequence
}

mod otlp {
    //! A real OTLP/gRPC receiver that records the spans it is sent.
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
    use opentelemetry_proto::tonic::trace::v1::Span;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    pub struct Receiver {
        pub spans: Arc<Mutex<Vec<Span>>>,
    }

    #[tonic::async_trait]
    impl TraceService for Receiver {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let mut spans = self.spans.lock().unwrap();
            for resource in request.into_inner().resource_spans {
                for scope in resource.scope_spans {
                    spans.extend(scope.spans);
                }
            }
            Ok(tonic::Response::new(ExportTraceServiceResponse {
                partial_success: None,
            }))
        }
    }

    pub async fn start() -> (std::net::SocketAddr, Receiver) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = Receiver::default();
        let service = TraceServiceServer::new(receiver.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (addr, receiver)
    }
}

/// The real binary with span export to `otlp_addr` and `env`: the process
/// (stderr still read, so the broker never blocks on it) and its gRPC
/// address. Tracing is process-wide, hence a process of its own.
fn start_traced(otlp_addr: std::net::SocketAddr, env: &[(&str, &str)]) -> (common::process::ChildGuard, String) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = common::process::ChildGuard::new(
        Command::new(env!("CARGO_BIN_EXE_tinybroker"))
            .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp_addr}"))
            .env("OTEL_SERVICE_NAME", "tinybroker-test")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.child.stderr.take().unwrap()).lines();
    let started = loop {
        let line = lines.next().expect("broker log").unwrap();
        if line.contains("tinybroker started") {
            break line;
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let grpc_addr = started
        .split_whitespace()
        .find_map(|f| f.strip_prefix("grpc_addr="))
        .unwrap()
        .to_owned();
    (child, grpc_addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_spans_reach_an_otlp_receiver_parented_by_the_callers_traceparent() {
    use std::process::Command;
    timeout(async {
        let (otlp_addr, receiver) = otlp::start().await;
        let (mut child, grpc_addr) = start_traced(otlp_addr, &[]);
        let mut client = pb::broker_client::BrokerClient::connect(format!("http://{grpc_addr}"))
            .await
            .unwrap();
        let (mut stream, _) = subscribe(&mut client, &["traced"]).await;

        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let mut request = tonic::Request::new(publish_request("traced", "x"));
        request.metadata_mut().insert(
            "traceparent",
            format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap(),
        );
        client.publish(request).await.unwrap();
        let delivered = stream.message().await.unwrap().unwrap();
        let traceparent = &delivered.headers["traceparent"];
        assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
        assert!(
            !traceparent.contains("00f067aa0ba902b7"),
            "the publish span is the new parent"
        );

        // SIGTERM: spans are flushed before the process exits.
        Command::new("kill")
            .args(["-TERM", &child.pid().to_string()])
            .status()
            .unwrap();
        let status = common::process::exit_status(&mut child, TEST_TIMEOUT).await;
        assert!(status.success());
        let spans = receiver.spans.lock().unwrap().clone();
        let publish = spans.iter().find(|s| s.name == "publish").unwrap_or_else(|| {
            panic!(
                "no publish span in {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
        assert_eq!(hex(&publish.trace_id), trace_id);
        assert_eq!(hex(&publish.parent_span_id), "00f067aa0ba902b7");
        let span_id = hex(&publish.span_id);
        assert!(
            traceparent.contains(&span_id),
            "message carries the publish span {span_id}: {traceparent}"
        );
        let deliver = spans.iter().find(|s| s.name == "deliver").expect("a deliver span");
        assert_eq!(hex(&deliver.trace_id), trace_id);
        assert_eq!(hex(&deliver.parent_span_id), span_id);
    })
    .await
}

/// A batch published on a session whose metadata carries a `traceparent`:
/// each message gets a `publish` span of its own, parented by the
/// session's context, and carries that span's context to its subscriber,
/// as a message sent with `Publish` does. (Without spans for batches, the
/// messages arrive with no `traceparent` and no span is exported.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batchs_messages_get_publish_spans_parented_by_the_sessions_traceparent() {
    use std::process::Command;
    use tinybroker::pb::session_event::Event;
    use tinybroker::pb::session_request::Request;
    timeout(async {
        let (otlp_addr, receiver) = otlp::start().await;
        let (mut child, grpc_addr) = start_traced(otlp_addr, &[]);
        let mut client = pb::broker_client::BrokerClient::connect(format!("http://{grpc_addr}"))
            .await
            .unwrap();
        let (mut stream, _) = subscribe(&mut client, &["traced.batch"]).await;
        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let (requests, received) = futures::channel::mpsc::unbounded();
        let mut request = tonic::Request::new(received);
        request.metadata_mut().insert(
            "traceparent",
            format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap(),
        );
        let mut events = client.session(request).await.unwrap().into_inner();
        requests
            .unbounded_send(pb::SessionRequest {
                request: Some(Request::Publish(pb::SessionPublish {
                    id: 1,
                    messages: vec![
                        publish_request("traced.batch", "a"),
                        publish_request("traced.batch", "b"),
                    ],
                })),
            })
            .unwrap();
        match events.message().await.unwrap().unwrap().event {
            Some(Event::Published(p)) => assert_eq!(p.accepted, 2, "{p:?}"),
            other => panic!("{other:?}"),
        }
        let mut carried = Vec::new();
        for _ in 0..2 {
            let delivered = stream.message().await.unwrap().unwrap();
            let traceparent = delivered.headers["traceparent"].clone();
            assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
            carried.push(traceparent);
        }
        assert_ne!(carried[0], carried[1], "a span per message");
        drop(requests);
        Command::new("kill")
            .args(["-TERM", &child.pid().to_string()])
            .status()
            .unwrap();
        let status = common::process::exit_status(&mut child, TEST_TIMEOUT).await;
        assert!(status.success());
        let spans = receiver.spans.lock().unwrap().clone();
        let publishes: Vec<_> = spans.iter().filter(|s| s.name == "publish").collect();
        assert_eq!(
            publishes.len(),
            2,
            "{:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        for (span, traceparent) in publishes.iter().zip(&carried) {
            assert_eq!(hex(&span.trace_id), trace_id);
            assert_eq!(hex(&span.parent_span_id), "00f067aa0ba902b7");
            assert!(
                carried.iter().any(|c| c.contains(&hex(&span.span_id))),
                "{traceparent} and the other carry the span"
            );
        }
    })
    .await
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Headers `h00`, `h01`, ... with value `v`, `count` of them.
fn numbered_headers(count: usize) -> HashMap<String, String> {
    (0..count).map(|i| (format!("h{i:02}"), "v".to_owned())).collect()
}

/// A request carrying a `traceparent` (and `tracestate`) in its metadata,
/// as an instrumented publisher sends it.
fn with_trace_context<T>(message: T, trace_id: &str, tracestate: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap(),
    );
    if let Some(state) = tracestate {
        request.metadata_mut().insert("tracestate", state.parse().unwrap());
    }
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_headers_never_make_a_valid_publish_invalid_nor_change_the_publishers() {
    timeout(async {
        let (otlp_addr, _receiver) = otlp::start().await;
        let (_child, grpc_addr) = start_traced(otlp_addr, &[("TINYBROKER_MAX_MESSAGE_BYTES", "4096")]);
        tracing_headers_scenario(&grpc_addr).await;
    })
    .await
}

/// The same with the cluster engine (a replica over one NATS server), which
/// checks a message twice (before it encodes it for NATS, and as its local
/// broker routes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_headers_never_make_a_valid_publish_invalid_in_cluster_mode() {
    let nats = common::nats::NatsCluster::start(1).await;
    timeout(async {
        let (otlp_addr, _receiver) = otlp::start().await;
        let (_child, grpc_addr) = start_traced(
            otlp_addr,
            &[
                ("TINYBROKER_MAX_MESSAGE_BYTES", "4096"),
                ("TINYBROKER_NATS_URL", &nats.url(0)),
                ("TINYBROKER_NATS_REPLICAS", "1"),
                ("TINYBROKER_REPLICA_ID", "traced"),
            ],
        );
        wait_until("the replica to serve", || async {
            use tonic_health::pb::health_check_response::ServingStatus;
            use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
            let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}")).unwrap();
            let Ok(channel) = endpoint.connect().await else {
                return false;
            };
            let mut health = HealthClient::new(channel);
            let request = HealthCheckRequest { service: String::new() };
            health
                .check(request)
                .await
                .is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
        })
        .await;
        tracing_headers_scenario(&grpc_addr).await;
    })
    .await
}

/// With tracing on, against the broker at `grpc_addr` (whose
/// max_message_bytes is 4096): the most headers and payload plus headers at
/// the limit are accepted and delivered with a traceparent added; the
/// publisher's own traceparent and tracestate arrive byte for byte; one
/// header or byte more of its own is refused naming it. Publish and
/// PublishStream.
async fn tracing_headers_scenario(grpc_addr: &str) {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = pb::broker_client::BrokerClient::new(channel.clone());
    let limits = pb::admin_client::AdminClient::new(channel)
        .get_broker_info(pb::GetBrokerInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .limits
        .unwrap();
    let (max_headers, max_bytes) = (limits.max_headers as usize, limits.max_message_bytes as usize);
    assert_eq!((max_headers, max_bytes), (64, 4096));
    let (mut stream, _) = subscribe(&mut client, &["full.>"]).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    // What a delivered message must be: the publisher's headers exactly
    // as sent, plus the broker's traceparent of this trace (and the
    // metadata's tracestate, when it had one) where it set none.
    let check = |delivered: &pb::Message, sent: &HashMap<String, String>, tracestate: Option<&str>| {
        let mut own = delivered.headers.clone();
        if !sent.contains_key("traceparent") {
            let traceparent = own.remove("traceparent").expect("a traceparent added");
            assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
            if !sent.contains_key("tracestate") {
                assert_eq!(own.remove("tracestate").as_deref(), tracestate);
            }
        }
        let sorted = |h: &HashMap<String, String>| h.clone().into_iter().collect::<std::collections::BTreeMap<_, _>>();
        assert_eq!(sorted(&own), sorted(sent));
    };

    // The most headers, and payload plus headers at exactly the limit,
    // with the metadata's tracestate added too: Publish.
    let sent = numbered_headers(max_headers);
    let own_bytes: usize = sent.iter().map(|(k, v)| k.len() + v.len()).sum();
    let full = pb::PublishRequest {
        topic: "full.one".into(),
        payload: vec![b'p'; max_bytes - own_bytes].into(),
        headers: sent.clone(),
    };
    let state = Some("vendor=from-metadata");
    client
        .publish(with_trace_context(full.clone(), trace_id, state))
        .await
        .unwrap();
    let delivered = stream.message().await.unwrap().unwrap();
    assert_eq!(delivered.headers.len(), max_headers + 2);
    assert_eq!(delivered.payload.len(), max_bytes - own_bytes);
    check(&delivered, &sent, state);

    // The publisher's own traceparent and tracestate, byte for byte
    // (the tracestate one the W3C grammar would not even accept), and
    // its tracestate alone, to which the broker adds its traceparent.
    let mut own_context = numbered_headers(max_headers - 2);
    own_context.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00".into(),
    );
    own_context.insert(
        "tracestate".into(),
        " Rojo=00f067aa0ba902b7 ,, congo=t61rcWkgMzE".into(),
    );
    let mut own_state = numbered_headers(max_headers - 1);
    own_state.insert("tracestate".into(), "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".into());
    for sent in [&own_context, &own_state] {
        let request = pb::PublishRequest {
            topic: "full.own".into(),
            payload: "x".into(),
            headers: sent.clone(),
        };
        client
            .publish(with_trace_context(request, trace_id, state))
            .await
            .unwrap();
        check(&stream.message().await.unwrap().unwrap(), sent, None);
    }

    // The same on one PublishStream, without a parent in the metadata
    // (the publish span starts a trace: only its traceparent is added).
    let stream_request = |m: pb::PublishRequest| tonic::Request::new(futures::stream::iter(vec![m]));
    let accepted = client
        .publish_stream(stream_request(full.clone()))
        .await
        .unwrap()
        .into_inner()
        .accepted;
    assert_eq!(accepted, 1);
    let delivered = stream.message().await.unwrap().unwrap();
    assert_eq!(delivered.headers.len(), max_headers + 1);
    assert!(
        !delivered.headers.contains_key("tracestate"),
        "no empty tracestate is added"
    );
    assert!(
        delivered.headers["traceparent"].starts_with("00-"),
        "{:?}",
        delivered.headers
    );
    assert!(
        !delivered.headers["traceparent"].contains(trace_id),
        "a trace of its own"
    );

    // One header or one byte more of the publisher's own is still
    // refused, naming the publisher's count or size, on both calls.
    let mut too_many = full.clone();
    too_many.payload = "x".into();
    too_many.headers = numbered_headers(max_headers + 1);
    let mut too_big = full.clone();
    too_big.payload = vec![b'p'; max_bytes - own_bytes + 1].into();
    let refusals = [
        (
            too_many,
            Code::InvalidArgument,
            format!("has {} headers, the limit is {max_headers}", max_headers + 1),
        ),
        (
            too_big,
            Code::ResourceExhausted,
            format!(
                "is {} bytes (payload plus headers), larger than max_message_bytes {max_bytes}",
                max_bytes + 1
            ),
        ),
    ];
    for (request, code, says) in refusals {
        let err = client
            .publish(with_trace_context(request.clone(), trace_id, state))
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{}", err.message());
        assert!(err.message().contains(&says), "{}", err.message());
        let err = client
            .publish_stream(tonic::Request::new(futures::stream::iter(vec![full.clone(), request])))
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{}", err.message());
        assert!(err.message().contains(&says), "{}", err.message());
        assert!(
            err.message()
                .contains("1 earlier messages of this stream were accepted"),
            "{}",
            err.message()
        );
        // The one accepted before it was delivered.
        assert_eq!(stream.message().await.unwrap().unwrap().payload, full.payload);
    }
}

/// A stock client (grpcurl, JSON over reflection) with a trace context in
/// its metadata: its 64 headers, its own `tracestate` among them, are
/// accepted and delivered as sent, with the broker's `traceparent`; 65 are
/// refused naming the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_clients_traced_publish_keeps_its_headers_and_limits() {
    require_grpcurl();
    timeout(async {
        let (otlp_addr, _receiver) = otlp::start().await;
        let (_child, grpc_addr) = start_traced(otlp_addr, &[]);
        let mut client = pb::broker_client::BrokerClient::connect(format!("http://{grpc_addr}"))
            .await
            .unwrap();
        let (mut stream, _) = subscribe(&mut client, &["stock.>"]).await;
        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let grpcurl = |headers: &HashMap<String, String>| {
            let body = serde_json::json!({ "topic": "stock.one", "payload": "eA==", "headers": headers });
            let output = std::process::Command::new("grpcurl")
                .args(["-plaintext", "-H"])
                .arg(format!("traceparent: 00-{trace_id}-00f067aa0ba902b7-01"))
                .args(["-H", "tracestate: vendor=from-metadata", "-d"])
                .arg(body.to_string())
                .arg(&grpc_addr)
                .arg("tinybroker.v1.Broker/Publish")
                .output()
                .unwrap();
            let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&output.stderr));
            (output.status.success(), text)
        };
        let mut sent = numbered_headers(63);
        sent.insert("tracestate".into(), "congo=t61rcWkgMzE".into());
        let (ok, out) = grpcurl(&sent);
        assert!(ok, "{out}");
        assert!(out.contains("\"sequence\""), "{out}");
        let mut delivered = stream.message().await.unwrap().unwrap().headers;
        let traceparent = delivered.remove("traceparent").expect("a traceparent added");
        assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
        let sorted = |h: HashMap<String, String>| h.into_iter().collect::<std::collections::BTreeMap<_, _>>();
        assert_eq!(sorted(delivered), sorted(sent));

        let (ok, out) = grpcurl(&numbered_headers(65));
        assert!(!ok, "{out}");
        assert!(out.contains("InvalidArgument"), "{out}");
        assert!(out.contains("has 65 headers, the limit is 64"), "{out}");
    })
    .await
}
