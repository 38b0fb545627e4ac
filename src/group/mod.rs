//! Consumer-group rules, written once for both engines: the single-node
//! engine (`broker/group/`) and a cluster hub (`cluster/groups/`) each keep
//! their own state and do their own I/O (locks, JetStream, logs of their
//! own), and decide with what is here.
//!
//! ARCHITECTURE.md's "Code map" says which file holds what.
//!
//! Nothing here does I/O (beyond a log line) or reads a clock: time is
//! passed in.

pub mod admission;
pub mod backlog;
pub mod dead_letter;
pub mod hung;
pub mod idle;
pub(crate) mod machine;
pub mod stall;

pub use admission::MemberSettings;
pub use backlog::BacklogLimits;
