//! A TCP proxy inside the test, between one replica and its NATS server,
//! that the test can cut the way a network does, with no root and no
//! network namespace:
//! - [`Proxy::blackhole`]: a partition. Nothing is forwarded either way and
//!   every socket stays open: bytes sent meanwhile wait (in the kernel's
//!   buffers, and at most one read chunk per direction in the proxy), as
//!   TCP keeps retransmitting them through a real partition, and go through
//!   when it heals. A new connection is accepted and waits too (its
//!   upstream connection is made when it heals).
//! - [`Proxy::reset`]: every open connection is reset (RST, both sides),
//!   and new ones are reset as they come, until it heals.
//! - [`Proxy::heal`]: forwarding again, on the same connections.
//!
//! The proxy's tasks end when it is dropped (its connections with them).

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Forward,
    Blackhole,
    Reset,
}

pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    stop: CancellationToken,
}

impl Proxy {
    /// A proxy on 127.0.0.1 (a port of its own) to `upstream`, forwarding.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::Forward);
        let stop = CancellationToken::new();
        let accepting = mode.subscribe();
        tokio::spawn(stop.clone().run_until_cancelled_owned(async move {
            let stop_all = CancellationToken::new();
            let _stop_all = stop_all.clone().drop_guard();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                tokio::spawn(stop_all.clone().run_until_cancelled_owned(serve(
                    client,
                    upstream,
                    accepting.clone(),
                    |m: &Mode| *m,
                    None,
                )));
            }
        }));
        Proxy { addr, mode, stop }
    }

    /// The URL a NATS client connects to: `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    pub fn blackhole(&self) {
        self.mode.send_replace(Mode::Blackhole);
    }

    pub fn reset(&self) {
        self.mode.send_replace(Mode::Reset);
    }

    pub fn heal(&self) {
        self.mode.send_replace(Mode::Forward);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The upstream address of a `nats://host:port` URL.
pub fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("nats://").parse().expect("a nats://ip:port URL")
}

/// Resets `stream`: closed with linger 0, so the peer gets an RST.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// A connection through a proxy: forwarded while `mode` (of the proxy's
/// state) says so, held while it blackholes, reset when it resets (and a
/// new one reset as it comes). `solicitor` is filled from the client's
/// first line when given (a route's CONNECT names its server), before
/// that line is forwarded, so that `mode` can use it at once.
async fn serve<S>(
    client: TcpStream,
    upstream: SocketAddr,
    state: watch::Receiver<S>,
    mode: impl Fn(&S) -> Mode,
    solicitor: Option<&std::sync::OnceLock<String>>,
) {
    let mut waiting = state.clone();
    if !forwarding(&mut waiting, &mode).await {
        return reset(client);
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let _ = server.set_nodelay(true);
    let (mut client, mut server) = (client, server);
    let was_reset = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let mut resets = state.clone();
        tokio::select! {
            _ = pump(client_read, server_write, state.clone(), &mode, solicitor) => false,
            _ = pump(server_read, client_write, state.clone(), &mode, None) => false,
            _ = async {
                loop {
                    if mode(&resets.borrow_and_update()) == Mode::Reset {
                        return;
                    }
                    if resets.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
            } => true,
        }
    };
    if was_reset {
        reset(client);
        reset(server);
    } else {
        // One side closed: the other is closed in kind.
        let _ = client.shutdown().await;
        let _ = server.shutdown().await;
    }
}

/// Waits until the connection forwards: true, or false when it resets.
async fn forwarding<S>(state: &mut watch::Receiver<S>, mode: &impl Fn(&S) -> Mode) -> bool {
    loop {
        match mode(&state.borrow_and_update()) {
            Mode::Forward => return true,
            Mode::Reset => return false,
            Mode::Blackhole => {}
        }
        if state.changed().await.is_err() {
            return false;
        }
    }
}

/// Copies `from` to `to` while the connection forwards; holds what it read
/// while it is blackholed; ends at the end of `from`, an error, or a
/// reset. With `solicitor`, the first line read names it (module docs).
async fn pump<S, R, W>(
    mut from: R,
    mut to: W,
    mut state: watch::Receiver<S>,
    mode: &impl Fn(&S) -> Mode,
    solicitor: Option<&std::sync::OnceLock<String>>,
) where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    let mut first_line = Vec::new();
    loop {
        if !forwarding(&mut state, mode).await {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(solicitor) = solicitor.filter(|s| s.get().is_none() && first_line.len() < 64 * 1024) {
            first_line.extend_from_slice(&buf[..n]);
            if let Some(end) = first_line.windows(2).position(|w| w == b"\r\n") {
                if let Some(id) = solicitor_of(&first_line[..end]) {
                    let _ = solicitor.set(id);
                }
                first_line = Vec::new();
            }
        }
        if !forwarding(&mut state, mode).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// What the proxies of a NATS cluster's routes do: forward, or cut one
/// server off from the others ([`RouteProxies::isolate`]).
#[derive(Debug, Clone, Default)]
struct Isolation {
    /// The server cut off, its `server_id` (what its routes' CONNECT says
    /// as `name`), and how.
    cut: Option<(usize, String, Mode)>,
}

impl Isolation {
    /// What a route connection accepted by server `owner`, solicited by
    /// the server whose id is `solicitor` (None until its CONNECT is
    /// read), goes through.
    fn mode(&self, owner: usize, solicitor: Option<&str>) -> Mode {
        match &self.cut {
            Some((server, id, mode)) if *server == owner || solicitor == Some(id.as_str()) => *mode,
            _ => Mode::Forward,
        }
    }
}

/// A proxy in front of every server's route port, each server's
/// `cluster.advertise` (and its peers' `routes`) naming its proxy, so that
/// every route connection of the cluster, configured or learned, goes
/// through exactly one of them: the accepting server's. A route's first
/// line from the soliciting side is `CONNECT {... "name":"<server_id>" ...}`,
/// so a proxy knows both ends of each connection, and
/// [`RouteProxies::isolate`] cuts every route to and from one server
/// (a partition of the NATS cluster), the way [`Proxy`] cuts a client's.
pub struct RouteProxies {
    state: watch::Sender<Isolation>,
    addrs: Vec<SocketAddr>,
    stop: CancellationToken,
}

impl RouteProxies {
    /// Proxies on 127.0.0.1, one to each of `upstreams` (route ports), forwarding.
    pub async fn start(upstreams: &[SocketAddr]) -> RouteProxies {
        let (state, _) = watch::channel(Isolation::default());
        let stop = CancellationToken::new();
        let mut addrs = Vec::new();
        for (owner, &upstream) in upstreams.iter().enumerate() {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a route proxy");
            addrs.push(listener.local_addr().unwrap());
            let state = state.subscribe();
            let stop_all = stop.clone();
            tokio::spawn(stop.clone().run_until_cancelled_owned(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    tokio::spawn(stop_all.clone().run_until_cancelled_owned(serve_route(
                        client,
                        upstream,
                        owner,
                        state.clone(),
                    )));
                }
            }));
        }
        RouteProxies { state, addrs, stop }
    }

    /// The address server `i`'s peers reach its route port at.
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.addrs[i]
    }

    /// Cuts server `i` (whose `server_id` is `id`) off from every other
    /// server: [`Mode::Blackhole`] or [`Mode::Reset`].
    pub fn isolate(&self, i: usize, id: &str, how: Mode) {
        self.state.send_replace(Isolation {
            cut: Some((i, id.to_owned(), how)),
        });
    }

    pub fn heal(&self) {
        self.state.send_replace(Isolation::default());
    }
}

impl Drop for RouteProxies {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The `name` of a route's `CONNECT {json}` line.
fn solicitor_of(line: &[u8]) -> Option<String> {
    let json = std::str::from_utf8(line).ok()?.strip_prefix("CONNECT ")?;
    let value: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
    value["name"].as_str().map(str::to_owned)
}

/// One route connection: its mode worked out from the cluster's
/// [`Isolation`], its accepting server and its soliciting one.
async fn serve_route(client: TcpStream, upstream: SocketAddr, owner: usize, state: watch::Receiver<Isolation>) {
    let solicitor = std::sync::OnceLock::<String>::new();
    let mode = |state: &Isolation| state.mode(owner, solicitor.get().map(String::as_str));
    serve(client, upstream, state, mode, Some(&solicitor)).await;
}
