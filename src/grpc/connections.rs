//! Accepts gRPC connections and serves HTTP/2 on them: the connection cap,
//! the handshake timeout, TLS, the HTTP/2 settings that decide what one
//! connection may hold, and a log line and a counter for every connection
//! closed for abuse.
//!
//! HTTP/2 flow control bounds the bytes a client may have in flight, not
//! the frames carrying them; h2 guards against floods of tiny DATA frames
//! with a budget of half the connection window, charged for every small
//! frame the application has not read yet. Stock gRPC clients (grpc-core's
//! Python, C++, Ruby; grpc-js) send one DATA frame per message, so a paused
//! broker (a CPU limit, a GC-like stall) finds up to a whole stream window of
//! tiny frames waiting. The windows below are sized so that this fits the
//! budget: a stream window of [`STREAM_WINDOW`] bytes of 8-byte messages
//! costs about 8 MiB of budget, and the connection window of
//! [`CONNECTION_WINDOW`] gives 16 MiB, so two such streams fit at once,
//! while a peer sending 1-byte frames it never lets the broker read is cut
//! off once about 64 KiB of them (65,000 frames) wait unread.
//!
//! Writes (issue 16): the requests of a connection run in its own task
//! ([`crate::grpc::executor`]), so all the streams a message woke queue
//! their frames before the connection writes, and [`Coalesce`]
//! (`grpc::coalesce`) sends what one turn of that task wrote in one system
//! call.

use crate::grpc::coalesce::Coalesce;
use crate::grpc::executor::Requests;
use crate::grpc::request_budget::{BoundedBody, ConnectionIncoming, IncomingLimits};
use crate::retry::Backoff;
use bytes::{Buf, Bytes};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::codegen::http;
use tonic::transport::server::TcpConnectInfo;
use tower::ServiceExt;

/// Initial flow-control window of each stream the client opens.
pub const STREAM_WINDOW: u32 = 256 * 1024;
/// Initial flow-control window of the whole connection; h2's budget for
/// small DATA frames is half of it (see the module docs).
pub const CONNECTION_WINDOW: u32 = 32 * 1024 * 1024;

/// How long a connection may take to finish its calls once the broker
/// stops serving.
pub const GRACEFUL_CLOSE: Duration = Duration::from_secs(5);

/// The wait after a failed accept (out of file descriptors or memory),
/// doubling while it keeps failing, jittered.
const ACCEPT_DELAY_FIRST: Duration = Duration::from_millis(5);
const ACCEPT_DELAY_CAP: Duration = Duration::from_secs(1);

/// The client connection preface every HTTP/2 connection begins with.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Why a connection was closed by the broker rather than by its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// `TINYBROKER_MAX_CONNECTIONS` were open already.
    ConnectionLimit,
    /// No TLS handshake and HTTP/2 preface within the handshake timeout.
    HandshakeTimeout,
    /// The TLS handshake failed.
    TlsHandshake,
    /// The first bytes were not the HTTP/2 preface (HTTP/1, plaintext
    /// against TLS, ...).
    NotHttp2,
    /// h2's flood protection: too many small DATA frames unread, too many
    /// resets (GOAWAY ENHANCE_YOUR_CALM).
    Http2Flood,
    /// Any other HTTP/2 protocol violation that ended the connection.
    Http2ProtocolError,
}

impl Rejection {
    pub const ALL: [Rejection; 6] = [
        Rejection::ConnectionLimit,
        Rejection::HandshakeTimeout,
        Rejection::TlsHandshake,
        Rejection::NotHttp2,
        Rejection::Http2Flood,
        Rejection::Http2ProtocolError,
    ];

    /// The `reason` label of `tinybroker_connections_rejected_total`.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::ConnectionLimit => "connection_limit",
            Rejection::HandshakeTimeout => "handshake_timeout",
            Rejection::TlsHandshake => "tls_handshake",
            Rejection::NotHttp2 => "not_http2",
            Rejection::Http2Flood => "http2_flood",
            Rejection::Http2ProtocolError => "http2_protocol_error",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Rejection::ConnectionLimit => {
                "connection refused: max_connections (TINYBROKER_MAX_CONNECTIONS) are open already"
            }
            Rejection::HandshakeTimeout => {
                "connection closed: no TLS handshake and HTTP/2 preface within the handshake timeout (TINYBROKER_HANDSHAKE_TIMEOUT_SECONDS)"
            }
            Rejection::TlsHandshake => "connection closed: the TLS handshake failed",
            Rejection::NotHttp2 => {
                "connection closed: the client did not speak HTTP/2 (plaintext to a TLS port, TLS to a plaintext port, or HTTP/1)"
            }
            Rejection::Http2Flood => "connection closed for abuse: HTTP/2 flood protection (GOAWAY ENHANCE_YOUR_CALM)",
            Rejection::Http2ProtocolError => "connection closed: HTTP/2 protocol error",
        }
    }
}

/// Counters of the listener, read by the metrics.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    open: AtomicUsize,
    rejected: [AtomicU64; Rejection::ALL.len()],
    accept_errors: AtomicU64,
    /// One rate limit per kind of log line, so a flood of one cannot hide
    /// another.
    log_limits: [LogLimit; Rejection::ALL.len() + 1],
}

impl ConnectionStats {
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    pub fn rejected(&self, reason: Rejection) -> u64 {
        self.rejected[reason as usize].load(Ordering::Relaxed)
    }

    pub fn accept_errors(&self) -> u64 {
        self.accept_errors.load(Ordering::Relaxed)
    }

    fn reject(&self, reason: Rejection, peer: SocketAddr, detail: Option<&str>) {
        self.rejected[reason as usize].fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.log_limits[reason as usize].admit() {
            tracing::warn!(
                %peer,
                reason = reason.label(),
                detail = detail.unwrap_or(""),
                similar_since_last_line = suppressed,
                "{}",
                reason.describe()
            );
        }
    }
}

/// At most one log line a second; counts the lines held back meanwhile.
#[derive(Debug, Default)]
struct LogLimit {
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl LogLimit {
    /// Some(lines held back since the last one) when a line may go out now.
    fn admit(&self) -> Option<u64> {
        let mut last = self.last.lock();
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now);
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

/// How connections are accepted and served.
pub struct Settings {
    pub limits: crate::config::ConnectionLimits,
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    pub incoming: Arc<IncomingLimits>,
}

/// Accepts connections on `listener` until `stop` is cancelled, serving each
/// with `service`; then asks every connection to finish (HTTP/2 GOAWAY) and
/// returns once all have closed.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    settings: Settings,
    stats: Arc<ConnectionStats>,
    stop: CancellationToken,
) where
    S: tower::Service<http::Request<BoundedBody<Incoming>>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let settings = Arc::new(settings);
    let connections = TaskTracker::new();
    // Out of file descriptors or memory: spinning on accept would only
    // burn the CPU the open connections need.
    let mut backoff = Backoff::new(ACCEPT_DELAY_FIRST, ACCEPT_DELAY_CAP);
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => {
                backoff.reset();
                accepted
            }
            Err(e) if is_per_connection(&e) => continue,
            Err(e) => {
                let delay = backoff.next_delay();
                stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = stats.log_limits[Rejection::ALL.len()].admit() {
                    tracing::warn!(
                        error = %e,
                        retry_in_ms = delay.as_millis() as u64,
                        similar_since_last_line = suppressed,
                        "cannot accept gRPC connections (is the file descriptor limit reached?); backing off"
                    );
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(delay) => continue,
                }
            }
        };
        if stats.open.load(Ordering::Relaxed) >= settings.limits.max_connections {
            stats.reject(Rejection::ConnectionLimit, peer, None);
            drop(tcp);
            continue;
        }
        let open = OpenConnection::new(stats.clone());
        let (service, settings, stop) = (service.clone(), settings.clone(), stop.clone());
        connections.spawn(async move {
            serve_connection(tcp, peer, service, &settings, &open.stats, stop).await;
            drop(open);
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Errors of one pending connection that say nothing about the listener.
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
    )
}

/// Counts an open connection for as long as it lives.
struct OpenConnection {
    stats: Arc<ConnectionStats>,
}

impl OpenConnection {
    fn new(stats: Arc<ConnectionStats>) -> Self {
        stats.open.fetch_add(1, Ordering::Relaxed);
        Self { stats }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve_connection<S, B>(
    tcp: TcpStream,
    peer: SocketAddr,
    service: S,
    settings: &Settings,
    stats: &ConnectionStats,
    stop: CancellationToken,
) where
    S: tower::Service<http::Request<BoundedBody<Incoming>>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // tonic's own listener would set it too: without it, Nagle holds back
    // small deliveries for milliseconds.
    let _ = tcp.set_nodelay(true);
    let info = TcpConnectInfo {
        local_addr: tcp.local_addr().ok(),
        remote_addr: Some(peer),
    };
    let handshake = tokio::time::timeout(settings.limits.handshake_timeout, async {
        match &settings.tls {
            None => read_preface(tcp).await.map(Stream::Plain),
            Some(acceptor) => {
                let tls = acceptor.accept(tcp).await.map_err(Handshake::Tls)?;
                read_preface(tls).await.map(|io| Stream::Tls(Box::new(io)))
            }
        }
    });
    let (io, writes) = match handshake.await {
        Ok(Ok(stream)) => Io::new(stream),
        Ok(Err(Handshake::Closed)) => return,
        Ok(Err(Handshake::Tls(e))) => return stats.reject(Rejection::TlsHandshake, peer, Some(&e.to_string())),
        Ok(Err(Handshake::NotHttp2)) => return stats.reject(Rejection::NotHttp2, peer, None),
        Err(_) => return stats.reject(Rejection::HandshakeTimeout, peer, None),
    };
    let incoming = ConnectionIncoming::new(settings.incoming.clone());
    let per_request = hyper::service::service_fn(move |mut request: http::Request<Incoming>| {
        request.extensions_mut().insert(info.clone());
        let request = request.map(|body| BoundedBody::new(body, incoming.clone()));
        // Boxed, so that what hyper keeps for the rest of a stream's life is
        // sized for its response body, not for this future: hyper's stream
        // state is an enum of the two, and this one (the request, the
        // service stack) made every idle subscription hold about 400 bytes
        // it no longer used (issue 16; BENCHMARKS.md).
        let call: Pin<Box<dyn Future<Output = Result<http::Response<B>, Infallible>> + Send>> =
            Box::pin(service.clone().oneshot(request));
        call
    });
    let limits = &settings.limits;
    let mut requests = Requests::new();
    let mut builder = hyper::server::conn::http2::Builder::new(requests.spawner());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(limits.max_streams_per_connection)
        .keep_alive_interval(limits.keepalive_interval)
        .keep_alive_timeout(limits.keepalive_timeout);
    let mut connection = Box::pin(builder.serve_connection(TokioIo::new(io), per_request));
    // One turn of the connection's task: its requests and the connection
    // are polled with the socket's writes held, and what they wrote goes
    // out at the end, together (grpc::coalesce).
    let mut turn = |cx: &mut Context<'_>, connection: Pin<&mut _>| {
        writes.hold();
        let polled = requests.drive(connection, cx);
        writes.release(cx);
        polled
    };
    let result = tokio::select! {
        result = std::future::poll_fn(|cx| turn(cx, connection.as_mut())) => result,
        _ = stop.cancelled() => {
            // GOAWAY: calls in progress may finish, no new ones start.
            connection.as_mut().graceful_shutdown();
            let finished = std::future::poll_fn(|cx| turn(cx, connection.as_mut()));
            match tokio::time::timeout(GRACEFUL_CLOSE, finished).await {
                Ok(result) => result,
                Err(_) => return tracing::debug!(%peer, "gRPC connection did not finish its calls in time; dropped"),
            }
        }
    };
    // Dropping the connection ends the streams of requests still running
    // (h2 tells each its connection is gone); they end at their next poll.
    drop(connection);
    if tokio::time::timeout(GRACEFUL_CLOSE, requests.finish()).await.is_err() {
        tracing::warn!(%peer, running = requests.len(), "requests of a closed gRPC connection did not end; dropped");
    }
    if let Err(e) = result {
        match library_go_away(&e) {
            Some(reason) => stats.reject(reason, peer, Some(&e.to_string())),
            None => tracing::debug!(%peer, error = %e, "gRPC connection ended with an error"),
        }
    }
}

/// The rejection when `error` is a GOAWAY the broker's HTTP/2 layer sent
/// on its own (a protocol violation or flood), not one the client sent.
fn library_go_away(error: &hyper::Error) -> Option<Rejection> {
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            if !(h2.is_go_away() && h2.is_library()) {
                return None;
            }
            return Some(match h2.reason() {
                Some(h2::Reason::ENHANCE_YOUR_CALM) => Rejection::Http2Flood,
                _ => Rejection::Http2ProtocolError,
            });
        }
        source = e.source();
    }
    None
}

enum Handshake {
    /// Closed before sending a byte: a TCP probe or a port scan, not worth a line.
    Closed,
    Tls(io::Error),
    NotHttp2,
}

/// Reads the client's HTTP/2 preface and hands back a stream that replays it.
async fn read_preface<T: AsyncRead + Unpin>(mut io: T) -> Result<Replay<T>, Handshake> {
    let mut preface = [0u8; PREFACE.len()];
    let mut read = 0;
    while read < preface.len() {
        match io.read(&mut preface[read..]).await {
            Ok(0) if read == 0 => return Err(Handshake::Closed),
            Ok(0) | Err(_) => return Err(Handshake::NotHttp2),
            Ok(n) => read += n,
        }
        if preface[..read] != PREFACE[..read] {
            return Err(Handshake::NotHttp2);
        }
    }
    Ok(Replay {
        prefix: Bytes::from_static(PREFACE),
        inner: io,
    })
}

/// A connection's stream, plaintext or TLS.
enum Stream {
    Plain(Replay<TcpStream>),
    Tls(Box<Replay<tokio_rustls::server::TlsStream<TcpStream>>>),
}

/// A stream whose first bytes, already read, are handed out again first.
struct Replay<T> {
    prefix: Bytes,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Replay<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Replay<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Runs `$body` with `$io` bound to the pinned stream inside a [`Stream`].
macro_rules! with_io {
    ($self:expr, $io:ident => $body:expr) => {
        match $self.get_mut() {
            Stream::Plain(inner) => {
                let $io = Pin::new(inner);
                $body
            }
            Stream::Tls(inner) => {
                let $io = Pin::new(inner.as_mut());
                $body
            }
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        with_io!(self, io => io.poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        with_io!(self, io => io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        with_io!(self, io => io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(io) => io.is_write_vectored(),
            Stream::Tls(io) => io.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_io!(self, io => io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_io!(self, io => io.poll_shutdown(cx))
    }
}

/// What hyper and h2 read and write: the connection's stream behind
/// [`Coalesce`].
type Io = Coalesce<Stream>;

/// Raises the soft limit of open file descriptors to the hard limit, so that
/// `max_connections` connections fit; returns the limit now in force.
pub fn raise_fd_limit() -> io::Result<libc::rlim_t> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Err(io::Error::last_os_error());
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                return Ok(limit.rlim_cur);
            }
            limit = raised;
        }
    }
    Ok(limit.rlim_cur)
}

/// Binds a listener with a backlog of 4,096 pending connections (the
/// kernel caps it at `net.core.somaxconn`), not std's 128.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_preface_is_replayed_and_anything_else_refused() {
        let (mut client, server) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut client, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nSETTINGS")
            .await
            .unwrap();
        let mut replay = read_preface(server).await.ok().expect("a preface");
        let mut all = vec![0u8; 32];
        replay.read_exact(&mut all).await.unwrap();
        assert_eq!(&all, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nSETTINGS");

        let (mut client, server) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut client, b"GET / HTTP/1.1\r\n")
            .await
            .unwrap();
        assert!(matches!(read_preface(server).await, Err(Handshake::NotHttp2)));

        let (client, server) = tokio::io::duplex(64);
        drop(client);
        assert!(matches!(read_preface(server).await, Err(Handshake::Closed)));
    }

    #[test]
    fn log_lines_are_limited_to_one_a_second() {
        let limit = LogLimit::default();
        assert_eq!(limit.admit(), Some(0));
        assert_eq!(limit.admit(), None);
        assert_eq!(limit.admit(), None);
        *limit.last.lock() = Some(Instant::now() - Duration::from_secs(2));
        assert_eq!(limit.admit(), Some(2), "two held back");
    }
}
