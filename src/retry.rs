//! The wait between two attempts of a retry loop: [`Backoff`], exponential
//! (from a first delay, doubling up to a cap) or at a fixed interval, each
//! delay times a random factor in [0.8, 1.2] ([`JITTER_PER_MILLE`]).
//!
//! The jitter is what the hand-written loops lacked: replicas that lost
//! NATS together, or clients that lost one broker, would otherwise come
//! back in lockstep, every retry at the same instant. A loop makes one
//! `Backoff`, waits with [`Backoff::sleep`] (or takes
//! [`Backoff::next_delay`] to log it or to race it against a shutdown),
//! and calls [`Backoff::reset`] once an attempt worked, so that the next
//! failure starts again from the first delay.
//!
//! This module uses nothing else of the crate (std, tokio, and `uuid`'s v4
//! for the random draws, which needs no other dependency): any module may
//! use it.

use std::time::Duration;

/// How far a delay strays from its nominal value, in thousandths either
/// way: each delay is multiplied by a factor drawn uniformly from
/// [0.8, 1.2] (docs/clients.md, `JITTER`).
pub const JITTER_PER_MILLE: u32 = 200;

/// The delays of a retry loop: `first`, then doubling at each failure in a
/// row up to `cap`, each times a jitter factor in [0.8, 1.2].
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    /// The nominal (unjittered) delay of the next attempt.
    next: Duration,
}

impl Backoff {
    /// From `first`, doubling up to `cap` (`first` above `cap` is taken
    /// as `cap`).
    pub fn new(first: Duration, cap: Duration) -> Self {
        let first = first.min(cap);
        Self {
            first,
            cap,
            next: first,
        }
    }

    /// Every `interval`, jittered: for a loop that polls for something
    /// expected soon rather than waiting out an outage.
    pub fn fixed(interval: Duration) -> Self {
        Self::new(interval, interval)
    }

    /// An attempt worked: the next delay is the first again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// The delay before the next attempt (jittered), and doubles the
    /// nominal one after it, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = jittered(self.next, draw());
        self.next = self.next.saturating_mul(2).min(self.cap);
        delay
    }

    /// Sleeps [`Self::next_delay`].
    pub async fn sleep(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }
}

/// `nominal` times the factor `random` picks in [1 - J, 1 + J]
/// ([`JITTER_PER_MILLE`] = J), in thousandths.
fn jittered(nominal: Duration, random: u32) -> Duration {
    let per_mille = 1000 - JITTER_PER_MILLE + random % (2 * JITTER_PER_MILLE + 1);
    nominal.saturating_mul(per_mille) / 1000
}

/// 32 random bits (from a v4 UUID: the OS's generator, no extra dependency;
/// a retry loop draws a few a second at most).
fn draw() -> u32 {
    let random = uuid::Uuid::new_v4();
    let b = random.as_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn within_jitter(delay: Duration, nominal: Duration) -> bool {
        delay >= nominal * 8 / 10 && delay <= nominal * 12 / 10
    }

    #[test]
    fn jitter_stays_within_its_bounds_and_reaches_both() {
        // The extreme draws give exactly 0.8 and 1.2.
        assert_eq!(jittered(1000 * MS, 0), 800 * MS);
        assert_eq!(jittered(1000 * MS, 2 * JITTER_PER_MILLE), 1200 * MS);
        let nominal = 1000 * MS;
        let (mut low, mut high) = (nominal, nominal);
        for _ in 0..10_000 {
            let delay = Backoff::fixed(nominal).next_delay();
            assert!(within_jitter(delay, nominal), "{delay:?}");
            low = low.min(delay);
            high = high.max(delay);
        }
        // Spread over the range, not stuck near one value.
        assert!(low < 850 * MS && high > 1150 * MS, "{low:?}..{high:?}");
    }

    #[test]
    fn delays_double_up_to_the_cap() {
        let mut backoff = Backoff::new(100 * MS, 1000 * MS);
        for nominal in [100, 200, 400, 800, 1000, 1000, 1000] {
            let delay = backoff.next_delay();
            assert!(within_jitter(delay, nominal * MS), "{delay:?} for {nominal} ms");
        }
    }

    #[test]
    fn reset_starts_over() {
        let mut backoff = Backoff::new(100 * MS, 5000 * MS);
        for _ in 0..10 {
            backoff.next_delay();
        }
        backoff.reset();
        for nominal in [100, 200, 400] {
            let delay = backoff.next_delay();
            assert!(within_jitter(delay, nominal * MS), "{delay:?} for {nominal} ms");
        }
    }

    #[test]
    fn a_fixed_interval_stays_fixed_and_a_first_above_the_cap_is_the_cap() {
        let mut fixed = Backoff::fixed(200 * MS);
        for _ in 0..20 {
            let delay = fixed.next_delay();
            assert!(within_jitter(delay, 200 * MS), "{delay:?}");
        }
        let delay = Backoff::new(10_000 * MS, 300 * MS).next_delay();
        assert!(within_jitter(delay, 300 * MS), "{delay:?}");
    }

    #[test]
    fn the_draws_are_not_all_equal() {
        let mut delays: Vec<Duration> = (0..100).map(|_| Backoff::fixed(1000 * MS).next_delay()).collect();
        delays.sort();
        delays.dedup();
        assert!(delays.len() > 50, "{} distinct delays of 100", delays.len());
    }

    #[tokio::test(start_paused = true)]
    async fn sleep_waits_the_next_delay() {
        let mut backoff = Backoff::new(100 * MS, 1000 * MS);
        for nominal in [100, 200, 400] {
            let started = tokio::time::Instant::now();
            backoff.sleep().await;
            let slept = started.elapsed();
            assert!(within_jitter(slept, nominal * MS), "{slept:?} for {nominal} ms");
        }
    }
}
