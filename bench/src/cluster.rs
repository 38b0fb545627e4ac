//! The systems of the cluster workloads (issue 15): a cluster of
//! nats-server ≥ 2.10 processes with JetStream memory storage, and
//! tinybroker replicas in cluster mode over it. The same NATS cluster,
//! used directly by async-nats clients, is the peer.
//!
//! Like every other server of the bench, each process is started fresh for
//! a run, on 127.0.0.1, and SIGKILLed and reaped when dropped
//! ([`Server`]). The cluster's configuration and readiness check follow
//! tests/common/nats.rs (docs/cluster-notes.md, "Server configuration that
//! works"), including its workaround for a start that stays stuck with a
//! JetStream meta group of 2: start over on new ports.

use crate::json;
use crate::systems::{
    Binaries, Kind, Server, TinybrokerEnv, free_port, http_get, spawn_logged, tail_of, tinybroker_command,
};
use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The oldest nats-server that tinybroker's cluster mode supports.
pub const MIN_VERSION: (u64, u64) = (2, 10);
/// Where `scripts/install-nats.sh` puts it.
pub const INSTALLED: &str = "/usr/local/lib/tinybroker/nats-server-2.10/nats-server";
/// How long one attempt at starting the cluster may take (a cold start of
/// 3 takes 0.1 to 0.8 s here), and how many attempts are made.
const START_TIMEOUT: Duration = Duration::from_secs(5);
const START_ATTEMPTS: usize = 4;
/// How long a replica gets to log its start-up line.
const REPLICA_START: Duration = Duration::from_secs(20);

/// The nats-server ≥ 2.10 to use: `explicit` (`--nats-cluster-bin`), else
/// `TB_NATS_SERVER` (what `.ci/run` exports), else [`INSTALLED`]. Err says
/// why there is none, for the line that skips the cluster workloads.
pub fn find_binary(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let (path, from) = match (explicit, std::env::var_os("TB_NATS_SERVER").filter(|p| !p.is_empty())) {
        (Some(p), _) => (p.to_path_buf(), "--nats-cluster-bin"),
        (None, Some(p)) => (PathBuf::from(p), "TB_NATS_SERVER"),
        (None, None) => (PathBuf::from(INSTALLED), "the install path"),
    };
    match version(&path) {
        Some(v) if v >= MIN_VERSION => Ok(path),
        Some((major, minor)) => Err(format!(
            "{} ({from}) is nats-server {major}.{minor}; cluster mode needs 2.10 or later (bash scripts/install-nats.sh)",
            path.display()
        )),
        None => Err(format!(
            "no nats-server 2.10 at {} ({from}): install it with `bash scripts/install-nats.sh`, or pass --nats-cluster-bin",
            path.display()
        )),
    }
}

/// (major, minor) of `nats-server --version` ("nats-server: v2.10.27").
pub fn version(binary: &Path) -> Option<(u64, u64)> {
    let output = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let v = text.trim().rsplit(' ').next()?.strip_prefix('v')?;
    let mut parts = v.split('.').map(|p| p.parse::<u64>().ok());
    Some((parts.next()??, parts.next()??))
}

/// A number unique in this bench process, for names and directories.
fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A running NATS cluster. Dropping it kills every server and removes
/// their JetStream store directories (the logs stay with the bench's).
pub struct NatsCluster {
    pub servers: Vec<Server>,
    names: Vec<String>,
    stores: Vec<PathBuf>,
}

/// One server's configuration before it starts.
struct Planned {
    name: String,
    client: SocketAddr,
    route: SocketAddr,
    http: SocketAddr,
    store: PathBuf,
    config: PathBuf,
    log: PathBuf,
}

impl NatsCluster {
    /// Starts `n` servers of `binary` and waits until the cluster is whole:
    /// every `/healthz` OK, routes to every other server, one meta leader
    /// whose `/jsz` says `cluster_size` n with every peer current.
    pub async fn start(binary: &Path, log_dir: &Path, n: usize) -> Result<NatsCluster> {
        let started = Instant::now();
        let mut why = String::new();
        for attempt in 1..=START_ATTEMPTS {
            let id = format!("bench{}x{}", std::process::id(), unique());
            let dir = log_dir.join(format!("nats-{id}"));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let mut planned = Vec::with_capacity(n);
            for i in 0..n {
                planned.push(Planned {
                    // Unique in the machine: a JetStream peer id is a hash of the name.
                    name: format!("n{i}-{id}"),
                    client: free_port()?,
                    route: free_port()?,
                    http: free_port()?,
                    store: dir.join(format!("n{i}-store")),
                    config: dir.join(format!("n{i}.conf")),
                    log: dir.join(format!("n{i}.log")),
                });
            }
            for (i, p) in planned.iter().enumerate() {
                std::fs::write(&p.config, config(&id, &planned, i))
                    .with_context(|| format!("writing {}", p.config.display()))?;
            }
            let mut cluster = NatsCluster {
                servers: Vec::with_capacity(n),
                names: planned.iter().map(|p| p.name.clone()).collect(),
                stores: planned.iter().map(|p| p.store.clone()).collect(),
            };
            for p in &planned {
                let mut cmd = Command::new(binary);
                cmd.arg("-c").arg(&p.config);
                let child = spawn_logged(Kind::Nats, &mut cmd, &p.log)?;
                cluster
                    .servers
                    .push(Server::adopt(Kind::Nats, p.client, Some(p.http), child, p.log.clone()));
            }
            match cluster.wait_ready(START_TIMEOUT).await {
                Ok(()) => {
                    if attempt > 1 {
                        eprintln!(
                            "  nats: cluster of {n} ready in {:?}, attempt {attempt}",
                            started.elapsed()
                        );
                    }
                    return Ok(cluster);
                }
                Err(e) => {
                    eprintln!("  nats: cluster start, attempt {attempt}: {e}; again on new ports");
                    why = e;
                }
            }
        }
        bail!("the NATS cluster did not come up in {START_ATTEMPTS} attempts: {why}")
    }

    /// The client URLs of every server, server `first` first, comma-separated.
    pub fn urls_from(&self, first: usize) -> String {
        let n = self.servers.len();
        (0..n)
            .map(|k| format!("nats://{}", self.servers[(first + k) % n].addr))
            .collect::<Vec<_>>()
            .join(",")
    }

    async fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            for (server, name) in self.servers.iter_mut().zip(&self.names) {
                if let Ok(Some(status)) = server.exited() {
                    return Err(format!("{name} exited with {status}:\n{}", tail_of(server.log())));
                }
            }
            let why = match self.not_ready().await {
                None => return Ok(()),
                Some(why) => why,
            };
            if Instant::now() >= deadline {
                return Err(why);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn monitor(&self, i: usize, path: &str) -> Result<json::Value, String> {
        let name = &self.names[i];
        let http = self.servers[i]
            .http
            .ok_or_else(|| format!("{name} has no monitoring port"))?;
        match http_get(http, path).await {
            Ok((200, body)) => json::parse(&body).map_err(|e| format!("{name} {path}: {e}")),
            Ok((status, body)) => Err(format!("{name} {path}: {status} {}", body.trim())),
            Err(e) => Err(format!("{name} {path}: {e:#}")),
        }
    }

    /// What is not ready yet (None: all of it is).
    async fn not_ready(&self) -> Option<String> {
        let n = self.servers.len();
        let mut leaders = Vec::new();
        for i in 0..n {
            let name = &self.names[i];
            if let Err(e) = self.monitor(i, "/healthz").await {
                return Some(e);
            }
            if n == 1 {
                continue;
            }
            let routez = match self.monitor(i, "/routez").await {
                Ok(v) => v,
                Err(e) => return Some(e),
            };
            let mut peers: Vec<&str> = routez
                .get("routes")
                .items()
                .iter()
                .filter_map(|r| r.get("remote_name").as_str())
                .collect();
            peers.sort_unstable();
            peers.dedup();
            if peers.len() != n - 1 {
                return Some(format!("{name} has routes to {peers:?}"));
            }
            let jsz = match self.monitor(i, "/jsz").await {
                Ok(v) => v,
                Err(e) => return Some(e),
            };
            match jsz.get("meta_cluster").get("leader").as_str() {
                Some(leader) if !leader.is_empty() => leaders.push(leader.to_owned()),
                _ => return Some(format!("{name}: no meta leader yet")),
            }
        }
        let leader = leaders.first()?;
        if leaders.iter().any(|l| l != leader) {
            return Some(format!("the servers disagree on the meta leader: {leaders:?}"));
        }
        let Some(l) = self.names.iter().position(|name| name == leader) else {
            return Some(format!("meta leader {leader} is none of the servers"));
        };
        let jsz = match self.monitor(l, "/jsz").await {
            Ok(v) => v,
            Err(e) => return Some(e),
        };
        let meta = jsz.get("meta_cluster");
        // The pitfall: a meta group of 2 that the third never joins, with
        // every /healthz OK.
        if meta.get("cluster_size").as_u64() != Some(n as u64) {
            return Some(format!(
                "meta cluster size {:?} (want {n})",
                meta.get("cluster_size").as_u64()
            ));
        }
        for (i, name) in self.names.iter().enumerate() {
            if i == l {
                continue;
            }
            let current = meta
                .get("replicas")
                .items()
                .iter()
                .find(|p| p.get("name").as_str() == Some(name))
                .is_some_and(|p| p.get("current").as_bool() == Some(true) && p.get("offline").as_bool() != Some(true));
            if !current {
                return Some(format!("{name} is not a current meta peer yet"));
            }
        }
        None
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        self.servers.clear();
        for store in &self.stores {
            let _ = std::fs::remove_dir_all(store);
        }
    }
}

/// Server `i`'s configuration file (tests/common/nats.rs writes the same).
fn config(cluster: &str, planned: &[Planned], i: usize) -> String {
    let p = &planned[i];
    let mut c = String::new();
    let _ = writeln!(c, "server_name: {:?}", p.name);
    let _ = writeln!(c, "listen: \"{}\"", p.client);
    let _ = writeln!(c, "http: \"{}\"", p.http);
    let _ = writeln!(c, "jetstream {{");
    let _ = writeln!(c, "  store_dir: {:?}", p.store.display().to_string());
    let _ = writeln!(c, "  max_memory_store: 256MB");
    let _ = writeln!(c, "  max_file_store: 0");
    let _ = writeln!(c, "}}");
    if planned.len() > 1 {
        let routes: Vec<String> = planned
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, q)| format!("\"nats-route://{}\"", q.route))
            .collect();
        let _ = writeln!(c, "cluster {{");
        let _ = writeln!(c, "  name: {cluster:?}");
        let _ = writeln!(c, "  listen: \"{}\"", p.route);
        let _ = writeln!(c, "  routes: [{}]", routes.join(", "));
        let _ = writeln!(c, "}}");
    }
    c
}

/// Starts `n` tinybroker replicas over `nats`, one after the other, each
/// SERVING before the next starts: replica `i` is `r<i>`, connected to
/// server `i % servers` first (every server listed), on ephemeral ports read
/// from its `tinybroker started` line, with a `TINYBROKER_NATS_PREFIX` of
/// its own for this run.
///
/// A replica takes its fan-out subscription (`<prefix>.m.>`) before it
/// serves, and pings every replica already live through their servers, so
/// once the last one serves, every server knows every replica's interest
/// (docs/cluster-notes.md, "What works").
pub async fn start_replicas(bins: &Binaries, tb: &TinybrokerEnv, nats: &NatsCluster, n: usize) -> Result<Vec<Server>> {
    let prefix = format!("bench{}x{}", std::process::id(), unique());
    let mut replicas = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("r{i}");
        let log = bins.log_dir.join(format!("{prefix}-{id}.log"));
        let mut cmd = tinybroker_command(bins, tb);
        cmd.env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
            .env("TINYBROKER_LOG_FORMAT", "text")
            // Its start-up and SERVING lines are info; nothing per message is.
            .env("RUST_LOG", "warn,tinybroker=info")
            .env("TINYBROKER_NATS_URL", nats.urls_from(i % nats.servers.len()))
            .env("TINYBROKER_NATS_PREFIX", &prefix)
            .env("TINYBROKER_REPLICA_ID", &id);
        // Fewer NATS servers than JetStream's default R3 (the guard's single
        // server): as many copies as there are servers.
        if nats.servers.len() < 3 {
            cmd.env("TINYBROKER_NATS_REPLICAS", nats.servers.len().to_string());
        }
        let child = spawn_logged(Kind::Tinybroker, &mut cmd, &log)?;
        // Held at once, so that it is killed on every way out of here; its
        // addresses are filled in from its start-up line.
        let mut replica = Server::adopt(Kind::Tinybroker, ([127, 0, 0, 1], 0).into(), None, child, log);
        let deadline = Instant::now() + REPLICA_START;
        let started = loop {
            let text = std::fs::read_to_string(replica.log()).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.contains("tinybroker started")) {
                break line.to_owned();
            }
            if let Some(status) = replica.exited()? {
                bail!(
                    "replica {id} exited during start-up with {status}:\n{}",
                    tail_of(replica.log())
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "replica {id} did not log `tinybroker started` within {REPLICA_START:?}:\n{}",
                    tail_of(replica.log())
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let addr = |field: &str| -> Result<SocketAddr> {
            log_field(&started, field)
                .and_then(|v| v.parse().ok())
                .with_context(|| format!("no {field} in replica {id}'s start-up line: {started}"))
        };
        replica.addr = addr("grpc_addr")?;
        replica.http = Some(addr("metrics_addr")?);
        // `/readyz` is 200 once the gRPC health status is SERVING, which
        // cluster mode sets after "cluster mode: connected to NATS; SERVING".
        replica
            .wait_ready()
            .await
            .with_context(|| format!("replica {id} (NATS {})", nats.urls_from(i % nats.servers.len())))?;
        let text = std::fs::read_to_string(replica.log()).unwrap_or_default();
        if !text.contains("cluster mode: connected to NATS; SERVING") {
            bail!(
                "replica {id} is ready but never logged that it serves in cluster mode:\n{}",
                tail_of(replica.log())
            );
        }
        replicas.push(replica);
    }
    Ok(replicas)
}

/// The value of `name=value` in a text log line.
fn log_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=");
    let at = line.split_whitespace().find(|w| w.starts_with(&key))?;
    Some(at[key.len()..].trim_matches('"'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_up_line_fields() {
        let line = "2026-12-01T10:00:00.1Z  INFO tinybroker::server: tinybroker started version=\"0.1.0\" grpc_addr=127.0.0.1:40001 metrics_addr=127.0.0.1:40002 consumer_capacity=4096";
        assert_eq!(log_field(line, "grpc_addr"), Some("127.0.0.1:40001"));
        assert_eq!(log_field(line, "metrics_addr"), Some("127.0.0.1:40002"));
        assert_eq!(log_field(line, "version"), Some("0.1.0"));
        assert_eq!(log_field(line, "nope"), None);
    }

    #[test]
    fn config_names_every_other_route() {
        let p = |i: u16| Planned {
            name: format!("n{i}-x"),
            client: ([127, 0, 0, 1], 4000 + i).into(),
            route: ([127, 0, 0, 1], 5000 + i).into(),
            http: ([127, 0, 0, 1], 6000 + i).into(),
            store: PathBuf::from(format!("/tmp/s{i}")),
            config: PathBuf::from("/dev/null"),
            log: PathBuf::from("/dev/null"),
        };
        let planned = [p(0), p(1), p(2)];
        let c = config("x", &planned, 1);
        assert!(c.contains("server_name: \"n1-x\""), "{c}");
        assert!(c.contains("listen: \"127.0.0.1:4001\""), "{c}");
        assert!(
            c.contains("max_memory_store: 256MB") && c.contains("max_file_store: 0"),
            "{c}"
        );
        assert!(
            c.contains("routes: [\"nats-route://127.0.0.1:5000\", \"nats-route://127.0.0.1:5002\"]"),
            "{c}"
        );
    }
}
