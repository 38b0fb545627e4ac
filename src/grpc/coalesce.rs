//! How a connection's bytes reach its socket: the writes h2 makes in one
//! turn of the connection's task go out together, in as few system calls as
//! the socket allows ([`Coalesce`], with its [`WriteBehind`] handle).
//!
//! h2 0.4 writes with tokio-util's `poll_write_buf`, and flushes after every
//! large DATA frame: its 16 KiB write buffer holds at most one frame that
//! is not copied into it, and `FramedWrite::poll_ready` flushes (the buffer,
//! the frame, then the stream's `poll_flush`) before it takes the next. A
//! subscription that has 200 KiB of deliveries ready goes out as 13 frames
//! of 16 KiB (the client's `SETTINGS_MAX_FRAME_SIZE`): 13 system calls and 13
//! TCP segments, each of which wakes the reader on the other side. NATS
//! writes the same bytes in one.
//!
//! So this stream does two things:
//! - it tells h2 it has no vectored writes, so that h2 copies frames under
//!   1 KiB into its buffer and writes as many as are pending at once
//!   (with vectored writes h2 keeps every frame of 256 bytes or more out of
//!   its buffer, and writes each with its own `writev`);
//! - while the connection's driver holds it ([`WriteBehind::hold`], for the
//!   turn in which the driver polls the requests and the connection), it
//!   *stages* what h2 writes, up to [`WRITE_BEHIND_MAX`] bytes, instead of
//!   sending it, and answers h2's flushes at once. When the turn ends,
//!   [`WriteBehind::release`] sends everything staged, in one `write`.
//!   When staging a write would pass the limit, what is staged and that
//!   write go out together in one `writev`.
//!
//! Outside a turn (a stream with no driver, as in the tests) it stages only
//! h2's buffer, up to [`STAGE_MAX`], so that the large frame's payload h2
//! writes next goes out with it in one `writev`; `poll_flush` sends it.
//!
//! What it costs: staged bytes are copied once more (h2 hands the payload
//! of a large frame by reference). The copy is cheaper than the system
//! calls and segments it saves: server CPU per delivery of a fan-out 1→3
//! fell 16 %, and a paced wide fan-out on sessions, whose turns are a frame
//! or two, did not move (BENCHMARKS.md, "Write-behind"). (callgrind counts
//! the copy one instruction per byte, memcpy's `rep movsb`, so the
//! instruction guard's baseline rose with it.) A connection's staging
//! buffer is [`WRITE_BEHIND_MAX`] once a turn staged more than h2's buffer,
//! and is given back when a turn wrote no more than h2's buffer holds, so a
//! quiet connection keeps at most [`STAGE_MAX`].
//!
//! Nothing stays staged when a turn ends or a flush outside a turn has
//! returned `Ready`, except what the socket did not take; the driver's
//! `release` then leaves the task's waker with the socket, so that the
//! task is woken when it can take more. A socket error during `release`
//! is kept and returned to h2's next write or flush.

use parking_lot::Mutex;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The size of h2's write buffer (`DEFAULT_BUFFER_CAPACITY` in h2 0.4's
/// `codec/framed_write.rs`); no write h2 makes from it is larger.
pub const STAGE_MAX: usize = 16 * 1024;

/// Most bytes a turn of the connection's task stages before it sends them:
/// one TCP segment on loopback (its MTU is 64 KiB), a few on a network
/// with TSO.
pub const WRITE_BEHIND_MAX: usize = 128 * 1024;

/// What h2 reads and writes (owned by the HTTP/2 connection): a stream that
/// stages writes. See the module docs.
pub struct Coalesce<T> {
    shared: Arc<Mutex<Staged<T>>>,
}

/// The connection driver's handle on the [`Coalesce`] it was made with. It
/// holds the stream weakly: dropping the connection closes the socket.
pub struct WriteBehind<T> {
    shared: Weak<Mutex<Staged<T>>>,
}

struct Staged<T> {
    inner: T,
    /// Bytes accepted and not sent yet: `staged[sent..]`.
    staged: Vec<u8>,
    sent: usize,
    /// Set by the driver for one turn of the connection's task.
    holding: bool,
    /// What the socket said when `release` sent the staged bytes: for h2's
    /// next call.
    failed: Option<io::Error>,
}

impl<T> Coalesce<T> {
    pub fn new(inner: T) -> (Self, WriteBehind<T>) {
        let shared = Arc::new(Mutex::new(Staged {
            inner,
            staged: Vec::new(),
            sent: 0,
            holding: false,
            failed: None,
        }));
        let handle = WriteBehind {
            shared: Arc::downgrade(&shared),
        };
        (Self { shared }, handle)
    }
}

impl<T> Staged<T> {
    fn pending(&self) -> usize {
        self.staged.len() - self.sent
    }

    fn unstage(&mut self) {
        self.staged.clear();
        self.sent = 0;
    }

    fn take_failure(&mut self) -> io::Result<()> {
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl<T: AsyncWrite + Unpin> Staged<T> {
    /// Sends what is staged; `Ready(Ok)` once nothing is.
    fn poll_send_staged(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.pending() > 0 {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.staged[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.unstage();
        Poll::Ready(Ok(()))
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.take_failure()?;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let pending = self.pending();
        // In a turn, everything up to the turn's limit; outside one, h2's
        // buffer, which a large frame's payload follows.
        let limit = match (self.holding, pending) {
            (true, _) => WRITE_BEHIND_MAX,
            (false, 0) => STAGE_MAX,
            (false, _) => 0,
        };
        if pending + buf.len() <= limit {
            if pending == 0 {
                self.unstage();
            }
            if self.holding && self.staged.capacity() - self.staged.len() < buf.len() {
                // Straight to the turn's limit: growing by doubling would
                // copy what is staged again at each step. (What a partial
                // send left ahead of `sent` may already take it past.)
                let room = WRITE_BEHIND_MAX.saturating_sub(self.staged.len()).max(buf.len());
                self.staged.reserve_exact(room);
            }
            self.staged.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        if pending == 0 {
            return Pin::new(&mut self.inner).poll_write(cx, buf);
        }
        loop {
            let pending = self.pending();
            let slices = [io::IoSlice::new(&self.staged[self.sent..]), io::IoSlice::new(buf)];
            let n = ready!(Pin::new(&mut self.inner).poll_write_vectored(cx, &slices))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            if n < pending {
                self.sent += n;
                continue;
            }
            self.unstage();
            if n > pending {
                return Poll::Ready(Ok(n - pending));
            }
            // All of the staged bytes went and none of `buf`.
            return Pin::new(&mut self.inner).poll_write(cx, buf);
        }
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.take_failure()?;
        if self.holding {
            // The turn's end sends it (`WriteBehind::release`).
            return Poll::Ready(Ok(()));
        }
        ready!(self.poll_send_staged(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesce<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.shared.lock().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesce<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.shared.lock().poll_write(cx, buf)
    }

    /// No: see the module docs.
    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.shared.lock().poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut this = self.shared.lock();
        this.take_failure()?;
        ready!(this.poll_send_staged(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

impl<T: AsyncWrite + Unpin> WriteBehind<T> {
    /// A turn of the connection's task begins: writes are staged until
    /// [`WriteBehind::release`].
    pub fn hold(&self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.lock().holding = true;
        }
    }

    /// The turn has ended: sends what it staged. If the socket cannot take
    /// it all, the rest stays staged and `cx`'s task is woken when it can
    /// (h2's next flush, or the next turn's end, sends it); an error is
    /// kept for h2's next write or flush, and the task woken to see it.
    pub fn release(&self, cx: &mut Context<'_>) {
        let Some(shared) = self.shared.upgrade() else { return };
        let mut this = shared.lock();
        this.holding = false;
        if this.failed.is_some() {
            return;
        }
        let wrote = this.staged.len();
        match this.poll_send_staged(cx) {
            Poll::Ready(Ok(())) => {
                let flushed = Pin::new(&mut this.inner).poll_flush(cx);
                if let Poll::Ready(Err(e)) = flushed {
                    this.failed = Some(e);
                    cx.waker().wake_by_ref();
                }
                if wrote <= STAGE_MAX && this.staged.capacity() > STAGE_MAX {
                    // A quiet turn: give back what a busy one grew.
                    this.staged = Vec::new();
                }
            }
            Poll::Ready(Err(e)) => {
                this.failed = Some(e);
                cx.waker().wake_by_ref();
            }
            Poll::Pending => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket that records every call: the slices of each write, how
    /// many bytes it took (at most `take` per call), and a `Pending` before
    /// every call while `stall` is set (it wakes the task at once).
    #[derive(Default)]
    pub(super) struct Socket {
        writes: Vec<Vec<Vec<u8>>>,
        wire: Vec<u8>,
        take: Option<usize>,
        stall: bool,
        stalled: bool,
        flushes: usize,
        shut: bool,
        fail: bool,
    }

    impl Socket {
        fn stall(&mut self, cx: &mut Context<'_>) -> bool {
            if self.stall && !self.stalled {
                self.stalled = true;
                cx.waker().wake_by_ref();
                return true;
            }
            self.stalled = false;
            false
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            if this.fail {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            }
            if this.stall(cx) {
                return Poll::Pending;
            }
            this.writes.push(bufs.iter().map(|b| b.to_vec()).collect());
            let all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            let n = all.len().min(this.take.unwrap_or(usize::MAX));
            this.wire.extend_from_slice(&all[..n]);
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            if this.stall(cx) {
                return Poll::Pending;
            }
            this.flushes += 1;
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().shut = true;
            Poll::Ready(Ok(()))
        }
    }

    /// One write as h2's `poll_write_buf` makes it (a single slice): how
    /// much was taken.
    async fn write_once(io: &mut Coalesce<Socket>, buf: &[u8]) -> usize {
        std::future::poll_fn(|cx| Pin::new(&mut *io).poll_write(cx, buf))
            .await
            .unwrap()
    }

    fn socket<R>(io: &Coalesce<Socket>, f: impl FnOnce(&Socket) -> R) -> R {
        f(&io.shared.lock().inner)
    }

    #[tokio::test]
    async fn outside_a_turn_a_small_write_waits_for_the_flush_and_a_payload_goes_with_it() {
        use tokio::io::AsyncWriteExt;
        let (mut io, _handle) = Coalesce::new(Socket::default());
        assert!(
            !io.is_write_vectored(),
            "so that h2 copies frames under 1 KiB into its buffer"
        );

        // h2's buffer of small frames, then its flush: one write.
        assert_eq!(write_once(&mut io, b"small frames").await, 12);
        assert!(socket(&io, |s| s.writes.is_empty()), "staged, not written");
        io.flush().await.unwrap();
        assert_eq!(socket(&io, |s| s.writes.clone()), [vec![b"small frames".to_vec()]]);
        assert_eq!(socket(&io, |s| s.flushes), 1);

        // h2's buffer ending with a large frame's head, then the frame's
        // payload, then the flush: still one write, of both.
        let payload = vec![7u8; 64 * 1024];
        assert_eq!(write_once(&mut io, b"head").await, 4);
        assert_eq!(write_once(&mut io, &payload).await, payload.len());
        io.flush().await.unwrap();
        assert_eq!(socket(&io, |s| s.writes.len()), 2);
        assert_eq!(
            socket(&io, |s| s.writes[1].clone()),
            [b"head".to_vec(), payload.clone()]
        );

        // More than h2's buffer holds, with nothing staged: written at once.
        assert_eq!(write_once(&mut io, &payload).await, payload.len());
        assert_eq!(socket(&io, |s| s.writes.len()), 3);

        // Shutting down sends what is staged first.
        assert_eq!(write_once(&mut io, b"goaway").await, 6);
        io.shutdown().await.unwrap();
        assert_eq!(socket(&io, |s| s.writes.len()), 4);
        assert!(socket(&io, |s| s.shut));
        let mut wire = b"small frameshead".to_vec();
        wire.extend_from_slice(&payload);
        wire.extend_from_slice(&payload);
        wire.extend_from_slice(b"goaway");
        assert_eq!(socket(&io, |s| s.wire.clone()), wire);
    }

    #[tokio::test]
    async fn a_turn_sends_all_it_wrote_in_one_write_at_its_end() {
        use tokio::io::AsyncWriteExt;
        let (mut io, handle) = Coalesce::new(Socket::default());
        let frame = vec![1u8; STAGE_MAX];
        handle.hold();
        // What h2 does for 5 large frames: its buffer (the frame's head),
        // the payload, a flush; five times.
        for _ in 0..5 {
            assert_eq!(write_once(&mut io, b"head").await, 4);
            assert_eq!(write_once(&mut io, &frame).await, frame.len());
            io.flush().await.unwrap();
        }
        assert!(socket(&io, |s| s.writes.is_empty()), "nothing sent during the turn");
        release_once(&handle);
        assert_eq!(socket(&io, |s| s.writes.len()), 1, "one write for the turn");
        assert_eq!(socket(&io, |s| s.wire.len()), 5 * (4 + frame.len()));
        assert!(
            io.shared.lock().staged.capacity() > STAGE_MAX,
            "a busy connection keeps the buffer it grew"
        );
        // A quiet turn gives it back.
        handle.hold();
        assert_eq!(write_once(&mut io, b"ping").await, 4);
        io.flush().await.unwrap();
        release_once(&handle);
        assert_eq!(socket(&io, |s| s.writes.len()), 2);
        assert_eq!(
            io.shared.lock().staged.capacity(),
            0,
            "an idle connection holds no staging buffer"
        );
    }

    #[tokio::test]
    async fn a_turn_past_its_limit_sends_what_it_staged_with_the_write_that_passes_it() {
        let (mut io, handle) = Coalesce::new(Socket::default());
        let frame = vec![2u8; 40 * 1024];
        handle.hold();
        for _ in 0..3 {
            write_once(&mut io, &frame).await;
        }
        assert!(socket(&io, |s| s.writes.is_empty()), "120 KiB staged: under the limit");
        write_once(&mut io, &frame).await;
        assert_eq!(socket(&io, |s| s.writes.len()), 1);
        assert_eq!(
            socket(&io, |s| s.writes[0].len()),
            2,
            "the staged bytes and the write, in one writev"
        );
        assert_eq!(socket(&io, |s| s.wire.len()), 4 * frame.len());
    }

    #[tokio::test]
    async fn a_turn_after_a_partial_send_stages_behind_what_is_left() {
        let (mut io, handle) = Coalesce::new(Socket::default());
        // As a send the socket took only part of leaves it: 200 KiB sent,
        // 10 KiB to go, in a full buffer longer than a turn's limit.
        {
            let mut staged = io.shared.lock();
            staged.staged = vec![6u8; 210 * 1024];
            staged.sent = 200 * 1024;
        }
        handle.hold();
        let next = vec![7u8; 50 * 1024];
        assert_eq!(write_once(&mut io, &next).await, next.len());
        assert!(socket(&io, |s| s.writes.is_empty()), "60 KiB pending: staged");
        end_turn(&io, &handle);
        let mut expected = vec![6u8; 10 * 1024];
        expected.extend_from_slice(&next);
        assert_eq!(socket(&io, |s| s.wire.clone()), expected);
    }

    #[tokio::test]
    async fn a_failed_send_at_a_turns_end_is_told_to_h2s_next_call() {
        use tokio::io::AsyncWriteExt;
        let (mut io, handle) = Coalesce::new(Socket::default());
        handle.hold();
        write_once(&mut io, b"frames").await;
        io.shared.lock().inner.fail = true;
        release_once(&handle);
        let e = io.flush().await.expect_err("the send failed");
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }

    #[tokio::test]
    async fn a_dropped_connection_closes_the_socket_the_handle_holds_weakly() {
        let (io, handle) = Coalesce::new(Socket::default());
        drop(io);
        assert!(handle.shared.upgrade().is_none());
        handle.hold();
        release_once(&handle);
    }

    /// Ends a turn once, as the driver does.
    fn release_once(handle: &WriteBehind<Socket>) {
        handle.release(&mut Context::from_waker(std::task::Waker::noop()));
    }

    /// Ends a turn, again while the socket is not ready (as its waker
    /// would), until nothing is staged; fails rather than waits forever
    /// when three ends in a row sent nothing.
    fn end_turn(io: &Coalesce<Socket>, handle: &WriteBehind<Socket>) {
        let mut idle = 0;
        loop {
            let before = io.shared.lock().pending();
            release_once(handle);
            let after = io.shared.lock().pending();
            if after == 0 {
                return;
            }
            idle = if after < before { 0 } else { idle + 1 };
            assert!(idle < 3, "the turn's end left {after} bytes staged and sends none");
        }
    }

    proptest::proptest! {
        /// Whatever the socket takes per call and however often it is not
        /// ready, in turns or not, the bytes reach it whole and in order,
        /// nothing is left staged after a flush outside a turn or a turn's
        /// end (with a socket that takes everything), and a turn makes at
        /// most one write per write that passes its limit, plus one.
        #[test]
        fn writes_reach_the_socket_in_order(
            writes in proptest::collection::vec((1usize..40_000, proptest::bool::ANY), 1..12),
            take in proptest::option::of(1usize..20_000),
            stall in proptest::bool::ANY,
            turns in proptest::bool::ANY,
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            runtime.block_on(async {
                use tokio::io::AsyncWriteExt;
                let (mut io, handle) = Coalesce::new(Socket { take, stall, ..Socket::default() });
                let mut expected = Vec::new();
                if turns {
                    handle.hold();
                }
                for (i, (len, end)) in writes.iter().enumerate() {
                    let buf: Vec<u8> = (0..*len).map(|j| (i * 31 + j) as u8).collect();
                    io.write_all(&buf).await.unwrap();
                    expected.extend_from_slice(&buf);
                    io.flush().await.unwrap();
                    if *end {
                        if turns {
                            end_turn(&io, &handle);
                            handle.hold();
                        }
                        assert_eq!(socket(&io, |s| s.wire.clone()), expected);
                        assert_eq!(io.shared.lock().pending(), 0);
                    }
                }
                if turns {
                    end_turn(&io, &handle);
                } else {
                    io.flush().await.unwrap();
                }
                assert_eq!(socket(&io, |s| s.wire.clone()), expected);
                if take.is_none() {
                    // A socket that takes everything: one call per write at
                    // most, and in turns, fewer calls than writes whenever
                    // all of them fit the limit.
                    let calls = socket(&io, |s| s.writes.len());
                    assert!(calls <= writes.len());
                    let total: usize = writes.iter().map(|(l, _)| l).sum();
                    let ends = writes.iter().filter(|(_, e)| *e).count();
                    if turns && total <= WRITE_BEHIND_MAX {
                        assert!(calls <= ends + 1, "{calls} writes for {ends} turn ends");
                    }
                }
            });
        }
    }
}
