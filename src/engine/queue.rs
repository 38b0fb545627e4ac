//! The bounded per-subscription queue between the publish path and one
//! subscriber's stream.
//!
//! Publishers push without waiting: a full queue is reported back (the caller
//! evicts the subscription) instead of applying back-pressure. Closing the
//! queue frees what it holds at once and wakes the stream, which then ends.

use super::Delivery;
#[cfg(doc)]
use super::Published;
use crate::engine::CloseReason;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

thread_local! {
    /// Wakers held back by an open [`WakeBatch`] on this thread.
    static DEFERRED_WAKES: RefCell<Option<Vec<Waker>>> = const { RefCell::new(None) };
    /// The number of the [`WakeBatch`] open on this thread (0: none).
    static OPEN_BATCH: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The last number this thread gave a batch (0: none yet).
    static LAST_BATCH: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Threads that have numbered a batch: a thread's numbers are its own in
/// the high 32 bits, so numbering takes no shared atomic per batch (a
/// publish opens one on every engine). After 2^32 batches on one thread a
/// number may repeat another thread's; [`WakeBatch::open`]'s one user, the
/// cluster's outbox, then queues a message it could have sent at once.
static THREADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn number_batch() {
    let number = LAST_BATCH.with(|last| {
        let mut n = last.get();
        if n == 0 {
            n = THREADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32;
        }
        n = n.wrapping_add(1);
        last.set(n);
        n
    });
    OPEN_BATCH.with(|b| b.set(number));
}

/// Holds back the wake-ups of streams that [`Queue::push`] fills while it is
/// alive, and wakes each once when dropped. A publisher routing a burst of
/// messages thus hands each subscriber one batch (one wake-up, one write to
/// its connection) instead of one per message. Synchronous only: a batch must
/// not be held across an `.await`, since the task may move threads there.
pub struct WakeBatch {
    /// The batch this one is nested in keeps the wakers; only the outermost wakes.
    outermost: bool,
}

impl WakeBatch {
    pub fn begin() -> Self {
        let outermost = DEFERRED_WAKES.with(|d| {
            let mut deferred = d.borrow_mut();
            if deferred.is_some() {
                return false;
            }
            *deferred = Some(Vec::new());
            true
        });
        if outermost {
            number_batch();
        }
        Self { outermost }
    }
}

impl Drop for WakeBatch {
    fn drop(&mut self) {
        if !self.outermost {
            return;
        }
        OPEN_BATCH.with(|b| b.set(0));
        let wakers = DEFERRED_WAKES.with(|d| d.borrow_mut().take()).unwrap_or_default();
        for waker in wakers {
            waker.wake();
        }
    }
}

impl WakeBatch {
    /// Wakes `waker` at the end of the open batch of this thread, or now
    /// when none is open (for a task fed by the publishers, as a stream is).
    pub fn wake(waker: Waker) {
        // Not `wake`'s body called: with a second caller the compiler made
        // it a call in `Queue::push`, about 13 instructions per delivery
        // (the guard's wide fan-out); this one is not on that path.
        let deferred = DEFERRED_WAKES.with(|d| match d.borrow_mut().as_mut() {
            Some(batch) => {
                batch.push(waker);
                None
            }
            None => Some(waker),
        });
        if let Some(waker) = deferred {
            waker.wake();
        }
    }

    /// The number of the batch open on this thread, unique in the process
    /// (a batch resumed after a wait has a new one); `None` outside one.
    pub fn open() -> Option<u64> {
        Some(OPEN_BATCH.with(|b| b.get())).filter(|&n| n != 0)
    }

    /// Runs `future` inside the open batch of the task polling it, without
    /// holding the batch across a wait: whenever `future` is pending, the
    /// wake-ups deferred so far on this thread are made and the batch is
    /// closed (the task may resume on another worker, and another task may
    /// run here meanwhile); when it is polled again, a batch is open again
    /// on the thread it then runs on, for the outermost [`WakeBatch`] to
    /// end. Nothing changes when no batch is open, or `future` never waits.
    pub async fn across_waits<F: Future>(future: F) -> F::Output {
        let mut future = std::pin::pin!(future);
        let mut paused = false;
        std::future::poll_fn(move |cx| {
            if std::mem::take(&mut paused) {
                DEFERRED_WAKES.with(|d| {
                    d.borrow_mut().get_or_insert_with(Vec::new);
                });
                number_batch();
            }
            let poll = future.as_mut().poll(cx);
            if poll.is_pending() {
                let deferred = DEFERRED_WAKES.with(|d| d.borrow_mut().take());
                if let Some(wakers) = deferred {
                    paused = true;
                    OPEN_BATCH.with(|b| b.set(0));
                    for waker in wakers {
                        waker.wake();
                    }
                }
            }
            poll
        })
        .await
    }
}

/// Wakes `waker` now, or at the end of the open [`WakeBatch`].
fn wake(waker: Waker) {
    let deferred = DEFERRED_WAKES.with(|d| match d.borrow_mut().as_mut() {
        Some(batch) => {
            batch.push(waker);
            None
        }
        None => Some(waker),
    });
    if let Some(waker) = deferred {
        waker.wake();
    }
}

/// What became of a pushed delivery; a refused one is handed back.
pub(crate) enum Push {
    Queued,
    /// The queue held `depth` messages of `bytes` bytes already, and this one
    /// would have taken it over its capacity or its byte limit; nothing was
    /// queued.
    Full {
        depth: usize,
        bytes: usize,
        item: Delivery,
    },
    Closed(Delivery),
}

pub(crate) struct Queue {
    /// A plain mutex: nothing awaits while it is held, and the only parties are
    /// publishers pushing and the one stream popping, each for a few
    /// instructions.
    state: Mutex<State>,
    /// At most `u32::MAX` (a larger configured capacity is that): with the
    /// fields below, it keeps an idle subscription's queue in 112 bytes.
    capacity: u32,
    /// Most bytes of messages (their [`Published::size`]) the queue holds at
    /// once; `usize::MAX` for group members, whose group bounds its bytes.
    max_bytes: usize,
    /// It has a credit limit (`State::credit` is set): set once, before the
    /// queue is shared, so a queue without one is never locked to ask.
    credited: bool,
}

struct State {
    items: VecDeque<Delivery>,
    /// Sum of the sizes of `items`.
    bytes: usize,
    /// The stream's waker while it waits for a message.
    waker: Option<Waker>,
    closed: Option<CloseReason>,
    /// Highest depth in the current and in the previous peak period (see
    /// [`Queue::take_peak`]).
    peak: [u32; 2],
    /// What the subscriber lost when the queue was closed (see [`Queue::close`]).
    lost: u64,
    /// A consumer-group member on a session with credit (`Queue::credited`):
    /// how many more messages its stream may take (each pop spends one, the
    /// session's `SessionCredit` adds); meaningless without a limit. Kept
    /// here, under the lock that pushes and pops take, so that what its
    /// group may still hand it ([`Queue::credit_room`]) never counts a
    /// message twice.
    credit: u64,
}

impl State {
    fn pop(&mut self) -> Option<Delivery> {
        let item = self.items.pop_front()?;
        self.bytes -= item.message.size();
        self.credit = self.credit.saturating_sub(1);
        Some(item)
    }

    /// Ready once closed; otherwise leaves the waker for the next push or
    /// the close.
    fn poll_closed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed.is_some() {
            return Poll::Ready(());
        }
        self.leave_waker(cx);
        Poll::Pending
    }

    fn leave_waker(&mut self, cx: &mut Context<'_>) {
        match &mut self.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
    }
}

impl Queue {
    pub(crate) fn new(capacity: usize, max_bytes: usize) -> Self {
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                bytes: 0,
                waker: None,
                closed: None,
                peak: [0; 2],
                lost: 0,
                credit: 0,
            }),
            capacity: u32::try_from(capacity).unwrap_or(u32::MAX),
            max_bytes,
            credited: false,
        }
    }

    /// A group member's queue whose stream may take `credit` messages
    /// before more is added (None: no limit): see [`Queue::credit_room`].
    pub(crate) fn with_credit(mut self, credit: Option<u64>) -> Self {
        self.state.get_mut().credit = credit.unwrap_or(0);
        self.credited = credit.is_some();
        self
    }

    /// Its stream may take `messages` more (a queue without a credit limit
    /// has none still).
    pub(crate) fn add_credit(&self, messages: u64) {
        if !self.credited {
            return;
        }
        let mut state = self.state.lock();
        state.credit = state.credit.saturating_add(messages);
    }

    /// How many more messages may be queued that its stream may take now:
    /// its credit less what is queued already. None: no credit limit.
    pub(crate) fn credit_room(&self) -> Option<u64> {
        if !self.credited {
            return None;
        }
        let state = self.state.lock();
        Some(state.credit.saturating_sub(state.items.len() as u64))
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Queues `item` unless the queue is full or closed. Never waits.
    pub(crate) fn push(&self, item: Delivery) -> Push {
        let waker = {
            let mut state = self.state.lock();
            if state.closed.is_some() {
                return Push::Closed(item);
            }
            // An empty queue takes any message, so that a message larger
            // than the byte limit still reaches a reader that keeps up.
            let size = item.message.size();
            let over_bytes = !state.items.is_empty() && state.bytes + size > self.max_bytes;
            if state.items.len() >= self.capacity as usize || over_bytes {
                let (depth, bytes) = (state.items.len(), state.bytes);
                return Push::Full { depth, bytes, item };
            }
            state.bytes += size;
            state.items.push_back(item);
            // Within u32: the depth is at most the capacity.
            state.peak[1] = state.peak[1].max(state.items.len() as u32);
            // Taken, so a burst of pushes yields one wake-up until the stream
            // polls again and leaves a new waker.
            state.waker.take()
        };
        if let Some(waker) = waker {
            wake(waker);
        }
        Push::Queued
    }

    /// The next message; `Ready(None)` once the queue is closed. A closed
    /// queue holds nothing: closing discards what was left.
    pub(crate) fn poll_pop(&self, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        let mut state = self.state.lock();
        if let Some(item) = state.pop() {
            return Poll::Ready(Some(item));
        }
        state.poll_closed(cx).map(|()| None)
    }

    /// As [`Queue::poll_pop`], and with a delivery says whether it was the
    /// last one queued (`true`): the waker is then left as a `Pending`
    /// would leave it, so the next push wakes the reader, which need not
    /// poll again to find the queue empty.
    pub(crate) fn poll_pop_drained(&self, cx: &mut Context<'_>) -> Poll<Option<(Delivery, bool)>> {
        let mut state = self.state.lock();
        if let Some(item) = state.pop() {
            let drained = state.items.is_empty();
            if drained {
                state.leave_waker(cx);
            }
            return Poll::Ready(Some((item, drained)));
        }
        state.poll_closed(cx).map(|()| None)
    }

    /// Ready once the queue is closed; otherwise leaves the waker, as
    /// [`Queue::poll_pop`] does, without taking anything.
    pub(crate) fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.state.lock().poll_closed(cx)
    }

    /// Closes the queue and returns what it held (never delivered), or `None`
    /// when it was already closed. `lost` is what the subscriber loses with
    /// it: `None` when what the queue held is not lost (a group member's
    /// messages go back to its group), else the messages beyond the queue's
    /// that it loses too (for an eviction, the one that did not fit). It is
    /// recorded before the stream is woken, for the trailers that say why the
    /// stream ended.
    pub(crate) fn close(&self, reason: CloseReason, lost: Option<u64>) -> Option<VecDeque<Delivery>> {
        let (discarded, waker) = {
            let mut state = self.state.lock();
            if state.closed.is_some() {
                return None;
            }
            state.closed = Some(reason);
            state.bytes = 0;
            state.lost = lost.map_or(0, |beyond| state.items.len() as u64 + beyond);
            let discarded = std::mem::take(&mut state.items);
            (discarded, state.waker.take())
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Some(discarded)
    }

    /// The highest depth since the call before the previous one (at least
    /// the depth now), and starts a new period. The metrics call it once per
    /// scrape: a queue that fills and drains between two scrapes still shows
    /// its peak, and two Prometheus servers scraping the same broker (an HA
    /// pair) each see every peak, because each period is reported twice.
    pub(crate) fn take_peak(&self) -> usize {
        let mut state = self.state.lock();
        let len = state.items.len() as u32;
        let [previous, current] = state.peak;
        state.peak = [current, len];
        previous.max(current).max(len) as usize
    }

    /// What [`Queue::take_peak`] would return, without starting a period.
    pub(crate) fn peak(&self) -> usize {
        let state = self.state.lock();
        let [previous, current] = state.peak;
        (previous.max(current) as usize).max(state.items.len())
    }

    /// Takes back a message that is still waiting in the queue.
    pub(crate) fn remove(&self, sequence: u64) -> Option<Delivery> {
        let mut state = self.state.lock();
        let index = state.items.iter().position(|d| d.message.sequence == sequence)?;
        let item = state.items.remove(index)?;
        state.bytes -= item.message.size();
        Some(item)
    }

    /// What the subscriber lost when the queue was closed.
    pub(crate) fn lost(&self) -> u64 {
        self.state.lock().lost
    }

    pub(crate) fn close_reason(&self) -> Option<CloseReason> {
        self.state.lock().closed
    }

    /// Live depth (what the metrics and Admin API report).
    pub(crate) fn len(&self) -> usize {
        self.state.lock().items.len()
    }

    /// Bytes of the messages queued now.
    pub(crate) fn bytes(&self) -> usize {
        self.state.lock().bytes
    }

    #[cfg(test)]
    pub(crate) fn sequences(&self) -> Vec<u64> {
        self.state.lock().items.iter().map(|d| d.message.sequence).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Published;
    use std::sync::Arc;
    use std::task::Waker;

    fn delivery(seq: u64) -> Delivery {
        Delivery {
            message: Arc::new(Published::for_test("t", seq)),
            attempt: 1,
        }
    }

    #[test]
    fn full_queue_refuses_and_keeps_what_it_has() {
        let q = Queue::new(2, usize::MAX);
        assert!(matches!(q.push(delivery(1)), Push::Queued));
        assert!(matches!(q.push(delivery(2)), Push::Queued));
        assert!(matches!(q.push(delivery(3)), Push::Full { depth: 2, .. }));
        assert_eq!(q.len(), 2);
        let mut cx = Context::from_waker(Waker::noop());
        match q.poll_pop(&mut cx) {
            Poll::Ready(Some(d)) => assert_eq!(d.message.sequence, 1),
            _ => panic!("expected the first message"),
        }
    }

    #[test]
    fn a_queue_over_its_byte_limit_refuses_and_popping_frees_bytes() {
        let size = delivery(0).message.size();
        let q = Queue::new(100, 2 * size + size / 2);
        assert!(matches!(q.push(delivery(1)), Push::Queued));
        assert!(matches!(q.push(delivery(2)), Push::Queued));
        assert_eq!(q.bytes(), 2 * size);
        match q.push(delivery(3)) {
            Push::Full { depth, bytes, .. } => assert_eq!((depth, bytes), (2, 2 * size)),
            _ => panic!("the third message is over the byte limit"),
        }
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(q.poll_pop(&mut cx), Poll::Ready(Some(_))));
        assert_eq!(q.bytes(), size);
        assert!(matches!(q.push(delivery(3)), Push::Queued), "room again");
        assert_eq!(q.remove(2).map(|d| d.message.sequence), Some(2));
        assert_eq!(q.bytes(), size);
        q.close(CloseReason::Cancelled, Some(0));
        assert_eq!(q.bytes(), 0);
    }

    /// Counts its wake-ups.
    struct CountingWaker(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    impl CountingWaker {
        fn wakes(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// `n` empty queues, each with a stream waiting on it, and what counts
    /// their wake-ups.
    fn waiting_queues(n: usize) -> (Vec<Queue>, Arc<CountingWaker>) {
        let queues: Vec<Queue> = (0..n).map(|_| Queue::new(8, usize::MAX)).collect();
        let counter = Arc::new(CountingWaker(Default::default()));
        let waker = Waker::from(counter.clone());
        for q in &queues {
            assert!(q.poll_pop(&mut Context::from_waker(&waker)).is_pending());
        }
        (queues, counter)
    }

    #[test]
    fn a_wake_batch_wakes_each_waiting_stream_once_at_its_end() {
        let (queues, counter) = waiting_queues(2);
        let wakes = || counter.wakes();
        {
            let _batch = WakeBatch::begin();
            let _nested = WakeBatch::begin();
            for seq in 0..3 {
                for q in &queues {
                    assert!(matches!(q.push(delivery(seq)), Push::Queued));
                }
            }
            drop(_nested);
            assert_eq!(wakes(), 0, "held back until the outermost batch ends");
        }
        assert_eq!(wakes(), 2, "one wake-up per queue");
        // Without a batch, a push wakes at once.
        let q = Queue::new(8, usize::MAX);
        assert!(
            q.poll_pop(&mut Context::from_waker(&Waker::from(counter.clone())))
                .is_pending()
        );
        q.push(delivery(9));
        assert_eq!(wakes(), 3);
    }

    #[test]
    fn a_wake_batch_is_not_held_across_a_wait_and_opens_again_where_the_task_resumes() {
        let (queues, counter) = waiting_queues(5);
        let wakes = || counter.wakes();
        let batch = WakeBatch::begin();
        queues[0].push(delivery(0));
        let mut waited = false;
        let publish = WakeBatch::across_waits(async {
            queues[1].push(delivery(1));
            // A publish that has to wait once (room in a client's queue).
            std::future::poll_fn(|_| {
                if std::mem::replace(&mut waited, true) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            queues[2].push(delivery(2));
        });
        let mut publish = Box::pin(publish);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(publish.as_mut().poll(&mut cx).is_pending());
        assert_eq!(wakes(), 2, "what the batch held is woken before the task yields");
        // Another task running on this thread meanwhile is in no batch.
        queues[3].push(delivery(3));
        assert_eq!(wakes(), 3);
        // The task resumes on another worker, and ends its batch there.
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let mut cx = Context::from_waker(Waker::noop());
                    assert!(publish.as_mut().poll(&mut cx).is_ready());
                    assert_eq!(wakes(), 3, "held back again after the wait");
                    drop(batch);
                    assert_eq!(wakes(), 4);
                })
                .join()
                .unwrap();
        });
        queues[4].push(delivery(4));
        assert_eq!(wakes(), 5, "nothing left open on the first thread");
    }

    #[test]
    fn a_peak_is_reported_by_the_next_two_periods_then_forgotten() {
        let q = Queue::new(8, usize::MAX);
        let mut cx = Context::from_waker(Waker::noop());
        assert_eq!(q.take_peak(), 0);
        // Fills to 5 and drains between two scrapes.
        for seq in 0..5 {
            q.push(delivery(seq));
        }
        while let Poll::Ready(Some(_)) = q.poll_pop(&mut cx) {}
        assert_eq!(q.len(), 0);
        assert_eq!(q.take_peak(), 5, "the scrape after the burst sees it");
        assert_eq!(q.take_peak(), 5, "and the next one (another Prometheus of an HA pair)");
        assert_eq!(q.take_peak(), 0, "then it is forgotten");
        // A queue that stays deep reports its depth in every period.
        for seq in 0..3 {
            q.push(delivery(seq));
        }
        assert_eq!(q.take_peak(), 3);
        assert_eq!(q.take_peak(), 3);
        assert_eq!(q.take_peak(), 3);
    }

    #[test]
    fn close_discards_wakes_and_ends() {
        let q = Queue::new(4, usize::MAX);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(q.poll_pop(&mut cx).is_pending());
        q.push(delivery(1));
        q.push(delivery(2));
        assert_eq!(q.close(CloseReason::Evicted, Some(1)).map(|d| d.len()), Some(2));
        assert_eq!(q.lost(), 3, "what it held and the one that did not fit");
        assert!(
            q.close(CloseReason::Shutdown, Some(0)).is_none(),
            "second close is a no-op"
        );
        assert_eq!(q.lost(), 3);
        assert_eq!(q.len(), 0);
        assert!(matches!(q.poll_pop(&mut cx), Poll::Ready(None)));
        assert!(matches!(q.push(delivery(3)), Push::Closed(_)));
        assert_eq!(q.close_reason(), Some(CloseReason::Evicted));
    }

    #[test]
    fn popping_the_last_one_leaves_the_waker_for_the_next_push() {
        let q = Queue::new(4, usize::MAX);
        let counter = Arc::new(CountingWaker(Default::default()));
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        q.push(delivery(1));
        q.push(delivery(2));
        let Poll::Ready(Some((first, drained))) = q.poll_pop_drained(&mut cx) else {
            panic!("queued");
        };
        assert_eq!((first.message.sequence, drained), (1, false), "one more behind it");
        q.push(delivery(3));
        assert_eq!(counter.wakes(), 0, "not drained: no waker left");
        let Poll::Ready(Some((_, drained))) = q.poll_pop_drained(&mut cx) else {
            panic!("queued");
        };
        assert!(!drained);
        let Poll::Ready(Some((last, drained))) = q.poll_pop_drained(&mut cx) else {
            panic!("queued");
        };
        assert_eq!((last.message.sequence, drained), (3, true));
        // No poll in between: the push alone wakes the reader.
        q.push(delivery(4));
        assert_eq!(counter.wakes(), 1);
        // And a close does too.
        assert!(matches!(q.poll_pop_drained(&mut cx), Poll::Ready(Some((_, true)))));
        q.close(CloseReason::Cancelled, None);
        assert_eq!(counter.wakes(), 2);
        assert!(matches!(q.poll_pop_drained(&mut cx), Poll::Ready(None)));
    }

    /// An idle subscription's queue stays in 112 bytes (128 with its `Arc`,
    /// a jemalloc size class): ARCHITECTURE.md, "What an idle subscription
    /// holds".
    #[test]
    fn a_queue_is_112_bytes() {
        assert!(
            std::mem::size_of::<super::Queue>() <= 112,
            "{}",
            std::mem::size_of::<super::Queue>()
        );
    }

    /// The cluster's outbox tells a publisher's burst from the next one by
    /// these numbers: none outside a batch, a new one for every batch, on
    /// this thread and on others, and the nested batch keeps its outer one's.
    #[test]
    fn each_open_batch_has_its_own_number() {
        assert_eq!(WakeBatch::open(), None);
        let first = {
            let _batch = WakeBatch::begin();
            let n = WakeBatch::open().expect("a batch is open");
            {
                let _inner = WakeBatch::begin();
                assert_eq!(WakeBatch::open(), Some(n), "the nested batch is the outer one's");
            }
            n
        };
        assert_eq!(WakeBatch::open(), None);
        let second = {
            let _batch = WakeBatch::begin();
            WakeBatch::open().unwrap()
        };
        let other = std::thread::spawn(|| {
            let _batch = WakeBatch::begin();
            WakeBatch::open().unwrap()
        })
        .join()
        .unwrap();
        assert_ne!(first, second);
        assert_ne!(other, first);
        assert_ne!(other, second);
    }
}
