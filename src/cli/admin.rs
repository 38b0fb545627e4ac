//! The Admin views at a terminal: `subscriptions`, `groups`, `evictions`,
//! `info` and `close`. Each prints an aligned table for people, or with
//! `--json` one JSON object per row (one per line) for scripts.

use super::failure::failed;
use super::{Connection, out};
use crate::client::Client;
use crate::pb;
use clap::Args;
use serde_json::{Value, json};
use std::time::{Duration, SystemTime};

#[derive(Args, Debug)]
pub(super) struct ListArgs {
    /// Print one JSON object per row (per line) instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    connection: Connection,
}

#[derive(Args, Debug)]
pub(super) struct SubscriptionsArgs {
    /// Only the members of this consumer group.
    #[arg(long, value_name = "NAME")]
    group: Option<String>,
    #[command(flatten)]
    list: ListArgs,
}

#[derive(Args, Debug)]
pub(super) struct CloseArgs {
    /// The subscription to close (as `subscriptions` lists it).
    subscription_id: String,
    #[command(flatten)]
    connection: Connection,
}

/// `tinybroker subscriptions`: fullest queue first.
pub(super) async fn subscriptions(args: SubscriptionsArgs) -> anyhow::Result<()> {
    let addr = &args.list.connection.addr;
    let mut client = args.list.connection.connect().await?;
    let mut list = client
        .list_subscriptions()
        .await
        .map_err(|s| failed("subscriptions", addr, s))?;
    if let Some(group) = &args.group {
        list.retain(|s| &s.consumer_group == group);
    }
    sort_by_fill(&mut list);
    if args.list.json {
        return print_json_rows(list.iter().map(subscription_json));
    }
    if list.is_empty() {
        match &args.group {
            Some(group) => out(format_args!("no open subscriptions in group {group:?}\n"))?,
            None => out("no open subscriptions\n")?,
        }
        return Ok(());
    }
    let replica = cluster_mode(&mut client).await || list.iter().any(|s| !s.replica_id.is_empty());
    out(subscriptions_table(&list, replica, SystemTime::now()).render())?;
    Ok(())
}

/// `tinybroker groups`: largest backlog first.
pub(super) async fn groups(args: ListArgs) -> anyhow::Result<()> {
    let mut client = args.connection.connect().await?;
    let mut list = client
        .list_groups()
        .await
        .map_err(|s| failed("groups", &args.connection.addr, s))?;
    sort_by_backlog(&mut list);
    if args.json {
        return print_json_rows(list.iter().map(group_json));
    }
    if list.is_empty() {
        out("no consumer groups\n")?;
        return Ok(());
    }
    out(groups_table(&list).render())?;
    Ok(())
}

/// `tinybroker evictions`: newest first.
pub(super) async fn evictions(args: ListArgs) -> anyhow::Result<()> {
    let mut client = args.connection.connect().await?;
    let mut list = client
        .list_evictions()
        .await
        .map_err(|s| failed("evictions", &args.connection.addr, s))?;
    sort_newest_first(&mut list);
    if args.json {
        return print_json_rows(list.iter().map(eviction_json));
    }
    if list.is_empty() {
        out("no evictions\n")?;
        return Ok(());
    }
    let replica = cluster_mode(&mut client).await || list.iter().any(|e| !e.replica_id.is_empty());
    out(evictions_table(&list, replica, SystemTime::now()).render())?;
    Ok(())
}

/// `tinybroker info`: one `name: value` line each, or one JSON object.
pub(super) async fn info(args: ListArgs) -> anyhow::Result<()> {
    let mut client = args.connection.connect().await?;
    let info = client
        .broker_info()
        .await
        .map_err(|s| failed("info", &args.connection.addr, s))?;
    if args.json {
        return print_json_rows(std::iter::once(info_json(&info)));
    }
    let mut lines: Vec<(&str, String)> = vec![
        ("version", info.version.clone()),
        (
            "mode",
            if info.cluster_mode {
                "cluster (over NATS)".to_owned()
            } else {
                "single node".to_owned()
            },
        ),
    ];
    if info.cluster_mode {
        lines.push(("replica", info.replica_id.clone()));
        lines.push(("nats server", or_dash(&info.nats_server)));
    }
    lines.extend([
        ("uptime", info.uptime.map(duration).map_or_else(dash, human_duration)),
        ("started at", info.started_at.map_or_else(dash, |t| t.to_string())),
        ("subscriptions", info.subscriptions.to_string()),
        ("consumer groups", info.consumer_groups.to_string()),
        ("last sequence", info.last_sequence.to_string()),
        ("messages published", info.messages_published.to_string()),
        ("messages delivered", info.messages_delivered.to_string()),
        ("auth", on_off(info.auth_enabled)),
        ("tls", on_off(info.tls_enabled)),
    ]);
    if let Some(l) = &info.limits {
        lines.extend([
            ("consumer capacity", l.consumer_capacity.to_string()),
            ("consumer max bytes", l.consumer_max_bytes.to_string()),
            ("group capacity", l.group_capacity.to_string()),
            ("group max bytes", l.group_max_bytes.to_string()),
            ("default max in flight", l.default_max_in_flight.to_string()),
            ("default ack deadline ms", l.default_ack_deadline_ms.to_string()),
            ("max delivery attempts", l.max_delivery_attempts.to_string()),
            ("group idle ttl seconds", l.group_idle_ttl_seconds.to_string()),
            ("max message bytes", l.max_message_bytes.to_string()),
            ("max memory bytes", l.max_memory_bytes.to_string()),
            ("max subscriptions", l.max_subscriptions.to_string()),
            (
                "max subscriptions per session",
                l.max_subscriptions_per_session.to_string(),
            ),
            ("max batch messages", l.max_batch_messages.to_string()),
            ("max connections", l.max_connections.to_string()),
            (
                "max patterns per subscription",
                l.max_patterns_per_subscription.to_string(),
            ),
            ("max topic bytes", l.max_topic_bytes.to_string()),
            ("max headers", l.max_headers.to_string()),
            ("handshake timeout seconds", l.handshake_timeout_seconds.to_string()),
            ("shutdown grace seconds", l.shutdown_grace_seconds.to_string()),
        ]);
    }
    let width = lines.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    for (name, value) in lines {
        out(format_args!(
            "{:<width$}  {value}\n",
            format!("{name}:"),
            width = width + 1
        ))?;
    }
    Ok(())
}

/// `tinybroker close ID`.
pub(super) async fn close(args: CloseArgs) -> anyhow::Result<()> {
    let mut client = args.connection.connect().await?;
    client
        .close_subscription(&args.subscription_id)
        .await
        .map_err(|s| failed("close", &args.connection.addr, s))?;
    out(format_args!("closed subscription {}\n", args.subscription_id))?;
    Ok(())
}

/// Whether the broker runs in cluster mode (then tables get a REPLICA
/// column). An older broker that cannot say counts as not.
async fn cluster_mode(client: &mut Client) -> bool {
    client.broker_info().await.is_ok_and(|i| i.cluster_mode)
}

fn print_json_rows(rows: impl Iterator<Item = Value>) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for row in rows {
        serde_json::to_writer(&mut out, &row)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

// === order of the rows ===

/// What a subscription holds: its queue, and for a manual-ack member the
/// messages on its stream not acked yet.
fn held(s: &pb::SubscriptionInfo) -> u64 {
    s.queue_depth.saturating_add(s.unacked)
}

/// How full a subscription is, 0 to 1: its queue over its capacity, and
/// for a group member what it holds (queued and unacked) over its
/// max_in_flight, so a hung member is as full as its unacked messages
/// make it (beyond 1 for a member holding more than its max_in_flight).
pub(super) fn fill(s: &pb::SubscriptionInfo) -> f64 {
    held(s) as f64 / s.capacity.max(1) as f64
}

/// Fullest first, then the most held, then by id.
pub(super) fn sort_by_fill(list: &mut [pb::SubscriptionInfo]) {
    list.sort_by(|a, b| {
        fill(b)
            .total_cmp(&fill(a))
            .then(held(b).cmp(&held(a)))
            .then(a.subscription_id.cmp(&b.subscription_id))
    });
}

/// Largest backlog first, then most in flight, then by name.
pub(super) fn sort_by_backlog(list: &mut [pb::ConsumerGroupInfo]) {
    list.sort_by(|a, b| {
        b.backlog
            .cmp(&a.backlog)
            .then(b.in_flight.cmp(&a.in_flight))
            .then(a.name.cmp(&b.name))
    });
}

/// Newest eviction first.
pub(super) fn sort_newest_first(list: &mut [pb::EvictionInfo]) {
    let at = |e: &pb::EvictionInfo| e.evicted_at.map_or((0, 0), |t| (t.seconds, t.nanos));
    list.sort_by_key(|e| std::cmp::Reverse(at(e)));
}

// === tables ===

/// An aligned text table: columns two spaces apart, numbers right-aligned.
pub(super) struct Table {
    headers: Vec<&'static str>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(columns: &[(&'static str, Align)]) -> Self {
        Self {
            headers: columns.iter().map(|(h, _)| *h).collect(),
            right: columns.iter().map(|(_, a)| *a == Align::Right).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    pub(super) fn render(&self) -> String {
        let width = |cell: &str| cell.chars().count();
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| width(&r[i]))
                    .chain([width(self.headers[i])])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        for cells in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in cells.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = " ".repeat(widths[i] - width(cell));
                if self.right[i] {
                    line.push_str(&pad);
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.push_str(&pad);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Align {
    Left,
    Right,
}

fn subscriptions_table(list: &[pb::SubscriptionInfo], replica: bool, now: SystemTime) -> Table {
    use Align::*;
    let mut columns = vec![
        ("ID", Left),
        ("MODE", Left),
        ("GROUP", Left),
        ("PATTERNS", Left),
        ("QUEUE", Right),
        ("FILL", Right),
        ("DELIVERED", Right),
        ("UNACKED", Right),
        ("OLDEST UNACKED", Right),
        ("AGE", Right),
        ("PEER", Left),
    ];
    if replica {
        columns.push(("REPLICA", Left));
    }
    let mut table = Table::new(&columns);
    for s in list {
        let mut row = vec![
            s.subscription_id.clone(),
            mode_label(s),
            or_dash(&s.consumer_group),
            s.topic_patterns.join(","),
            format!("{}/{}", s.queue_depth, s.capacity),
            percent(fill(s)),
            s.delivered.to_string(),
            unacked_cell(s),
            s.oldest_unacked_age.map(duration).map_or_else(dash, human_duration),
            s.opened_at.map_or_else(dash, |t| human_duration(age(t, now))),
            or_dash(&s.peer_address),
        ];
        if replica {
            row.push(or_dash(&s.replica_id));
        }
        table.row(row);
    }
    table
}

/// A manual-ack member's unacked count; a dash for every other
/// subscription (which has nothing to ack).
pub(super) fn unacked_cell(s: &pb::SubscriptionInfo) -> String {
    if s.ack_mode == pb::AckMode::Manual as i32 && !s.consumer_group.is_empty() {
        s.unacked.to_string()
    } else {
        dash()
    }
}

fn groups_table(list: &[pb::ConsumerGroupInfo]) -> Table {
    use Align::*;
    let mut table = Table::new(&[
        ("GROUP", Left),
        ("PATTERNS", Left),
        ("MEMBERS", Right),
        ("BACKLOG", Right),
        ("IN FLIGHT", Right),
        ("OLDEST UNACKED", Right),
        ("REDELIVERED", Right),
        ("DEAD LETTERED", Right),
        ("DROPPED", Right),
    ]);
    for g in list {
        table.row(vec![
            g.name.clone(),
            g.topic_patterns.join(","),
            g.members.to_string(),
            g.backlog.to_string(),
            g.in_flight.to_string(),
            g.oldest_unacked_age.map(duration).map_or_else(dash, human_duration),
            g.redeliveries.to_string(),
            g.dead_lettered.to_string(),
            g.dropped.to_string(),
        ]);
    }
    table
}

fn evictions_table(list: &[pb::EvictionInfo], replica: bool, now: SystemTime) -> Table {
    use Align::*;
    let mut columns = vec![
        ("EVICTED", Right),
        ("ID", Left),
        ("PATTERNS", Left),
        ("QUEUE DEPTH", Right),
        ("LAST SEQUENCE", Right),
        ("PEER", Left),
    ];
    if replica {
        columns.push(("REPLICA", Left));
    }
    let mut table = Table::new(&columns);
    for e in list {
        let mut row = vec![
            e.evicted_at
                .map_or_else(dash, |t| format!("{} ago", human_duration(age(t, now)))),
            e.subscription_id.clone(),
            e.topic_patterns.join(","),
            e.queue_depth.to_string(),
            e.last_delivered_sequence.to_string(),
            or_dash(&e.peer_address),
        ];
        if replica {
            row.push(or_dash(&e.replica_id));
        }
        table.row(row);
    }
    table
}

// === JSON rows: the proto's field names, enums as their short names,
// times as RFC 3339, durations in seconds ===

fn subscription_json(s: &pb::SubscriptionInfo) -> Value {
    json!({
        "subscription_id": s.subscription_id,
        "mode": delivery_mode(s.mode),
        "consumer_group": s.consumer_group,
        "ack_mode": if s.consumer_group.is_empty() { "" } else { ack_mode(s.ack_mode) },
        "topic_patterns": s.topic_patterns,
        "queue_depth": s.queue_depth,
        "capacity": s.capacity,
        "delivered": s.delivered,
        "unacked": s.unacked,
        "oldest_unacked_age_seconds": s.oldest_unacked_age.map(|d| duration(d).as_secs_f64()),
        "opened_at": s.opened_at.map(|t| t.to_string()),
        "peer_address": s.peer_address,
        "replica_id": s.replica_id,
    })
}

fn group_json(g: &pb::ConsumerGroupInfo) -> Value {
    json!({
        "name": g.name,
        "topic_patterns": g.topic_patterns,
        "members": g.members,
        "backlog": g.backlog,
        "in_flight": g.in_flight,
        "oldest_unacked_age_seconds": g.oldest_unacked_age.map(|d| duration(d).as_secs_f64()),
        "redeliveries": g.redeliveries,
        "dead_lettered": g.dead_lettered,
        "dropped": g.dropped,
    })
}

fn eviction_json(e: &pb::EvictionInfo) -> Value {
    json!({
        "subscription_id": e.subscription_id,
        "evicted_at": e.evicted_at.map(|t| t.to_string()),
        "topic_patterns": e.topic_patterns,
        "queue_depth": e.queue_depth,
        "last_delivered_sequence": e.last_delivered_sequence,
        "peer_address": e.peer_address,
        "replica_id": e.replica_id,
    })
}

fn info_json(i: &pb::GetBrokerInfoResponse) -> Value {
    let limits = i.limits.as_ref().map(|l| {
        json!({
            "consumer_capacity": l.consumer_capacity,
            "consumer_max_bytes": l.consumer_max_bytes,
            "group_capacity": l.group_capacity,
            "group_max_bytes": l.group_max_bytes,
            "default_max_in_flight": l.default_max_in_flight,
            "default_ack_deadline_ms": l.default_ack_deadline_ms,
            "max_delivery_attempts": l.max_delivery_attempts,
            "group_idle_ttl_seconds": l.group_idle_ttl_seconds,
            "max_message_bytes": l.max_message_bytes,
            "max_memory_bytes": l.max_memory_bytes,
            "max_subscriptions": l.max_subscriptions,
            "max_subscriptions_per_session": l.max_subscriptions_per_session,
            "max_batch_messages": l.max_batch_messages,
            "max_connections": l.max_connections,
            "max_patterns_per_subscription": l.max_patterns_per_subscription,
            "max_topic_bytes": l.max_topic_bytes,
            "max_headers": l.max_headers,
            "handshake_timeout_seconds": l.handshake_timeout_seconds,
            "shutdown_grace_seconds": l.shutdown_grace_seconds,
        })
    });
    json!({
        "version": i.version,
        "uptime_seconds": i.uptime.map(|d| duration(d).as_secs_f64()),
        "started_at": i.started_at.map(|t| t.to_string()),
        "subscriptions": i.subscriptions,
        "consumer_groups": i.consumer_groups,
        "last_sequence": i.last_sequence,
        "messages_published": i.messages_published,
        "messages_delivered": i.messages_delivered,
        "auth_enabled": i.auth_enabled,
        "tls_enabled": i.tls_enabled,
        "cluster_mode": i.cluster_mode,
        "replica_id": i.replica_id,
        "nats_server": i.nats_server,
        "limits": limits,
    })
}

// === cells ===

fn delivery_mode(raw: i32) -> &'static str {
    match pb::DeliveryMode::try_from(raw) {
        Ok(pb::DeliveryMode::Single) => "single",
        _ => "multi",
    }
}

fn ack_mode(raw: i32) -> &'static str {
    match pb::AckMode::try_from(raw) {
        Ok(pb::AckMode::Manual) => "manual",
        _ => "auto",
    }
}

/// `multi`, or `single/auto`, `single/manual` for a group member.
fn mode_label(s: &pb::SubscriptionInfo) -> String {
    match delivery_mode(s.mode) {
        "single" => format!("single/{}", ack_mode(s.ack_mode)),
        mode => mode.to_owned(),
    }
}

fn dash() -> String {
    "-".to_owned()
}

pub(super) fn or_dash(s: &str) -> String {
    if s.is_empty() { dash() } else { s.to_owned() }
}

fn on_off(on: bool) -> String {
    if on { "on" } else { "off" }.to_owned()
}

pub(super) fn percent(ratio: f64) -> String {
    format!("{:.0}%", ratio * 100.0)
}

pub(super) fn duration(d: prost_types::Duration) -> Duration {
    Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32)
}

/// How long before `now` the time `t` was (zero for a time ahead of it).
pub(super) fn age(t: prost_types::Timestamp, now: SystemTime) -> Duration {
    let then = SystemTime::try_from(t).unwrap_or(now);
    now.duration_since(then).unwrap_or_default()
}

/// `42s`, `3m12s`, `2h05m`, `3d04h`: the two largest units.
pub(super) fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(id: &str, depth: u64, capacity: u64) -> pb::SubscriptionInfo {
        pb::SubscriptionInfo {
            subscription_id: id.to_owned(),
            queue_depth: depth,
            capacity,
            topic_patterns: vec!["a.>".to_owned()],
            ..Default::default()
        }
    }

    #[test]
    fn subscriptions_are_ordered_by_how_full_their_queue_is() {
        // A member holding 3 of max_in_flight 4 is fuller than a broadcast
        // queue holding 500 of 1024.
        let mut list = vec![sub("half", 500, 1024), sub("empty", 0, 1024), sub("member", 3, 4)];
        sort_by_fill(&mut list);
        let ids: Vec<&str> = list.iter().map(|s| s.subscription_id.as_str()).collect();
        assert_eq!(ids, ["member", "half", "empty"]);
    }

    /// `tinybroker subscriptions --group`: a member that never acks holds
    /// its max_in_flight unacked with an empty queue; it comes first and
    /// its UNACKED and OLDEST UNACKED cells name it.
    #[test]
    fn a_hung_member_comes_first_with_its_unacked_messages() {
        let member = |id: &str, unacked: u64, age: Option<i64>| pb::SubscriptionInfo {
            consumer_group: "workers".into(),
            mode: pb::DeliveryMode::Single as i32,
            ack_mode: pb::AckMode::Manual as i32,
            unacked,
            oldest_unacked_age: age.map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
            ..sub(id, 0, 64)
        };
        let mut list = vec![
            member("ok-1", 1, Some(0)),
            member("hung", 43, Some(21)),
            member("ok-2", 0, None),
        ];
        sort_by_fill(&mut list);
        assert_eq!(list[0].subscription_id, "hung");
        let text = subscriptions_table(&list, false, SystemTime::now()).render();
        assert_eq!(cell(&text, "hung", "UNACKED"), "43", "{text}");
        assert_eq!(cell(&text, "hung", "OLDEST UNACKED"), "21s", "{text}");
        assert_eq!(cell(&text, "ok-2", "OLDEST UNACKED"), "-", "{text}");
        // A broadcast subscription has nothing to ack.
        let text = subscriptions_table(&[sub("b", 0, 8)], false, SystemTime::now()).render();
        assert_eq!(cell(&text, "b", "UNACKED"), "-", "{text}");
    }

    /// The cell of `column` in the row starting with `row` (columns are
    /// right-aligned numbers here: the cell ends where the header ends).
    fn cell(table: &str, row: &str, column: &str) -> String {
        let header = table.lines().next().unwrap();
        let end = header.find(column).unwrap() + column.len();
        let line = table.lines().find(|l| l.starts_with(row)).unwrap();
        line[..end].split_whitespace().last().unwrap().to_owned()
    }

    #[test]
    fn a_table_aligns_its_columns_and_right_aligns_numbers() {
        let list = vec![sub("a-long-id", 5, 10), sub("b", 100, 1000)];
        let text = subscriptions_table(&list, false, SystemTime::now()).render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("ID         MODE "), "{text}");
        // Every QUEUE cell ends where the header does.
        let end = lines[0].find("QUEUE").unwrap() + "QUEUE".len();
        assert!(lines[1][..end].ends_with("5/10"), "{text}");
        assert!(lines[2][..end].ends_with("100/1000"), "{text}");
        assert!(!text.contains("REPLICA"));
        assert!(
            subscriptions_table(&list, true, SystemTime::now())
                .render()
                .contains("REPLICA")
        );
    }

    #[test]
    fn durations_read_in_their_two_largest_units() {
        assert_eq!(human_duration(Duration::from_secs(42)), "42s");
        assert_eq!(human_duration(Duration::from_secs(192)), "3m12s");
        assert_eq!(human_duration(Duration::from_secs(7500)), "2h05m");
        assert_eq!(human_duration(Duration::from_secs(3 * 86400 + 4 * 3600)), "3d04h");
    }
}
