//! What every system shares: the payload format, counting every message
//! (lost, duplicate, latency) and the publisher's flow-control window.
//!
//! A payload starts with its message number (u64 LE) and its send time
//! (u64 LE nanoseconds since [`epoch`], a shared `Instant` of this process),
//! padded with zeros to the payload size (16 B is exactly these two fields).
//!
//! Counting is per *delivery domain*: a broadcast subscriber is one domain
//! (it must see every message), the members of a consumer group share one
//! (every message once among them). A domain keeps an atomic bitset of the
//! message numbers seen, so a duplicate is caught even across members.

use bytes::{BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Smallest payload: the message number and the send timestamp.
pub const HEADER_BYTES: usize = 16;

/// The shared clock of the bench process.
pub fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Builds message `number`'s payload of `size` bytes, stamped now.
pub fn payload(number: u64, size: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(size.max(HEADER_BYTES));
    b.put_u64_le(number);
    b.put_u64_le(now_ns());
    b.resize(size.max(HEADER_BYTES), 0);
    b.freeze()
}

/// The message number and send time of a payload (None when too short).
pub fn decode(p: &[u8]) -> Option<(u64, u64)> {
    let n = u64::from_le_bytes(p.get(0..8)?.try_into().ok()?);
    let t = u64::from_le_bytes(p.get(8..16)?.try_into().ok()?);
    Some((n, t))
}

/// Wakes the publisher when it waits on the window.
#[derive(Default)]
pub struct Signal {
    notify: Notify,
    waiting: AtomicBool,
}

impl Signal {
    fn poke(&self) {
        if self.waiting.load(Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }
}

/// Every message number that must reach one broadcast subscriber, or one
/// consumer group as a whole.
pub struct Domain {
    seen: Vec<AtomicU64>,
    expected: u64,
    unique: AtomicU64,
    dup: AtomicU64,
    stray: AtomicU64,
    members: usize,
    ended_members: AtomicUsize,
    signal: Arc<Signal>,
}

impl Domain {
    pub fn new(expected: u64, members: usize, signal: Arc<Signal>) -> Arc<Domain> {
        let words = expected.div_ceil(64) as usize;
        Arc::new(Domain {
            seen: (0..words).map(|_| AtomicU64::new(0)).collect(),
            expected,
            unique: AtomicU64::new(0),
            dup: AtomicU64::new(0),
            stray: AtomicU64::new(0),
            members,
            ended_members: AtomicUsize::new(0),
            signal,
        })
    }

    /// Marks `number` seen; false if it was already (a duplicate).
    fn mark(&self, number: u64) -> bool {
        let Some(word) = self.seen.get((number / 64) as usize) else {
            self.stray.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let bit = 1u64 << (number % 64);
        if word.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
            self.dup.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.unique.fetch_add(1, Ordering::Release);
        self.signal.poke();
        true
    }

    pub fn unique(&self) -> u64 {
        self.unique.load(Ordering::Acquire)
    }

    pub fn complete(&self) -> bool {
        self.unique() >= self.expected
    }

    /// Every member's stream ended (evicted, closed, failed): it gets no more.
    pub fn dead(&self) -> bool {
        self.ended_members.load(Ordering::Acquire) >= self.members
    }

    pub fn lost(&self) -> u64 {
        self.expected.saturating_sub(self.unique())
    }

    /// Duplicates, plus anything that was not a message of this run.
    pub fn dup(&self) -> u64 {
        self.dup.load(Ordering::Relaxed) + self.stray.load(Ordering::Relaxed)
    }
}

/// One subscriber's own figures, returned when its receive loop ends.
pub struct Tally {
    pub received: u64,
    pub latency_ns: Histogram<u64>,
    pub last_at: Option<Instant>,
    /// Why the stream ended, when the server or the network ended it.
    pub ended: Option<String>,
}

/// What a receive loop records into: its own tally and its domain.
pub struct Recorder {
    pub tally: Tally,
    domain: Arc<Domain>,
}

impl Recorder {
    pub fn new(domain: Arc<Domain>) -> Recorder {
        Recorder {
            tally: Tally {
                received: 0,
                latency_ns: new_histogram(),
                last_at: None,
                ended: None,
            },
            domain,
        }
    }

    /// Counts one received payload.
    pub fn record(&mut self, p: &[u8]) {
        // One clock reading per message serves both the latency and `last_at`.
        let at = Instant::now();
        let now = at.duration_since(epoch()).as_nanos() as u64;
        self.tally.received += 1;
        match decode(p) {
            Some((number, sent)) => {
                self.tally.latency_ns.saturating_record(now.saturating_sub(sent).max(1));
                self.domain.mark(number);
            }
            None => {
                self.domain.stray.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.tally.last_at = Some(at);
    }

    /// The stream ended without being asked to (eviction, error).
    pub fn ended(&mut self, why: String) {
        self.tally.ended = Some(why);
    }

    pub fn finish(self) -> Tally {
        if self.tally.ended.is_some() {
            self.domain.ended_members.fetch_add(1, Ordering::Release);
            self.domain.signal.notify.notify_one();
        }
        self.tally
    }
}

/// A received message of any system, as far as counting goes.
pub trait Delivery {
    fn payload(&self) -> &[u8];
}

/// The receive loop every subscriber runs: counts each message until `stop`
/// is cancelled or the stream ends. `each` sees every message after it is
/// counted (the manual-ack member collects sequences there).
pub async fn drive<S, T, E>(
    stream: S,
    mut rec: Recorder,
    stop: CancellationToken,
    mut each: impl FnMut(&T) + Send,
) -> Tally
where
    S: Stream<Item = Result<T, E>> + Send,
    T: Delivery,
    E: std::fmt::Display,
{
    let stream = std::pin::pin!(stream);
    let mut stream = stream;
    let cancelled = stop.cancelled();
    let mut cancelled = std::pin::pin!(cancelled);
    loop {
        tokio::select! {
            biased;
            _ = &mut cancelled => break,
            item = stream.next() => match item {
                Some(Ok(m)) => {
                    rec.record(m.payload());
                    each(&m);
                }
                Some(Err(e)) => {
                    rec.ended(format!("stream failed: {e}"));
                    break;
                }
                None => {
                    rec.ended("stream ended by the server".into());
                    break;
                }
            }
        }
    }
    rec.finish()
}

pub fn new_histogram() -> Histogram<u64> {
    // 1 ns .. 100 s at 3 significant digits; values above saturate.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("static histogram bounds are valid")
}

/// The publisher keeps at most `window` messages ahead of the slowest live
/// domain, so a run that keeps up loses nothing by design, whatever the
/// system's buffering policy is.
pub struct Flow {
    domains: Vec<Arc<Domain>>,
    window: u64,
    signal: Arc<Signal>,
    /// Progress known at the last check, to skip the scan while far from the edge.
    floor: u64,
    /// How long the slowest domain may make no progress before the publisher gives up.
    stall_limit: Duration,
}

/// The publisher waited `stall_limit` without any progress.
#[derive(Debug)]
pub struct Stalled {
    pub sent: u64,
    pub progress: u64,
}

impl Flow {
    pub fn new(domains: Vec<Arc<Domain>>, window: u64, signal: Arc<Signal>) -> Flow {
        Flow {
            domains,
            window: window.max(1),
            signal,
            floor: 0,
            stall_limit: Duration::from_secs(10),
        }
    }

    /// Progress of the slowest domain still alive (`u64::MAX` when none is).
    fn progress(&self) -> u64 {
        self.domains
            .iter()
            .filter(|d| !d.dead())
            .map(|d| d.unique())
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Waits until message number `sent` may be published.
    pub async fn admit(&mut self, sent: u64) -> Result<(), Stalled> {
        if sent < self.floor.saturating_add(self.window) {
            return Ok(());
        }
        self.floor = self.progress();
        if sent < self.floor.saturating_add(self.window) {
            return Ok(());
        }
        let mut last_progress = (self.floor, Instant::now());
        loop {
            let notified = self.signal.notify.notified();
            self.signal.waiting.store(true, Ordering::SeqCst);
            self.floor = self.progress();
            if sent < self.floor.saturating_add(self.window) {
                self.signal.waiting.store(false, Ordering::SeqCst);
                return Ok(());
            }
            if self.floor != last_progress.0 {
                last_progress = (self.floor, Instant::now());
            } else if last_progress.1.elapsed() > self.stall_limit {
                self.signal.waiting.store(false, Ordering::SeqCst);
                return Err(Stalled {
                    sent,
                    progress: self.floor,
                });
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }
}

/// A plain thread of the bench process that sleeps [`StallWatch::NAP`] at a
/// time and notes how late it wakes. A wake-up over [`StallWatch::THRESHOLD`]
/// late is a moment when the machine left a ready thread of this process
/// waiting; a receiver waiting likewise adds that delay to every message in
/// flight, whatever the broker did. Reported beside the latency run so its
/// tail can be read.
pub struct StallWatch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Stalls>>,
}

/// What a [`StallWatch`] saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stalls {
    pub count: u64,
    pub longest: Duration,
}

impl StallWatch {
    pub const NAP: Duration = Duration::from_micros(200);
    pub const THRESHOLD: Duration = Duration::from_millis(1);

    pub fn start() -> StallWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("stall-watch".into())
            .spawn(move || {
                let mut seen = Stalls::default();
                while !flag.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    std::thread::sleep(Self::NAP);
                    let late = t.elapsed().saturating_sub(Self::NAP);
                    if late > Self::THRESHOLD {
                        seen.count += 1;
                        seen.longest = seen.longest.max(late);
                    }
                }
                seen
            })
            .ok();
        StallWatch { stop, thread }
    }

    /// Stops the thread; None if it could not be started.
    pub fn finish(mut self) -> Option<Stalls> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take()?.join().ok()
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Latency percentiles in milliseconds, from a merged histogram.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
}

impl Percentiles {
    pub fn of(h: &Histogram<u64>) -> Option<Percentiles> {
        if h.is_empty() {
            return None;
        }
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e6;
        Some(Percentiles {
            p50: ms(0.50),
            p99: ms(0.99),
            p999: ms(0.999),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_round_trip() {
        for size in [16, 256, 4096] {
            let p = payload(42, size);
            assert_eq!(p.len(), size);
            assert_eq!(decode(&p).map(|(n, _)| n), Some(42));
        }
        assert_eq!(decode(b"short"), None);
    }

    #[test]
    fn domain_counts_lost_and_duplicates() {
        let d = Domain::new(100, 1, Arc::new(Signal::default()));
        let mut r = Recorder::new(d.clone());
        for n in 0..90 {
            r.record(&payload(n, 16));
        }
        r.record(&payload(5, 16));
        r.record(&payload(1000, 16));
        assert_eq!(d.unique(), 90);
        assert_eq!(d.lost(), 10);
        assert_eq!(d.dup(), 2);
        assert!(!d.complete());
        let t = r.finish();
        assert_eq!(t.received, 92);
        assert!(!d.dead());
    }
}
