//! The bounds of a consumer group's backlog: the same for both engines.

/// What bounds a group's backlog.
#[derive(Debug, Clone, Copy)]
pub struct BacklogLimits {
    /// Most messages (`TINYBROKER_GROUP_CAPACITY`).
    pub capacity: usize,
    /// Most bytes (`TINYBROKER_GROUP_MAX_BYTES`).
    pub max_bytes: usize,
}
