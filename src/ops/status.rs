//! `/status.json`, the data of the status page (what `tinybroker top`
//! shows), built in-process from the engine: its Admin listings (the whole
//! cluster's in cluster mode), its info, and the publish and delivery totals
//! the metrics report, from which the page computes rates.
//!
//! Shape (docs/operations.md, "Status page"): times are Unix seconds and durations
//! seconds, both fractional; a peer or a time that is not known is `null`.

use crate::engine::{
    AckMode, BrokerError, DeliveryMode, Engine, EngineInfo, EvictionRecord, GroupInfo, SubscriptionInfo,
};
use futures::future::BoxFuture;
use serde::Serialize;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::SystemTime;

/// Rows of each listing when the request does not say (`?limit=`).
pub const DEFAULT_LIMIT: usize = 50;

/// Builds a [`Status`] from the engine picked at start-up (one dynamic call
/// per request keeps the side server free of the engine type).
#[derive(Clone)]
pub struct StatusSource(Arc<dyn Fn(usize) -> BoxFuture<'static, Result<Status, BrokerError>> + Send + Sync>);

impl StatusSource {
    pub fn new<E: Engine>(engine: E) -> Self {
        Self(Arc::new(move |limit| {
            let engine = engine.clone();
            Box::pin(async move { build(&engine, limit).await })
        }))
    }

    /// The status now, each listing cut to its first `limit` rows (0: all).
    pub async fn status(&self, limit: usize) -> Result<Status, BrokerError> {
        (self.0)(limit).await
    }
}

/// What `/status.json` answers.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub version: &'static str,
    /// When this was read (the page's rates divide by its differences).
    pub generated_at: f64,
    pub started_at: f64,
    pub uptime_seconds: f64,
    /// Cluster mode: this replica and its NATS server; `null` otherwise.
    pub cluster: Option<Cluster>,
    /// Lifetime totals of this broker (this replica in cluster mode):
    /// `tinybroker_messages_published_total` and the sum of
    /// `tinybroker_messages_delivered_total`.
    pub totals: Totals,
    /// Open subscriptions, groups and manual-ack group members in all (the
    /// lists may be cut).
    pub subscription_count: usize,
    pub group_count: usize,
    pub member_count: usize,
    /// Fullest queues first (depth over capacity, then depth).
    pub subscriptions: Vec<SubscriptionRow>,
    /// The manual-ack group members, oldest unacked message first: a hung
    /// member (`looks_hung`) among acking ones comes first.
    pub members: Vec<SubscriptionRow>,
    /// Largest backlog first.
    pub groups: Vec<GroupRow>,
    /// Newest first.
    pub evictions: Vec<EvictionRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Cluster {
    pub replica_id: String,
    pub nats_server: String,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Totals {
    pub published: u64,
    pub delivered: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SubscriptionRow {
    pub subscription_id: String,
    /// `multi` (broadcast) or `single` (a group member).
    pub mode: &'static str,
    pub consumer_group: String,
    pub topic_patterns: Vec<String>,
    pub queue_depth: usize,
    pub capacity: usize,
    pub delivered: u64,
    pub opened_at: f64,
    pub peer: Option<String>,
    pub replica_id: String,
    /// A MANUAL member's messages delivered and not acked yet.
    pub unacked: u64,
    pub oldest_unacked_age_seconds: Option<f64>,
    /// A manual-ack member whose oldest unacked message is far older than
    /// its group's other members' ([`crate::group::hung`]): the page and
    /// `tinybroker top` mark it "HUNG?".
    pub looks_hung: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct GroupRow {
    pub name: String,
    pub topic_patterns: Vec<String>,
    pub members: usize,
    pub backlog: usize,
    pub in_flight: usize,
    pub oldest_unacked_age_seconds: Option<f64>,
    pub redeliveries: u64,
    pub dead_lettered: u64,
    pub dropped: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvictionRow {
    pub subscription_id: String,
    pub evicted_at: f64,
    pub topic_patterns: Vec<String>,
    pub queue_depth: usize,
    pub last_delivered_sequence: u64,
    pub peer: Option<String>,
    pub replica_id: String,
}

async fn build<E: Engine>(engine: &E, limit: usize) -> Result<Status, BrokerError> {
    let (subscriptions, groups, evictions, info) = tokio::try_join!(
        engine.list_subscriptions(),
        engine.list_groups(),
        engine.list_evictions(),
        engine.info(),
    )?;
    let counters = engine.counters();
    let totals = Totals {
        published: counters.published,
        delivered: counters.delivered_multi + counters.delivered_single,
    };
    Ok(assemble(
        subscriptions,
        groups,
        evictions,
        info,
        totals,
        SystemTime::now(),
        limit,
    ))
}

/// Sorts and cuts the listings as the page shows them.
fn assemble(
    mut subscriptions: Vec<SubscriptionInfo>,
    mut groups: Vec<GroupInfo>,
    evictions: Vec<EvictionRecord>,
    info: EngineInfo,
    totals: Totals,
    now: SystemTime,
    limit: usize,
) -> Status {
    let limit = if limit == 0 { usize::MAX } else { limit };
    let (subscription_count, group_count) = (subscriptions.len(), groups.len());
    // Marked among every member of each group, before any list is cut.
    let mut members: Vec<SubscriptionInfo> = subscriptions.iter().filter(|s| manual_member(s)).cloned().collect();
    let ages: Vec<(&str, Option<std::time::Duration>)> = members
        .iter()
        .map(|s| (s.consumer_group.as_str(), s.oldest_unacked_age))
        .collect();
    let hung: HashSet<String> = members
        .iter()
        .zip(crate::group::hung::marks(&ages))
        .filter(|(_, marked)| *marked)
        .map(|(s, _)| s.subscription_id.clone())
        .collect();
    members.sort_by(|a, b| {
        b.oldest_unacked_age
            .cmp(&a.oldest_unacked_age)
            .then(b.unacked.cmp(&a.unacked))
            .then_with(|| a.consumer_group.cmp(&b.consumer_group))
            .then_with(|| a.subscription_id.cmp(&b.subscription_id))
    });
    let member_count = members.len();
    let row = |s: SubscriptionInfo| SubscriptionRow {
        looks_hung: hung.contains(&s.subscription_id),
        subscription_id: s.subscription_id,
        mode: match s.mode {
            DeliveryMode::Multi => "multi",
            DeliveryMode::Single => "single",
        },
        consumer_group: s.consumer_group,
        topic_patterns: s.topic_patterns,
        queue_depth: s.queue_depth,
        capacity: s.capacity,
        delivered: s.delivered,
        opened_at: unix_seconds(s.opened_at),
        peer: s.peer.map(|p| p.to_string()),
        replica_id: s.replica_id,
        unacked: s.unacked,
        oldest_unacked_age_seconds: s.oldest_unacked_age.map(|age| age.as_secs_f64()),
    };
    // Fill as a cross product, so that no float is compared: a/b > c/d. A
    // group member's fill counts what it holds unacked too (its capacity is
    // max_in_flight), so a hung member comes first, not among the empty.
    subscriptions.sort_by(|a, b| {
        let held = |s: &SubscriptionInfo| s.queue_depth as u128 + u128::from(s.unacked);
        let fill = |s: &SubscriptionInfo, other: &SubscriptionInfo| held(s) * other.capacity.max(1) as u128;
        fill(b, a)
            .cmp(&fill(a, b))
            .then(held(b).cmp(&held(a)))
            .then_with(|| a.subscription_id.cmp(&b.subscription_id))
    });
    groups.sort_by(|a, b| {
        b.backlog
            .cmp(&a.backlog)
            .then(b.in_flight.cmp(&a.in_flight))
            .then_with(|| a.name.cmp(&b.name))
    });
    Status {
        version: env!("CARGO_PKG_VERSION"),
        generated_at: unix_seconds(now),
        started_at: unix_seconds(info.started_at),
        uptime_seconds: info.uptime.as_secs_f64(),
        cluster: info.cluster.map(|c| Cluster {
            replica_id: c.replica_id,
            nats_server: c.nats_server,
        }),
        totals,
        subscription_count,
        group_count,
        member_count,
        subscriptions: subscriptions.into_iter().take(limit).map(row).collect(),
        members: members.into_iter().take(limit).map(row).collect(),
        groups: groups
            .into_iter()
            .take(limit)
            .map(|g| GroupRow {
                name: g.name,
                topic_patterns: g.topic_patterns,
                members: g.members,
                backlog: g.backlog,
                in_flight: g.in_flight,
                oldest_unacked_age_seconds: g.oldest_unacked_age.map(|d| d.as_secs_f64()),
                redeliveries: g.redeliveries,
                dead_lettered: g.dead_lettered,
                dropped: g.dropped,
            })
            .collect(),
        evictions: evictions
            .into_iter()
            .take(limit)
            .map(|e| EvictionRow {
                subscription_id: e.subscription_id,
                evicted_at: unix_seconds(e.evicted_at),
                topic_patterns: e.topic_patterns,
                queue_depth: e.queue_depth,
                last_delivered_sequence: e.last_delivered_sequence,
                peer: e.peer.map(|p| p.to_string()),
                replica_id: e.replica_id,
            })
            .collect(),
    }
}

/// A member of a group whose messages wait for its acks.
fn manual_member(s: &SubscriptionInfo) -> bool {
    s.ack_mode == Some(AckMode::Manual) && !s.consumer_group.is_empty()
}

/// `?limit=N` of a `/status.json` request: rows of each listing, 0 for all.
pub fn limit_from_query(query: Option<&str>) -> Result<usize, String> {
    let mut limit = DEFAULT_LIMIT;
    for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "limit" => {
                limit = value
                    .parse()
                    .map_err(|_| format!("limit={value:?} is not a number of rows (0 for all)"))?
            }
            _ => {
                return Err(format!(
                    "unknown parameter {key:?}; /status.json takes limit=N (0 for all)"
                ));
            }
        }
    }
    Ok(limit)
}

fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn subscription(id: &str, depth: usize, capacity: usize) -> SubscriptionInfo {
        SubscriptionInfo {
            subscription_id: id.into(),
            mode: DeliveryMode::Multi,
            consumer_group: String::new(),
            ack_mode: None,
            topic_patterns: vec!["a.>".into()],
            queue_depth: depth,
            queue_peak: depth,
            capacity,
            delivered: 0,
            opened_at: SystemTime::UNIX_EPOCH + Duration::from_millis(1_500),
            peer: None,
            replica_id: String::new(),
            unacked: 0,
            oldest_unacked_age: None,
            stalled: None,
        }
    }

    fn group(name: &str, backlog: usize) -> GroupInfo {
        GroupInfo {
            name: name.into(),
            backlog,
            ..GroupInfo::default()
        }
    }

    fn info() -> EngineInfo {
        EngineInfo {
            started_at: SystemTime::UNIX_EPOCH,
            uptime: Duration::from_secs(5),
            subscriptions: 0,
            consumer_groups: 0,
            last_sequence: 0,
            cluster: None,
        }
    }

    #[test]
    fn fullest_queues_and_largest_backlogs_come_first_and_lists_are_cut() {
        let status = assemble(
            vec![
                subscription("half-of-big", 500, 1000),
                subscription("full-small", 4, 4),
                subscription("empty", 0, 10),
                subscription("half-of-small", 2, 4),
            ],
            vec![group("small", 1), group("big", 90), group("none", 0)],
            Vec::new(),
            info(),
            Totals {
                published: 7,
                delivered: 9,
            },
            SystemTime::UNIX_EPOCH + Duration::from_secs(10),
            3,
        );
        let ids: Vec<_> = status
            .subscriptions
            .iter()
            .map(|s| s.subscription_id.as_str())
            .collect();
        assert_eq!(ids, ["full-small", "half-of-big", "half-of-small"]);
        let names: Vec<_> = status.groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["big", "small", "none"]);
        assert_eq!((status.subscription_count, status.group_count), (4, 3));
        assert_eq!(status.subscriptions[0].opened_at, 1.5);
        assert_eq!(status.generated_at, 10.0);
    }

    /// A busy group: every member holds its max_in_flight; the one whose
    /// oldest unacked message is far older than the others' comes first
    /// among the members and is marked.
    #[test]
    fn members_come_oldest_unacked_first_and_a_hung_one_is_marked() {
        let member = |id: &str, group: &str, age: Option<u64>| SubscriptionInfo {
            mode: DeliveryMode::Single,
            consumer_group: group.into(),
            ack_mode: Some(AckMode::Manual),
            unacked: 16,
            oldest_unacked_age: age.map(Duration::from_secs),
            ..subscription(id, 0, 16)
        };
        let status = assemble(
            vec![
                member("ok-1", "workers", Some(2)),
                member("hung", "workers", Some(13)),
                member("ok-2", "workers", Some(1)),
                member("idle", "other", None),
                member("alone", "solo", Some(40)),
                subscription("broadcast", 3, 10),
            ],
            Vec::new(),
            Vec::new(),
            info(),
            Totals {
                published: 0,
                delivered: 0,
            },
            SystemTime::UNIX_EPOCH,
            4,
        );
        let rows: Vec<_> = status
            .members
            .iter()
            .map(|s| (s.subscription_id.as_str(), s.looks_hung))
            .collect();
        assert_eq!(
            rows,
            [("alone", false), ("hung", true), ("ok-1", false), ("ok-2", false)]
        );
        assert_eq!(status.member_count, 5, "the broadcast subscription is no member");
        let hung = status.subscriptions.iter().find(|s| s.subscription_id == "hung");
        assert!(hung.is_some_and(|s| s.looks_hung), "marked in both lists");
    }

    #[test]
    fn the_limit_parameter_is_checked() {
        assert_eq!(limit_from_query(None), Ok(DEFAULT_LIMIT));
        assert_eq!(limit_from_query(Some("limit=0")), Ok(0));
        assert_eq!(limit_from_query(Some("limit=7")), Ok(7));
        let bad = limit_from_query(Some("limit=ten")).unwrap_err();
        assert!(bad.contains("\"ten\""), "{bad}");
        let unknown = limit_from_query(Some("rows=3")).unwrap_err();
        assert!(unknown.contains("\"rows\""), "{unknown}");
    }
}
