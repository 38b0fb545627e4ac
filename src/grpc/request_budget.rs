//! Bounds the memory held for requests still being received. The bytes of
//! every gRPC message a client has begun but not finished sending are
//! charged as they arrive, to their connection (at most
//! [`IncomingLimits::per_connection`]) and to their share of the broker's
//! memory budget (an eighth, see [`crate::memory::split`]); a
//! request that would go over either fails with RESOURCE_EXHAUSTED naming
//! the limit, and its bytes are released at once. A complete message is
//! released as soon as it is complete: from then on it is the broker's
//! (charged as a published message) or gone.

use crate::memory::MemoryBudget;
use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use tonic::Status;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Length of the gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_LEN: usize = 5;

/// Limits shared by every connection of one server.
#[derive(Debug)]
pub struct IncomingLimits {
    /// Bytes of incomplete messages one connection may hold, all its
    /// streams together.
    pub per_connection: usize,
    pub memory: &'static MemoryBudget,
    /// Requests refused because their connection held too much.
    pub refused_connection_limit: AtomicU64,
    /// Requests refused because the broker's memory budget was spent.
    pub refused_memory_limit: AtomicU64,
}

impl IncomingLimits {
    /// The per-connection limit for a broker whose largest request is
    /// `max_request_bytes`: room for several maximal requests at once, and
    /// never below 16 MiB.
    pub fn new(max_request_bytes: usize, memory: &'static MemoryBudget) -> Self {
        Self {
            per_connection: max_request_bytes.saturating_mul(4).max(16 << 20),
            memory,
            refused_connection_limit: AtomicU64::new(0),
            refused_memory_limit: AtomicU64::new(0),
        }
    }
}

/// What one connection holds of incomplete requests.
#[derive(Debug)]
pub struct ConnectionIncoming {
    limits: Arc<IncomingLimits>,
    held: AtomicUsize,
}

impl ConnectionIncoming {
    pub fn new(limits: Arc<IncomingLimits>) -> Arc<Self> {
        Arc::new(Self {
            limits,
            held: AtomicUsize::new(0),
        })
    }

    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn try_charge(&self, bytes: usize) -> Result<(), Status> {
        let limits = &self.limits;
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > limits.per_connection {
            self.held.fetch_sub(bytes, Ordering::Relaxed);
            limits.refused_connection_limit.fetch_add(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "this connection already holds {before} bytes of requests still being received, and {bytes} more would exceed its limit of {} bytes (4 x the largest request, TINYBROKER_MAX_MESSAGE_BYTES); finish or cancel the requests already started",
                limits.per_connection
            )));
        }
        if !limits.memory.try_charge(bytes) {
            self.held.fetch_sub(bytes, Ordering::Relaxed);
            limits.refused_memory_limit.fetch_add(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "requests being received take {} bytes, their share (an eighth, {} bytes) of max_memory_bytes (TINYBROKER_MAX_MEMORY_BYTES): the {bytes} more of this request do not fit",
                limits.memory.used(),
                limits.memory.limit().unwrap_or(usize::MAX)
            )));
        }
        Ok(())
    }

    fn release(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        self.limits.memory.release(bytes);
    }
}

/// Where a stream is in the gRPC framing of its messages.
#[derive(Debug, Default)]
struct Framing {
    /// Bytes of the current message's prefix seen so far (0..5).
    prefix: [u8; PREFIX_LEN],
    prefix_seen: usize,
    /// Bytes of the current message's body still to come, once its prefix
    /// is complete.
    body_left: usize,
}

impl Framing {
    /// Walks `chunk`; returns the bytes of the message still incomplete at
    /// its end (prefix included).
    fn advance(&mut self, mut chunk: &[u8]) -> usize {
        while !chunk.is_empty() {
            if self.prefix_seen < PREFIX_LEN {
                let n = (PREFIX_LEN - self.prefix_seen).min(chunk.len());
                self.prefix[self.prefix_seen..self.prefix_seen + n].copy_from_slice(&chunk[..n]);
                self.prefix_seen += n;
                chunk = &chunk[n..];
                if self.prefix_seen == PREFIX_LEN {
                    let len = u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]);
                    self.body_left = len as usize;
                    if self.body_left == 0 {
                        self.prefix_seen = 0;
                    }
                }
                continue;
            }
            let n = self.body_left.min(chunk.len());
            self.body_left -= n;
            chunk = &chunk[n..];
            if self.body_left == 0 {
                self.prefix_seen = 0;
            }
        }
        self.in_progress()
    }

    fn in_progress(&self) -> usize {
        match self.prefix_seen {
            0 => 0,
            PREFIX_LEN => {
                let len = u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]) as usize;
                PREFIX_LEN + (len - self.body_left)
            }
            seen => seen,
        }
    }
}

/// A request body whose incomplete message bytes are charged (see the
/// module docs).
pub struct BoundedBody<B> {
    inner: B,
    connection: Arc<ConnectionIncoming>,
    framing: Framing,
    /// What is charged for this stream now.
    charged: usize,
    /// Set once a limit refused this stream: it yields nothing more.
    failed: bool,
}

impl<B> BoundedBody<B> {
    pub fn new(inner: B, connection: Arc<ConnectionIncoming>) -> Self {
        Self {
            inner,
            connection,
            framing: Framing::default(),
            charged: 0,
            failed: false,
        }
    }

    /// Charges or releases the change in this stream's incomplete bytes.
    fn account(&mut self, data: &Bytes) -> Result<(), Status> {
        let now = self.framing.advance(data.chunk());
        if now > self.charged {
            self.connection.try_charge(now - self.charged)?;
        } else {
            self.connection.release(self.charged - now);
        }
        self.charged = now;
        Ok(())
    }
}

impl<B> Drop for BoundedBody<B> {
    fn drop(&mut self) {
        self.connection.release(self.charged);
    }
}

impl<B> Body for BoundedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            None => return Poll::Ready(None),
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            Some(Ok(frame)) => frame,
        };
        if let Some(data) = frame.data_ref()
            && let Err(status) = self.account(data)
        {
            self.failed = true;
            let charged = std::mem::take(&mut self.charged);
            self.connection.release(charged);
            return Poll::Ready(Some(Err(Box::new(status))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc_message(len: usize) -> Vec<u8> {
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(&(len as u32).to_be_bytes());
        bytes.extend(std::iter::repeat_n(7u8, len));
        bytes
    }

    #[test]
    fn framing_counts_only_the_unfinished_message() {
        let mut f = Framing::default();
        let two = [grpc_message(10), grpc_message(3)].concat();
        assert_eq!(f.advance(&two), 0, "two whole messages");
        assert_eq!(f.advance(&[0, 0, 0]), 3, "part of a prefix");
        assert_eq!(f.advance(&[0, 100]), 5, "a whole prefix of a 100-byte message");
        assert_eq!(f.advance(&[1; 60]), 65);
        let rest_and_next = [vec![1; 40], grpc_message(0), vec![0, 0]].concat();
        assert_eq!(f.advance(&rest_and_next), 2, "done, an empty one, and the next begun");
    }

    #[test]
    fn a_connection_over_its_limit_refuses_and_releases_on_drop() {
        let memory = MemoryBudget::leak(None);
        let limits = Arc::new(IncomingLimits {
            per_connection: 100,
            ..IncomingLimits::new(0, memory)
        });
        let connection = ConnectionIncoming::new(limits.clone());
        let mut a = BoundedBody::new((), connection.clone());
        let mut b = BoundedBody::new((), connection.clone());
        // Each begins a 1,000-byte message.
        let begun = Bytes::from([grpc_message(1000)[..60].to_vec()].concat());
        a.account(&begun).unwrap();
        assert_eq!((connection.held(), memory.used()), (60, 60));
        let err = b.account(&begun).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("limit of 100 bytes"), "{}", err.message());
        assert_eq!(limits.refused_connection_limit.load(Ordering::Relaxed), 1);
        assert_eq!(connection.held(), 60, "the refused charge left nothing");
        drop(a);
        assert_eq!((connection.held(), memory.used()), (0, 0));
        drop(b);
        assert_eq!(connection.held(), 0);
    }

    #[test]
    fn the_memory_budget_refuses_too() {
        let memory = MemoryBudget::leak(Some(50));
        let limits = Arc::new(IncomingLimits::new(1 << 20, memory));
        let connection = ConnectionIncoming::new(limits.clone());
        let mut body = BoundedBody::new((), connection.clone());
        let err = body
            .account(&Bytes::from(grpc_message(1000)[..60].to_vec()))
            .unwrap_err();
        assert!(
            err.message().contains("TINYBROKER_MAX_MEMORY_BYTES"),
            "{}",
            err.message()
        );
        assert_eq!(limits.refused_memory_limit.load(Ordering::Relaxed), 1);
        assert_eq!((connection.held(), memory.used()), (0, 0));
    }
}
