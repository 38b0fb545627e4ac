//! When a manual-ack member looks hung among its group's others, for every
//! view that marks it (`tinybroker top` and the status page's
//! `/status.json`): its oldest unacked message is far older than any other
//! member's. In a busy group every member holds its `max_in_flight`, so
//! what a member holds does not tell a hung one from the others; how long
//! it has held its oldest does.
//!
//! "Far older" is [`FACTOR`] times the largest oldest-unacked age of the
//! group's other members (a member holding nothing counts as 0), and at
//! least [`MARGIN`] more than it: a member is never marked for a second or
//! two, nor when its whole group is as slow (two hung members hide each
//! other: `TinybrokerConsumerGroupStuck` and the per-member alert see them).
//! A member alone in its group is never marked. An age restarts when its
//! message is redelivered after the ack deadline, so with a short deadline
//! a hung member is marked for part of each deadline only (after `MARGIN`
//! and three times what the others hold); the alert
//! `TinybrokerConsumerGroupMemberHung` reads its stall instead, which a
//! redelivery does not restart.

use std::collections::HashMap;
use std::time::Duration;

/// How many times the others' largest oldest-unacked age a member's must be.
pub const FACTOR: u32 = 3;
/// How much older than the others' largest it must be, at least.
pub const MARGIN: Duration = Duration::from_secs(5);

/// Whether a member whose oldest unacked message is `age` old looks hung
/// beside its group's other members, the largest of whose oldest-unacked
/// ages is `others`.
pub fn far_older(age: Duration, others: Duration) -> bool {
    age >= others.saturating_mul(FACTOR) && age >= others.saturating_add(MARGIN)
}

/// For each of `members` (its group, and the age of its oldest unacked
/// message, None when it holds none), whether it looks hung: every
/// manual-ack member of each group must be among them.
pub fn marks(members: &[(&str, Option<Duration>)]) -> Vec<bool> {
    // Per group: the largest age and which member has it, and the second.
    let mut top: HashMap<&str, (usize, Duration, Duration, usize)> = HashMap::new();
    for (i, &(group, age)) in members.iter().enumerate() {
        let age = age.unwrap_or_default();
        let entry = top.entry(group).or_insert((i, age, Duration::ZERO, 0));
        entry.3 += 1;
        if entry.0 == i {
            continue;
        }
        if age > entry.1 {
            entry.2 = entry.1;
            (entry.0, entry.1) = (i, age);
        } else if age > entry.2 {
            entry.2 = age;
        }
    }
    members
        .iter()
        .enumerate()
        .map(|(i, &(group, age))| {
            let (first, largest, second, count) = top[group];
            let others = if first == i { second } else { largest };
            count > 1 && age.is_some_and(|age| far_older(age, others))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(seconds: u64) -> Option<Duration> {
        Some(Duration::from_secs(seconds))
    }

    #[test]
    fn far_older_is_three_times_and_five_seconds_more() {
        assert!(far_older(Duration::from_secs(6), Duration::from_secs(1)));
        assert!(
            !far_older(Duration::from_secs(5), Duration::from_secs(1)),
            "not 5 s more"
        );
        assert!(far_older(Duration::from_secs(5), Duration::ZERO));
        assert!(!far_older(Duration::from_secs(4), Duration::ZERO), "a few seconds");
        assert!(far_older(Duration::from_secs(30), Duration::from_secs(10)));
        assert!(!far_older(Duration::from_secs(29), Duration::from_secs(10)), "not 3x");
    }

    #[test]
    fn a_member_is_marked_against_the_others_of_its_own_group() {
        let members = [
            ("workers", s(1)),
            ("workers", s(13)),
            ("workers", s(2)),
            ("workers", None),
            // Each as old as the other: neither is marked.
            ("pair", s(40)),
            ("pair", s(40)),
            // Alone in its group.
            ("solo", s(600)),
            // The largest comes first, and the second is far behind.
            ("first", s(20)),
            ("first", s(3)),
            ("first", None),
        ];
        assert_eq!(
            marks(&members),
            [false, true, false, false, false, false, false, true, false, false]
        );
        // Two hung members hide each other.
        assert_eq!(marks(&[("g", s(20)), ("g", s(19)), ("g", s(1))]), [false; 3]);
        // Nothing held anywhere.
        assert_eq!(marks(&[("g", None), ("g", None)]), [false; 2]);
    }
}
