//! The standard `process_*` metrics, read from `/proc` at each scrape, with
//! the names, types and help texts of the Prometheus client conventions
//! (client_golang's process collector). They replace the `prometheus`
//! crate's collector, which keeps `process_cpu_seconds_total` as an integer
//! counter, so that CPU time read in whole seconds only
//! (tikv/rust-prometheus #451 and #560).

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, Opts};

const CPU: (&str, &str) = (
    "process_cpu_seconds_total",
    "Total user and system CPU time spent in seconds.",
);
const OPEN_FDS: (&str, &str) = ("process_open_fds", "Number of open file descriptors.");
const MAX_FDS: (&str, &str) = ("process_max_fds", "Maximum number of open file descriptors.");
const VIRTUAL: (&str, &str) = ("process_virtual_memory_bytes", "Virtual memory size in bytes.");
const VIRTUAL_MAX: (&str, &str) = (
    "process_virtual_memory_max_bytes",
    "Maximum amount of virtual memory available in bytes.",
);
const RESIDENT: (&str, &str) = ("process_resident_memory_bytes", "Resident memory size in bytes.");
const START_TIME: (&str, &str) = (
    "process_start_time_seconds",
    "Start time of the process since unix epoch in seconds.",
);
const THREADS: (&str, &str) = ("process_threads", "Number of OS threads in the process.");

/// The gauges, in the order [`ProcessCollector::collect`] reads them.
const GAUGES: [(&str, &str); 7] = [OPEN_FDS, MAX_FDS, VIRTUAL, VIRTUAL_MAX, RESIDENT, START_TIME, THREADS];

/// This process's `process_*` metrics. A value that cannot be read (no
/// `/proc`) is left out of the scrape rather than reported as 0.
pub struct ProcessCollector {
    /// Templates: they give `desc()`; each scrape builds fresh metrics.
    cpu: Counter,
    gauges: Vec<Gauge>,
    /// `_SC_CLK_TCK`: the unit of the CPU times in `/proc/self/stat`.
    ticks_per_second: f64,
    page_size: f64,
    /// Seconds since the epoch; fixed for the process's life, read once.
    start_time: Option<f64>,
}

impl ProcessCollector {
    pub fn for_self() -> Self {
        // SAFETY: sysconf only reads a system constant.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        let ticks_per_second = if ticks > 0 { ticks as f64 } else { 100.0 };
        let start_time = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|text| Stat::parse(&text))
            .zip(boot_time())
            .map(|(stat, boot)| boot + stat.start_ticks as f64 / ticks_per_second);
        Self {
            cpu: Counter::with_opts(Opts::new(CPU.0, CPU.1)).expect("valid counter"),
            gauges: GAUGES
                .iter()
                .map(|(name, help)| Gauge::new(*name, *help).expect("valid gauge"))
                .collect(),
            ticks_per_second,
            page_size: if page > 0 { page as f64 } else { 4096.0 },
            start_time,
        }
    }
}

impl Collector for ProcessCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.cpu
            .desc()
            .into_iter()
            .chain(self.gauges.iter().flat_map(|g| g.desc()))
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let stat = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|text| Stat::parse(&text));
        let mut families = Vec::new();
        if let Some(stat) = &stat {
            let cpu = Counter::with_opts(Opts::new(CPU.0, CPU.1)).expect("valid counter");
            cpu.inc_by((stat.utime + stat.stime) as f64 / self.ticks_per_second);
            families.extend(cpu.collect());
        }
        let [max_fds, max_address_space] = soft_limits();
        let values = [
            open_fds().map(|n| n as f64),
            max_fds,
            stat.as_ref().map(|s| s.vsize as f64),
            max_address_space,
            stat.as_ref().map(|s| s.rss_pages as f64 * self.page_size),
            self.start_time,
            stat.as_ref().map(|s| s.threads as f64),
        ];
        for ((name, help), value) in GAUGES.iter().zip(values) {
            if let Some(value) = value {
                let gauge = Gauge::new(*name, *help).expect("valid gauge");
                gauge.set(value);
                families.extend(gauge.collect());
            }
        }
        families
    }
}

/// The fields of `/proc/self/stat` the metrics use (proc(5)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    /// CPU time in user mode, in clock ticks.
    utime: u64,
    /// CPU time in kernel mode, in clock ticks.
    stime: u64,
    threads: u64,
    /// Clock ticks after boot at which the process started.
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

impl Stat {
    /// Parses the one line of `/proc/<pid>/stat`. The command name (field 2)
    /// is in parentheses and may itself hold spaces and parentheses, so the
    /// fields are counted from the last `)`.
    fn parse(text: &str) -> Option<Self> {
        let after_name = &text[text.rfind(')')? + 1..];
        // Field 3 (state) is the first after the name.
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
        Some(Self {
            utime: field(14)?,
            stime: field(15)?,
            threads: field(20)?,
            start_ticks: field(22)?,
            vsize: field(23)?,
            rss_pages: field(24)?,
        })
    }
}

/// The system's boot time, seconds since the epoch (`btime` of `/proc/stat`).
fn boot_time() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|secs| secs as f64)
}

/// Entries of `/proc/self/fd` (the directory's own descriptor included, as
/// client_golang counts).
fn open_fds() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count())
}

/// The soft limits of open descriptors and of address space; unlimited is
/// `u64::MAX`, as client_golang reports it (1.8446744073709552e+19).
fn soft_limits() -> [Option<f64>; 2] {
    [libc::RLIMIT_NOFILE, libc::RLIMIT_AS].map(|resource| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct given.
        (unsafe { libc::getrlimit(resource, &mut limit) } == 0).then_some(limit.rlim_cur as f64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        // A command name with a space and a ')' of its own.
        let line = "4242 (tokio) worker) S 1 4242 4242 0 -1 4194560 2000 0 0 0 \
                    78 13 0 0 20 0 7 0 123456 196702208 7177 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 1260 0 0 0 17 1 0 0 0 0 0\n";
        assert_eq!(
            Stat::parse(line),
            Some(Stat {
                utime: 78,
                stime: 13,
                threads: 7,
                start_ticks: 123456,
                vsize: 196702208,
                rss_pages: 7177,
            })
        );
        assert_eq!(Stat::parse("4242 (cut short) S 1 2 3"), None);
        assert_eq!(Stat::parse(""), None);
    }

    #[test]
    fn every_series_is_read_with_its_standard_type() {
        let families = ProcessCollector::for_self().collect();
        let kinds: Vec<(String, prometheus::proto::MetricType)> = families
            .iter()
            .map(|f| (f.name().to_owned(), f.get_field_type()))
            .collect();
        let mut expected = vec![(CPU.0.to_owned(), prometheus::proto::MetricType::COUNTER)];
        expected.extend(
            GAUGES
                .iter()
                .map(|(name, _)| ((*name).to_owned(), prometheus::proto::MetricType::GAUGE)),
        );
        assert_eq!(kinds, expected);
    }
}
