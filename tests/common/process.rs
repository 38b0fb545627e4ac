//! Child processes for tests that need signals, exit codes, logs or a
//! separate address space: the real broker binary (its log, exit status and
//! RSS) and `tinybroker subscribe` clients to kill. Every child is SIGKILLed
//! and reaped when its guard drops, so a failing test leaves nothing behind.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

/// A child process, killed (SIGKILL) and reaped on drop.
pub struct ChildGuard {
    pub child: Child,
    /// Lines of stdout, read by a thread.
    pub stdout: Option<Receiver<String>>,
}

impl ChildGuard {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`, `KILL`).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([format!("-{name}"), self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {}", self.pid());
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

fn lines(reader: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// `tinybroker subscribe ARGS... --addr URL`, stdout piped to a line reader.
pub fn spawn_cli_subscriber(url: &str, args: &[&str]) -> ChildGuard {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tinybroker"))
        .env_remove("TINYBROKER_AUTH_TOKEN")
        .env("RUST_LOG", "warn")
        .arg("subscribe")
        .args(args)
        .args(["--addr", url])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn tinybroker subscribe");
    let stdout = child.stdout.take().map(lines);
    ChildGuard { child, stdout }
}

/// The real broker binary on ephemeral ports.
pub struct BrokerProcess {
    pub guard: ChildGuard,
    pub grpc_addr: String,
    pub metrics_addr: std::net::SocketAddr,
    /// The `tinybroker started` log line.
    pub started: String,
    /// stderr lines after the start-up line.
    pub log: Receiver<String>,
}

impl BrokerProcess {
    /// Starts `tinybroker serve` with `env` on top of a clean environment and
    /// waits for its `tinybroker started` line.
    pub fn spawn<K: AsRef<OsStr>, V: AsRef<OsStr>>(env: &[(K, V)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tinybroker"));
        command
            .env_clear()
            .env("RUST_LOG", "info")
            .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
            .arg("serve")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        Self::from_command(command)
    }

    /// Starts `command` (a broker with its stderr piped, perhaps under a
    /// wrapper such as prlimit) and waits for its `tinybroker started` line.
    pub fn from_command(mut command: Command) -> Self {
        let mut child = command.spawn().expect("spawn tinybroker serve");
        let log = lines(child.stderr.take().expect("stderr"));
        let guard = ChildGuard { child, stdout: None };
        let started = loop {
            let line = log
                .recv_timeout(Duration::from_secs(30))
                .expect("the broker logs `tinybroker started` within 30 s");
            if line.contains("tinybroker started") {
                break line;
            }
        };
        Self {
            grpc_addr: field(&started, "grpc_addr"),
            metrics_addr: field(&started, "metrics_addr").parse().expect("metrics_addr"),
            started,
            guard,
            log,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// Resident set size of the broker, in KiB (VmRSS of /proc/PID/status).
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.guard.pid())
    }

    /// Waits for a log line containing `needle`.
    pub fn line_containing(&self, needle: &str) -> String {
        loop {
            let line = self
                .log
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("no log line containing {needle:?}"));
            if line.contains(needle) {
                return line;
            }
        }
    }

    /// Every log line printed so far and not yet read.
    pub fn drain_lines(&self) -> Vec<String> {
        self.log.try_iter().collect()
    }

    /// Waits up to 30 s for the process to exit.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.guard.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(std::time::Instant::now() < deadline, "process did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The value of field `name` in a log line, text (`name=value`) or JSON
/// (`"name":"value"`).
pub fn field(line: &str, name: &str) -> String {
    if let Ok(json) = serde_json::from_str::<serde_json::Value>(line) {
        return match &json[name] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => panic!("{name} in {line}"),
            other => other.to_string(),
        };
    }
    let start = line
        .find(&format!("{name}="))
        .unwrap_or_else(|| panic!("{name} in {line}"))
        + name.len()
        + 1;
    line[start..].split_whitespace().next().expect("a value").to_owned()
}

pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// Sum of every sample of metric `name` in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Spawns `command` with stdout and stderr piped, each read line by line by
/// a thread: stdout into the guard's `stdout`, stderr into the returned
/// receiver (for failure messages). Killed and reaped when the guard drops.
pub fn spawn_piped(command: &mut Command) -> (ChildGuard, Receiver<String>) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
    let stdout = child.stdout.take().map(lines);
    let stderr = lines(child.stderr.take().expect("stderr"));
    (ChildGuard { child, stdout }, stderr)
}

/// The sample of metric `name` whose labels include `label` (e.g.
/// `reason="h2_flood"`), if the exposition has one.
pub fn metric_with_label(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|rest| rest.split_once('}'))
        .find(|(labels, _)| labels.split(',').any(|l| l == label))
        .and_then(|(_, value)| value.trim().parse().ok())
}
