//! Who may join a consumer group, and with what settings: the same for
//! both engines.

use crate::engine::AckMode;
use std::time::Duration;

/// A member's settings, fixed when it joins.
#[derive(Debug, Clone, Copy)]
pub struct MemberSettings {
    pub ack_mode: AckMode,
    pub max_in_flight: u32,
    pub ack_deadline: Duration,
}
