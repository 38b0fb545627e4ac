//! Consumer-group rules, written once for both engines: the single-node
//! engine (`broker/group/`) and a cluster hub (`cluster/groups/`) each keep
//! their own state and do their own I/O (locks, JetStream, logs of their
//! own), and decide with what is here.
//!
//! One concern per file:
//! - [`machine`]: the state machine of one group (or one cluster hub): who
//!   gets a message, what a Nack, an expired deadline or a member leaving
//!   does with what it held, when a message has used its last attempt,
//!   what a full backlog drops;
//! - [`admission`]: who may join a group (the patterns and ack mode its
//!   first member fixed, FAILED_PRECONDITION otherwise) and with what
//!   settings;
//! - [`backlog`]: a backlog's bounds, and what a full one drops and counts;
//! - [`idle`]: the idle TTL, and the removal's log line;
//! - [`stall`]: when a stalled group is reported, and in what words;
//! - [`hung`]: when a member looks hung beside its group's others (the
//!   mark of `tinybroker top` and the status page);
//! - [`dead_letter`]: a dead letter's form, and what becomes of one that
//!   breaks a message limit.
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
