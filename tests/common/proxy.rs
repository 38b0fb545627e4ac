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
                tokio::spawn(
                    stop_all
                        .clone()
                        .run_until_cancelled_owned(serve(client, upstream, accepting.clone())),
                );
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

/// Waits until the proxy forwards: true, or false when it resets.
async fn forwarding(mode: &mut watch::Receiver<Mode>) -> bool {
    loop {
        match *mode.borrow_and_update() {
            Mode::Forward => return true,
            Mode::Reset => return false,
            Mode::Blackhole => {}
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}

/// Resets `stream`: closed with linger 0, so the peer gets an RST.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn serve(client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    if !forwarding(&mut mode).await {
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
        let mut resets = mode.clone();
        tokio::select! {
            _ = pump(client_read, server_write, mode.clone()) => false,
            _ = pump(server_read, client_write, mode.clone()) => false,
            _ = resets.wait_for(|m| *m == Mode::Reset) => true,
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

/// Copies `from` to `to` while the proxy forwards; holds what it read
/// while it is blackholed; ends at the end of `from`, an error, or a reset.
async fn pump<R, W>(mut from: R, mut to: W, mut mode: watch::Receiver<Mode>)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !forwarding(&mut mode).await {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !forwarding(&mut mode).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
