//! The bounded per-subscription queue between the publish path and one
//! subscriber's stream.
//!
//! Publishers push without waiting: a full queue is reported back (the caller
//! evicts the subscription) instead of applying back-pressure. Closing the
//! queue frees what it holds at once and wakes the stream, which then ends.

use super::Delivery;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

/// Why a queue was closed; decides what happens to what it still held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// The subscriber fell too far behind.
    Evicted,
    /// The client cancelled its stream.
    Cancelled,
    /// An operator closed it through the Admin API.
    ClosedByAdmin,
    /// The broker is shutting down.
    Shutdown,
}

pub(crate) enum Push {
    Queued,
    /// The queue held `depth` messages already; nothing was queued.
    Full {
        depth: usize,
    },
    Closed,
}

pub(crate) struct Queue {
    /// A plain mutex: nothing awaits while it is held, and the only parties are
    /// publishers pushing and the one stream popping, each for a few
    /// instructions.
    state: Mutex<State>,
    capacity: usize,
}

struct State {
    items: VecDeque<Delivery>,
    /// The stream's waker while it waits for a message.
    waker: Option<Waker>,
    closed: Option<CloseReason>,
}

impl Queue {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                waker: None,
                closed: None,
            }),
            capacity,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queues `item` unless the queue is full or closed. Never waits.
    pub(crate) fn push(&self, item: Delivery) -> Push {
        let waker = {
            let mut state = self.state.lock();
            if state.closed.is_some() {
                return Push::Closed;
            }
            if state.items.len() >= self.capacity {
                return Push::Full {
                    depth: state.items.len(),
                };
            }
            state.items.push_back(item);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Push::Queued
    }

    /// The next message; `Ready(None)` once the queue is closed. A closed
    /// queue holds nothing: closing discards what was left.
    pub(crate) fn poll_pop(&self, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        let mut state = self.state.lock();
        if let Some(item) = state.items.pop_front() {
            return Poll::Ready(Some(item));
        }
        if state.closed.is_some() {
            return Poll::Ready(None);
        }
        match &mut state.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Closes the queue and returns what it held (never delivered), or `None`
    /// when it was already closed.
    pub(crate) fn close(&self, reason: CloseReason) -> Option<VecDeque<Delivery>> {
        let (discarded, waker) = {
            let mut state = self.state.lock();
            if state.closed.is_some() {
                return None;
            }
            state.closed = Some(reason);
            let discarded = std::mem::take(&mut state.items);
            (discarded, state.waker.take())
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Some(discarded)
    }

    /// Takes back a message that is still waiting in the queue.
    pub(crate) fn remove(&self, sequence: u64) -> Option<Delivery> {
        let mut state = self.state.lock();
        let index = state.items.iter().position(|d| d.message.sequence == sequence)?;
        state.items.remove(index)
    }

    #[cfg(test)]
    pub(crate) fn close_reason(&self) -> Option<CloseReason> {
        self.state.lock().closed
    }

    /// Live depth (what the metrics and Admin API report).
    pub(crate) fn len(&self) -> usize {
        self.state.lock().items.len()
    }

    #[cfg(test)]
    pub(crate) fn sequences(&self) -> Vec<u64> {
        self.state.lock().items.iter().map(|d| d.message.sequence).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Published;
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
        let q = Queue::new(2);
        assert!(matches!(q.push(delivery(1)), Push::Queued));
        assert!(matches!(q.push(delivery(2)), Push::Queued));
        assert!(matches!(q.push(delivery(3)), Push::Full { depth: 2 }));
        assert_eq!(q.len(), 2);
        let mut cx = Context::from_waker(Waker::noop());
        match q.poll_pop(&mut cx) {
            Poll::Ready(Some(d)) => assert_eq!(d.message.sequence, 1),
            _ => panic!("expected the first message"),
        }
    }

    #[test]
    fn close_discards_wakes_and_ends() {
        let q = Queue::new(4);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(q.poll_pop(&mut cx).is_pending());
        q.push(delivery(1));
        q.push(delivery(2));
        assert_eq!(q.close(CloseReason::Evicted).map(|d| d.len()), Some(2));
        assert!(q.close(CloseReason::Shutdown).is_none(), "second close is a no-op");
        assert_eq!(q.len(), 0);
        assert!(matches!(q.poll_pop(&mut cx), Poll::Ready(None)));
        assert!(matches!(q.push(delivery(3)), Push::Closed));
        assert_eq!(q.close_reason(), Some(CloseReason::Evicted));
    }
}
