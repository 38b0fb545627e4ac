//! [`Call`] and [`Answer`] to and from their declared form,
//! `tinybroker.cluster.v1.Call` and `Answer`
//! (`proto/tinybroker/cluster/v1/cluster.proto`). What does not convert (a
//! call or answer naming none, a value unknown here, a peer that is no
//! address) is an error naming the value, never a listing quietly wrong.

use super::{Answer, Call, WireError};
use crate::cluster::wire::pb;
use crate::engine::{AckMode, Acked, DeliveryMode, EvictionRecord, Nacked, SubscriptionInfo};

impl From<Call> for pb::Call {
    fn from(call: Call) -> Self {
        use pb::call::Call as C;
        let call = match call {
            Call::Ping => C::Ping(pb::PingCall {}),
            Call::Ack { id, sequences } => C::Ack(pb::AckCall {
                subscription_id: id,
                sequences,
            }),
            Call::Nack { id, sequences } => C::Nack(pb::NackCall {
                subscription_id: id,
                sequences,
            }),
            Call::Close { id } => C::Close(pb::CloseCall { subscription_id: id }),
            Call::ListSubscriptions => C::ListSubscriptions(pb::ListSubscriptionsCall {}),
            Call::ListEvictions => C::ListEvictions(pb::ListEvictionsCall {}),
            Call::ListGroups => C::ListGroups(pb::ListGroupsCall {}),
            Call::RouteGroup { name, patterns } => C::RouteGroup(pb::RouteGroupCall { name, patterns }),
            Call::Interest {
                replica,
                version,
                some,
                reads_batches,
            } => C::Interest(pb::InterestCall {
                replica,
                incarnation: version.incarnation,
                n: version.n,
                some,
                reads_batches,
            }),
        };
        pb::Call { call: Some(call) }
    }
}

impl TryFrom<pb::Call> for Call {
    type Error = String;

    fn try_from(call: pb::Call) -> Result<Self, String> {
        use pb::call::Call as C;
        Ok(match call.call.ok_or("a call naming no call (of a later version?)")? {
            C::Ping(_) => Call::Ping,
            C::Ack(a) => Call::Ack {
                id: a.subscription_id,
                sequences: a.sequences,
            },
            C::Nack(n) => Call::Nack {
                id: n.subscription_id,
                sequences: n.sequences,
            },
            C::Close(c) => Call::Close { id: c.subscription_id },
            C::ListSubscriptions(_) => Call::ListSubscriptions,
            C::ListEvictions(_) => Call::ListEvictions,
            C::ListGroups(_) => Call::ListGroups,
            C::RouteGroup(r) => Call::RouteGroup {
                name: r.name,
                patterns: r.patterns,
            },
            C::Interest(i) => Call::Interest {
                replica: i.replica,
                version: super::Version {
                    incarnation: i.incarnation,
                    n: i.n,
                },
                some: i.some,
                reads_batches: i.reads_batches,
            },
        })
    }
}

impl From<Answer> for pb::Answer {
    fn from(answer: Answer) -> Self {
        use pb::answer::Answer as A;
        let answer = match answer {
            Answer::Pong => A::Pong(pb::Pong {}),
            Answer::Acked(a) => A::Acked(pb::Acked {
                acked: a.acked,
                unknown: a.unknown,
            }),
            Answer::Nacked(n) => A::Nacked(pb::Nacked {
                requeued: n.requeued,
                unknown: n.unknown,
            }),
            Answer::Closed => A::Closed(pb::Closed {}),
            Answer::Subscriptions(list) => A::Subscriptions(pb::Subscriptions {
                subscriptions: list.into_iter().map(subscription_to_wire).collect(),
            }),
            Answer::Evictions(list) => A::Evictions(pb::Evictions {
                evictions: list.into_iter().map(eviction_to_wire).collect(),
            }),
            Answer::Groups(list) => A::Groups(pb::Groups {
                groups: list.into_iter().map(group_to_wire).collect(),
            }),
            Answer::Routed => A::Routed(pb::Routed {}),
            Answer::Error(e) => A::Error(pb::Error {
                code: error_code(&e.code) as i32,
                message: e.message,
            }),
        };
        pb::Answer { answer: Some(answer) }
    }
}

impl TryFrom<pb::Answer> for Answer {
    type Error = String;

    fn try_from(answer: pb::Answer) -> Result<Self, String> {
        use pb::answer::Answer as A;
        Ok(
            match answer
                .answer
                .ok_or("an answer naming no answer (of a later version?)")?
            {
                A::Pong(_) => Answer::Pong,
                A::Acked(a) => Answer::Acked(Acked {
                    acked: a.acked,
                    unknown: a.unknown,
                }),
                A::Nacked(n) => Answer::Nacked(Nacked {
                    requeued: n.requeued,
                    unknown: n.unknown,
                }),
                A::Closed(_) => Answer::Closed,
                A::Subscriptions(list) => Answer::Subscriptions(
                    list.subscriptions
                        .into_iter()
                        .map(subscription_from_wire)
                        .collect::<Result<_, _>>()?,
                ),
                A::Evictions(list) => Answer::Evictions(
                    list.evictions
                        .into_iter()
                        .map(eviction_from_wire)
                        .collect::<Result<_, _>>()?,
                ),
                A::Groups(list) => {
                    Answer::Groups(list.groups.into_iter().map(group_from_wire).collect::<Result<_, _>>()?)
                }
                A::Routed(_) => Answer::Routed,
                A::Error(e) => Answer::Error(WireError {
                    code: error_code_name(e.code).into(),
                    message: e.message,
                }),
            },
        )
    }
}

/// [`WireError`]'s code (its JSON form) as the proto enum.
fn error_code(code: &str) -> pb::ErrorCode {
    match code {
        "invalid_argument" => pb::ErrorCode::InvalidArgument,
        "failed_precondition" => pb::ErrorCode::FailedPrecondition,
        "already_exists" => pb::ErrorCode::AlreadyExists,
        "not_found" => pb::ErrorCode::NotFound,
        "resource_exhausted" => pb::ErrorCode::ResourceExhausted,
        _ => pb::ErrorCode::Unavailable,
    }
}

/// The proto enum as [`WireError`]'s code; unknown values are unavailable.
fn error_code_name(code: i32) -> &'static str {
    match pb::ErrorCode::try_from(code) {
        Ok(pb::ErrorCode::InvalidArgument) => "invalid_argument",
        Ok(pb::ErrorCode::FailedPrecondition) => "failed_precondition",
        Ok(pb::ErrorCode::AlreadyExists) => "already_exists",
        Ok(pb::ErrorCode::NotFound) => "not_found",
        Ok(pb::ErrorCode::ResourceExhausted) => "resource_exhausted",
        _ => "unavailable",
    }
}

pub(super) fn subscription_to_wire(s: SubscriptionInfo) -> pb::Subscription {
    pb::Subscription {
        subscription_id: s.subscription_id,
        mode: match s.mode {
            DeliveryMode::Multi => pb::DeliveryMode::Multi,
            DeliveryMode::Single => pb::DeliveryMode::Single,
        } as i32,
        consumer_group: s.consumer_group,
        ack_mode: match s.ack_mode {
            None => pb::AckMode::Unspecified,
            Some(AckMode::Auto) => pb::AckMode::Auto,
            Some(AckMode::Manual) => pb::AckMode::Manual,
        } as i32,
        topic_patterns: s.topic_patterns,
        queue_depth: s.queue_depth as u64,
        queue_peak: s.queue_peak as u64,
        capacity: s.capacity as u64,
        delivered: s.delivered,
        opened_at: Some(s.opened_at.into()),
        peer: s.peer.map(|p| p.to_string()).unwrap_or_default(),
        replica_id: s.replica_id,
        unacked: s.unacked,
        oldest_unacked_ms: s.oldest_unacked_age.map(|age| age.as_millis() as u64),
    }
}

pub(super) fn subscription_from_wire(s: pb::Subscription) -> Result<SubscriptionInfo, String> {
    let id = &s.subscription_id;
    let mode = match pb::DeliveryMode::try_from(s.mode) {
        Ok(pb::DeliveryMode::Multi) => DeliveryMode::Multi,
        Ok(pb::DeliveryMode::Single) => DeliveryMode::Single,
        _ => {
            return Err(format!(
                "subscription {id:?} has delivery mode {}, unknown here",
                s.mode
            ));
        }
    };
    let ack_mode = match pb::AckMode::try_from(s.ack_mode) {
        Ok(pb::AckMode::Unspecified) => None,
        Ok(pb::AckMode::Auto) => Some(AckMode::Auto),
        Ok(pb::AckMode::Manual) => Some(AckMode::Manual),
        Err(_) => return Err(format!("subscription {id:?} has ack mode {}, unknown here", s.ack_mode)),
    };
    Ok(SubscriptionInfo {
        opened_at: time_from_wire(s.opened_at, || format!("subscription {id:?}'s opened_at"))?,
        peer: peer_from_wire(&s.peer, || format!("subscription {id:?}'s peer"))?,
        queue_depth: size_from_wire(s.queue_depth, || format!("subscription {id:?}'s queue_depth"))?,
        queue_peak: size_from_wire(s.queue_peak, || format!("subscription {id:?}'s queue_peak"))?,
        capacity: size_from_wire(s.capacity, || format!("subscription {id:?}'s capacity"))?,
        subscription_id: s.subscription_id,
        mode,
        consumer_group: s.consumer_group,
        ack_mode,
        topic_patterns: s.topic_patterns,
        delivered: s.delivered,
        replica_id: s.replica_id,
        unacked: s.unacked,
        oldest_unacked_age: s.oldest_unacked_ms.map(std::time::Duration::from_millis),
        // The metrics read it, from this replica's own records only.
        stalled: None,
    })
}

fn eviction_to_wire(e: EvictionRecord) -> pb::Eviction {
    pb::Eviction {
        subscription_id: e.subscription_id,
        evicted_at: Some(e.evicted_at.into()),
        topic_patterns: e.topic_patterns,
        queue_depth: e.queue_depth as u64,
        last_delivered_sequence: e.last_delivered_sequence,
        peer: e.peer.map(|p| p.to_string()).unwrap_or_default(),
        replica_id: e.replica_id,
    }
}

fn eviction_from_wire(e: pb::Eviction) -> Result<EvictionRecord, String> {
    let id = &e.subscription_id;
    Ok(EvictionRecord {
        evicted_at: time_from_wire(e.evicted_at, || format!("eviction of {id:?}'s evicted_at"))?,
        peer: peer_from_wire(&e.peer, || format!("eviction of {id:?}'s peer"))?,
        queue_depth: size_from_wire(e.queue_depth, || format!("eviction of {id:?}'s queue_depth"))?,
        subscription_id: e.subscription_id,
        topic_patterns: e.topic_patterns,
        last_delivered_sequence: e.last_delivered_sequence,
        replica_id: e.replica_id,
    })
}

fn group_to_wire(g: super::LocalGroup) -> pb::GroupPart {
    pb::GroupPart {
        name: g.name,
        members: g.members as u64,
        held: g.held as u64,
        redeliveries: g.redeliveries,
        dead_lettered: g.dead_lettered,
        acked: g.acked,
        dropped: g.dropped,
        delivered: g.delivered,
        oldest_held_ms: g.oldest_held_ms,
    }
}

fn group_from_wire(g: pb::GroupPart) -> Result<super::LocalGroup, String> {
    let name = &g.name;
    Ok(super::LocalGroup {
        members: size_from_wire(g.members, || format!("group {name:?}'s members"))?,
        held: size_from_wire(g.held, || format!("group {name:?}'s held"))?,
        name: g.name,
        redeliveries: g.redeliveries,
        dead_lettered: g.dead_lettered,
        acked: g.acked,
        dropped: g.dropped,
        delivered: g.delivered,
        oldest_held_ms: g.oldest_held_ms,
    })
}

fn time_from_wire(
    time: Option<prost_types::Timestamp>,
    what: impl Fn() -> String,
) -> Result<std::time::SystemTime, String> {
    let time = time.ok_or_else(|| format!("{} is missing", what()))?;
    std::time::SystemTime::try_from(time).map_err(|e| format!("{} {time}: {e}", what()))
}

fn peer_from_wire(peer: &str, what: impl FnOnce() -> String) -> Result<Option<std::net::SocketAddr>, String> {
    if peer.is_empty() {
        return Ok(None);
    }
    peer.parse()
        .map(Some)
        .map_err(|_| format!("{} {peer:?} is no ip:port", what()))
}

fn size_from_wire(n: u64, what: impl FnOnce() -> String) -> Result<usize, String> {
    usize::try_from(n).map_err(|_| format!("{} {n} does not fit this machine's usize", what()))
}
