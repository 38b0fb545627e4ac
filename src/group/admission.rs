//! Who may join a consumer group, and with what settings, for both
//! engines: a group's topic patterns and ack mode are fixed by its first
//! member, and every later member must ask for the same
//! (FAILED_PRECONDITION naming both otherwise); a member's own settings are
//! what it asked for, or the broker's defaults where it asked for 0.

use crate::config::Limits;
use crate::engine::validate::{self, truncate};
use crate::engine::{AckMode, BrokerError, SubscribeRequest};
use crate::topic::TopicPattern;
use std::time::Duration;

/// A member's settings, fixed when it joins.
#[derive(Debug, Clone, Copy)]
pub struct MemberSettings {
    pub ack_mode: AckMode,
    pub max_in_flight: u32,
    pub ack_deadline: Duration,
}

impl MemberSettings {
    /// What `request` asked for, with `limits`' defaults for what it left
    /// at 0 (`TINYBROKER_DEFAULT_MAX_IN_FLIGHT`,
    /// `TINYBROKER_DEFAULT_ACK_DEADLINE_MS`).
    pub fn of(request: &SubscribeRequest, limits: &Limits) -> Self {
        Self {
            ack_mode: request.ack_mode,
            max_in_flight: match request.max_in_flight {
                0 => limits.default_max_in_flight,
                n => n,
            },
            ack_deadline: match request.ack_deadline_ms {
                0 => limits.default_ack_deadline,
                ms => Duration::from_millis(ms.into()),
            },
        }
    }
}

/// What a group is opened with: its topic patterns (sorted, without
/// duplicates, as [`validate::patterns`] gives them) and its ack mode
/// (None: not fixed, or not asked).
#[derive(Debug, Clone, Copy)]
pub struct Terms<'a> {
    pub patterns: &'a [TopicPattern],
    pub ack_mode: Option<AckMode>,
}

/// Whether a member asking for `asked` may join group `name`, whose first
/// member fixed `fixed`: the patterns must be the same set, and the ack
/// mode the same where both are known (a cluster's group record written by
/// an earlier version fixed none; a rebuild asks for none).
/// FAILED_PRECONDITION naming both otherwise.
pub fn admit(name: &str, fixed: Terms<'_>, asked: Terms<'_>) -> Result<(), BrokerError> {
    if fixed.patterns != asked.patterns {
        return Err(BrokerError::FailedPrecondition(format!(
            "consumer group {:?} has topic_patterns {}; this member asked for {}; all members of a group must use the same set",
            truncate(name),
            validate::pattern_list(fixed.patterns),
            validate::pattern_list(asked.patterns)
        )));
    }
    match (fixed.ack_mode, asked.ack_mode) {
        (Some(fixed), Some(asked)) if fixed != asked => Err(BrokerError::FailedPrecondition(format!(
            "consumer group {:?} was opened with ack_mode {}; this member asked for {}; all members of a group must use the same ack mode (ACK_MODE_UNSPECIFIED is ACK_MODE_AUTO)",
            truncate(name),
            validate::ack_mode_name(fixed),
            validate::ack_mode_name(asked)
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(p: &[&str]) -> Vec<TopicPattern> {
        p.iter().map(|p| TopicPattern::parse(p).unwrap()).collect()
    }

    #[test]
    fn a_member_must_ask_for_the_patterns_and_ack_mode_the_first_fixed() {
        let t = patterns(&["t"]);
        let terms = |patterns, ack_mode| Terms { patterns, ack_mode };
        for (fixed, other) in [(AckMode::Auto, AckMode::Manual), (AckMode::Manual, AckMode::Auto)] {
            assert_eq!(admit("g", terms(&t, Some(fixed)), terms(&t, Some(fixed))), Ok(()));
            let Err(BrokerError::FailedPrecondition(message)) =
                admit("g", terms(&t, Some(fixed)), terms(&t, Some(other)))
            else {
                panic!("{other:?} joined a group of {fixed:?}");
            };
            assert_eq!(
                message,
                format!(
                    "consumer group \"g\" was opened with ack_mode {}; this member asked for {}; all members of a group must use the same ack mode (ACK_MODE_UNSPECIFIED is ACK_MODE_AUTO)",
                    validate::ack_mode_name(fixed),
                    validate::ack_mode_name(other)
                )
            );
            // Not fixed (an earlier version's record), or not asked: any.
            assert_eq!(admit("g", terms(&t, None), terms(&t, Some(other))), Ok(()));
            assert_eq!(admit("g", terms(&t, Some(fixed)), terms(&t, None)), Ok(()));
        }
        let u = patterns(&["u", "v.*"]);
        let Err(BrokerError::FailedPrecondition(message)) =
            admit("g", terms(&t, Some(AckMode::Auto)), terms(&u, Some(AckMode::Manual)))
        else {
            panic!("other patterns joined");
        };
        assert_eq!(
            message,
            "consumer group \"g\" has topic_patterns [t]; this member asked for [u, v.*]; all members of a group must use the same set"
        );
    }

    #[test]
    fn a_member_gets_the_brokers_defaults_for_what_it_left_at_0() {
        let limits = Limits::default();
        let mut request = SubscribeRequest::default();
        let s = MemberSettings::of(&request, &limits);
        assert_eq!(
            (s.ack_mode, s.max_in_flight, s.ack_deadline),
            (AckMode::Auto, limits.default_max_in_flight, limits.default_ack_deadline)
        );
        request.ack_mode = AckMode::Manual;
        request.max_in_flight = 3;
        request.ack_deadline_ms = 250;
        let s = MemberSettings::of(&request, &limits);
        assert_eq!(
            (s.ack_mode, s.max_in_flight, s.ack_deadline),
            (AckMode::Manual, 3, Duration::from_millis(250))
        );
    }
}
