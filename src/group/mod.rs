//! Consumer-group rules, written once for both engines: the single-node
//! engine (`broker/group/`) and a cluster hub (`cluster/groups/`) each keep
//! their own state and do their own I/O, and decide with what is here.
//!
//! One concern per file:
//! - [`machine`]: the state machine of one group (or one cluster hub): who
//!   gets a message, what a Nack, an expired deadline or a member leaving
//!   does with what it held, when a message has used its last attempt,
//!   what a full backlog drops;
//! - [`admission`]: who may join a group (the patterns and ack mode its
//!   first member fixed) and with what settings;
//! - [`backlog`]: the bounds of a group's backlog.
//!
//! Nothing here does I/O or reads a clock: time is passed in.

pub mod admission;
pub mod backlog;
pub(crate) mod machine;

pub use admission::MemberSettings;
pub use backlog::BacklogLimits;
