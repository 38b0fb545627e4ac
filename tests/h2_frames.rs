//! HTTP/2 framing against the real broker binary, with a raw `h2` client
//! (issue 12, point 1):
//! - a `PublishStream` that sends every gRPC message in its own DATA frame
//!   (as grpc-core clients do), with a window's worth of them buffered while
//!   the broker is stopped, is accepted in full and its connection stays up;
//! - a real flood, 1-byte DATA frames that the broker cannot drain (on a
//!   stream it has stopped reading), is still stopped with GOAWAY
//!   ENHANCE_YOUR_CALM, and another connection's subscription goes on
//!   receiving;
//! - that close is counted in `tinybroker_connections_rejected_total` and
//!   logged at WARN with the peer;
//! - a request stream that cannot be decoded (cut off in the middle of a
//!   message, a bad compressed flag, bytes that are not the message's
//!   protobuf) ends a `Session` or `PublishStream` with INVALID_ARGUMENT
//!   saying what was wrong, and one over the decoding limit with
//!   RESOURCE_EXHAUSTED (issue 33, point 4);
//! - a `SessionPublish` split across many DATA frames is published whole,
//!   and one over the request size ends only its session (issue 43).

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::process::{BrokerProcess, metric_with_label};
use common::*;
use prost::Message as _;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tinybroker::pb;
use tokio::net::TcpStream;

/// How long the broker stays stopped while the client writes.
const PAUSE: Duration = Duration::from_secs(2);
/// Without a window update for this long, a stopped broker's window is used
/// up (it cannot grant more while stopped); only sizes the burst.
const WINDOW_SPENT_AFTER: Duration = Duration::from_millis(300);

/// The `reason` of `tinybroker_connections_rejected_total` for a connection
/// closed by HTTP/2 flood protection.
const FLOOD_REASON: &str = "http2_flood";

type Connection = tokio::task::JoinHandle<Result<(), h2::Error>>;

/// A TCP stream whose writes, once the peer has closed the socket, are
/// dropped instead of failing: the client of a flood is still writing when
/// the broker sends GOAWAY and closes, and h2 must go on reading to see the
/// GOAWAY rather than end with a broken pipe.
struct KeepReading {
    tcp: TcpStream,
    write_failed: bool,
}

impl tokio::io::AsyncRead for KeepReading {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for KeepReading {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.write_failed {
            return std::task::Poll::Ready(Ok(buf.len()));
        }
        match std::pin::Pin::new(&mut self.tcp).poll_write(cx, buf) {
            std::task::Poll::Ready(Err(e)) if peer_closed(&e) => {
                self.write_failed = true;
                std::task::Poll::Ready(Ok(buf.len()))
            }
            other => other,
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.write_failed {
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.write_failed {
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

fn peer_closed(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}

/// An HTTP/2 connection to the broker: the request handle, the task that
/// drives the connection (it ends with the error of a GOAWAY), and the
/// client's own address (the peer the broker sees).
async fn connect(addr: &str) -> (h2::client::SendRequest<Bytes>, Connection, SocketAddr) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let local = tcp.local_addr().unwrap();
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(8 << 20)
        .initial_connection_window_size(8 << 20)
        .handshake(KeepReading {
            tcp,
            write_failed: false,
        })
        .await
        .unwrap();
    let driver = tokio::spawn(connection);
    (send.ready().await.unwrap(), driver, local)
}

fn grpc_request(addr: &str, method: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/tinybroker.v1.Broker/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// A gRPC length-prefixed message.
fn grpc_frame(message: &impl prost::Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + body.len());
    frame.put_u8(0);
    frame.put_u32(body.len() as u32);
    frame.put_slice(&body);
    frame.freeze()
}

/// Waits until the stream may send `len` bytes; `None` if `limit` passed
/// without enough window, `Some(Err)` if the stream or connection failed.
async fn wait_capacity(
    stream: &mut h2::SendStream<Bytes>,
    len: usize,
    limit: Option<Duration>,
) -> Option<Result<(), h2::Error>> {
    stream.reserve_capacity(len);
    while stream.capacity() < len {
        let more = poll_fn(|cx| stream.poll_capacity(cx));
        let next = match limit {
            Some(limit) => tokio::time::timeout(limit, more).await.ok()?,
            None => more.await,
        };
        match next {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Some(Err(e)),
            None => return Some(Err(stream_error(stream).await)),
        }
    }
    Some(Ok(()))
}

async fn stream_error(stream: &mut h2::SendStream<Bytes>) -> h2::Error {
    match poll_fn(|cx| stream.poll_reset(cx)).await {
        Ok(reason) => h2::Error::from(reason),
        Err(e) => e,
    }
}

/// Sends `frame` as one DATA frame of its own: waits for window for all of
/// it first, so h2 never splits it.
async fn send_one_frame(stream: &mut h2::SendStream<Bytes>, frame: Bytes) -> Result<(), h2::Error> {
    wait_capacity(stream, frame.len(), None).await.expect("no time limit")?;
    stream.send_data(frame, false)
}

/// Reads a whole gRPC response: (grpc-status, grpc-message, body).
async fn read_response(response: h2::client::ResponseFuture) -> Result<(String, String, Bytes), h2::Error> {
    let response = response.await?;
    assert_eq!(response.status(), 200, "{response:?}");
    let mut status = response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned());
    // A trailers-only response carries its message in the headers.
    let mut message = response
        .headers()
        .get("grpc-message")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let mut body = response.into_body();
    let mut data = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        body.flow_control().release_capacity(chunk.len()).unwrap();
        data.extend_from_slice(&chunk);
    }
    if let Some(trailers) = body.trailers().await? {
        status = trailers.get("grpc-status").map(|v| v.to_str().unwrap().to_owned());
        if let Some(m) = trailers.get("grpc-message") {
            message = m.to_str().unwrap().to_owned();
        }
    }
    Ok((status.unwrap_or_default(), message, data.freeze()))
}

fn publish_request(i: usize) -> pb::PublishRequest {
    pb::PublishRequest {
        topic: "h2.frames".into(),
        payload: format!("{i:010}").into_bytes().into(),
        headers: Default::default(),
    }
}

/// Describes how an h2 call or connection ended, for assertion messages.
fn describe(error: &h2::Error) -> String {
    format!(
        "{error} (reason {:?}, go_away {}, remote {})",
        error.reason(),
        error.is_go_away(),
        error.is_remote()
    )
}

/// Panics with how the stream and its connection ended.
async fn stream_failed(sent: usize, error: &h2::Error, connection: &mut Connection) -> ! {
    let closed = tokio::time::timeout(Duration::from_secs(5), connection).await;
    panic!(
        "the stream failed after {sent} messages: {}; connection: {closed:?}",
        describe(error)
    )
}

/// One gRPC message per DATA frame, 100,000 of them (28 bytes each) on one
/// PublishStream; the broker is SIGSTOPped and the client writes its whole
/// window (tens of thousands of frames) before the broker resumes and reads
/// them in one go. Every message is accepted and the connection stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_data_frame_per_message_with_a_window_buffered_is_accepted() {
    const COUNT: usize = 100_000;
    const BEFORE_PAUSE: usize = 5_000;
    let started = Instant::now();
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let result = tokio::time::timeout(Duration::from_secs(90), async {
        let (mut send, mut connection, _) = connect(&broker.grpc_addr).await;
        let (response, mut stream) = send
            .send_request(grpc_request(&broker.grpc_addr, "PublishStream"), false)
            .unwrap();
        let mut i = 0;
        while i < BEFORE_PAUSE {
            if let Err(e) = send_one_frame(&mut stream, grpc_frame(&publish_request(i))).await {
                stream_failed(i, &e, &mut connection).await;
            }
            i += 1;
        }
        broker.guard.signal("STOP");
        let stopped = Instant::now();
        // Everything the window allows goes out now and waits in the
        // broker's socket until it resumes.
        let burst_from = i;
        while i < COUNT {
            let frame = grpc_frame(&publish_request(i));
            match wait_capacity(&mut stream, frame.len(), Some(WINDOW_SPENT_AFTER)).await {
                Some(Ok(())) => {}
                Some(Err(e)) => stream_failed(i, &e, &mut connection).await,
                None => break,
            }
            if let Err(e) = stream.send_data(frame, false) {
                stream_failed(i, &e, &mut connection).await;
            }
            i += 1;
        }
        let burst = i - burst_from;
        tokio::time::sleep(PAUSE.saturating_sub(stopped.elapsed())).await;
        broker.guard.signal("CONT");
        eprintln!("{burst} one-message DATA frames written while the broker was stopped");
        assert!(burst > 1_000, "the window let only {burst} frames through");
        while i < COUNT {
            if let Err(e) = send_one_frame(&mut stream, grpc_frame(&publish_request(i))).await {
                stream_failed(i, &e, &mut connection).await;
            }
            i += 1;
        }
        if let Err(e) = stream.send_data(Bytes::new(), true) {
            stream_failed(COUNT, &e, &mut connection).await;
        }
        let (status, message, body) = match read_response(response).await {
            Ok(r) => r,
            Err(e) => {
                let closed = tokio::time::timeout(Duration::from_secs(5), &mut connection).await;
                panic!("PublishStream failed: {}; connection: {closed:?}", describe(&e))
            }
        };
        assert_eq!(status, "0", "grpc-status {status}: {message}");
        let reply = pb::PublishStreamResponse::decode(&body[5..]).unwrap();
        assert_eq!(reply.accepted, COUNT as u64);
        assert!(
            !connection.is_finished(),
            "the connection closed: {:?}",
            connection.await
        );
        // The same connection still serves a new call.
        let (response, mut stream) = send
            .ready()
            .await
            .expect("connection still up")
            .send_request(grpc_request(&broker.grpc_addr, "Publish"), false)
            .unwrap();
        stream.send_data(grpc_frame(&publish_request(COUNT)), true).unwrap();
        let (status, message, _) = read_response(response).await.unwrap();
        assert_eq!(status, "0", "{message}");
        let m = scrape(broker.metrics_addr).await;
        assert_eq!(
            common::process::metric_sum(&m, "tinybroker_messages_published_total"),
            COUNT as f64 + 1.0
        );
    })
    .await;
    result.expect("test timed out");
    eprintln!("h2 one frame per message: {:.1} s", started.elapsed().as_secs_f64());
}

/// What a flood of 1-byte frames came to.
struct Flood {
    /// 1-byte frames the client got out.
    frames: usize,
    /// How the flooding connection ended.
    closed: Result<(), h2::Error>,
    /// The flooding connection's local address (the broker's peer).
    peer: SocketAddr,
}

/// A real flood, one the broker cannot drain: a reflection stream
/// (`ServerReflectionInfo`, bidirectional) on a connection that gives the
/// broker no window to answer in (SETTINGS_INITIAL_WINDOW_SIZE 0). After two
/// requests the reflection task waits for room to answer and stops reading
/// the stream, so every 1-byte DATA frame sent after them stays in the
/// broker's HTTP/2 receive buffer. Sends such frames (never END_STREAM) until
/// the connection ends, or until the window is used up and `linger` has
/// passed with the connection still open.
async fn flood(broker: &BrokerProcess, linger: Duration) -> Flood {
    let tcp = TcpStream::connect(&broker.grpc_addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let peer = tcp.local_addr().unwrap();
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(KeepReading {
            tcp,
            write_failed: false,
        })
        .await
        .unwrap();
    let mut connection = tokio::spawn(connection);
    let mut send = send.ready().await.unwrap();

    // A first call answered without DATA (an error is trailers only), so
    // the handshake and the broker's windows are settled.
    let (response, mut stream) = send
        .send_request(grpc_request(&broker.grpc_addr, "Publish"), false)
        .unwrap();
    let empty = pb::PublishRequest::default();
    stream.send_data(grpc_frame(&empty), true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(
        response.headers().get("grpc-status").map(|v| v.to_str().unwrap()),
        Some("3"),
        "{response:?}"
    );

    let request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{}/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            broker.grpc_addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut stream) = send.ready().await.unwrap().send_request(request, false).unwrap();
    let list = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    for _ in 0..4 {
        send_one_frame(&mut stream, grpc_frame(&list)).await.unwrap();
    }
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);

    let one = Bytes::from_static(&[0]);
    let mut frames = 0;
    let closed = loop {
        if connection.is_finished() {
            break (&mut connection).await.unwrap();
        }
        match wait_capacity(&mut stream, 1, Some(linger)).await {
            // The window is used up and nothing closed the connection.
            None => break Ok(()),
            Some(Err(_)) => {
                break tokio::time::timeout(Duration::from_secs(10), &mut connection)
                    .await
                    .map(|ended| ended.unwrap())
                    .unwrap_or(Ok(()));
            }
            Some(Ok(())) => {}
        }
        if stream.send_data(one.clone(), false).is_err() {
            continue;
        }
        frames += 1;
    };
    Flood { frames, closed, peer }
}

/// A subscription on its own connection, and a check that it still gets
/// what is published.
struct Bystander {
    stream: tonic::Streaming<pb::Message>,
    client: pb::broker_client::BrokerClient<tonic::transport::Channel>,
}

impl Bystander {
    async fn open(broker: &BrokerProcess) -> Self {
        let mut client = pb::broker_client::BrokerClient::connect(broker.url()).await.unwrap();
        let (stream, _) = subscribe(&mut client, &["flood.>"]).await;
        let mut bystander = Self { stream, client };
        bystander.still_receives("before").await;
        bystander
    }

    async fn still_receives(&mut self, payload: &str) {
        self.client
            .publish(common::publish_request("flood.check", payload))
            .await
            .unwrap();
        let m = tokio::time::timeout(Duration::from_secs(20), self.stream.message())
            .await
            .expect("the bystander's message within 20 s")
            .expect("the bystander's stream is fine")
            .expect("the bystander's stream stays open");
        assert_eq!(&m.payload[..], payload.as_bytes());
    }
}

/// 1-byte DATA frames on a stream the broker does not read, up to the
/// window: the broker closes that connection with GOAWAY ENHANCE_YOUR_CALM,
/// and a subscription on another connection keeps receiving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_one_byte_data_frames_is_stopped_with_enhance_your_calm() {
    let started = Instant::now();
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let result = tokio::time::timeout(Duration::from_secs(90), async {
        let mut bystander = Bystander::open(&broker).await;
        let flood = flood(&broker, Duration::from_secs(5)).await;
        eprintln!(
            "flood: {} 1-byte frames, connection ended with {:?}",
            flood.frames, flood.closed
        );
        let Err(error) = flood.closed else {
            panic!(
                "the broker took {} undrained 1-byte DATA frames (all its window allowed) and kept the connection open",
                flood.frames
            )
        };
        assert_eq!(
            error.reason(),
            Some(h2::Reason::ENHANCE_YOUR_CALM),
            "closed with {}",
            describe(&error)
        );
        assert!(error.is_go_away() && error.is_remote(), "{}", describe(&error));
        bystander.still_receives("after").await;
    })
    .await;
    result.expect("test timed out");
    eprintln!("h2 flood: {:.1} s", started.elapsed().as_secs_f64());
}

/// The same flood, then what an operator sees (issue 12: "when the broker
/// does close a connection for abuse, it logs one WARN line (peer, reason)
/// and counts it in `tinybroker_connections_rejected_total{reason}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_close_is_counted_and_logged_with_the_peer() {
    let started = Instant::now();
    let broker = BrokerProcess::spawn(&[] as &[(&str, &str)]);
    let result = tokio::time::timeout(Duration::from_secs(90), async {
        let flood = flood(&broker, Duration::from_secs(5)).await;
        let error = flood.closed.expect_err("the flood is stopped");
        assert_eq!(
            error.reason(),
            Some(h2::Reason::ENHANCE_YOUR_CALM),
            "{}",
            describe(&error)
        );

        // The counter. The broker counts once the connection's task ends,
        // which may be just after the client read the GOAWAY.
        let label = format!("reason=\"{FLOOD_REASON}\"");
        let flood_count = |m: &str| metric_with_label(m, "tinybroker_connections_rejected_total", &label);
        wait_until("the flood close to be counted", || async {
            flood_count(&scrape(broker.metrics_addr).await).is_some_and(|n| n >= 1.0)
        })
        .await;
        let m = scrape(broker.metrics_addr).await;
        let rejected = flood_count(&m);
        assert_eq!(
            rejected,
            Some(1.0),
            "tinybroker_connections_rejected_total{{reason=\"{FLOOD_REASON}\"}} after one flood; metrics:\n{}",
            m.lines()
                .filter(|l| l.contains("connection"))
                .collect::<Vec<_>>()
                .join("\n")
        );

        // One WARN line naming the peer (written with the count, maybe
        // after the client read the GOAWAY).
        let peer = flood.peer.to_string();
        let mut log = broker.drain_lines();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !log.iter().any(|l| l.contains("WARN") && l.contains(&peer)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            log.extend(broker.drain_lines());
        }
        let warnings: Vec<&String> = log.iter().filter(|l| l.contains("WARN") && l.contains(&peer)).collect();
        assert_eq!(warnings.len(), 1, "one WARN line naming {peer}; log: {log:#?}");
    })
    .await;
    result.expect("test timed out");
    eprintln!("h2 flood counted: {:.1} s", started.elapsed().as_secs_f64());
}

/// A gRPC message header: the compressed flag and the length it announces.
fn grpc_header(flag: u8, len: u32) -> BytesMut {
    let mut frame = BytesMut::new();
    frame.put_u8(flag);
    frame.put_u32(len);
    frame
}

/// The request streams no broker can decode, with the code and the words
/// of the status they must end with.
fn undecodable_streams() -> Vec<(&'static str, Bytes, &'static str, &'static str)> {
    let mut truncated = grpc_header(0, 100);
    truncated.put_slice(b"abcd");
    let mut flagged = grpc_header(1, 2);
    flagged.put_slice(&[0x08, 0x01]);
    let mut bad_flag = grpc_header(2, 2);
    bad_flag.put_slice(&[0x08, 0x01]);
    // Field 1, wire type 2, a length of 100 with 1 byte behind it.
    let mut not_protobuf = grpc_header(0, 3);
    not_protobuf.put_slice(&[0x0a, 100, 0x01]);
    let over_limit = grpc_header(0, u32::MAX);
    vec![
        (
            "truncated",
            truncated.freeze(),
            "3",
            "ended in the middle of a gRPC message",
        ),
        (
            "compressed without grpc-encoding",
            flagged.freeze(),
            "3",
            "compressed flag set",
        ),
        (
            "compressed flag 2",
            bad_flag.freeze(),
            "3",
            "compressed flag is neither 0 nor 1",
        ),
        (
            "not protobuf",
            not_protobuf.freeze(),
            "3",
            "not a valid protobuf encoding",
        ),
        (
            "over the decoding limit",
            over_limit.freeze(),
            "8",
            "TINYBROKER_MAX_MESSAGE_BYTES",
        ),
    ]
}

/// `grpc-message` is percent-encoded.
fn percent_decoded(message: &str) -> String {
    let bytes = message.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&message[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `before` (well-formed messages) then `bytes` on a new `method`
/// stream and half-closes; the status it ends with, decoded.
async fn end_of(addr: &str, method: &str, before: &[Bytes], bytes: Bytes) -> (String, String) {
    let (mut send, _connection, _) = connect(addr).await;
    let (response, mut stream) = send.send_request(grpc_request(addr, method), false).unwrap();
    for frame in before {
        send_one_frame(&mut stream, frame.clone()).await.unwrap();
    }
    wait_capacity(&mut stream, bytes.len(), None)
        .await
        .expect("no time limit")
        .unwrap();
    stream.send_data(bytes, true).unwrap();
    let (status, message, _) = read_response(response).await.unwrap();
    (status, percent_decoded(&message))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_session_stream_ends_with_invalid_argument_saying_why() {
    let broker = start().await;
    let addr = broker.grpc_addr.to_string();
    timeout(async {
        for (case, bytes, code, says) in undecodable_streams() {
            let (status, message) = end_of(&addr, "Session", &[], bytes).await;
            assert_eq!(status, code, "{case}: {message}");
            assert!(message.contains(says), "{case}: {message:?} should say {says:?}");
            if code == "3" {
                assert!(message.contains("tinybroker.v1.SessionRequest"), "{case}: {message}");
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_publish_stream_ends_with_invalid_argument_saying_why() {
    let broker = start().await;
    let addr = broker.grpc_addr.to_string();
    timeout(async {
        for (case, bytes, code, says) in undecodable_streams() {
            let before = [grpc_frame(&publish_request(1))];
            let (status, message) = end_of(&addr, "PublishStream", &before, bytes).await;
            assert_eq!(status, code, "{case}: {message}");
            assert!(message.contains(says), "{case}: {message:?} should say {says:?}");
            assert!(message.contains("1 earlier messages"), "{case}: {message}");
            if code == "3" {
                assert!(message.contains("tinybroker.v1.PublishRequest"), "{case}: {message}");
            }
        }
    })
    .await;
}

/// A `Session` response as a raw client reads it: its events as they come,
/// decoded from the gRPC frames of the DATA it gets, and its status.
struct SessionEvents {
    body: h2::RecvStream,
    buf: BytesMut,
    /// The status, when the response was trailers only.
    status: Option<(String, String)>,
}

impl SessionEvents {
    async fn new(response: h2::client::ResponseFuture) -> Self {
        let response = response.await.expect("the session's response headers");
        assert_eq!(response.status(), 200, "{response:?}");
        let status = response.headers().get("grpc-status").map(|s| {
            let message = response
                .headers()
                .get("grpc-message")
                .map(|m| percent_decoded(m.to_str().unwrap()))
                .unwrap_or_default();
            (s.to_str().unwrap().to_owned(), message)
        });
        Self {
            body: response.into_body(),
            buf: BytesMut::new(),
            status,
        }
    }

    /// The next event; None once the body ended.
    async fn next(&mut self) -> Option<pb::session_event::Event> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
                if self.buf.len() >= 5 + len {
                    assert_eq!(self.buf[0], 0, "an uncompressed gRPC frame");
                    let frame = self.buf.split_to(5 + len);
                    let event = pb::SessionEvent::decode(&frame[5..]).expect("a SessionEvent");
                    return Some(event.event.expect("an event with its variant set"));
                }
            }
            let chunk = self.body.data().await?.expect("the session's body");
            self.body.flow_control().release_capacity(chunk.len()).unwrap();
            self.buf.extend_from_slice(&chunk);
        }
    }

    async fn published(&mut self) -> pb::SessionPublished {
        match self.next().await {
            Some(pb::session_event::Event::Published(p)) => p,
            other => panic!("expected published, got {other:?}"),
        }
    }

    /// (grpc-status, grpc-message) once the body ended.
    async fn status(mut self) -> (String, String) {
        if let Some(status) = self.status.take() {
            return status;
        }
        if let Some(event) = self.next().await {
            panic!("the end was expected, got an event: {event:?}");
        }
        let trailers = self.body.trailers().await.unwrap().expect("the session's trailers");
        let status = trailers.get("grpc-status").map(|v| v.to_str().unwrap().to_owned());
        let message = trailers
            .get("grpc-message")
            .map(|m| percent_decoded(m.to_str().unwrap()))
            .unwrap_or_default();
        (status.unwrap_or_default(), message)
    }
}

fn session_publish(id: u64, messages: Vec<pb::PublishRequest>) -> pb::SessionRequest {
    pb::SessionRequest {
        request: Some(pb::session_request::Request::Publish(pb::SessionPublish {
            id,
            messages,
        })),
    }
}

/// One `SessionPublish` of 300 messages (about 36 KB) sent in DATA frames of
/// 1, 2, 3, 5, 8, ... bytes up to 4 KiB each (the gRPC header itself split
/// across frames), with pauses between some: the broker reassembles it and
/// answers it once, all accepted, and a subscriber gets the 300 in order;
/// a second batch right behind it in the same frames is answered next.
/// (Catches: a request decoded from what one DATA frame holds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_publish_split_across_data_frames_is_published_whole() {
    let broker = start().await;
    let addr = broker.grpc_addr.to_string();
    timeout(async {
        let (mut sub, _) = subscribe(&mut broker.client().await, &["h2.split.>"]).await;
        let (mut send, _connection, _) = connect(&addr).await;
        let (response, mut stream) = send.send_request(grpc_request(&addr, "Session"), false).unwrap();
        let mut events = SessionEvents::new(response).await;
        let batch = |id: u64, prefix: &str| {
            session_publish(
                id,
                (0..300)
                    .map(|i| pb::PublishRequest {
                        topic: format!("h2.split.{prefix}"),
                        payload: format!("{prefix}{i:0100}").into_bytes().into(),
                        headers: Default::default(),
                    })
                    .collect(),
            )
        };
        let mut bytes = BytesMut::new();
        bytes.extend_from_slice(&grpc_frame(&batch(1, "a")));
        bytes.extend_from_slice(&grpc_frame(&batch(2, "b")));
        let mut bytes = bytes.freeze();
        let total = bytes.len();
        let (mut a, mut b) = (1usize, 2usize);
        let mut frames = 0;
        while !bytes.is_empty() {
            let piece = bytes.split_to(a.min(4096).min(bytes.len()));
            send_one_frame(&mut stream, piece).await.unwrap();
            frames += 1;
            if frames % 7 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (a, b) = (b, a + b);
            if a > 4096 {
                (a, b) = (1, 2);
            }
        }
        eprintln!("two batches of {total} bytes in {frames} DATA frames");
        for (id, prefix) in [(1, "a"), (2, "b")] {
            let answer = events.published().await;
            assert_eq!((answer.id, answer.accepted), (id, 300), "{answer:?}");
            assert!(answer.rejected.is_empty(), "{answer:?}");
            for i in 0..300u64 {
                let m = sub.message().await.unwrap().expect("the subscription is open");
                assert_eq!(m.payload, format!("{prefix}{i:0100}").as_bytes(), "in order");
                assert_eq!(m.sequence, answer.first_sequence + i);
            }
        }
        stream.send_data(Bytes::new(), true).unwrap();
        let (status, message) = events.status().await;
        assert_eq!(status, "0", "{message}");
    })
    .await;
}

/// A `SessionPublish` larger than any request may be (max_message_bytes +
/// 64 KiB) ends that session with RESOURCE_EXHAUSTED naming
/// max_message_bytes, and nothing else: another session on the same
/// connection goes on publishing and ends OK, and the connection serves
/// new calls. None of the oversize batch is published. (Catches: an
/// oversize request read whole; the connection closed for it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_batch_ends_only_its_session() {
    let broker = start_with_limits(tinybroker::config::Limits {
        max_message_bytes: 65_536,
        ..Default::default()
    })
    .await;
    let addr = broker.grpc_addr.to_string();
    timeout(async {
        let (mut sub, _) = subscribe(&mut broker.client().await, &["h2.big"]).await;
        let (mut send, connection, _) = connect(&addr).await;
        let (other_response, mut other) = send.send_request(grpc_request(&addr, "Session"), false).unwrap();
        let mut other_events = SessionEvents::new(other_response).await;
        let mut send = send.ready().await.unwrap();
        let (response, mut stream) = send.send_request(grpc_request(&addr, "Session"), false).unwrap();
        let events = SessionEvents::new(response).await;
        // Three messages of 60,000 bytes: each within max_message_bytes,
        // the request (about 180 KB) over 65,536 + 65,536.
        let big = session_publish(
            1,
            (0..3)
                .map(|i| pb::PublishRequest {
                    topic: "h2.big".into(),
                    payload: vec![b'0' + i; 60_000].into(),
                    headers: Default::default(),
                })
                .collect(),
        );
        assert!(big.encoded_len() > 65_536 + 64 * 1024);
        send_one_frame(&mut stream, grpc_frame(&big)).await.unwrap();
        let (status, message) = events.status().await;
        assert_eq!(status, "8", "RESOURCE_EXHAUSTED: {message}");
        assert!(
            message.to_lowercase().contains("max_message_bytes"),
            "names max_message_bytes: {message}"
        );

        // The other session on the connection goes on.
        let small = session_publish(2, vec![common::publish_request("h2.big", "small")]);
        send_one_frame(&mut other, grpc_frame(&small)).await.unwrap();
        let answer = other_events.published().await;
        assert_eq!((answer.id, answer.accepted), (2, 1), "{answer:?}");
        let m = sub.message().await.unwrap().expect("the subscription is open");
        assert_eq!(&m.payload[..], b"small", "nothing of the oversize batch was published");
        other.send_data(Bytes::new(), true).unwrap();
        let (status, message) = other_events.status().await;
        assert_eq!(status, "0", "{message}");
        assert!(!connection.is_finished(), "the connection stays up");
        let mut send = send.ready().await.expect("the connection serves new calls");
        let (response, mut call) = send.send_request(grpc_request(&addr, "Publish"), false).unwrap();
        call.send_data(grpc_frame(&common::publish_request("h2.big", "after")), true)
            .unwrap();
        let (status, message, _) = read_response(response).await.unwrap();
        assert_eq!(status, "0", "{message}");
    })
    .await;
}
