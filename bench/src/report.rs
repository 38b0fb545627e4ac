//! Medians over rounds and the Markdown table.

use crate::systems::Kind;
use crate::workloads::{CLUSTER_P99_TARGET, CLUSTER_THROUGHPUT_TARGET, Case, RunResult, Spec, Variant};
use std::fmt::Write;

/// Every round's outcome of one workload against one contender.
pub struct Runs {
    pub variant: Variant,
    pub results: Vec<Result<RunResult, String>>,
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.retain(|x| x.is_finite());
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    Some(if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    })
}

/// Medians of one contender's successful rounds.
#[derive(Debug, Default, Clone)]
pub struct Summary {
    pub ok: usize,
    pub rounds: usize,
    pub published: Option<f64>,
    pub delivered: Option<f64>,
    pub per_subscriber: Option<f64>,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub p999: Option<f64>,
    pub lost: u64,
    pub dup: u64,
    pub peak_rss_kib: Option<f64>,
    pub cpu: Option<f64>,
    pub cpu_per_m: Option<f64>,
    pub rss_per_sub: Option<f64>,
    pub split: Option<Vec<f64>>,
    pub flagged: Option<(usize, usize)>,
    pub errors: Vec<String>,
    pub remarks: Vec<String>,
    pub violations: Vec<String>,
}

impl Summary {
    pub fn of(runs: &Runs) -> Summary {
        let ok: Vec<&RunResult> = runs.results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let m = |f: &dyn Fn(&RunResult) -> Option<f64>| median(ok.iter().filter_map(|r| f(r)).collect());
        let splits: Vec<&Vec<f64>> = ok.iter().filter_map(|r| r.split.as_ref()).collect();
        let split = splits.first().map(|first| {
            (0..first.len())
                .map(|i| median(splits.iter().filter_map(|s| s.get(i).copied()).collect()).unwrap_or(0.0))
                .collect()
        });
        let flags: Vec<bool> = ok.iter().filter_map(|r| r.stalled_flagged).collect();
        Summary {
            ok: ok.len(),
            rounds: runs.results.len(),
            published: m(&|r| r.published_per_s),
            delivered: m(&|r| r.delivered_per_s),
            per_subscriber: m(&|r| r.per_subscriber_per_s),
            p50: m(&|r| r.latency.map(|l| l.p50)),
            p99: m(&|r| r.latency.map(|l| l.p99)),
            p999: m(&|r| r.latency.map(|l| l.p999)),
            lost: ok.iter().map(|r| r.lost).sum(),
            dup: ok.iter().map(|r| r.dup).sum(),
            peak_rss_kib: m(&|r| Some(r.peak_rss_kib as f64)),
            cpu: m(&|r| Some(r.cpu_percent)),
            cpu_per_m: m(&|r| r.cpu_s_per_m),
            rss_per_sub: m(&|r| r.rss_per_sub_bytes),
            split,
            flagged: (!flags.is_empty()).then(|| (flags.iter().filter(|f| **f).count(), flags.len())),
            errors: runs.results.iter().filter_map(|r| r.as_ref().err().cloned()).collect(),
            remarks: ok.iter().flat_map(|r| r.remarks.iter().cloned()).collect(),
            violations: ok.iter().filter_map(|r| r.violation.clone()).collect(),
        }
    }
}

fn rate(x: Option<f64>) -> String {
    match x {
        None => "—".into(),
        Some(x) if x >= 1e6 => format!("{:.2} M", x / 1e6),
        Some(x) if x >= 1e3 => format!("{:.0} k", x / 1e3),
        Some(x) => format!("{x:.0}"),
    }
}

fn ms(x: Option<f64>) -> String {
    match x {
        None => "—".into(),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.3}"),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn times(x: Option<f64>) -> String {
    x.map(|x| format!("×{x:.2}")).unwrap_or_else(|| "—".into())
}

fn kib(bytes: f64) -> String {
    if bytes >= 1024.0 {
        format!("{:.1} KiB", bytes / 1024.0)
    } else {
        format!("{bytes:.0} B")
    }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "missed",
        None => "—",
    }
}

/// Medians over rounds of each process's CPU per published message.
fn cpu_parts(runs: &Runs) -> Option<String> {
    let ok: Vec<&RunResult> = runs.results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let first = ok.iter().find(|r| !r.cpu_parts.is_empty())?;
    let parts: Vec<String> = first
        .cpu_parts
        .iter()
        .map(|(name, _)| {
            let m = median(
                ok.iter()
                    .filter_map(|r| r.cpu_parts.iter().find(|(n, _)| n == name).map(|(_, v)| *v))
                    .collect(),
            );
            format!("{name} {}", m.map(|m| format!("{m:.1}")).unwrap_or_else(|| "—".into()))
        })
        .collect();
    Some(format!("CPU µs per published message (medians): {}", parts.join(", ")))
}

/// The ratio cell of a non-NATS row against the NATS row of the same workload.
fn vs_nats(spec: &Spec, s: &Summary, nats: &Summary) -> String {
    match spec {
        Spec::Latency { .. } => format!(
            "p99 {}, p999 {}",
            times(ratio(s.p99, nats.p99)),
            times(ratio(s.p999, nats.p999))
        ),
        Spec::Idle { .. } => format!("RSS/sub {}", times(ratio(s.rss_per_sub, nats.rss_per_sub))),
        Spec::Wide { rate: Some(_), .. } => format!(
            "CPU/M {}, p50 {}, p99 {}, p999 {}",
            times(ratio(s.cpu_per_m, nats.cpu_per_m)),
            times(ratio(s.p50, nats.p50)),
            times(ratio(s.p99, nats.p99)),
            times(ratio(s.p999, nats.p999))
        ),
        Spec::Wide { rate: None, .. } => format!(
            "{} (CPU/M {})",
            times(ratio(s.delivered, nats.delivered)),
            times(ratio(s.cpu_per_m, nats.cpu_per_m))
        ),
        Spec::Cluster { rate: Some(_), .. } => {
            let p99 = ratio(s.p99, nats.p99);
            format!(
                "p50 {}, p99 {} (target ≤ ×{:.0}: {})",
                times(ratio(s.p50, nats.p50)),
                times(p99),
                CLUSTER_P99_TARGET,
                verdict(p99.map(|r| r <= CLUSTER_P99_TARGET))
            )
        }
        Spec::Cluster {
            rate: None,
            group,
            nats_queue,
            ..
        } => {
            let r = ratio(s.delivered, nats.delivered);
            let mut text = if *nats_queue {
                // JetStream-backed groups against core NATS's at-most-once
                // queue group: a ratio, not a target.
                format!("{} (JetStream R3 vs core NATS: no target)", times(r))
            } else {
                format!(
                    "{} (target ≥ ×{:.1}: {})",
                    times(r),
                    CLUSTER_THROUGHPUT_TARGET,
                    verdict(r.map(|r| r >= CLUSTER_THROUGHPUT_TARGET))
                )
            };
            if *group {
                // Unpaced, so its latency is mostly queueing: shown, not judged.
                text.push_str(&format!(
                    "; CPU/M {}; p50 {}, p99 {}",
                    times(ratio(s.cpu_per_m, nats.cpu_per_m)),
                    times(ratio(s.p50, nats.p50)),
                    times(ratio(s.p99, nats.p99))
                ));
            }
            text
        }
        Spec::FanOut { .. } => format!(
            "{} (pub {})",
            times(ratio(s.delivered, nats.delivered)),
            times(ratio(s.published, nats.published))
        ),
        _ => times(ratio(s.delivered, nats.delivered)),
    }
}

/// The table, and the notes below it.
pub fn render(cases: &[(Case, Vec<Runs>)]) -> String {
    let mut out = String::new();
    out.push_str(
        "| workload | system | published/s | delivered/s | p50 ms | p99 ms | p999 ms | lost/dup | peak RSS | CPU % | CPU s/M | vs NATS | notes |\n",
    );
    out.push_str("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|\n");
    let mut notes = Vec::new();
    // The stalled run's baseline: the same live subscribers, none stalled.
    let baseline: Vec<(Variant, Summary)> = cases
        .iter()
        .filter(|(c, _)| matches!(c.spec, Spec::Stalled { stalled: false, .. }))
        .flat_map(|(_, runs)| runs.iter().map(|r| (r.variant, Summary::of(r))))
        .collect();
    for (case, runs) in cases {
        let summaries: Vec<Summary> = runs.iter().map(Summary::of).collect();
        let nats = runs
            .iter()
            .zip(&summaries)
            .find(|(r, _)| r.variant.kind == Kind::Nats)
            .map(|(_, s)| s.clone());
        for (r, s) in runs.iter().zip(&summaries) {
            let label = format!("{} / {}", case.label, r.variant);
            if s.ok == 0 {
                let _ = writeln!(
                    out,
                    "| {} | {} | error | | | | | | | | | | failed in all {} rounds |",
                    case.label, r.variant, s.rounds
                );
                notes.extend(s.errors.iter().map(|e| format!("{label}: {e}")));
                continue;
            }
            let vs = match (&nats, r.variant.kind) {
                (Some(n), Kind::Tinybroker | Kind::Redis) => vs_nats(&case.spec, s, n),
                _ => "—".into(),
            };
            let mut note = Vec::new();
            if let Some(split) = &s.split {
                let parts: Vec<String> = split.iter().map(|x| format!("{:.0}", x * 100.0)).collect();
                note.push(format!("split {} %", parts.join("/")));
            }
            if let Some(b) = s.rss_per_sub {
                note.push(format!("RSS/sub {}", kib(b)));
            }
            if let Some((yes, of)) = s.flagged {
                let what = if r.variant.kind == Kind::Tinybroker {
                    "evicted"
                } else {
                    "slow consumer flagged"
                };
                note.push(format!("{what} {yes}/{of}"));
            }
            if matches!(case.spec, Spec::Stalled { stalled: true, .. }) {
                let base = baseline
                    .iter()
                    .find(|(v, _)| *v == r.variant)
                    .map(|(_, p)| p.per_subscriber);
                if let Some(k) = ratio(s.per_subscriber, base.flatten()) {
                    note.push(format!("live subs kept {:.0} % of baseline", k * 100.0));
                }
            }
            if s.ok < s.rounds {
                note.push(format!("{} of {} rounds failed", s.rounds - s.ok, s.rounds));
            }
            let rss = s
                .peak_rss_kib
                .map(|k| format!("{:.1} MiB", k / 1024.0))
                .unwrap_or_else(|| "—".into());
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {}/{} | {} | {} | {} | {} | {} |",
                case.label,
                r.variant,
                rate(s.published),
                rate(s.delivered),
                ms(s.p50),
                ms(s.p99),
                ms(s.p999),
                s.lost,
                s.dup,
                rss,
                s.cpu.map(|c| format!("{c:.0}")).unwrap_or_else(|| "—".into()),
                s.cpu_per_m.map(|c| format!("{c:.3}")).unwrap_or_else(|| "—".into()),
                vs,
                note.join("; ")
            );
            notes.extend(s.errors.iter().map(|e| format!("{label}: error: {e}")));
            notes.extend(s.violations.iter().map(|e| format!("{label}: CONTRACT VIOLATION: {e}")));
            // Each remark once, in the order first seen (rounds repeat them).
            let mut remarks: Vec<&String> = Vec::new();
            for remark in &s.remarks {
                if !remarks.contains(&remark) {
                    remarks.push(remark);
                }
            }
            notes.extend(remarks.iter().map(|e| format!("{label}: {e}")));
            if let Some(parts) = cpu_parts(r) {
                notes.push(format!("{label}: {parts}"));
            }
        }
    }
    if !notes.is_empty() {
        out.push('\n');
        for n in notes {
            let _ = writeln!(out, "- {n}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn rates_read_well() {
        assert_eq!(rate(Some(1_234_567.0)), "1.23 M");
        assert_eq!(rate(Some(412_000.0)), "412 k");
        assert_eq!(rate(None), "—");
    }
}
