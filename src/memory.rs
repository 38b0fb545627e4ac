//! The broker-wide memory budget, in bytes: what the messages held for
//! subscribers and consumer groups, and the requests still being received,
//! may take in all (`TINYBROKER_MAX_MEMORY_BYTES`), and the container memory
//! limit its default is derived from.
//!
//! Every published message is charged once, however many queues hold it,
//! when it is created, and released when its last holder drops it; a
//! partially received request is charged while it is being received (see
//! [`crate::grpc::request_budget`]). What the budget does not see (the allocator's
//! slack, HTTP/2 and socket buffers, the runtime) is what the remaining
//! quarter of the container's limit is for.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes charged for a message beyond its topic, payload and headers: its
/// shared allocation and the queue entries that point at it.
pub const MESSAGE_OVERHEAD: usize = 160;
/// Bytes charged per header beyond its name and value (two strings and a
/// hash-table slot).
pub const HEADER_OVERHEAD: usize = 64;

/// A byte budget shared by the whole broker. Lives for the rest of the
/// process once made (see [`MemoryBudget::leak`]), so that every message can
/// point at it without a reference count of its own.
#[derive(Debug)]
pub struct MemoryBudget {
    /// `usize::MAX` when no limit is set.
    limit: usize,
    used: AtomicUsize,
}

impl MemoryBudget {
    /// A budget for one broker. Leaked on purpose: a process makes one (tests
    /// a few hundred, 16 bytes each), and a `&'static` spares every message
    /// an atomic reference count on a line all cores share.
    pub fn leak(limit: Option<usize>) -> &'static MemoryBudget {
        Box::leak(Box::new(MemoryBudget {
            limit: limit.unwrap_or(usize::MAX),
            used: AtomicUsize::new(0),
        }))
    }

    /// A budget without a limit, for a `static`.
    pub const fn unlimited() -> MemoryBudget {
        MemoryBudget {
            limit: usize::MAX,
            used: AtomicUsize::new(0),
        }
    }

    /// The configured limit, if any.
    pub fn limit(&self) -> Option<usize> {
        (self.limit != usize::MAX).then_some(self.limit)
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if they fit under the limit; false (nothing charged)
    /// when they do not.
    pub fn try_charge(&self, bytes: usize) -> bool {
        let before = self.used.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) > self.limit {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Charges `bytes` whatever the limit: for messages the broker makes from
    /// ones it already holds (dead letters), which must not be lost to it.
    pub fn charge(&self, bytes: usize) {
        self.used.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn release(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The memory limit of the cgroup this process runs in (v2 `memory.max`,
/// else v1 `memory.limit_in_bytes`), or None when there is none.
pub fn container_memory_limit() -> Option<u64> {
    let v2 = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok();
    let v1 = || std::fs::read_to_string("/sys/fs/cgroup/memory/memory.limit_in_bytes").ok();
    parse_cgroup_limit(&v2.or_else(v1)?)
}

/// A cgroup memory limit file's value: "max" (v2) or a value near
/// `i64::MAX` rounded to pages (v1) mean no limit.
fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let value: u64 = text.trim().parse().ok()?;
    (value < (1 << 60)).then_some(value)
}

/// The share of `TINYBROKER_MAX_MEMORY_BYTES` for requests being received
/// (an eighth); the rest is for messages. Two budgets, so that a publisher's
/// message in flight is never refused for the bytes slow readers hold (the
/// message budget evicts them instead) and the two together never exceed
/// the limit.
pub fn split(total: Option<usize>) -> (Option<usize>, Option<usize>) {
    match total {
        None => (None, None),
        Some(total) => {
            let incoming = total / 8;
            (Some(total - incoming), Some(incoming))
        }
    }
}

/// `TINYBROKER_MAX_MEMORY_BYTES`'s default: three quarters of the
/// container's memory limit.
pub fn default_limit(container_limit: Option<u64>) -> Option<usize> {
    container_limit.map(|l| usize::try_from(l / 4 * 3).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_fit_under_the_limit_or_are_refused_whole() {
        let budget = MemoryBudget::leak(Some(100));
        assert!(budget.try_charge(60));
        assert!(!budget.try_charge(41), "60 + 41 > 100");
        assert_eq!(budget.used(), 60, "a refused charge leaves nothing behind");
        assert!(budget.try_charge(40));
        budget.release(50);
        assert_eq!(budget.used(), 50);
        budget.charge(200);
        assert_eq!(budget.used(), 250, "an unconditional charge may exceed the limit");
        let unlimited = MemoryBudget::leak(None);
        assert!(unlimited.try_charge(usize::MAX / 2));
        assert_eq!(unlimited.limit(), None);
    }

    #[test]
    fn cgroup_limits_are_read_as_the_kernel_writes_them() {
        assert_eq!(parse_cgroup_limit("536870912\n"), Some(512 << 20));
        assert_eq!(parse_cgroup_limit("max\n"), None);
        assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None, "v1 unlimited");
        assert_eq!(default_limit(Some(512 << 20)), Some(384 << 20));
        assert_eq!(default_limit(None), None);
        assert_eq!(split(Some(800)), (Some(700), Some(100)));
        assert_eq!(split(None), (None, None));
    }
}
