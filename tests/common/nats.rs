//! A real NATS cluster for the cluster-mode tests: `n` nats-server (>= 2.10)
//! processes on 127.0.0.1, each with its own client, route and monitoring
//! port, routes to every peer, and JetStream with memory storage only.
//!
//! The server binary is `TB_NATS_SERVER`, else a nats-server >= 2.10 on
//! PATH, else the one `scripts/install-nats.sh` installs. With none, a test
//! fails naming the script (a test that cannot run says so; it does not
//! pass).
//!
//! Each server has a directory under one temporary directory: its config
//! file, its JetStream `store_dir` (the meta layer's state lives there even
//! with memory streams) and its log (stdout and stderr, appended across
//! restarts). A test that panics prints the tail of every log and keeps the
//! directory; the processes are SIGKILLed either way ([`ChildGuard`]).

use super::process::{ChildGuard, free_port};
use super::proxy::{Mode, RouteProxies};
use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The oldest nats-server the cluster mode supports (multi-subject consumer
/// filters).
pub const MIN_VERSION: (u64, u64) = (2, 10);

/// Where `scripts/install-nats.sh` puts the server.
pub const INSTALLED: &str = "/usr/local/lib/tinybroker/nats-server-2.10/nats-server";

/// How long [`NatsCluster::restart`] waits for the cluster to be whole
/// again.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a restarted server may take to be current again: it catches up
/// on the meta log and every stream from the others, which took over 20 s
/// once while the rest of the test suite ran beside it.
pub const REJOIN_TIMEOUT: Duration = Duration::from_secs(45);
/// How long a server of a cluster restarted whole may stay behind the meta
/// leader before it is restarted, and how many times.
pub const STUCK_PEER: Duration = Duration::from_secs(15);
pub const STUCK_RESTARTS: usize = 2;

/// How long one attempt of [`NatsCluster::start`] waits (a cold start takes
/// 0.1 to 0.8 s here) before it starts over on new ports, at most
/// [`START_ATTEMPTS`] times: 2.10.27 servers started together now and then
/// form a JetStream meta group of 2 peers that the third never joins (every
/// /healthz says OK; /jsz says cluster_size 2), or a port was taken.
pub const START_TIMEOUT: Duration = Duration::from_secs(5);
pub const START_ATTEMPTS: usize = 4;

/// Lines of each server's log printed when a test fails.
const LOG_TAIL: usize = 40;

pub struct NatsCluster {
    binary: PathBuf,
    dir: PathBuf,
    name: String,
    servers: Vec<Server>,
    /// With [`NatsCluster::start_routed`]: every route goes through these.
    routes: Option<RouteProxies>,
}

struct Server {
    name: String,
    client_port: u16,
    route_port: u16,
    http_port: u16,
    dir: PathBuf,
    config: PathBuf,
    log: PathBuf,
    process: Option<ChildGuard>,
}

impl NatsCluster {
    /// The nats-server binary to use; panics when there is none, or when
    /// `TB_NATS_SERVER` names a binary that does not run or is older than
    /// 2.10.
    pub fn binary() -> PathBuf {
        if let Some(path) = std::env::var_os("TB_NATS_SERVER").filter(|p| !p.is_empty()) {
            let path = PathBuf::from(path);
            match version(&path) {
                Some(v) if v >= MIN_VERSION => return path,
                Some((major, minor)) => {
                    panic!(
                        "TB_NATS_SERVER={} is nats-server {major}.{minor}, older than 2.10",
                        path.display()
                    )
                }
                None => panic!("TB_NATS_SERVER={}: `--version` does not run", path.display()),
            }
        }
        let on_path = std::env::var_os("PATH")
            .map(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("nats-server"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let found = on_path
            .into_iter()
            .chain([PathBuf::from(INSTALLED)])
            .find(|p| version(p).is_some_and(|v| v >= MIN_VERSION));
        found.unwrap_or_else(|| {
            panic!(
                "this test needs nats-server >= 2.10, which was not found (TB_NATS_SERVER, PATH, {INSTALLED}): \
                 run `bash scripts/install-nats.sh` (or .ci/run, which installs every tool the tests need)"
            )
        })
    }

    /// Starts `n` servers and waits until every one answers /healthz, has
    /// routes to all the others and agrees on one JetStream meta leader
    /// whose peers are all current. Panics without a nats-server (see
    /// [`NatsCluster::binary`]).
    pub async fn start(n: usize) -> NatsCluster {
        Self::start_with(n, false).await
    }

    /// As [`NatsCluster::start`], with every route between the servers
    /// through a proxy of the test's ([`RouteProxies`]), so that a test can
    /// cut one server off from the rest ([`NatsCluster::isolate`]).
    pub async fn start_routed(n: usize) -> NatsCluster {
        assert!(n >= 2, "routes between at least two servers");
        Self::start_with(n, true).await
    }

    async fn start_with(n: usize, routed: bool) -> NatsCluster {
        assert!(n >= 1, "a cluster of at least one server");
        let binary = Self::binary();
        let name = format!("tbtest-{}-{}", std::process::id(), unique());
        let dir = std::env::temp_dir().join(&name);
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the cluster's directory");
            let servers: Vec<Server> = (0..n).map(|i| Server::new(&dir, &name, i)).collect();
            let routes = match routed {
                true => {
                    let upstreams: Vec<_> = servers
                        .iter()
                        .map(|s| std::net::SocketAddr::from(([127, 0, 0, 1], s.route_port)))
                        .collect();
                    Some(RouteProxies::start(&upstreams).await)
                }
                false => None,
            };
            let mut cluster = NatsCluster {
                binary: binary.clone(),
                dir: dir.clone(),
                name: name.clone(),
                servers,
                routes,
            };
            for i in 0..n {
                cluster.write_config(i);
            }
            for i in 0..n {
                cluster.spawn(i);
            }
            match cluster.wait_ready(START_TIMEOUT).await {
                Ok(()) => {
                    eprintln!(
                        "nats: a cluster of {n} ({}) ready in {:?}",
                        cluster.name,
                        started.elapsed()
                    );
                    return cluster;
                }
                Err(why) if attempt < START_ATTEMPTS => {
                    eprintln!("nats: cluster start, attempt {attempt}: {why}; again on new ports");
                    cluster.kill_all();
                }
                Err(why) => panic!("the nats cluster did not come up in {START_ATTEMPTS} attempts: {why}"),
            }
        }
    }

    /// The number of servers (running or not).
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// The client URL of every server, `nats://127.0.0.1:PORT`.
    pub fn urls(&self) -> Vec<String> {
        (0..self.len()).map(|i| self.url(i)).collect()
    }

    /// The client URL of server `i`.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.servers[i].client_port)
    }

    /// The name (`server_name`) of server `i`: `n0-<pid>-<k>`, `n1-...`, ...
    pub fn name(&self, i: usize) -> &str {
        &self.servers[i].name
    }

    /// The index of the server named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.servers.iter().position(|s| s.name == name)
    }

    /// The monitoring address of server `i` (`/varz`, `/jsz`, `/healthz`).
    pub fn monitor_addr(&self, i: usize) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.servers[i].http_port).into()
    }

    /// GET `path` from server `i`'s monitoring port, parsed as JSON; None
    /// when the server does not answer or the body is not JSON.
    pub async fn monitor(&self, i: usize, path: &str) -> Option<serde_json::Value> {
        let (_, body) = try_http_get(self.monitor_addr(i), path).await?;
        serde_json::from_str(&body).ok()
    }

    /// Cuts server `i` off from the other servers (after
    /// [`NatsCluster::start_routed`]): every route to and from it is
    /// blackholed or reset until [`NatsCluster::heal`]. Its clients stay
    /// connected to it.
    pub async fn isolate(&self, i: usize, how: Mode) {
        let routes = self.routes.as_ref().expect("a cluster started with start_routed");
        let varz = self.monitor(i, "/varz").await.expect("the server's /varz");
        let id = varz["server_id"].as_str().expect("/varz names the server_id");
        routes.isolate(i, id, how);
    }

    /// Ends [`NatsCluster::isolate`]'s cut.
    pub fn heal(&self) {
        self.routes
            .as_ref()
            .expect("a cluster started with start_routed")
            .heal();
    }

    /// The log of server `i` so far.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.servers[i].log).unwrap_or_default()
    }

    /// True while server `i`'s process is running (started, and neither
    /// killed, stopped nor exited).
    pub fn is_running(&mut self, i: usize) -> bool {
        self.servers[i].process.is_some() && !self.servers[i].died()
    }

    /// SIGKILLs server `i` and reaps it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut process) = self.servers[i].process.take() {
            process.kill();
        }
    }

    /// SIGTERMs server `i` and waits (up to 10 s) for it to exit.
    pub async fn stop(&mut self, i: usize) {
        if let Some(mut process) = self.servers[i].process.take() {
            process.signal("TERM");
            super::process::exit_status(&mut process, Duration::from_secs(10)).await;
        }
    }

    /// Starts server `i` again (after [`NatsCluster::kill`] or
    /// [`NatsCluster::stop`]) with the same ports, config and store
    /// directory, and waits until the running servers are a whole cluster
    /// again: server `i` healthy (its JetStream assets current), routes
    /// between all running servers, one meta leader with every running
    /// peer current.
    pub async fn restart(&mut self, i: usize) {
        assert!(self.servers[i].process.is_none(), "server {i} is still running");
        self.spawn(i);
        if let Err(why) = self.wait_ready(REJOIN_TIMEOUT).await {
            panic!("server {i} did not rejoin within {REJOIN_TIMEOUT:?}: {why}");
        }
    }

    /// Stops every server, then starts them all again together (a cluster
    /// cannot form a meta leader while most of it is down) and waits until
    /// they are a whole cluster: memory-stored messages are gone, while the
    /// meta layer (in each server's store directory) keeps the definitions
    /// of streams and consumers.
    pub async fn restart_all(&mut self) {
        for i in 0..self.len() {
            self.stop(i).await;
        }
        for i in 0..self.len() {
            self.spawn(i);
        }
        if let Err(why) = self.wait_whole_again().await {
            panic!("the restarted cluster was not whole within {REJOIN_TIMEOUT:?}: {why}");
        }
    }

    /// SIGKILLs every server, then starts them all again together on the
    /// same ports, configs and store directories (as
    /// [`NatsCluster::restart_all`], without letting any server stop
    /// cleanly), and waits until they are a whole cluster.
    pub async fn kill_and_restart_all(&mut self) {
        self.kill_all();
        for i in 0..self.len() {
            self.spawn(i);
        }
        if let Err(why) = self.wait_whole_again().await {
            panic!("the cluster killed and restarted was not whole within {REJOIN_TIMEOUT:?}: {why}");
        }
    }

    /// [`NatsCluster::wait_ready`] after every server was started again
    /// together, restarting a server that stays behind the meta leader for
    /// [`STUCK_PEER`] (at most [`STUCK_RESTARTS`] times), as a Kubernetes
    /// liveness probe would restart its pod. NATS 2.10 now and then leaves one
    /// peer of a cluster restarted whole at `active: 0` with a fixed lag, its
    /// /healthz OK, for good (seen in CI: still so after 45 s), and only a
    /// restart brings it back.
    async fn wait_whole_again(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + REJOIN_TIMEOUT;
        let mut restarts = 0;
        let mut behind_since: Option<(usize, Instant)> = None;
        loop {
            let why = match self.not_ready().await {
                None => return Ok(()),
                Some(why) => why,
            };
            let behind = self.behind_meta_leader(&why);
            behind_since = match (behind, behind_since) {
                (Some(i), Some((j, since))) if i == j => Some((j, since)),
                (Some(i), _) => Some((i, Instant::now())),
                (None, _) => None,
            };
            if let Some((i, since)) = behind_since
                && since.elapsed() >= STUCK_PEER
                && restarts < STUCK_RESTARTS
            {
                eprintln!(
                    "nats: {} stayed behind the meta leader for {STUCK_PEER:?}; restarting it ({why})",
                    self.name(i)
                );
                self.kill(i);
                self.spawn(i);
                restarts += 1;
                behind_since = None;
            }
            if Instant::now() >= deadline || self.servers.iter_mut().any(|s| s.died()) {
                return Err(why);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Which server a [`NatsCluster::not_ready`] answer says is not a
    /// current meta peer, if that is what it says.
    fn behind_meta_leader(&self, why: &str) -> Option<usize> {
        let (name, _) = why.split_once(" is not a current meta peer")?;
        self.index_of(name)
    }

    /// Waits until every running server is healthy, routed to every other
    /// running server and agrees on a meta leader whose running peers are
    /// all current; Err says what was still missing at the deadline.
    pub async fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            let why = match self.not_ready().await {
                None => return Ok(()),
                Some(why) => why,
            };
            if Instant::now() >= deadline || self.servers.iter_mut().any(|s| s.died()) {
                return Err(why);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What is not ready yet (None: all of it is).
    async fn not_ready(&mut self) -> Option<String> {
        for server in &mut self.servers {
            if server.died() {
                return Some(format!("{} exited", server.name));
            }
        }
        let running: Vec<usize> = (0..self.len()).filter(|&i| self.servers[i].process.is_some()).collect();
        let mut leaders = Vec::new();
        for &i in &running {
            let name = self.name(i).to_owned();
            match try_http_get(self.monitor_addr(i), "/healthz").await {
                Some((200, _)) => {}
                Some((status, body)) => return Some(format!("{name} /healthz: {status} {}", body.trim())),
                None => return Some(format!("{name}: no answer on its monitoring port")),
            }
            if running.len() > 1 {
                let Some(routez) = self.monitor(i, "/routez").await else {
                    return Some(format!("{name}: no /routez"));
                };
                let mut peers: Vec<&str> = routez["routes"]
                    .as_array()
                    .map(|r| r.iter().filter_map(|r| r["remote_name"].as_str()).collect())
                    .unwrap_or_default();
                peers.sort_unstable();
                peers.dedup();
                if peers.len() != running.len() - 1 {
                    return Some(format!("{name} has routes to {peers:?}"));
                }
                let Some(jsz) = self.monitor(i, "/jsz").await else {
                    return Some(format!("{name}: no /jsz"));
                };
                match jsz["meta_cluster"]["leader"].as_str() {
                    Some(leader) if !leader.is_empty() => leaders.push(leader.to_owned()),
                    _ => return Some(format!("{name}: no meta leader yet")),
                }
            }
        }
        if let Some(leader) = leaders.first() {
            if leaders.iter().any(|l| l != leader) {
                return Some(format!("the servers disagree on the meta leader: {leaders:?}"));
            }
            let Some(l) = self.index_of(leader).filter(|l| running.contains(l)) else {
                return Some(format!("meta leader {leader} is not one of the running servers"));
            };
            let Some(jsz) = self.monitor(l, "/jsz").await else {
                return Some(format!("{leader}: no /jsz"));
            };
            let meta = &jsz["meta_cluster"];
            if meta["cluster_size"].as_u64() != Some(self.len() as u64) {
                return Some(format!(
                    "meta cluster size {} (want {}): {meta}",
                    meta["cluster_size"],
                    self.len()
                ));
            }
            for &i in &running {
                if i == l {
                    continue;
                }
                let current = meta["replicas"]
                    .as_array()
                    .and_then(|r| r.iter().find(|p| p["name"] == self.name(i)))
                    .is_some_and(|p| p["current"] == true && p["offline"] != true);
                if !current {
                    return Some(format!(
                        "{} is not a current meta peer: {}",
                        self.name(i),
                        meta["replicas"]
                    ));
                }
            }
        }
        None
    }

    fn write_config(&self, i: usize) {
        let server = &self.servers[i];
        let store = server.dir.join("store");
        let mut config = String::new();
        writeln!(config, "server_name: {:?}", server.name).unwrap();
        writeln!(config, "listen: \"127.0.0.1:{}\"", server.client_port).unwrap();
        writeln!(config, "http: \"127.0.0.1:{}\"", server.http_port).unwrap();
        writeln!(config, "jetstream {{").unwrap();
        writeln!(config, "  store_dir: {:?}", store.display().to_string()).unwrap();
        writeln!(config, "  max_memory_store: 256MB").unwrap();
        writeln!(config, "  max_file_store: 0").unwrap();
        writeln!(config, "}}").unwrap();
        if self.len() > 1 {
            // Through the proxies, when there are: each server's peers reach
            // it at its proxy, which it also advertises (the routes it
            // learns of go there too).
            let route_addr = |j: usize| match &self.routes {
                Some(proxies) => proxies.addr(j).to_string(),
                None => format!("127.0.0.1:{}", self.servers[j].route_port),
            };
            let routes: Vec<String> = (0..self.len())
                .filter(|&j| j != i)
                .map(|j| format!("\"nats-route://{}\"", route_addr(j)))
                .collect();
            writeln!(config, "cluster {{").unwrap();
            writeln!(config, "  name: {:?}", self.name).unwrap();
            writeln!(config, "  listen: \"127.0.0.1:{}\"", server.route_port).unwrap();
            if self.routes.is_some() {
                writeln!(config, "  advertise: \"{}\"", route_addr(i)).unwrap();
            }
            writeln!(config, "  routes: [{}]", routes.join(", ")).unwrap();
            writeln!(config, "}}").unwrap();
        }
        std::fs::write(&server.config, config).expect("write the server's config");
    }

    fn spawn(&mut self, i: usize) {
        let server = &mut self.servers[i];
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&server.log)
            .expect("open the server's log");
        let child = Command::new(&self.binary)
            .arg("-c")
            .arg(&server.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary.display()));
        server.process = Some(ChildGuard::new(child));
    }

    fn kill_all(&mut self) {
        for i in 0..self.len() {
            self.kill(i);
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        self.kill_all();
        if std::thread::panicking() {
            for server in &self.servers {
                let log = std::fs::read_to_string(&server.log).unwrap_or_default();
                eprintln!(
                    "---- the end of nats-server {}'s log ({}), repeated lines collapsed ----\n{}",
                    server.name,
                    server.log.display(),
                    tail(&log, LOG_TAIL).join("\n")
                );
            }
            eprintln!("---- nats cluster files kept in {} ----", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Server {
    fn new(dir: &Path, cluster: &str, i: usize) -> Self {
        let own = dir.join(format!("n{i}"));
        // Unique in the machine: a JetStream peer id is a hash of the
        // server name, and several clusters run at once.
        let name = format!("n{i}-{}", cluster.trim_start_matches("tbtest-"));
        std::fs::create_dir_all(&own).expect("create the server's directory");
        Server {
            client_port: free_port(),
            route_port: free_port(),
            http_port: free_port(),
            config: own.join("nats-server.conf"),
            log: own.join("nats-server.log"),
            dir: own,
            name,
            process: None,
        }
    }

    /// True if the process is held (started and not killed or stopped on
    /// purpose) but has exited.
    fn died(&mut self) -> bool {
        match &mut self.process {
            Some(guard) => guard.child.try_wait().ok().flatten().is_some(),
            None => false,
        }
    }
}

/// The last `n` lines of a nats-server log, each run of lines that differ
/// only in their `[pid] date time` prefix (the /healthz polls' warnings)
/// shown once with its count.
fn tail(log: &str, n: usize) -> Vec<String> {
    let mut runs: Vec<(&str, &str, usize)> = Vec::new();
    for line in log.lines() {
        let text = line.splitn(4, ' ').nth(3).unwrap_or(line);
        match runs.last_mut() {
            Some((_, last, count)) if *last == text => *count += 1,
            _ => runs.push((line, text, 1)),
        }
    }
    runs[runs.len().saturating_sub(n)..]
        .iter()
        .map(|&(line, _, count)| match count {
            1 => line.to_owned(),
            _ => format!("{line} (and {} times more)", count - 1),
        })
        .collect()
}

/// (major, minor) of `nats-server --version` ("nats-server: v2.10.27").
fn version(binary: &Path) -> Option<(u64, u64)> {
    let output = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let v = text.trim().rsplit(' ').next()?.strip_prefix('v')?;
    let mut parts = v.split('.').map(|p| p.parse::<u64>().ok());
    Some((parts.next()??, parts.next()??))
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// GET `path` with a 2 s limit; None when nothing answers. HTTP/1.0, so
/// that the body is never chunked.
async fn try_http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        let response = String::from_utf8_lossy(&response).into_owned();
        let status = response.split(' ').nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n")?.1.to_owned();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(2), exchange).await.ok()?
}
