//! The cluster session's checks: a dashboard query or a rule's expression
//! over every replica, and the series it must give (a known total, within
//! the slack `rate` and `increase` need), all holding together for
//! [`STEADY`].

use crate::prometheus::{Prometheus, Sample};
use crate::{JOB, POLL};
use std::time::{Duration, Instant};

/// The range counter panels are read over in the cluster session: longer
/// than the session, so `rate(x[WHOLE]) * WHOLE` is all that happened.
pub const WHOLE: &str = "10m";
pub const WHOLE_SECONDS: f64 = 600.0;
/// How long the cluster session's checks may take to agree with what
/// happened (a heartbeat's gathering, 2 s, then a scrape, 1 s, and room).
pub const SETTLE: Duration = Duration::from_secs(20);
/// How long every check must hold, evaluated again and again, to count:
/// longer than a heartbeat and a scrape, so a sum that only looks right
/// while one replica's gathering lags behind the other's does not pass.
pub const STEADY: Duration = Duration::from_secs(4);

/// A dashboard query or a rule's expression as the cluster session reads
/// it: over every instance (Grafana's "All"), counters over [`WHOLE`], and
/// the 45 s thresholds of stalls and memberless groups at 5 s, the 1000
/// messages of a growing backlog at 0 (the thresholds themselves, and how
/// soon each fires, are the single-node session's; here it is how a
/// query adds up the replicas).
pub fn cluster_fill(expr: &str) -> String {
    expr.replace("$__rate_interval", WHOLE)
        .replace("$__interval", "1s")
        .replace("$__range", WHOLE)
        .replace("$job", JOB)
        .replace("$instance", ".*")
        .replace("> 45", "> 5")
        .replace("> 1000", "> 0")
}

/// Whether a query reads a consumer-group metric, or the drops (group
/// overflow and expiry among them).
pub fn about_groups(expr: &str) -> bool {
    [
        "tinybroker_consumer_group_",
        "tinybroker_redeliveries_total",
        "tinybroker_dead_lettered_total",
        "tinybroker_recent_group_removal_",
        "tinybroker_messages_dropped_total",
    ]
    .iter()
    .any(|metric| expr.contains(metric))
}

/// One series a check wants: the one whose `label` is `value` ("" for the
/// single series of a stat), its value (times the check's scale) within
/// `lo..=hi`.
pub struct Want {
    pub label: &'static str,
    pub value: String,
    pub lo: f64,
    pub hi: f64,
}

pub fn exactly(label: &'static str, value: &str, n: f64) -> Want {
    Want {
        label,
        value: value.to_owned(),
        lo: n - 0.01,
        hi: n + 0.01,
    }
}

/// A count read through `rate` or `increase`, which extrapolate a little
/// past the last sample: at least `n - 0.5`, at most 10 % above.
pub fn about(label: &'static str, value: &str, n: f64) -> Want {
    Want {
        label,
        value: value.to_owned(),
        lo: n - 0.5,
        hi: n * 1.1 + 0.5,
    }
}

/// Seconds since `since`, as a gauge refreshed every heartbeat (2 s) and
/// scraped every second shows them (started up to 2 s late).
pub fn aged(label: &'static str, value: &str, since: Instant) -> Want {
    let seconds = since.elapsed().as_secs_f64();
    Want {
        label,
        value: value.to_owned(),
        lo: seconds - 6.0,
        hi: seconds + 1.5,
    }
}

pub struct ClusterCheck {
    pub what: String,
    pub expr: String,
    /// What each series is multiplied by first ([`WHOLE_SECONDS`] for rates).
    pub scale: f64,
    /// The wanted series, worked out when checked (ages change).
    pub wants: Box<dyn Fn() -> Vec<Want> + Send>,
    /// No series but the wanted ones (rules: an alert for no other group).
    pub only: bool,
    /// Why the last evaluation did not match; None when it did.
    pub failing: Option<String>,
}

impl ClusterCheck {
    pub fn judge(&self, samples: &[Sample]) -> Result<(), String> {
        let wants = (self.wants)();
        let shown = || {
            samples
                .iter()
                .map(|s| format!("{:?}={}", s.labels, s.value * self.scale))
                .collect::<Vec<_>>()
                .join(", ")
        };
        for want in &wants {
            let matching: Vec<f64> = samples
                .iter()
                .filter(|s| want.label.is_empty() || s.has(want.label, &want.value))
                .map(|s| s.value * self.scale)
                .collect();
            match matching[..] {
                [v] if (want.lo..=want.hi).contains(&v) => {}
                _ => {
                    return Err(format!(
                        "{}={} wanted once in {:.2}..={:.2}; got [{}]",
                        want.label,
                        want.value,
                        want.lo,
                        want.hi,
                        shown()
                    ));
                }
            }
        }
        if self.only && samples.len() != wants.len() {
            return Err(format!("only {} series wanted; got [{}]", wants.len(), shown()));
        }
        Ok(())
    }
}

/// Evaluates every check, all of them every [`POLL`], until all have held
/// together for [`STEADY`], or [`SETTLE`] passed; what did not match in the
/// last round, with its result.
pub async fn settle(prometheus: &Prometheus, checks: &mut [ClusterCheck]) -> Vec<String> {
    let deadline = Instant::now() + SETTLE + STEADY;
    let mut holding_since: Option<Instant> = None;
    loop {
        for check in checks.iter_mut() {
            check.failing = match prometheus.query(&check.expr).await {
                Ok(samples) => check.judge(&samples).err(),
                Err(e) => Some(e),
            };
        }
        let failing: Vec<String> = checks
            .iter()
            .filter_map(|c| {
                c.failing
                    .as_ref()
                    .map(|why| format!("{}: {why}\n    {}", c.what, c.expr))
            })
            .collect();
        if !failing.is_empty() {
            holding_since = None;
        } else if holding_since.get_or_insert_with(Instant::now).elapsed() >= STEADY {
            return failing;
        }
        if Instant::now() > deadline {
            return if failing.is_empty() {
                vec![format!("the checks never held together for {STEADY:?}")]
            } else {
                failing
            };
        }
        tokio::time::sleep(POLL).await;
    }
}

pub type Wants = Box<dyn Fn() -> Vec<Want> + Send>;

pub fn check(what: String, expr: String, scale: f64, only: bool, wants: Wants) -> ClusterCheck {
    ClusterCheck {
        what,
        expr,
        scale,
        wants,
        only,
        failing: Some("not evaluated yet".into()),
    }
}
