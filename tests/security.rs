//! Authentication (bearer token on Broker and Admin, open health and
//! reflection), TLS (rustls, certificates made in the test with rcgen) and
//! the connection limits: keepalive reaping of a vanished client and the
//! cap on concurrent streams per connection.

mod common;

use common::process::BrokerProcess;
use common::tls::TestPki;
use common::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tinybroker::config::{Config, ConnectionLimits};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const TOKEN: &str = "s3cret-t0ken";

fn with_token<T>(message: T, token: Option<&str>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

/// Every Broker and Admin call with `token`; returns each call's code.
async fn broker_and_admin_codes(channel: Channel, token: Option<&str>) -> Vec<(&'static str, Code)> {
    let mut broker = BrokerClient::new(channel.clone());
    let mut admin = AdminClient::new(channel);
    let code = |r: Result<(), tonic::Status>| r.err().map(|s| s.code()).unwrap_or(Code::Ok);
    let publish = broker
        .publish(with_token(publish_request("auth.t", "x"), token))
        .await
        .map(drop);
    let stream = broker
        .publish_stream(with_token(
            tokio_stream::iter(vec![publish_request("auth.t", "y")]),
            token,
        ))
        .await
        .map(drop);
    let subscribe = broker
        .open_subscription(with_token(subscribe_request(&["auth.>"]), token))
        .await
        .map(drop);
    let ack = broker
        .ack(with_token(
            pb::AckRequest {
                subscription_id: "nobody".into(),
                sequences: vec![1],
            },
            token,
        ))
        .await
        .map(drop);
    let nack = broker
        .nack(with_token(
            pb::NackRequest {
                subscription_id: "nobody".into(),
                sequences: vec![1],
            },
            token,
        ))
        .await
        .map(drop);
    let list = admin
        .list_subscriptions(with_token(pb::ListSubscriptionsRequest {}, token))
        .await
        .map(drop);
    let info = admin
        .get_broker_info(with_token(pb::GetBrokerInfoRequest {}, token))
        .await
        .map(drop);
    vec![
        ("Publish", code(publish)),
        ("PublishStream", code(stream)),
        ("OpenSubscription", code(subscribe)),
        ("Ack", code(ack)),
        ("Nack", code(nack)),
        ("ListSubscriptions", code(list)),
        ("GetBrokerInfo", code(info)),
    ]
}

/// The codes an authorized caller gets (Ack/Nack name an unknown id).
fn authorized_codes() -> Vec<(&'static str, Code)> {
    vec![
        ("Publish", Code::Ok),
        ("PublishStream", Code::Ok),
        ("OpenSubscription", Code::Ok),
        ("Ack", Code::NotFound),
        ("Nack", Code::NotFound),
        ("ListSubscriptions", Code::Ok),
        ("GetBrokerInfo", Code::Ok),
    ]
}

async fn health_and_reflection_work(channel: Channel) {
    let status = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: "tinybroker.v1.Broker".into(),
        })
        .await
        .expect("health needs no token")
        .into_inner()
        .status;
    assert_eq!(status, 1, "SERVING");
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .expect("reflection needs no token")
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        responses.message().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list");
    };
    assert!(
        list.service.iter().any(|s| s.name == "tinybroker.v1.Broker"),
        "{list:?}"
    );
}

#[tokio::test]
async fn with_a_token_broker_and_admin_need_it_and_health_and_reflection_do_not() {
    timeout(async {
        let broker = start_with(Config {
            auth_token: Some(TOKEN.into()),
            ..config()
        })
        .await;
        let channel = broker.channel().await;
        for token in [None, Some("wrong"), Some("s3cret-t0ke"), Some("s3cret-t0ken2")] {
            let codes = broker_and_admin_codes(channel.clone(), token).await;
            for (call, code) in codes {
                assert_eq!(code, Code::Unauthenticated, "{call} with {token:?}");
            }
        }
        assert_eq!(
            broker_and_admin_codes(channel.clone(), Some(TOKEN)).await,
            authorized_codes()
        );

        let status = BrokerClient::new(channel.clone())
            .publish(publish_request("auth.t", "x"))
            .await
            .unwrap_err();
        assert!(status.message().contains("authorization: Bearer"), "{status:?}");
        let status = BrokerClient::new(channel.clone())
            .publish(with_token(publish_request("auth.t", "x"), Some("wrong")))
            .await
            .unwrap_err();
        assert!(!status.message().contains(TOKEN), "never tells the token: {status:?}");

        health_and_reflection_work(channel.clone()).await;
        let info = AdminClient::new(channel)
            .get_broker_info(with_token(pb::GetBrokerInfoRequest {}, Some(TOKEN)))
            .await
            .unwrap()
            .into_inner();
        assert!(info.auth_enabled);
    })
    .await
}

#[tokio::test]
async fn without_a_token_every_call_is_open() {
    timeout(async {
        let broker = start().await;
        let channel = broker.channel().await;
        assert_eq!(broker_and_admin_codes(channel.clone(), None).await, authorized_codes());
        // A token sent to a broker that has none is ignored.
        assert_eq!(
            broker_and_admin_codes(channel.clone(), Some("any")).await,
            authorized_codes()
        );
        health_and_reflection_work(channel).await;
    })
    .await
}

#[tokio::test]
async fn the_cli_sends_the_token_and_the_broker_never_logs_it() {
    timeout(async {
        let process = BrokerProcess::spawn(&[("TINYBROKER_AUTH_TOKEN", TOKEN), ("RUST_LOG", "trace")]);
        let url = process.url();
        let cli_url = url.clone();
        let publish = move |token: Option<&str>| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_tinybroker"));
            command.env_remove("TINYBROKER_AUTH_TOKEN");
            if let Some(token) = token {
                command.env("TINYBROKER_AUTH_TOKEN", token);
            }
            command
                .args(["publish", "auth.cli", "hello", "--addr", &cli_url])
                .output()
                .unwrap()
        };
        let (with, without, wrong) =
            tokio::task::spawn_blocking(move || (publish(Some(TOKEN)), publish(None), publish(Some("wrong"))))
                .await
                .unwrap();
        assert!(with.status.success(), "{}", String::from_utf8_lossy(&with.stderr));
        for output in [without, wrong] {
            assert!(!output.status.success());
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                stderr.contains("Unauthenticated") || stderr.contains("UNAUTHENTICATED"),
                "{stderr}"
            );
            assert!(!stderr.contains(TOKEN), "{stderr}");
        }
        // Every line the broker logged, at trace level, is free of the token.
        let mut client = BrokerClient::new(Endpoint::from_shared(url).unwrap().connect().await.unwrap());
        client
            .publish(with_token(publish_request("auth.cli", "x"), Some(TOKEN)))
            .await
            .unwrap();
        let lines = process.drain_lines();
        assert!(!lines.is_empty());
        for line in lines {
            assert!(!line.contains(TOKEN), "token in a log line: {line}");
        }
    })
    .await
}

// === TLS ===

async fn tls_channel(port: u16, ca: &Path) -> Result<Channel, tonic::transport::Error> {
    let ca = Certificate::from_pem(std::fs::read(ca).unwrap());
    Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(ClientTlsConfig::new().ca_certificate(ca))
        .unwrap()
        .connect()
        .await
}

#[tokio::test]
async fn tls_round_trip_and_plaintext_is_refused() {
    timeout(async {
        let pki = TestPki::new("tls");
        let broker = start_with(Config {
            tls: Some(pki.files()),
            ..config()
        })
        .await;
        let port = broker.grpc_addr.port();
        let channel = tls_channel(port, &pki.ca).await.unwrap();
        let mut client = BrokerClient::new(channel.clone());
        let (mut stream, _) = subscribe(&mut client, &["tls.>"]).await;
        client.publish(publish_request("tls.a", "over tls")).await.unwrap();
        let message = stream.message().await.unwrap().unwrap();
        assert_eq!(&message.payload[..], b"over tls");
        health_and_reflection_work(channel.clone()).await;
        let info = AdminClient::new(channel)
            .get_broker_info(pb::GetBrokerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(info.tls_enabled);

        // A plaintext client gets no gRPC answer.
        let plain = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5))
            .connect()
            .await;
        if let Ok(plain) = plain {
            let refused = BrokerClient::new(plain).publish(publish_request("tls.a", "x")).await;
            assert!(refused.is_err(), "plaintext must not work against a TLS listener");
        }
        // A client that does not trust the CA cannot connect.
        let other = TestPki::new("tls-other");
        let untrusted = match tls_channel(port, &other.ca).await {
            Err(_) => true,
            Ok(ch) => BrokerClient::new(ch)
                .publish(publish_request("tls.a", "x"))
                .await
                .is_err(),
        };
        assert!(untrusted, "a certificate from another CA must be refused");

        // The CLI: https:// address and --ca.
        let url = format!("https://127.0.0.1:{port}");
        let ca = pki.ca.clone();
        let output = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_tinybroker"))
                .args(["publish", "tls.cli", "from the cli", "--addr", &url, "--ca"])
                .arg(&ca)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let message = stream.message().await.unwrap().unwrap();
        assert_eq!(&message.payload[..], b"from the cli");
    })
    .await
}

#[test]
fn bad_tls_files_stop_start_up_with_one_line() {
    let pki = TestPki::new("tls-bad");
    let garbage = pki.dir.join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN NOTHING-----\n").unwrap();
    let missing = pki.dir.join("missing.pem");
    let other = TestPki::new("tls-bad-other");
    let cases: [(&Path, &Path, &str); 4] = [
        (&missing, &pki.key, "TINYBROKER_TLS_CERT"),
        (&garbage, &pki.key, "TINYBROKER_TLS_CERT"),
        (&pki.cert, &garbage, "TINYBROKER_TLS_KEY"),
        // A key that belongs to another certificate.
        (&pki.cert, &other.key, "TINYBROKER_TLS_KEY"),
    ];
    for (cert, key, named) in cases {
        let output = Command::new(env!("CARGO_BIN_EXE_tinybroker"))
            .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_TLS_CERT", cert)
            .env("TINYBROKER_TLS_KEY", key)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{cert:?} {key:?} must not start: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(named), "{stderr}");
    }
}

// === connection limits ===

/// A TCP proxy that can freeze: it stops moving bytes in both directions but
/// keeps both sockets open, like a client whose host vanished from the
/// network without closing anything.
struct FreezingProxy {
    addr: std::net::SocketAddr,
    freeze: tokio::sync::watch::Sender<bool>,
}

impl FreezingProxy {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (freeze, frozen) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pipe(client_read, server_write, frozen.clone()));
                tokio::spawn(pipe(server_read, client_write, frozen.clone()));
            }
        });
        Self { addr, freeze }
    }

    fn freeze(&self) {
        self.freeze.send_replace(true);
    }
}

/// Copies until frozen, then holds both halves open without reading.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            read = from.read(&mut buffer) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if to.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                }
            },
            changed = frozen.changed() => if changed.is_err() { return },
        }
        let is_frozen = *frozen.borrow();
        if is_frozen {
            break;
        }
    }
    // Frozen: keep the sockets until the test ends.
    std::future::pending::<()>().await;
    drop((from, to));
}

fn quick_keepalive() -> ConnectionLimits {
    ConnectionLimits {
        keepalive_interval: Duration::from_secs(1),
        keepalive_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    }
}

async fn subscription_ids(broker: &TestBroker) -> Vec<String> {
    broker
        .subscriptions()
        .await
        .into_iter()
        .map(|s| s.subscription_id)
        .collect()
}

#[tokio::test]
async fn keepalive_reaps_a_vanished_client_and_redelivers_its_unacked_messages() {
    timeout(async {
        let broker = start_with(Config {
            connections: quick_keepalive(),
            ..config()
        })
        .await;
        let proxy = FreezingProxy::start(broker.grpc_addr).await;
        // The vanishing client: a broadcast subscription and a manual-ack group member.
        let far = Endpoint::from_shared(format!("http://{}", proxy.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut far_client = BrokerClient::new(far);
        let (_far_stream, far_id) = subscribe(&mut far_client, &["ka.>"]).await;
        let (mut far_member, far_member_id) =
            open(&mut far_client, member_request(&["ka.>"], "workers", true, 1)).await;

        let mut client = broker.client().await;
        client.publish(publish_request("ka.1", "held")).await.unwrap();
        let held = far_member.message().await.unwrap().unwrap();
        assert_eq!((held.delivery_attempt, &held.payload[..]), (1, &b"held"[..]));

        proxy.freeze();
        wait_until("the vanished client's subscriptions are reaped", || async {
            let ids = subscription_ids(&broker).await;
            !ids.contains(&far_id) && !ids.contains(&far_member_id)
        })
        .await;

        // Its unacked message goes to the next member, as a redelivery.
        let (mut member, _) = open(&mut client, member_request(&["ka.>"], "workers", true, 1)).await;
        let again = member.message().await.unwrap().unwrap();
        assert_eq!((again.sequence, again.delivery_attempt), (held.sequence, 2));
    })
    .await
}

/// SETTINGS_MAX_CONCURRENT_STREAMS as the broker at `addr` advertises it
/// to a new connection, read by a raw h2 client once the broker answered a
/// Health/Check (its SETTINGS come before any response).
async fn advertised_max_streams(addr: std::net::SocketAddr) -> usize {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let request = tonic::codegen::http::Request::post(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = h2.send_request(request, false).unwrap();
    // An empty HealthCheckRequest: the gRPC header alone.
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200, "{response:?}");
    let max = h2.current_max_send_streams();
    connection.abort();
    max
}

#[tokio::test]
async fn streams_per_connection_are_capped_and_the_next_waits_for_a_free_slot() {
    timeout(async {
        let broker = start_with(Config {
            connections: ConnectionLimits {
                max_streams_per_connection: 2,
                ..ConnectionLimits::default()
            },
            ..config()
        })
        .await;
        let mut client = broker.client().await;
        let (first, _) = subscribe(&mut client, &["cap.a"]).await;
        let (_second, _) = subscribe(&mut client, &["cap.b"]).await;

        // Every connection is told its cap in the broker's SETTINGS, so a
        // client's HTTP/2 queues a third call while both slots are taken
        // (what a client sees, not a wait of so many milliseconds)...
        assert_eq!(advertised_max_streams(broker.grpc_addr).await, 2);
        let mut third_client = client.clone();
        let third = tokio::spawn(async move { subscribe(&mut third_client, &["cap.c"]).await });
        assert_eq!(subscription_ids(&broker).await.len(), 2);
        // ...and it goes through once one is released.
        drop(first);
        let (_third_stream, third_id) = third.await.unwrap();
        assert!(subscription_ids(&broker).await.contains(&third_id));
    })
    .await
}

#[tokio::test]
async fn ids_and_group_names_are_bounded_and_printable() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let at_limit = "i".repeat(256);
        let (_stream, id) = open(
            &mut client,
            pb::OpenSubscriptionRequest {
                subscription_id: at_limit.clone(),
                ..subscribe_request(&["ids.>"])
            },
        )
        .await;
        assert_eq!(id, at_limit);
        let bad_requests = [
            (
                pb::OpenSubscriptionRequest {
                    subscription_id: "i".repeat(257),
                    ..subscribe_request(&["ids.>"])
                },
                "257 bytes long, the limit is 256",
            ),
            (
                pb::OpenSubscriptionRequest {
                    subscription_id: "has space".into(),
                    ..subscribe_request(&["ids.>"])
                },
                "only printable ASCII",
            ),
            (
                member_request(&["ids.>"], &"g".repeat(257), false, 0),
                "the limit is 256",
            ),
            (
                member_request(&["ids.>"], "tab\tgroup", false, 0),
                "only printable ASCII",
            ),
        ];
        for (request, expected) in bad_requests {
            let err = client.open_subscription(request).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
            assert!(err.message().contains(expected), "{}", err.message());
        }
    })
    .await
}
