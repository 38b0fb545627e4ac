//! The idle TTL, for both engines: a group without members for
//! `TINYBROKER_GROUP_IDLE_TTL_SECONDS` is removed, what it held is dropped
//! and counted (`reason="group_expired"`, by the engine), and its name is
//! free again. When a group counts as memberless from is each engine's to
//! say (the single-node engine: its last member's leave; a cluster: the
//! second heartbeat in a row that finds it memberless everywhere,
//! `cluster/groups/`).

use std::time::Duration;
use tokio::time::Instant;

/// Whether a group memberless since `since` has outlived its idle TTL
/// `ttl` at `now` (never before it).
pub fn outlived(since: Instant, now: Instant, ttl: Duration) -> bool {
    now.saturating_duration_since(since) >= ttl
}

/// The log line of group `name` removed after its idle TTL with `left`
/// messages dropped: WARN when it dropped any, INFO otherwise.
pub fn log_removal(name: &str, left: usize) {
    if left == 0 {
        tracing::info!(
            consumer_group = name,
            dropped = left,
            "consumer group removed after its idle TTL with no members"
        );
    } else {
        tracing::warn!(
            consumer_group = name,
            dropped = left,
            "consumer group removed after its idle TTL with no members"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_outlives_its_ttl_at_the_ttl_and_not_before() {
        let since = Instant::now();
        let ttl = Duration::from_secs(5);
        assert!(!outlived(since, since + Duration::from_millis(4999), ttl));
        assert!(outlived(since, since + ttl, ttl));
        assert!(outlived(since, since, Duration::ZERO), "a TTL of 0: at once");
        assert!(!outlived(since + ttl, since, ttl), "a clock behind: not yet");
    }
}
