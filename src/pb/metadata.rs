//! The request and response metadata of `tinybroker.v1` that the `.proto`
//! files cannot carry: the names the front writes and reads and a client
//! sends and reads (docs/contract.md states what each means).

/// The request metadata a session asks for batched deliveries with.
pub const BATCH_METADATA: &str = "tinybroker-batch";
/// The response header of `Session` and `OpenSubscription` naming the
/// broker instance (a new id at every start): sequences restart with it.
pub const INSTANCE_METADATA: &str = "tinybroker-instance";
/// The response header saying where delivered sequences come from:
/// `instance` or `replica`.
pub const SEQUENCE_SCOPE_METADATA: &str = "tinybroker-sequence-scope";
/// Initial response metadata of `OpenSubscription` carrying the
/// subscription id.
pub const SUBSCRIPTION_ID_METADATA: &str = "tinybroker-subscription-id";
/// Trailer of a subscription stream the broker ended (status OK): why,
/// `evicted`, `closed_by_admin` or `shutdown`.
pub const END_REASON_METADATA: &str = "tinybroker-end-reason";
/// Trailer beside it: messages queued for the subscription that it lost.
pub const DROPPED_METADATA: &str = "tinybroker-dropped";
/// Trailer beside it: the sequence of the last message handed to the stream.
pub const LAST_SEQUENCE_METADATA: &str = "tinybroker-last-sequence";
