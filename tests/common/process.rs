//! The real `tinybroker` binary as a child process, for tests that need
//! signals, exit codes, logs or a separate address space.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The real binary, started with the given environment.
pub struct Process {
    pub child: std::process::Child,
    stderr_lines: std::sync::mpsc::Receiver<String>,
}

impl Process {
    pub fn spawn(env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tinybroker"));
        command
            .env_clear()
            .env("RUST_LOG", "info")
            .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawn tinybroker");
        let stderr = child.stderr.take().unwrap();
        let (tx, stderr_lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, stderr_lines }
    }

    /// Waits for a log line containing `needle`.
    pub fn line_containing(&self, needle: &str) -> String {
        loop {
            let line = self
                .stderr_lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("no log line containing {needle:?}"));
            if line.contains(needle) {
                return line;
            }
        }
    }

    /// Every log line printed so far and not yet read.
    pub fn drain_lines(&self) -> Vec<String> {
        self.stderr_lines.try_iter().collect()
    }

    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(std::time::Instant::now() < deadline, "process did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn field(line: &str, name: &str) -> String {
    let start = line
        .find(&format!("{name}="))
        .unwrap_or_else(|| panic!("{name} in {line}"))
        + name.len()
        + 1;
    line[start..].split_whitespace().next().unwrap().to_owned()
}
