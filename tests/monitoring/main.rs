//! The shipped alerts and dashboard against live situations (issue 17): the
//! real broker binary, a real Prometheus scraping it every second with
//! `deploy/monitoring/alerts.yaml` loaded (its group interval set to 1 s, the
//! only change), and at the same time, beside healthy traffic: a queue that
//! fills and drains between two scrapes, a slow subscriber that is evicted, a
//! MANUAL group whose member never acks with a 1 h ack deadline and one with
//! a 2 s deadline, a busy MANUAL group of three whose one member never acks
//! while the others do, a memberless group whose backlog grows, and groups
//! removed by their idle TTL (60 s here) with messages left.
//!
//! Through Prometheus's HTTP API it asserts that each alert fires, naming the
//! subscriber or group, within its promise at a 1 s scrape (and not before
//! its threshold), that no other alert fires, that each dashboard panel shows
//! what it is for (the evicted id, the stuck groups, ...), that every
//! dashboard query returns data and every panel has thresholds. It prints
//! how long each took. The same rules at the chart's 30 s scrape interval
//! are shown by `promtool test rules deploy/monitoring/alerts_test.yaml`.
//!
//! The cluster session does the same sums over two replicas (issue 25):
//! two broker processes in cluster mode over one nats-server, one
//! Prometheus scraping both, and known counts made across them (a MANUAL
//! group with a member on each replica, acked through the other replica,
//! nacked, redelivered and dead-lettered; a group holding messages, one
//! overflowing, one without members and then removed after its idle TTL;
//! broadcast deliveries on both). Every consumer-group panel of the
//! dashboard and every group rule of alerts.yaml, evaluated over both
//! replicas, must give the total the clients saw, not twice it (a gauge
//! every replica reports, summed) nor a part of it (a counter each replica
//! keeps for itself, not summed), and must hold for a few seconds on end;
//! a group panel or rule added later without a check here fails it.
//!
//! Ignored by default: they need the `prometheus` server (and nats-server)
//! and take about 90 s and 30 s. `scripts/check-alerts-live.sh` (a CI step)
//! installs Prometheus and runs them.
//!
//! - [`prometheus`]: a Prometheus of the test's own and its HTTP API;
//! - [`dashboard`]: the shipped dashboard's queries and the alert rules,
//!   read as written;
//! - [`clients`]: the broker clients and waits both sessions use;
//! - [`watch`]: what the single-node session watches for, each check with
//!   its promise;
//! - [`single_node`]: the single-node session, step by step;
//! - [`sums`]: the cluster session's checks, each a known total that must
//!   hold for a while;
//! - [`two_replicas`]: the cluster session.
//!
//! The two tests run one after the other (`--test-threads=1`), in name
//! order: the single-node session, whose timings are its promises, first.

#[path = "../common/mod.rs"]
mod common;

mod clients;
mod dashboard;
mod prometheus;
mod single_node;
mod sums;
mod two_replicas;
mod watch;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

/// Upper bound for the whole session.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the watcher asks Prometheus.
pub const POLL: Duration = Duration::from_millis(250);
/// The scrape job's name, as the dashboard's $job selects it.
pub const JOB: &str = "tinybroker";

fn log(started: Instant, what: &str) {
    println!("[{:6.1}s] {what}", started.elapsed().as_secs_f64());
}

fn temp_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("tinybroker-alerts-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
