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
    /// Lines of stderr, read by a thread (when it was captured).
    pub stderr: Option<Receiver<String>>,
}

impl ChildGuard {
    /// Holds `child`, its pipes left as they are.
    pub fn new(child: Child) -> Self {
        Self {
            child,
            stdout: None,
            stderr: None,
        }
    }

    /// Spawns `command` with stdin null and stdout and stderr piped: stderr
    /// read line by line into [`ChildGuard::stderr`], stdout left unread
    /// (see [`ChildGuard::read_stdout`] and [`ChildGuard::reading_stdout`]).
    pub fn spawn(command: &mut Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
        let stderr = child.stderr.take().map(lines);
        Self {
            child,
            stdout: None,
            stderr,
        }
    }

    /// This guard, its stdout read line by line into [`ChildGuard::stdout`].
    pub fn reading_stdout(mut self) -> Self {
        self.stdout = Some(self.read_stdout());
        self
    }

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

    /// Starts reading stdout, left unread by [`ChildGuard::spawn`] until
    /// now, line by line.
    pub fn read_stdout(&mut self) -> Receiver<String> {
        lines(self.child.stdout.take().expect("stdout was piped and not read yet"))
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "process did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// `tinybroker ARGS...` (any subcommand), without the caller's auth token:
/// the one way a test builds the CLI's command line.
pub fn cli(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinybroker"));
    command
        .env_remove("TINYBROKER_AUTH_TOKEN")
        .env_remove("TINYBROKER_ADDR")
        .args(args);
    command
}

/// `tinybroker ARGS...` (any subcommand) with `RUST_LOG=warn` and `env` set,
/// stdout piped but NOT read (a reader that stalls once the pipe is full;
/// call [`ChildGuard::read_stdout`] to start reading) and stderr read line by
/// line into [`ChildGuard::stderr`].
pub fn spawn_cli(args: &[&str], env: &[(&str, &str)]) -> ChildGuard {
    let mut command = cli(args);
    command.env("RUST_LOG", "warn").envs(env.iter().copied());
    ChildGuard::spawn(&mut command)
}

/// `tinybroker subscribe ARGS... --addr URL`, stdout read line by line into
/// [`ChildGuard::stdout`], stderr into [`ChildGuard::stderr`].
pub fn spawn_cli_subscriber(url: &str, args: &[&str]) -> ChildGuard {
    let mut all = vec!["subscribe"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--addr", url]);
    spawn_cli(&all, &[]).reading_stdout()
}

/// Runs `tinybroker ARGS...` to completion (killed after 30 s) and returns
/// its exit status, stdout and stderr.
pub fn run_cli(args: &[&str], env: &[(&str, &str)]) -> (std::process::ExitStatus, String, String) {
    let mut command = cli(args);
    command
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut guard = ChildGuard::new(command.spawn().expect("spawn tinybroker"));
    let stdout = guard.child.stdout.take().map(read_all);
    let stderr = guard.child.stderr.take().map(read_all);
    let status = guard.wait_exit(Duration::from_secs(30));
    let text = |rx: Option<Receiver<String>>| {
        rx.and_then(|rx| rx.recv_timeout(Duration::from_secs(5)).ok())
            .unwrap_or_default()
    };
    (status, text(stdout), text(stderr))
}

/// The whole of `reader`, read by a thread, sent once at its end.
fn read_all(mut reader: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = reader.read_to_end(&mut bytes);
        let _ = tx.send(String::from_utf8_lossy(&bytes).into_owned());
    });
    rx
}

/// Waits up to `limit`, without blocking the async runtime, for the next
/// line of `rx` containing `needle`; returns it and every line read before it.
pub async fn line_containing(rx: &Receiver<String>, needle: &str, limit: Duration) -> (String, Vec<String>) {
    let deadline = std::time::Instant::now() + limit;
    let mut before = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(line) if line.contains(needle) => return (line, before),
            Ok(line) => before.push(line),
            Err(std::sync::mpsc::TryRecvError::Empty) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("no line containing {needle:?} within {limit:?} ({e}); lines before: {before:#?}"),
        }
    }
}

/// The next line of `rx`, waiting up to `limit` without blocking the async runtime.
pub async fn next_line(rx: &Receiver<String>, limit: Duration) -> String {
    line_containing(rx, "", limit).await.0
}

/// Waits up to `limit`, without blocking the async runtime, for `child` to exit.
pub async fn exit_status(child: &mut ChildGuard, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process did not exit within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago, for a server that
/// must come back on the same address. Taken below the kernel's ephemeral
/// range (32768-60999 by default): while the server is down, a `:0` bind of
/// another test running beside it, or the source port of a connection a
/// client makes to the stopped server, could otherwise take the port (a
/// restart failed with AddrInUse once under load).
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    (0u64..)
        .map(|attempt| 20_000 + (RandomState::new().hash_one(attempt) % 12_000) as u16)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port in 20000-31999")
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
    /// stderr lines before the start-up line (start-up warnings).
    pub before_start: Vec<String>,
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
        let mut guard = ChildGuard::new(command.spawn().expect("spawn tinybroker serve"));
        let log = lines(guard.child.stderr.take().expect("stderr"));
        let mut before_start = Vec::new();
        let started = loop {
            let line = log.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
                panic!("the broker logs `tinybroker started` within 30 s; it logged {before_start:#?}")
            });
            if line.contains("tinybroker started") {
                break line;
            }
            before_start.push(line);
        };
        Self {
            grpc_addr: field(&started, "grpc_addr"),
            metrics_addr: field(&started, "metrics_addr").parse().expect("metrics_addr"),
            started,
            guard,
            log,
            before_start,
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
        self.guard.wait_exit(Duration::from_secs(30))
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

/// GET `path` with a plain blocking socket (for a scraper thread); None when
/// the server does not answer (refused, reset, or nothing within 2 s).
pub fn try_http_get_blocking(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}
