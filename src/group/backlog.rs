//! The bounds of a consumer group's backlog, and what a full one drops, for
//! both engines: a new message that does not fit pushes out the oldest ones
//! no member was given, each dropped and counted
//! (`tinybroker_messages_dropped_total{reason="group_overflow"}`, and the
//! group's `dropped`).
//!
//! The single-node engine's backlog is the state machine's
//! ([`super::machine`], which asks [`BacklogLimits::must_drop_oldest`]); a
//! cluster group's is its JetStream stream, created with the same bounds
//! ([`BacklogLimits::of`]), which refuses what does not fit; the publishing
//! replica then deletes the oldest message no member was given and counts
//! it ([`count_overflow`]).

use crate::config::Limits;
use std::sync::atomic::{AtomicU64, Ordering};

/// What bounds a group's backlog.
#[derive(Debug, Clone, Copy)]
pub struct BacklogLimits {
    /// Most messages (`TINYBROKER_GROUP_CAPACITY`).
    pub capacity: usize,
    /// Most bytes (`TINYBROKER_GROUP_MAX_BYTES`).
    pub max_bytes: usize,
}

impl BacklogLimits {
    /// A group's backlog bounds under the broker's `limits`.
    pub fn of(limits: &Limits) -> Self {
        Self {
            capacity: limits.group_capacity,
            max_bytes: limits.group_max_bytes,
        }
    }

    /// Whether a backlog of `len` messages and `bytes` bytes must drop its
    /// oldest before it takes a new message of `incoming` bytes: it is at
    /// its capacity, or the new message would take it over its bytes.
    #[inline]
    pub fn must_drop_oldest(&self, len: usize, bytes: usize, incoming: usize) -> bool {
        len >= self.capacity || bytes + incoming > self.max_bytes
    }
}

/// Counts `dropped` messages a full backlog dropped to make room in the
/// broker's `group_overflow` total (the engine counts them in the group's
/// `dropped` too).
#[inline]
pub fn count_overflow(total: &AtomicU64, dropped: u64) {
    if dropped > 0 {
        total.fetch_add(dropped, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_backlog_drops_its_oldest_by_count_or_by_bytes() {
        let limits = BacklogLimits {
            capacity: 3,
            max_bytes: 100,
        };
        assert!(!limits.must_drop_oldest(2, 50, 50), "exactly at the byte limit fits");
        assert!(limits.must_drop_oldest(2, 50, 51), "one byte over");
        assert!(limits.must_drop_oldest(3, 0, 1), "at capacity");
        let l = Limits::default();
        let of = BacklogLimits::of(&l);
        assert_eq!((of.capacity, of.max_bytes), (l.group_capacity, l.group_max_bytes));
        let total = AtomicU64::new(0);
        count_overflow(&total, 0);
        count_overflow(&total, 2);
        assert_eq!(total.load(Ordering::Relaxed), 2);
    }
}
