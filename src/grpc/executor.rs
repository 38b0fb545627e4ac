//! Runs the requests of one HTTP/2 connection inside that connection's own
//! task, instead of a tokio task each (issue 16).
//!
//! hyper hands every request it accepts (one HTTP/2 stream: a subscription,
//! a publish stream, a unary call) to an executor. With tokio's, each is a
//! task of its own: a message fanned out to the 50 subscriptions of one
//! connection woke 50 tasks, each woke the connection's task through h2, and
//! the two worker threads passed those wake-ups to each other. Profiled
//! (callgrind, 1,000 subscriptions on 20 connections at 200 msg/s) that
//! scheduling was the largest share of the CPU per delivery.
//!
//! [`Spawner`] is the executor hyper gets instead: it only queues the
//! request's future. [`Requests`] owns them and [`Requests::drive`] polls the
//! ones that were woken, then the connection, from the connection's task. A
//! message for 50 subscriptions of a connection now wakes that one task, its
//! 50 streams queue their frames, and the connection writes them together.
//!
//! What this changes for a request: it runs on the thread its connection
//! runs on, so one connection's requests no longer run in parallel with each
//! other (connections still do). None of the broker's handlers blocks a
//! thread: they either finish at once or wait on a future. A request that
//! panics ends itself, as a task would, and is logged; its connection and the
//! other requests on it go on.

use futures::task::{ArcWake, AtomicWaker, waker_ref};
use parking_lot::Mutex;
use slab::Slab;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

type Request = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The executor hyper hands a connection's requests to; they go to the
/// [`Requests`] it was made by.
#[derive(Clone)]
pub struct Spawner {
    queued: Arc<Mutex<Vec<Request>>>,
}

impl<F> hyper::rt::Executor<F> for Spawner
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, request: F) {
        // hyper calls this only while the connection (or a request of it) is
        // being polled, that is from inside `Requests::drive`, which looks at
        // the queue again after each poll: no wake-up needed.
        self.queued.lock().push(Box::pin(request));
    }
}

/// Most rounds of (woken requests, then the connection) one poll of the
/// connection's task runs before it lets the worker run other tasks.
const ROUNDS_PER_POLL: usize = 16;

/// The requests of one connection, polled by [`Requests::drive`].
///
/// Not `FuturesUnordered`: it hands its caller `Pending` as soon as two of
/// its futures wake themselves while polled, and every h2 stream that sends
/// wakes itself (h2 assigns it capacity), so the connection wrote after
/// every second subscription instead of once for all of them.
pub struct Requests {
    queued: Arc<Mutex<Vec<Request>>>,
    running: Slab<Running>,
    ready: Arc<ReadyList>,
    /// The woken requests being polled now (kept to reuse its allocation).
    polling: Vec<(usize, u64)>,
    /// Told to each request started, so that a wake-up of a request that has
    /// ended cannot poll another one that took its slot.
    generation: u64,
}

/// A running request: 24 bytes in the slab, its waker made from `slot`
/// when it is polled (`waker_ref`, no count taken), not kept beside it.
struct Running {
    request: Request,
    slot: Arc<Slot>,
}

/// Which requests were woken since they were last polled.
struct ReadyList {
    woken: Mutex<Vec<(usize, u64)>>,
    /// The connection's task.
    task: AtomicWaker,
    /// Set while `drive` runs: it looks at `woken` again before it returns,
    /// so a wake-up then need not wake the task.
    driving: AtomicBool,
}

/// A request's waker.
struct Slot {
    key: usize,
    generation: u64,
    woken: AtomicBool,
    ready: Arc<ReadyList>,
}

impl ArcWake for Slot {
    fn wake_by_ref(slot: &Arc<Self>) {
        if slot.woken.swap(true, Ordering::AcqRel) {
            return;
        }
        slot.ready.woken.lock().push((slot.key, slot.generation));
        if !slot.ready.driving.load(Ordering::SeqCst) {
            slot.ready.task.wake();
        }
    }
}

impl Default for Requests {
    fn default() -> Self {
        Self::new()
    }
}

impl Requests {
    pub fn new() -> Self {
        Self {
            queued: Arc::default(),
            running: Slab::new(),
            ready: Arc::new(ReadyList {
                woken: Mutex::new(Vec::new()),
                task: AtomicWaker::new(),
                driving: AtomicBool::new(false),
            }),
            polling: Vec::new(),
            generation: 0,
        }
    }

    /// The executor to give hyper for this connection.
    pub fn spawner(&self) -> Spawner {
        Spawner {
            queued: self.queued.clone(),
        }
    }

    /// How many requests are running.
    pub fn len(&self) -> usize {
        self.running.len() + self.queued.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Polls the requests that were woken (what they send, h2 queues), then
    /// `connection` (which writes it all and reads what came in), and again
    /// while either woke a request or started one; ready with the
    /// connection's result when it has ended.
    pub fn drive<C: Future>(&mut self, mut connection: Pin<&mut C>, cx: &mut Context<'_>) -> Poll<C::Output> {
        self.ready.task.register(cx.waker());
        self.ready.driving.store(true, Ordering::SeqCst);
        for _ in 0..ROUNDS_PER_POLL {
            self.run_woken();
            if let Poll::Ready(output) = connection.as_mut().poll(cx) {
                self.ready.driving.store(false, Ordering::SeqCst);
                return Poll::Ready(output);
            }
            if !self.has_work() {
                // Wake-ups from now on wake the task; one that came after
                // the look above is in the list by the time of this one.
                self.ready.driving.store(false, Ordering::SeqCst);
                if !self.has_work() {
                    return Poll::Pending;
                }
                self.ready.driving.store(true, Ordering::SeqCst);
            }
        }
        // Still busy: let the worker's other tasks run, then go on.
        self.ready.driving.store(false, Ordering::SeqCst);
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Waits until every request has ended (their connection has: h2 ends
    /// their streams when it is dropped).
    pub async fn finish(&mut self) {
        std::future::poll_fn(|cx| {
            self.ready.task.register(cx.waker());
            self.run_woken();
            if self.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }

    fn has_work(&self) -> bool {
        !self.ready.woken.lock().is_empty() || !self.queued.lock().is_empty()
    }

    /// Polls, once each, the requests woken or started since the last time.
    fn run_woken(&mut self) {
        self.start_queued();
        let mut polling = std::mem::take(&mut self.polling);
        std::mem::swap(&mut polling, &mut *self.ready.woken.lock());
        for &(key, generation) in &polling {
            let Some(running) = self.running.get_mut(key) else {
                continue;
            };
            if running.slot.generation != generation {
                continue;
            }
            running.slot.woken.store(false, Ordering::Release);
            let waker = waker_ref(&running.slot);
            let mut cx = Context::from_waker(&waker);
            // Outside tokio's cooperative budget, which is the connection
            // task's and would otherwise be shared by all its requests; each
            // bounds its own turn (`broker::subscription`'s `TURN`, h2's
            // send buffer).
            let request = &mut running.request;
            let polled = std::panic::catch_unwind(AssertUnwindSafe(|| {
                Pin::new(&mut tokio::task::coop::unconstrained(request.as_mut())).poll(&mut cx)
            }));
            match polled {
                Ok(Poll::Pending) => {}
                Ok(Poll::Ready(())) => drop(self.running.remove(key)),
                Err(_) => {
                    // The panic hook has printed the panic; dropping the
                    // request resets its stream, as ending a task would.
                    drop(self.running.remove(key));
                    tracing::error!("a request panicked; its stream is reset, its connection goes on");
                }
            }
        }
        polling.clear();
        self.polling = polling;
    }

    fn start_queued(&mut self) {
        let queued = std::mem::take(&mut *self.queued.lock());
        for request in queued {
            self.generation += 1;
            let entry = self.running.vacant_entry();
            let slot = Arc::new(Slot {
                key: entry.key(),
                generation: self.generation,
                woken: AtomicBool::new(false),
                ready: self.ready.clone(),
            });
            entry.insert(Running {
                request,
                slot: slot.clone(),
            });
            ArcWake::wake_by_ref(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Executor;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A connection stand-in: starts `requests` requests on its first poll,
    /// each of which counts itself done when its channel says so, and ends
    /// when `end` fires.
    #[tokio::test]
    async fn requests_run_in_the_connection_task_and_a_panic_ends_only_its_own() {
        let mut requests = Requests::new();
        let spawner = requests.spawner();
        let done = Arc::new(AtomicUsize::new(0));
        let (release, released) = tokio::sync::watch::channel(false);
        let mut started = false;
        let (end, ended) = tokio::sync::oneshot::channel::<()>();
        let mut ended = Box::pin(ended);
        let connection = std::future::poll_fn(|cx| {
            if !started {
                started = true;
                for i in 0..10 {
                    let (done, mut released) = (done.clone(), released.clone());
                    spawner.execute(async move {
                        released.wait_for(|r| *r).await.unwrap();
                        if i == 3 {
                            panic!("request 3 panics on purpose");
                        }
                        done.fetch_add(1, Ordering::SeqCst);
                    });
                }
            }
            ended.as_mut().poll(cx).map(|_| "ended")
        });
        tokio::pin!(connection);
        let driven = async {
            let result = std::future::poll_fn(|cx| requests.drive(connection.as_mut(), cx)).await;
            requests.finish().await;
            result
        };
        let checks = async {
            tokio::task::yield_now().await;
            assert_eq!(done.load(Ordering::SeqCst), 0, "nothing ran before it was released");
            release.send(true).unwrap();
            tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while done.load(Ordering::SeqCst) < 9 {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the nine requests that do not panic finish");
            end.send(()).unwrap();
        };
        let (result, ()) = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            tokio::join!(driven, checks)
        })
        .await
        .expect("the connection ends");
        assert_eq!(result, "ended");
        assert_eq!(done.load(Ordering::SeqCst), 9);
        assert!(requests.is_empty());
    }

    /// A request held by an idle connection costs its slab slot (this) and
    /// its `Slot`: 24 bytes here, not 40 with a `Waker` kept beside it.
    #[test]
    fn a_running_request_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Running>(), 24);
    }
}
