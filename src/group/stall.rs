//! When a stalled consumer group is reported, for both engines: a group
//! that has had work (a backlog, or messages its members hold) and
//! completed none for [`STALL_WARNING_AFTER`] is logged at WARN, once per
//! stall, in the same words. How long a group has been stalled is each
//! engine's to measure (the single-node engine from its group's last
//! progress; a cluster from each heartbeat's gathering, `cluster/stalls.rs`).

use crate::engine::GroupInfo;
use std::time::Duration;

/// A group that has had work but completed nothing for this long is logged
/// at WARN, once per stall (the shipped `TinybrokerConsumerGroupStuck` alert
/// uses the same threshold).
pub const STALL_WARNING_AFTER: Duration = Duration::from_secs(45);

/// Whether a group's current stall was reported.
#[derive(Debug, Default)]
pub struct StallReport {
    reported: bool,
}

impl StallReport {
    /// The group completed a message, or has no work: its next stall is a
    /// new one.
    pub fn progressed(&mut self) {
        self.reported = false;
    }

    /// Whether a group stalled for `stalled` is to be reported now: from
    /// [`STALL_WARNING_AFTER`] on, once per stall.
    pub fn due(&mut self, stalled: Duration) -> bool {
        if self.reported || stalled < STALL_WARNING_AFTER {
            return false;
        }
        self.reported = true;
        true
    }
}

/// The WARN line of a stalled group, from its view.
pub fn warn(group: &GroupInfo) {
    tracing::warn!(
        consumer_group = group.name.as_str(),
        stalled_seconds = group.stalled.as_secs(),
        members = group.members,
        backlog = group.backlog,
        in_flight = group.in_flight,
        redeliveries = group.redeliveries,
        "consumer group stalled: it has messages waiting or held but none was acked or delivered"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_is_due_once_from_the_threshold_until_the_group_progresses() {
        let mut report = StallReport::default();
        assert!(!report.due(Duration::ZERO));
        assert!(!report.due(STALL_WARNING_AFTER - Duration::from_millis(1)));
        assert!(report.due(STALL_WARNING_AFTER));
        assert!(!report.due(STALL_WARNING_AFTER * 10), "once per stall");
        report.progressed();
        assert!(!report.due(Duration::from_secs(1)));
        assert!(report.due(STALL_WARNING_AFTER), "a new stall");
    }
}
