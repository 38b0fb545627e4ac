//! A Prometheus of the test's own, scraping the brokers every second with
//! the shipped rules, and the HTTP API the sessions ask it through.

use crate::JOB;
use crate::common::process::ChildGuard;
use serde_json::Value;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Prometheus {
    pub addr: SocketAddr,
}

impl Prometheus {
    /// Starts Prometheus on 127.0.0.1, scraping `targets` and evaluating the
    /// shipped rules every second. The guard stops it.
    pub async fn start(dir: &Path, targets: &[SocketAddr]) -> (Self, ChildGuard) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let rules = std::fs::read_to_string(root.join("deploy/monitoring/alerts.yaml")).unwrap();
        let group_interval = "    interval: 30s\n";
        assert_eq!(
            rules.matches(group_interval).count(),
            1,
            "alerts.yaml has one group interval"
        );
        std::fs::write(
            dir.join("alerts.yaml"),
            rules.replace(group_interval, "    interval: 1s\n"),
        )
        .unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: [{}]\n",
            dir.join("alerts.yaml").display(),
            targets.join(", ")
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        // A free port can be taken between picking and binding: try a few.
        for _ in 0..3 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
            let child = Command::new("prometheus")
                .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("run prometheus (Debian package prometheus; scripts/check-alerts-live.sh installs it)");
            let mut guard = ChildGuard::new(child);
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if guard.child.try_wait().unwrap().is_some() {
                    break;
                }
                if http_get(addr, "/-/ready").await.is_ok_and(|(status, _)| status == 200) {
                    return (Self { addr }, guard);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            guard.kill();
        }
        panic!(
            "prometheus did not start: {}",
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
    }

    pub async fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = http_get(self.addr, path).await.map_err(|e| e.to_string())?;
        let json: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || json["status"] != "success" {
            return Err(format!("HTTP {status}: {body}"));
        }
        Ok(json["data"].clone())
    }

    /// An instant query's series.
    pub async fn query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", percent_encode(expr)))
            .await?;
        let result = data["result"]
            .as_array()
            .ok_or_else(|| format!("no result in {data}"))?;
        Ok(result
            .iter()
            .map(|s| Sample {
                labels: labels(&s["metric"]),
                value: s["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN),
            })
            .collect())
    }

    /// The labels of every firing alert.
    pub async fn firing(&self) -> Result<Vec<HashMap<String, String>>, String> {
        let data = self.api("/api/v1/alerts").await?;
        Ok(data["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["state"] == "firing")
            .map(|a| labels(&a["labels"]))
            .collect())
    }
}

#[derive(Debug, Clone)]
pub struct Sample {
    pub labels: HashMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn has(&self, label: &str, value: &str) -> bool {
        self.labels.get(label).is_some_and(|v| v == value)
    }
}

pub fn labels(metric: &Value) -> HashMap<String, String> {
    metric
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// HTTP/1.0 GET (no chunked encoding: the body runs to the end).
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr)).await??;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await??;
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
