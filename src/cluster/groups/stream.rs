//! A group's JetStream stream and its consumer: their names (the same on
//! every replica and every version), and their creation. Each group is a
//! WorkQueue memory stream `<prefix>_g_<hash>` on the one subject
//! `<prefix>.g.<hash>`, bounded by the shared backlog bounds
//! ([`crate::group::BacklogLimits`]: `max_msgs`, `max_bytes`, discard new),
//! read by one durable pull consumer, `members`.

use crate::cluster::{ClusterEngine, Ready};
use crate::engine::BrokerError;
use crate::engine::validate::truncate;
use crate::group::BacklogLimits;
use crate::retry::Backoff;
use async_nats::jetstream::{self, consumer::pull, stream};
use std::time::Duration;
use tokio::time::Instant;

/// A stable 64-bit FNV-1a hash: names a group's stream and subject the
/// same way on every replica and every version.
pub(super) fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The consumer's `ack_wait`, fixed by the group's first member: its ack
/// deadline, at least 2 s so that progress reports (every third of it)
/// stay few.
fn consumer_ack_wait(ack_deadline: Duration) -> Duration {
    ack_deadline.max(Duration::from_secs(2))
}

pub(super) fn stream_name(prefix: &str, group: &str) -> String {
    format!("{prefix}_g_{:016x}", fnv(group))
}

pub(super) fn subject(prefix: &str, group: &str) -> String {
    format!("{prefix}.g.{:016x}", fnv(group))
}

/// How long creating a group's stream is retried while JetStream cannot
/// place it (see [`placement_pending`]).
const PLACEMENT_RETRY_FOR: Duration = Duration::from_secs(5);
/// The wait between two of those attempts, doubling up to
/// [`PLACEMENT_RETRY_CAP`].
const PLACEMENT_RETRY_FIRST: Duration = Duration::from_millis(80);
const PLACEMENT_RETRY_CAP: Duration = Duration::from_millis(500);

/// Whether JetStream refused a stream for want of room on its servers
/// (`CLUSTER_NO_PEERS`, `INSUFFICIENT_RESOURCES`): retried for a while,
/// since a stream deleted a moment before still holds its reservation.
fn placement_pending(error: &jetstream::context::CreateStreamError) -> bool {
    use jetstream::ErrorCode;
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(e)
            if e.error_code() == ErrorCode::CLUSTER_NO_PEERS || e.error_code() == ErrorCode::INSUFFICIENT_RESOURCES
    ) || memory_exhausted(error)
}

/// Whether JetStream has no memory left to reserve for a new stream
/// ("insufficient memory resources available": the servers'
/// `max_memory_store` is taken by other streams' reservations).
fn memory_exhausted(error: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(e)
            if e.error_code() == jetstream::ErrorCode::MEMORY_RESOURCES_EXCEEDED
    )
}

impl ClusterEngine {
    /// The group's stream and its consumer, created if missing.
    pub(super) async fn group_consumer(
        &self,
        ready: &Ready,
        name: &str,
        ack_deadline: Duration,
    ) -> Result<jetstream::consumer::PullConsumer, BrokerError> {
        let stream = self.group_stream(ready, name).await?;
        let unavailable =
            |e: &dyn std::fmt::Display| BrokerError::Unavailable(format!("JetStream did not answer: {e}"));
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                "members",
                pull::Config {
                    durable_name: Some("members".into()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: consumer_ack_wait(ack_deadline),
                    max_deliver: -1,
                    max_ack_pending: -1,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(consumer)
    }

    /// The group's stream, created if missing.
    pub(super) async fn group_stream(
        &self,
        ready: &Ready,
        name: &str,
    ) -> Result<jetstream::stream::Stream, BrokerError> {
        let limits = self.inner.local.limits();
        let bounds = BacklogLimits::of(limits);
        let prefix = &self.inner.config.prefix;
        let unavailable =
            |e: &dyn std::fmt::Display| BrokerError::Unavailable(format!("JetStream did not answer: {e}"));
        let config = stream::Config {
            name: stream_name(prefix, name),
            subjects: vec![subject(prefix, name)],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::Memory,
            num_replicas: self.inner.config.nats_replicas,
            max_messages: bounds.capacity as i64,
            max_bytes: bounds.max_bytes as i64,
            // Refused when full, so the publishing replica drops (and
            // counts) the oldest: `publish_to_group`.
            discard: stream::DiscardPolicy::New,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        // A stream just deleted (a group removed after its idle TTL, whose
        // name is taken again) still holds its memory reservation on the
        // servers for a moment: JetStream answers "no suitable peers for
        // placement, insufficient storage" (10005) until it lets go.
        let started = Instant::now();
        let mut backoff = Backoff::new(PLACEMENT_RETRY_FIRST, PLACEMENT_RETRY_CAP);
        let stream = loop {
            match ready.js.get_or_create_stream(config.clone()).await {
                Ok(stream) => break stream,
                Err(e) if placement_pending(&e) && started.elapsed() < PLACEMENT_RETRY_FOR => {
                    tracing::debug!(group = %name, error = %e, "creating a group's stream retried");
                    backoff.sleep().await;
                }
                // Every group's stream reserves its byte budget on each
                // of its servers: a limit reached, not an outage.
                Err(e) if placement_pending(&e) => {
                    return Err(BrokerError::ResourceExhausted(format!(
                        "consumer group {:?}: the NATS servers have no JetStream memory left for its stream (each group reserves TINYBROKER_GROUP_MAX_BYTES={} on each of its TINYBROKER_NATS_REPLICAS={} servers): raise max_memory_store on the NATS servers, lower TINYBROKER_GROUP_MAX_BYTES, or let unused groups expire (JetStream: {e})",
                        truncate(name),
                        limits.group_max_bytes,
                        self.inner.config.nats_replicas
                    )));
                }
                Err(e) => return Err(unavailable(&e)),
            }
        };
        Ok(stream)
    }
}
