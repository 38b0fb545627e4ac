//! Starting and stopping the servers under test, reading their `/proc`
//! figures, and the small network helpers every adapter shares.
//!
//! Each server is a child process bound to 127.0.0.1 on free ports, started
//! fresh for every workload run (so peak RSS is per run) and killed and reaped
//! when its [`Server`] is dropped: at the end of a run, on error, on Ctrl-C
//! (the run future is dropped) and on panic. The child also gets
//! `PR_SET_PDEATHSIG`, so even a SIGKILLed bench leaves no orphan behind.

use anyhow::{Context, Result, anyhow, bail};
use std::fmt;
use std::fs::File;
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a server gets to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Awaits `fut` for at most `limit`, failing with a message naming `what`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("timed out after {limit:?} while {what}"))
}

/// [`within`] with a deadline the caller computed, for hot loops: it reads
/// no clock (a timeout made per message would read it once per message).
pub async fn before<T>(deadline: tokio::time::Instant, what: &str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout_at(deadline, fut)
        .await
        .map_err(|_| anyhow!("timed out while {what}"))
}

/// The systems compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Tinybroker,
    Nats,
    Redis,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Tinybroker => "tinybroker",
            Kind::Nats => "NATS",
            Kind::Redis => "Redis",
        })
    }
}

/// Where the server binaries are and how tinybroker is configured.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub tinybroker: PathBuf,
    pub nats: PathBuf,
    pub redis: PathBuf,
    /// nats-server >= 2.10 for the cluster workloads, when there is one.
    pub nats_cluster: Option<PathBuf>,
    /// Directory for server logs (kept for a failed run's diagnosis).
    pub log_dir: PathBuf,
}

/// Extra tinybroker settings for one run.
#[derive(Debug, Clone, Default)]
pub struct TinybrokerEnv {
    pub consumer_capacity: usize,
    pub max_subscriptions: usize,
    pub metrics_per_subscription: bool,
}

/// A running server. Dropping it kills and reaps the process.
pub struct Server {
    pub kind: Kind,
    /// Client address: gRPC for tinybroker, NATS protocol, RESP for Redis.
    pub addr: SocketAddr,
    /// HTTP side address: tinybroker's metrics server, NATS monitoring; none for Redis.
    pub http: Option<SocketAddr>,
    child: Child,
    log: PathBuf,
}

/// How many times [`Server::start`] tries fresh ports when the server finds
/// one taken: a port found free is released for the server to bind, and in
/// between an outgoing connection of this machine may get it as its
/// source port (seen once in a CI guard run: the metrics port).
const START_ATTEMPTS: usize = 3;

impl Server {
    /// Starts `kind` on ports found free, and waits until it is ready. A
    /// server that exits because a port was taken meanwhile is started
    /// again on others ([`START_ATTEMPTS`] in all).
    pub async fn start(kind: Kind, bins: &Binaries, tb: &TinybrokerEnv) -> Result<Server> {
        let mut attempt = 1;
        loop {
            match Self::start_once(kind, bins, tb).await {
                Err(error) if attempt < START_ATTEMPTS && port_taken(&error) => {
                    eprintln!("{kind}: a port was taken before it bound it; starting again on others ({error:#})");
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    async fn start_once(kind: Kind, bins: &Binaries, tb: &TinybrokerEnv) -> Result<Server> {
        let addr = free_port()?;
        let http = if kind == Kind::Redis { None } else { Some(free_port()?) };
        let log = bins.log_dir.join(format!("{}-{}.log", kind, addr.port()));
        let mut cmd = match kind {
            Kind::Tinybroker => {
                let mut c = tinybroker_command(bins, tb);
                c.env("TINYBROKER_GRPC_ADDR", addr.to_string())
                    .env(
                        "TINYBROKER_METRICS_ADDR",
                        http.map(|h| h.to_string()).unwrap_or_default(),
                    )
                    .env("RUST_LOG", "warn");
                c
            }
            Kind::Nats => {
                let mut c = Command::new(&bins.nats);
                c.args(["-a", "127.0.0.1", "-p"])
                    .arg(addr.port().to_string())
                    .arg("-m")
                    .arg(http.map(|h| h.port().to_string()).unwrap_or_default());
                c
            }
            Kind::Redis => {
                let mut c = Command::new(&bins.redis);
                c.args(["--bind", "127.0.0.1", "--port"])
                    .arg(addr.port().to_string())
                    .args(["--save", "", "--appendonly", "no"]);
                c
            }
        };
        let child = spawn_logged(kind, &mut cmd, &log)?;
        let mut server = Server::adopt(kind, addr, http, child, log);
        server.wait_ready().await?;
        Ok(server)
    }

    /// A server spawned by the caller (with [`spawn_logged`]) whose
    /// addresses are known; dropping it kills and reaps the process.
    pub fn adopt(kind: Kind, addr: SocketAddr, http: Option<SocketAddr>, child: Child, log: PathBuf) -> Server {
        Server {
            kind,
            addr,
            http,
            child,
            log,
        }
    }

    /// The file that has the server's stdout and stderr.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The exit status, if the process has exited.
    pub fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        self.child.try_wait().context("polling the server process")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until [`Server::probe`] passes (for tinybroker: gRPC health
    /// SERVING), failing with the end of the log if the process exits.
    pub async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().context("polling the server process")? {
                bail!(
                    "{} exited during start-up with {status}; its log {}:\n{}",
                    self.kind,
                    self.log.display(),
                    tail_of(&self.log)
                );
            }
            if self.probe().await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not become ready within {READY_TIMEOUT:?}; its log {}:\n{}",
                    self.kind,
                    self.log.display(),
                    tail_of(&self.log)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// One readiness probe: the client port accepts, and for tinybroker
    /// `/readyz` answers 200 (the gRPC health status is SERVING).
    async fn probe(&self) -> bool {
        let connect = |a: SocketAddr| async move {
            matches!(
                tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(a)).await,
                Ok(Ok(_))
            )
        };
        if !connect(self.addr).await {
            return false;
        }
        match (self.kind, self.http) {
            (Kind::Tinybroker, Some(http)) => matches!(http_get(http, "/readyz").await, Ok((200, _))),
            (_, Some(http)) => connect(http).await,
            (_, None) => true,
        }
    }

    /// A snapshot of the server's memory and CPU counters.
    pub fn stats(&self) -> Result<ProcStats> {
        ProcStats::read(self.pid())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // With BENCH_TERM_WAIT_MS set (for a profiler that writes its data
        // when the process exits, such as callgrind), SIGTERM first and wait
        // up to that long for the server to exit by itself.
        let wait = std::env::var("BENCH_TERM_WAIT_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok());
        if let (Some(ms), Ok(pid)) = (wait, libc::pid_t::try_from(self.child.id())) {
            // SAFETY: kill(2) with our own child's pid, which is not reaped yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_millis(ms);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // SIGKILL and reap: a benchmark has nothing to drain.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tinybroker serve` with a clean `TINYBROKER_*` environment and the
/// run's settings; the caller adds the addresses and `RUST_LOG`.
pub fn tinybroker_command(bins: &Binaries, tb: &TinybrokerEnv) -> Command {
    let mut c = Command::new(&bins.tinybroker);
    c.arg("serve");
    // Nothing from the caller's environment may change the setup.
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        if k.starts_with("TINYBROKER_") || k.starts_with("OTEL_") {
            c.env_remove(&key);
        }
    }
    c.env("TINYBROKER_CONSUMER_CAPACITY", tb.consumer_capacity.to_string())
        .env("TINYBROKER_MAX_SUBSCRIPTIONS", tb.max_subscriptions.to_string())
        .env(
            "TINYBROKER_METRICS_PER_SUBSCRIPTION",
            tb.metrics_per_subscription.to_string(),
        );
    c
}

/// Spawns `cmd` (a server of `kind`) with stdin closed, stdout and stderr
/// to `log`, and `PR_SET_PDEATHSIG` so it dies with the bench.
pub fn spawn_logged(kind: Kind, cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = File::create(log).with_context(|| format!("creating server log {}", log.display()))?;
    let err = out.try_clone().context("duplicating the server log handle")?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: prctl is async-signal-safe; it only asks the kernel to
    // SIGKILL this child if the bench dies without cleaning up.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    cmd.spawn().with_context(|| match kind {
        Kind::Tinybroker => format!(
            "starting {program} (build it with `cargo build --release -p tinybroker`, or pass --tinybroker-bin)"
        ),
        _ => format!("starting {program} (install it with `apt-get install -y nats-server redis-server`)"),
    })
}

/// The end of a server's log, for an error message.
pub fn tail_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Whether a start-up failure says a port was taken (tinybroker's "Address
/// already in use", nats-server's and Redis's "address already in use").
fn port_taken(error: &anyhow::Error) -> bool {
    let text = format!("{error:#}").to_lowercase();
    text.contains("exited during start-up") && text.contains("address already in use")
}

/// A free port on 127.0.0.1 (bound, then released for the server to take),
/// below the kernel's ephemeral range (32768-60999 by default), as the
/// tests' `free_port`: a `:0` port is one an outgoing connection can be
/// given as its source port before the server binds it (a CI guard run lost
/// tinybroker's metrics port that way; the NATS cluster's ports had the
/// same race). [`Server::start`]'s retries stay for what is left.
pub fn free_port() -> Result<SocketAddr> {
    use std::hash::{BuildHasher, RandomState};
    (0u64..1_000)
        .map(|attempt| 20_000 + (RandomState::new().hash_one(attempt) % 12_000) as u16)
        .find_map(|port| TcpListener::bind(("127.0.0.1", port)).ok())
        .context("no free port in 127.0.0.1:20000-31999 after 1,000 tries")?
        .local_addr()
        .context("reading the free port")
}

/// Memory and CPU counters of a process, from `/proc/<pid>/{status,stat}`.
#[derive(Debug, Clone, Copy)]
pub struct ProcStats {
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
    /// utime + stime, in clock ticks.
    pub cpu_ticks: u64,
    /// stime alone: the part spent in the kernel (syscalls, the network
    /// stack, wake-ups).
    pub sys_ticks: u64,
    pub at: Instant,
}

impl ProcStats {
    pub fn read(pid: u32) -> Result<ProcStats> {
        let at = Instant::now();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("reading /proc/{pid}/status"))?;
        let field = |name: &str| -> Result<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("no {name} in /proc/{pid}/status"))
        };
        let rss_kib = field("VmRSS:")?;
        let peak_rss_kib = field("VmHWM:")?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .with_context(|| format!("reading /proc/{pid}/stat"))?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let after = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .with_context(|| format!("malformed /proc/{pid}/stat"))?;
        let fields: Vec<&str> = after.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat; `after` starts at field 3.
        let tick = |i: usize| -> Result<u64> {
            fields
                .get(i)
                .and_then(|f| f.parse().ok())
                .with_context(|| format!("no field {} in /proc/{pid}/stat", i + 3))
        };
        Ok(ProcStats {
            rss_kib,
            peak_rss_kib,
            cpu_ticks: tick(11)? + tick(12)?,
            sys_ticks: tick(12)?,
            at,
        })
    }

    /// The counters of several processes together: RSS and peak RSS and CPU
    /// added up, read at the first one's time.
    pub fn sum(parts: &[ProcStats]) -> Option<ProcStats> {
        let first = parts.first()?;
        Some(ProcStats {
            rss_kib: parts.iter().map(|p| p.rss_kib).sum(),
            peak_rss_kib: parts.iter().map(|p| p.peak_rss_kib).sum(),
            cpu_ticks: parts.iter().map(|p| p.cpu_ticks).sum(),
            sys_ticks: parts.iter().map(|p| p.sys_ticks).sum(),
            at: first.at,
        })
    }

    /// CPU (utime + stime) used between two snapshots, in seconds.
    pub fn cpu_seconds_since(&self, earlier: &ProcStats) -> f64 {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        self.cpu_ticks.saturating_sub(earlier.cpu_ticks) as f64 / hz
    }

    /// The kernel's share (stime) of the CPU used between two snapshots,
    /// 0 to 1; `None` when none was used.
    pub fn kernel_share_since(&self, earlier: &ProcStats) -> Option<f64> {
        let all = self.cpu_ticks.saturating_sub(earlier.cpu_ticks);
        (all > 0).then(|| self.sys_ticks.saturating_sub(earlier.sys_ticks) as f64 / all as f64)
    }

    /// CPU used between two snapshots, in % of one core.
    pub fn cpu_percent_since(&self, earlier: &ProcStats) -> f64 {
        let secs = self.at.duration_since(earlier.at).as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        self.cpu_seconds_since(earlier) / secs * 100.0
    }
}

/// A tiny HTTP/1.1 GET (`Connection: close`) for `/metrics`, `/readyz` and
/// NATS `/varz`: returns the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    within(Duration::from_secs(5), &format!("GET http://{addr}{path}"), async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("no HTTP status in the answer to GET {path}"))?;
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let chunked = head.lines().any(|l| {
            l.split_once(':').is_some_and(|(k, v)| {
                k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim().eq_ignore_ascii_case("chunked")
            })
        });
        let body = if chunked { dechunk(body) } else { body.to_owned() };
        anyhow::Ok((code, body))
    })
    .await?
}

/// The body of a `Transfer-Encoding: chunked` answer (nats-server's
/// monitoring port sends its larger documents so).
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = size.split(';').next().unwrap_or("").trim();
        let Ok(n) = usize::from_str_radix(size, 16) else { break };
        if n == 0 || after.len() < n {
            out.push_str(&after[..n.min(after.len())]);
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
    }
    out
}

/// The sum of every sample of a Prometheus metric (all label sets).
pub fn prom_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The sample of a Prometheus metric whose labels include `label`
/// (`reason="nats_slow_consumer"`); 0 when there is none.
pub fn prom_with_label(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|rest| rest.split_once('}'))
        .filter(|(labels, _)| labels.split(',').any(|l| l == label))
        .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
        .sum()
}

/// A top-level number field of a NATS `/varz` JSON document.
pub fn varz_field(json: &str, name: &str) -> Option<u64> {
    let key = format!("\"{name}\":");
    let at = json.find(&key)? + key.len();
    let digits: String = json[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// A server's version line, for the report header.
pub fn version_of(program: &Path, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .ok()
        .map(|o| {
            let s = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
            s.lines().next().unwrap_or("").trim().to_owned()
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("{} (version unknown)", program.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A start-up that lost its port is told from any other failure, in
    /// the words tinybroker and nats-server use (the first is from a CI
    /// guard run that failed on it).
    #[test]
    fn a_port_taken_at_start_up_is_told_apart() {
        let taken = anyhow!(
            "tinybroker exited during start-up with exit status: 2; its log /tmp/x.log:\ntinybroker: cannot listen on TINYBROKER_METRICS_ADDR=127.0.0.1:33227: Address already in use (os error 98)"
        );
        assert!(port_taken(&taken));
        let nats = anyhow!(
            "nats exited during start-up with exit status: 1; its log /tmp/y.log:\n[FTL] Error listening on port: 127.0.0.1:4222, \"listen tcp 127.0.0.1:4222: bind: address already in use\""
        );
        assert!(port_taken(&nats));
        let other = anyhow!(
            "tinybroker exited during start-up with exit status: 2; its log /tmp/z.log:\ntinybroker: TINYBROKER_MAX_MESSAGE_BYTES=x is not a number"
        );
        assert!(!port_taken(&other));
        let not_ready =
            anyhow!("tinybroker did not become ready within 10s; address already in use appears in a client's log");
        assert!(!port_taken(&not_ready));
    }

    /// The ports servers are given are outside the kernel's ephemeral range,
    /// where no outgoing connection can take them, and free.
    #[test]
    fn free_ports_are_below_the_ephemeral_range() {
        for _ in 0..20 {
            let addr = free_port().unwrap();
            assert!((20_000..32_000).contains(&addr.port()), "{addr}");
            TcpListener::bind(addr).unwrap();
        }
    }

    #[test]
    fn prometheus_sum_over_labels() {
        let text = "# HELP x\ntinybroker_subscriptions{mode=\"broadcast\"} 7\ntinybroker_subscriptions{mode=\"group\"} 3\ntinybroker_subscriptions_other 9\n";
        assert_eq!(prom_sum(text, "tinybroker_subscriptions"), 10.0);
        assert_eq!(
            prom_sum("tinybroker_evictions_total 2\n", "tinybroker_evictions_total"),
            2.0
        );
        let dropped = "tinybroker_messages_dropped_total{reason=\"evicted\"} 4\ntinybroker_messages_dropped_total{reason=\"nats_slow_consumer\"} 3\n";
        let name = "tinybroker_messages_dropped_total";
        assert_eq!(prom_with_label(dropped, name, "reason=\"nats_slow_consumer\""), 3.0);
        assert_eq!(prom_with_label(dropped, name, "reason=\"other\""), 0.0);
    }

    #[test]
    fn chunked_bodies() {
        assert_eq!(dechunk("5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n"), "hello, world");
        assert_eq!(dechunk("3;x=y\r\nabc\r\n0\r\n\r\n"), "abc");
        assert_eq!(dechunk(""), "");
    }

    #[test]
    fn varz_fields() {
        let json = "{\n  \"subscriptions\": 10042,\n  \"slow_consumers\": 1\n}";
        assert_eq!(varz_field(json, "subscriptions"), Some(10042));
        assert_eq!(varz_field(json, "slow_consumers"), Some(1));
        assert_eq!(varz_field(json, "nope"), None);
    }
}
