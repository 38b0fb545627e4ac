//! How long each consumer group has had work without completing any, in
//! cluster mode: [`GroupInfo::stalled`], which the single-node engine keeps
//! per group (`broker/group/mod.rs`) and a cluster has nowhere in one place.
//! Every replica works it out from each gathering of the cluster's groups
//! (every heartbeat, `registry.rs`): a group has work while its backlog or
//! its members hold messages, and completes one when the cluster's count of
//! done messages goes up (`acked`: a MANUAL member's Ack, or an AUTO
//! member's stream taking it, on any replica). Redeliveries are not
//! progress. So `tinybroker_consumer_group_stalled_seconds` is the same on
//! every replica, give or take a heartbeat, and the alert and panels read
//! it with `max by (consumer_group)`.
//!
//! A replica that leaves takes its counts out of the sum; that is not
//! progress, and its return (the counts back) counts as progress: the
//! stall clock errs toward quiet. When a stall is reported, and its words,
//! are the shared rule's ([`crate::group::stall`]): at WARN, once per
//! stall, by every replica (whichever pod an operator reads has it).

use crate::engine::GroupInfo;
use crate::group::stall::{self, StallReport};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Instant;

#[derive(Default)]
pub(super) struct Stalls {
    /// Each group's done count as last gathered, and since when it has had
    /// work without that count going up (None: no work).
    groups: Mutex<HashMap<String, Progress>>,
}

struct Progress {
    acked: u64,
    since: Option<Instant>,
    report: StallReport,
}

impl Stalls {
    /// Sets each group's `stalled` as of `now`, from the gathering `groups`
    /// (the cluster's every group); forgets groups no longer in it.
    pub(super) fn stamp(&self, groups: &mut [GroupInfo], now: Instant) {
        let mut seen = self.groups.lock();
        seen.retain(|name, _| groups.iter().any(|g| g.name == *name));
        for group in groups {
            let has_work = group.backlog > 0 || group.in_flight > 0;
            let progress = seen.entry(group.name.clone()).or_insert(Progress {
                acked: group.acked,
                since: None,
                report: StallReport::default(),
            });
            let completed = group.acked > progress.acked;
            progress.acked = group.acked;
            if !has_work || completed {
                progress.since = None;
                progress.report.progressed();
            }
            let since = if has_work {
                *progress.since.get_or_insert(now)
            } else {
                now
            };
            group.stalled = now.saturating_duration_since(since);
            if progress.report.due(group.stalled) {
                stall::warn(group);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A group as a gathering gives it.
    fn gathered(name: &str, backlog: usize, in_flight: usize, acked: u64) -> GroupInfo {
        GroupInfo {
            name: name.into(),
            backlog,
            in_flight,
            acked,
            ..Default::default()
        }
    }

    fn stalled(stalls: &Stalls, group: GroupInfo, at: Instant) -> Duration {
        let mut groups = [group];
        stalls.stamp(&mut groups, at);
        groups[0].stalled
    }

    #[test]
    fn a_group_with_work_and_no_completion_is_stalled_from_when_it_was_first_seen_so() {
        let stalls = Stalls::default();
        let t0 = Instant::now();
        let s = |secs| t0 + Duration::from_secs(secs);
        // No work: never stalled, however long.
        assert_eq!(stalled(&stalls, gathered("g", 0, 0, 0), s(0)), Duration::ZERO);
        assert_eq!(stalled(&stalls, gathered("g", 0, 0, 0), s(30)), Duration::ZERO);
        // Work arrives and nothing completes: stalled from there.
        assert_eq!(stalled(&stalls, gathered("g", 3, 0, 0), s(32)), Duration::ZERO);
        assert_eq!(stalled(&stalls, gathered("g", 1, 2, 0), s(40)), Duration::from_secs(8));
        // A completion anywhere in the cluster is progress.
        assert_eq!(stalled(&stalls, gathered("g", 0, 2, 1), s(42)), Duration::ZERO);
        assert_eq!(stalled(&stalls, gathered("g", 0, 2, 1), s(90)), Duration::from_secs(48));
        // A replica leaving takes its counts out of the sum: no progress.
        assert_eq!(stalled(&stalls, gathered("g", 0, 2, 0), s(92)), Duration::from_secs(50));
        // All done: not stalled.
        assert_eq!(stalled(&stalls, gathered("g", 0, 0, 3), s(94)), Duration::ZERO);
        // A memberless backlog waits too.
        assert_eq!(stalled(&stalls, gathered("g", 5, 0, 3), s(100)), Duration::ZERO);
        assert_eq!(
            stalled(&stalls, gathered("g", 5, 0, 3), s(160)),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn groups_gone_from_the_gathering_are_forgotten() {
        let stalls = Stalls::default();
        let t0 = Instant::now();
        stalled(&stalls, gathered("g", 1, 0, 0), t0);
        stalls.stamp(&mut [], t0 + Duration::from_secs(10));
        assert!(stalls.groups.lock().is_empty());
        // Made again: a new stall clock.
        let again = stalled(&stalls, gathered("g", 1, 0, 0), t0 + Duration::from_secs(20));
        assert_eq!(again, Duration::ZERO);
    }
}
