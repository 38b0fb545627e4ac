//! The standard `process_*` metrics of the real broker binary against what
//! `/proc` says about the same process at the same moment (read just before
//! and just after the scrape), after the broker has burnt some CPU time.

mod common;

use common::process::BrokerProcess;
use common::*;
use std::time::{Duration, SystemTime};
use tinybroker::pb::broker_client::BrokerClient;

/// Every `process_*` series the broker exports: name, type, help text (the
/// Prometheus client conventions, as client_golang words them).
const EXPECTED: [(&str, &str, &str); 8] = [
    (
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
    ),
    ("process_max_fds", "gauge", "Maximum number of open file descriptors."),
    ("process_open_fds", "gauge", "Number of open file descriptors."),
    (
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
    ),
    (
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    ),
    ("process_threads", "gauge", "Number of OS threads in the process."),
    ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes."),
    (
        "process_virtual_memory_max_bytes",
        "gauge",
        "Maximum amount of virtual memory available in bytes.",
    ),
];

/// What `/proc` says about one process, read by this test.
#[derive(Debug, Clone, Copy)]
struct ProcView {
    /// utime + stime, in clock ticks.
    cpu_ticks: u64,
    threads: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
    open_fds: u64,
    max_fds: f64,
    max_address_space: f64,
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as u64 }
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as u64 }
}

fn boot_time() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .expect("btime in /proc/stat")
        .trim()
        .parse()
        .unwrap()
}

/// The soft limit on the `/proc/PID/limits` line that starts with `what`;
/// "unlimited" is u64::MAX (as client_golang reports it).
fn soft_limit(limits: &str, what: &str) -> f64 {
    let line = limits
        .lines()
        .find(|l| l.starts_with(what))
        .unwrap_or_else(|| panic!("{what} in {limits}"));
    match line[what.len()..].split_whitespace().next().unwrap() {
        "unlimited" => u64::MAX as f64,
        n => n.parse().unwrap(),
    }
}

fn read_proc(pid: u32) -> ProcView {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<u64> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // fields[0] is field 3 of proc(5) (state).
    let field = |n: usize| fields[n - 3];
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    ProcView {
        cpu_ticks: field(14) + field(15),
        threads: field(20),
        start_ticks: field(22),
        vsize: field(23),
        rss_pages: field(24),
        open_fds: std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count() as u64,
        max_fds: soft_limit(&limits, "Max open files"),
        max_address_space: soft_limit(&limits, "Max address space"),
    }
}

/// The value of the one unlabelled sample of `name`, as written.
fn sample<'a>(text: &'a str, name: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample of {name} in the scrape"))
}

fn value(text: &str, name: &str) -> f64 {
    let raw = sample(text, name);
    raw.parse().unwrap_or_else(|_| panic!("{name} {raw} is not a number"))
}

/// Publishes `n` messages to `topic` on one PublishStream.
async fn publish(client: &mut BrokerClient<tonic::transport::Channel>, topic: &str, n: usize) {
    let requests: Vec<_> = (0..n).map(|i| publish_request(topic, &i.to_string())).collect();
    let r = client
        .publish_stream(futures::stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.accepted, n as u64);
}

/// Reads `/proc` until the broker's CPU time has not moved for 100 ms (its
/// deliveries done), so that a scrape between two reads is pinned down.
async fn wait_idle(pid: u32) -> ProcView {
    let mut last = read_proc(pid);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = read_proc(pid);
        if now.cpu_ticks == last.cpu_ticks {
            return now;
        }
        last = now;
    }
    panic!("the broker did not go idle: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_metrics_agree_with_proc() {
    timeout(async {
        let spawned_at = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let broker = BrokerProcess::spawn::<&str, &str>(&[]);
        let pid = broker.guard.pid();
        let mut client = BrokerClient::connect(broker.url()).await.unwrap();
        let (mut reader, _) = subscribe(&mut client, &["burn.>"]).await;
        let reading = tokio::spawn(async move { while let Ok(Some(_)) = reader.message().await {} });

        let ticks = clock_ticks();
        // The kernel charges CPU time by ticks it samples: a short burst can
        // be charged nothing yet (CI read 0 ticks after 3,000 messages once).
        // Burn until it has charged some, so the comparisons below compare
        // something (at most 20 bursts; the assertion below says if not).
        for _ in 0..20 {
            if read_proc(pid).cpu_ticks > 0 {
                break;
            }
            publish(&mut client, "burn.cpu", 3000).await;
        }
        let mut fractional_checked = false;
        for round in 0..6 {
            // Burn CPU: a few thousand published and delivered messages.
            publish(&mut client, "burn.cpu", 3000).await;
            let before = wait_idle(pid).await;
            let text = scrape(broker.metrics_addr).await;
            let after = read_proc(pid);

            for (name, kind, help) in EXPECTED {
                assert!(text.contains(&format!("# HELP {name} {help}\n")), "HELP of {name}");
                assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "TYPE of {name}");
            }
            let names: std::collections::BTreeSet<&str> = text
                .lines()
                .filter(|l| l.starts_with("process_"))
                .filter_map(|l| l.split([' ', '{']).next())
                .collect();
            let expected: std::collections::BTreeSet<&str> = EXPECTED.iter().map(|e| e.0).collect();
            assert_eq!(names, expected, "the process_* series");

            // CPU: between the two reads (one tick of rounding), within 0.1 s.
            let cpu = value(&text, "process_cpu_seconds_total");
            let (lo, hi) = (before.cpu_ticks as f64 / ticks as f64, after.cpu_ticks as f64 / ticks as f64);
            assert!(
                cpu >= lo - 0.01 && cpu <= hi + 0.01 && (cpu - lo).abs() <= 0.1,
                "process_cpu_seconds_total {cpu}, /proc {lo}..{hi}"
            );
            assert!(lo > 0.0, "the broker burnt CPU time: {before:?}");
            // Its fractions: whenever /proc's value is not whole, nor is the
            // scraped one (the prometheus crate's collector gave whole seconds).
            if before.cpu_ticks == after.cpu_ticks && before.cpu_ticks % ticks != 0 {
                let raw = sample(&text, "process_cpu_seconds_total");
                assert!(raw.contains('.'), "process_cpu_seconds_total {raw}: /proc says {lo}");
                assert!((cpu - lo).abs() < 1e-9, "process_cpu_seconds_total {cpu}: /proc says {lo}");
                fractional_checked = true;
            }

            let rss = value(&text, "process_resident_memory_bytes");
            let (rss_lo, rss_hi) = minmax(before.rss_pages * page_size(), after.rss_pages * page_size());
            assert!(
                rss >= rss_lo * 0.95 && rss <= rss_hi * 1.05,
                "process_resident_memory_bytes {rss}, /proc {rss_lo}..{rss_hi}"
            );
            let vsize = value(&text, "process_virtual_memory_bytes");
            let (vs_lo, vs_hi) = minmax(before.vsize, after.vsize);
            assert!(
                vsize >= vs_lo * 0.95 && vsize <= vs_hi * 1.05,
                "process_virtual_memory_bytes {vsize}, /proc {vs_lo}..{vs_hi}"
            );
            let threads = value(&text, "process_threads");
            let (th_lo, th_hi) = minmax(before.threads, after.threads);
            assert!(
                threads >= th_lo && threads <= th_hi,
                "process_threads {threads}, /proc {th_lo}..{th_hi}"
            );
            // Open fds: the scrape's own connection and the broker's look at
            // /proc/self/fd are open while it counts.
            let fds = value(&text, "process_open_fds");
            let (fd_lo, fd_hi) = minmax(before.open_fds, after.open_fds);
            assert!(
                fds >= fd_lo && fds <= fd_hi + 2.0,
                "process_open_fds {fds}, /proc {fd_lo}..{fd_hi} (+ the scrape's 2)"
            );
            assert_eq!(value(&text, "process_max_fds"), after.max_fds, "process_max_fds");
            assert_eq!(
                value(&text, "process_virtual_memory_max_bytes"),
                after.max_address_space,
                "process_virtual_memory_max_bytes"
            );
            let start = value(&text, "process_start_time_seconds");
            let proc_start = boot_time() as f64 + after.start_ticks as f64 / ticks as f64;
            assert!(
                (start - proc_start).abs() <= 1.0,
                "process_start_time_seconds {start}, /proc {proc_start}"
            );
            // btime is whole seconds: the test's own clock agrees within 2 s.
            assert!(
                (start - spawned_at).abs() <= 2.0,
                "process_start_time_seconds {start}, spawned at {spawned_at}"
            );
            eprintln!(
                "round {round}: process_cpu_seconds_total {cpu} (/proc {lo}..{hi}), rss {rss}, threads {threads}, fds {fds}"
            );
            if fractional_checked {
                break;
            }
        }
        assert!(
            fractional_checked,
            "no scrape fell between two equal, non-whole /proc CPU readings in 6 rounds"
        );
        drop(client);
        reading.abort();
    })
    .await;
}

fn minmax(a: u64, b: u64) -> (f64, f64) {
    (a.min(b) as f64, a.max(b) as f64)
}
