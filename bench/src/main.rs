//! tinybroker-bench: runs the same workloads against tinybroker, NATS core
//! and Redis pub/sub on this machine, several rounds alternating systems,
//! and prints one Markdown table of medians with the ratio tinybroker/NATS.
//! The cluster workloads compare 3 tinybroker replicas in cluster mode over
//! a 3-server NATS cluster with that NATS cluster used directly.
//!
//! Exits non-zero when a tinybroker run loses a message its contract says
//! must arrive, or when a run fails.

mod cluster;
mod guard;
mod json;
mod measure;
mod nats;
mod redis_pubsub;
mod report;
mod systems;
mod tb;
mod workloads;

use anyhow::{Context, Result, bail};
use clap::Parser;
use report::Runs;
use std::path::PathBuf;
use std::process::ExitCode;
use systems::{Binaries, Kind};
use workloads::{Case, Settings};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Benchmark tinybroker against NATS core and Redis pub/sub on 127.0.0.1"
)]
struct Cli {
    /// Messages of the fan-out 1→3 and group workloads (1→30 gets a tenth,
    /// 4 KiB payloads a quarter, the 20k msg/s latency run at most 300k, 15 s).
    #[arg(long)]
    messages: Option<u64>,
    /// Rounds; each round runs every system once per workload, alternating.
    #[arg(long)]
    rounds: Option<usize>,
    /// Only workloads whose id or label contains this (repeatable):
    /// fanout-3-16, fanout-3-256, fanout-3-4096, fanout-30-…, latency, group, stalled,
    /// wide-paced, wide-max (`wide` for both), idle, idle-100,
    /// cluster-fanout-3, cluster-fanout-30, cluster-latency, cluster-group (MANUAL
    /// against JetStream), cluster-group-auto (AUTO against a NATS queue group)
    /// (`cluster` for the five, `cluster-group` for both groups). In the guard:
    /// fanout, group, wide, idle (idle-session, idle-open), cluster.
    #[arg(long)]
    only: Vec<String>,
    /// Tiny configuration for CI: 3000 messages, 1 round, 1000 idle subscriptions,
    /// wide fan-out to 100 subscribers for 2 s (paced) and 500 messages (unthrottled),
    /// the cluster latency run for 1 s.
    #[arg(long)]
    quick: bool,
    /// Leave Redis out.
    #[arg(long)]
    skip_redis: bool,
    /// Only runs of these systems or variants (repeatable, case-insensitive
    /// substring of the table's system column: tinybroker, nats, redis, manual,
    /// session, session-batch), for profiling one of them; ratios need NATS in the run.
    #[arg(long)]
    system: Vec<String>,
    /// Idle subscriptions of the idle workloads.
    #[arg(long)]
    idle_subscriptions: Option<usize>,
    /// Subscribers of the wide fan-out workloads, 50 per connection
    /// (default 1000; 100 with --quick).
    #[arg(long)]
    wide_subscribers: Option<usize>,
    /// Publishing rate of the paced wide fan-out run, messages per second.
    #[arg(long, default_value_t = 200)]
    wide_rate: u64,
    /// Length of the paced wide fan-out run (default 10; 2 with --quick).
    #[arg(long)]
    wide_seconds: Option<u64>,
    /// Messages of the unthrottled wide fan-out run (default 10000; 500 with --quick).
    #[arg(long)]
    wide_messages: Option<u64>,
    /// Publishing rate of the cluster latency run, messages per second.
    #[arg(long, default_value_t = 5000)]
    cluster_rate: u64,
    /// Length of the cluster latency run (default 10; 1 with --quick).
    #[arg(long)]
    cluster_seconds: Option<u64>,
    /// Flow-control window: most messages the publisher keeps ahead of the
    /// slowest live subscriber (or group).
    #[arg(long, default_value_t = 2048)]
    window: u64,
    /// tinybroker's TINYBROKER_CONSUMER_CAPACITY (per-subscription queue slots).
    #[arg(long, default_value_t = 4096)]
    consumer_capacity: usize,
    /// Also write the table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value = "target/release/tinybroker")]
    tinybroker_bin: PathBuf,
    #[arg(long, default_value = "nats-server")]
    nats_bin: PathBuf,
    #[arg(long, default_value = "redis-server")]
    redis_bin: PathBuf,
    /// nats-server 2.10 or later for the cluster workloads (default:
    /// $TB_NATS_SERVER, else what scripts/install-nats.sh installs); without
    /// one they are skipped, saying so.
    #[arg(long)]
    nats_cluster_bin: Option<PathBuf>,
    /// Run the performance guard instead of the comparison: instructions,
    /// syscalls and context switches per message (one workload in cluster
    /// mode, over nats-server 2.10), and bytes per idle subscription on
    /// Sessions and on OpenSubscription, against the baseline file (needs
    /// valgrind and perf).
    #[arg(long)]
    guard: bool,
    /// The guard's baseline file.
    #[arg(long, default_value = "bench/perf-baseline.txt")]
    baseline: PathBuf,
    /// The guard writes its figures as the new baseline, with this reason.
    #[arg(long, value_name = "WHY", requires = "guard")]
    write_baseline: Option<String>,
    /// The guard's runs per workload under callgrind and natively (it
    /// reports their medians).
    #[arg(long, default_value_t = 5, requires = "guard")]
    guard_runs: usize,
    /// Add this fraction to every instruction count the guard reads, to show
    /// that it catches a regression of that size (e.g. 0.03).
    #[arg(long, default_value_t = 0.0, requires = "guard")]
    inflate_instructions: f64,
    /// Keep the server logs and the guard's callgrind dumps (for
    /// `callgrind_annotate`) even when every run passed.
    #[arg(long)]
    keep_logs: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The workloads run on the runtime's workers, not on this thread: a
    // publisher driven from `block_on` would wake a worker for every message
    // it hands over, and the benchmark would measure its own thread hops.
    let mut task = tokio::spawn(run(cli));
    tokio::select! {
        r = &mut task => match r {
            Ok(Ok(true)) => ExitCode::SUCCESS,
            Ok(Ok(false)) => ExitCode::FAILURE,
            Ok(Err(e)) => {
                eprintln!("tinybroker-bench: {e:#}");
                ExitCode::FAILURE
            }
            Err(e) => {
                eprintln!("tinybroker-bench: the benchmark task failed: {e}");
                ExitCode::FAILURE
            }
        },
        // Aborting `run` drops it, which kills and reaps every server it started.
        signal = interrupted() => {
            task.abort();
            let _ = task.await;
            eprintln!("tinybroker-bench: {signal}, servers stopped");
            ExitCode::from(130)
        }
    }
}

/// Whether `--system` keeps the variant named `name` (as the table's system
/// column shows it): no filter keeps all, else any case-insensitive substring.
fn selects(filters: &[String], name: &str) -> bool {
    let name = name.to_lowercase();
    filters.is_empty() || filters.iter().any(|f| name.contains(&f.to_lowercase()))
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        eprintln!("tinybroker-bench: cannot listen for SIGINT/SIGTERM; interrupting may leave servers behind");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "interrupted",
        _ = term.recv() => "terminated",
    }
}

/// Runs everything; Ok(false) when a run failed or lost what must arrive.
async fn run(cli: Cli) -> Result<bool> {
    measure::epoch();
    let messages = cli.messages.unwrap_or(if cli.quick { 3000 } else { 500_000 });
    let rounds = cli.rounds.unwrap_or(if cli.quick { 1 } else { 3 }).max(1);
    let scale = workloads::Scale {
        messages,
        idle_subs: cli.idle_subscriptions.unwrap_or(if cli.quick { 1000 } else { 10_000 }),
        wide_subs: cli
            .wide_subscribers
            .unwrap_or(if cli.quick { 100 } else { 1000 })
            .max(1),
        wide_rate: cli.wide_rate.max(1),
        wide_seconds: cli.wide_seconds.unwrap_or(if cli.quick { 2 } else { 10 }).max(1),
        wide_messages: cli.wide_messages.unwrap_or(if cli.quick { 500 } else { 10_000 }),
        cluster_rate: cli.cluster_rate.max(1),
        cluster_seconds: cli.cluster_seconds.unwrap_or(if cli.quick { 1 } else { 10 }).max(1),
    };
    if cli.window as usize > cli.consumer_capacity {
        bail!(
            "--window {} must fit in --consumer-capacity {} (half of it is comfortable)",
            cli.window,
            cli.consumer_capacity
        );
    }
    let tinybroker = std::fs::canonicalize(&cli.tinybroker_bin).with_context(|| {
        format!(
            "no tinybroker binary at {} (build it with `cargo build --release -p tinybroker`, or pass --tinybroker-bin)",
            cli.tinybroker_bin.display()
        )
    })?;
    let nats_cluster = cluster::find_binary(cli.nats_cluster_bin.as_deref());
    let log_dir = std::env::temp_dir().join(format!("tinybroker-bench-{}", std::process::id()));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let settings = Settings {
        bins: Binaries {
            tinybroker,
            nats: cli.nats_bin.clone(),
            redis: cli.redis_bin.clone(),
            nats_cluster: nats_cluster.as_ref().ok().cloned(),
            log_dir: log_dir.clone(),
        },
        window: cli.window,
        consumer_capacity: cli.consumer_capacity,
        probe: None,
    };
    if cli.guard {
        if cli.write_baseline.as_deref().is_some_and(|w| w.trim().is_empty()) {
            bail!("--write-baseline needs a reason: say why the cost moved");
        }
        let args = guard::GuardArgs {
            baseline: cli.baseline.clone(),
            write_baseline: cli.write_baseline.clone(),
            runs: cli.guard_runs.max(1),
            messages: cli.messages.unwrap_or(20_000),
            only: cli.only.clone(),
            inflate_instructions: cli.inflate_instructions,
            no_cluster: nats_cluster.as_ref().err().cloned(),
        };
        eprintln!(
            "tinybroker-bench: the performance guard, {}",
            systems::version_of(&settings.bins.tinybroker, "--version")
        );
        let ok = guard::run(args, settings).await?;
        if ok && !cli.keep_logs {
            let _ = std::fs::remove_dir_all(&log_dir);
        } else {
            eprintln!("tinybroker-bench: server logs kept in {}", log_dir.display());
        }
        return Ok(ok);
    }
    let mut selected: Vec<Case> = workloads::cases(&scale, !cli.skip_redis)
        .into_iter()
        .filter(|c| cli.only.is_empty() || cli.only.iter().any(|o| c.id.contains(o) || c.label.contains(o)))
        .map(|mut c| {
            c.variants.retain(|v| selects(&cli.system, &v.to_string()));
            c
        })
        .filter(|c| !c.variants.is_empty())
        .collect();
    if selected.is_empty() {
        bail!("--only {:?} matches no workload", cli.only);
    }
    if let Err(why) = &nats_cluster {
        let skipped: Vec<String> = selected
            .iter()
            .filter(|c| matches!(c.spec, workloads::Spec::Cluster { .. }))
            .map(|c| c.id.clone())
            .collect();
        if !skipped.is_empty() {
            eprintln!("tinybroker-bench: skipping {}: {why}", skipped.join(", "));
            selected.retain(|c| !matches!(c.spec, workloads::Spec::Cluster { .. }));
            if selected.is_empty() {
                eprintln!("tinybroker-bench: nothing left to run");
                let _ = std::fs::remove_dir_all(&log_dir);
                return Ok(true);
            }
        }
    }
    eprintln!(
        "tinybroker-bench: {} workloads, {rounds} round(s), {messages} messages (1→3), window {}, tinybroker consumer capacity {}; server logs in {}",
        selected.len(),
        cli.window,
        cli.consumer_capacity,
        log_dir.display()
    );

    eprintln!(
        "versions: {} | {} | {}{}",
        systems::version_of(&settings.bins.tinybroker, "--version"),
        systems::version_of(&settings.bins.nats, "--version"),
        systems::version_of(&settings.bins.redis, "--version"),
        match &settings.bins.nats_cluster {
            Some(bin)
                if selected
                    .iter()
                    .any(|c| matches!(c.spec, workloads::Spec::Cluster { .. })) =>
                format!(
                    " | cluster: {} ({})",
                    systems::version_of(bin, "--version"),
                    bin.display()
                ),
            _ => String::new(),
        }
    );

    let mut all_ok = true;
    let mut table: Vec<(Case, Vec<Runs>)> = Vec::new();
    for case in selected {
        let mut runs: Vec<Runs> = case
            .variants
            .iter()
            .map(|&variant| Runs {
                variant,
                results: Vec::new(),
            })
            .collect();
        for round in 1..=rounds {
            // A/B/A/B: every system once per round, in the same order.
            for r in runs.iter_mut() {
                let outcome = workloads::run(&case, r.variant, &settings).await;
                match &outcome {
                    Ok(res) => {
                        eprintln!(
                            "[{round}/{rounds}] {} / {}: delivered/s {:.0}, lost {}, dup {}{}{}",
                            case.id,
                            r.variant,
                            res.delivered_per_s.unwrap_or(0.0),
                            res.lost,
                            res.dup,
                            res.latency
                                .filter(|_| matches!(
                                    case.spec,
                                    workloads::Spec::Wide { rate: Some(_), .. }
                                        | workloads::Spec::Cluster { rate: Some(_), .. }
                                        | workloads::Spec::Cluster { group: true, .. }
                                ))
                                .map(|l| format!(", p50/p99/p999 {:.2}/{:.2}/{:.2} ms", l.p50, l.p99, l.p999))
                                .unwrap_or_default()
                                + &res
                                    .cpu_s_per_m
                                    .map(|c| format!(", server CPU {c:.3} s per M deliveries"))
                                    .unwrap_or_default()
                                + &res
                                    .kernel_share
                                    .map(|k| format!(" ({:.0} % in the kernel)", k * 100.0))
                                    .unwrap_or_default(),
                            res.rss_per_sub_bytes
                                .map(|b| format!(", RSS/sub {b:.0} B"))
                                .unwrap_or_default()
                        );
                        if let Some(v) = &res.violation {
                            eprintln!("  CONTRACT VIOLATION: {v}");
                            all_ok = false;
                        }
                        if res.lost > 0 && r.variant.kind != Kind::Tinybroker {
                            eprintln!("  note: {} lost {} messages", r.variant, res.lost);
                        }
                    }
                    Err(e) => {
                        eprintln!("[{round}/{rounds}] {} / {}: FAILED: {e:#}", case.id, r.variant);
                        all_ok = false;
                    }
                }
                r.results.push(outcome.map_err(|e| format!("{e:#}")));
            }
        }
        table.push((case, runs));
    }
    let text = report::render(&table);
    println!("{text}");
    if let Some(path) = &cli.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    if !all_ok {
        eprintln!(
            "tinybroker-bench: some runs failed or lost messages; server logs kept in {}",
            log_dir.display()
        );
    } else if cli.keep_logs {
        eprintln!("tinybroker-bench: server logs kept in {}", log_dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    Ok(all_ok)
}

#[cfg(test)]
mod tests {
    use super::selects;

    #[test]
    fn system_filter_matches_the_table_names() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(selects(&[], "NATS"));
        assert!(selects(&f(&["nats"]), "NATS"));
        assert!(!selects(&f(&["nats"]), "tinybroker"));
        assert!(selects(&f(&["manual"]), "tinybroker MANUAL ack"));
        assert!(!selects(&f(&["manual"]), "tinybroker"));
        assert!(selects(&f(&["redis", "tinybroker"]), "tinybroker MANUAL ack"));
    }
}
