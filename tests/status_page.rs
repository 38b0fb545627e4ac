//! The status page on the metrics port: `/status` and `/status.json` over
//! HTTP, then the page itself in a real headless browser (Debian's
//! `chromium`, driven over the DevTools protocol on a pipe): it shows what
//! the broker holds, follows it as it changes without a reload, and asks for
//! the token once when the broker has one. A screenshot is written to
//! `target/test-artifacts/status-page.png`.
//!
//! Without chromium the browser tests fail, saying how to install it
//! (`.ci/run` does).

mod common;

use common::hung::busy_group_with_a_hung_member;
use common::process::ChildGuard;
use common::*;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tinybroker::config::{Config, Limits};
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tonic::transport::Channel;

const TOKEN: &str = "status-s3cret";

/// GET `path` with extra request headers: status, response head, body.
async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

async fn status_json(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let (status, head, body) = get(addr, path, headers).await;
    assert!(head.contains("content-type: application/json"), "{head}");
    (
        status,
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}")),
    )
}

/// `request` with the bearer token.
fn authed<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    request
}

/// What the tests look at on the page: broadcast subscriptions (two that
/// read, one that lags), a group with a backlog and a held message, and an
/// evicted subscriber.
struct Scene {
    /// Kept open: the lagging subscription and the group member.
    _reports: (BrokerClient<Channel>, tonic::Streaming<pb::Message>),
    _member: tonic::Streaming<pb::Message>,
    _client: BrokerClient<Channel>,
    admin: AdminClient<Channel>,
}

const AUDIT_ID: &str = "orders-audit";
/// A subscription id that would be markup if the page wrote it as HTML.
const MARKUP_ID: &str = "<i>not-markup</i>";
const GROUP: &str = "billing";
/// A subscription whose queue holds 10 of its 16.
const LAGGING_ID: &str = "reports-export";
/// The group's one member (max_in_flight 1, never acks): it holds its one
/// message unacked, so it is full and listed first.
const MEMBER_ID: &str = "invoices-worker";
const EVICTED_ID: &str = "slow-dashboard";

/// Sets the scene on a broker whose consumer capacity is small (16):
/// `orders-audit` and `<i>not-markup</i>` open, `reports-export` with 10
/// messages queued, group `billing` with `backlog` messages waiting and 1
/// in flight, and `slow-dashboard` evicted.
async fn set_scene(broker: &TestBroker, backlog: usize) -> Scene {
    let mut client = BrokerClient::new(broker.wide_channel().await);
    let mut admin = broker.admin().await;
    let (audit, _) = open(
        &mut client,
        pb::OpenSubscriptionRequest {
            subscription_id: AUDIT_ID.into(),
            ..subscribe_request(&["orders.>"])
        },
    )
    .await;
    let (markup, _) = open(
        &mut client,
        pb::OpenSubscriptionRequest {
            subscription_id: MARKUP_ID.into(),
            ..subscribe_request(&["orders.>"])
        },
    )
    .await;
    // Both read what they get (the page's rates come from their deliveries).
    for mut stream in [audit, markup] {
        tokio::spawn(async move { while let Ok(Some(_)) = stream.message().await {} });
    }
    let (member, _) = open(
        &mut client,
        pb::OpenSubscriptionRequest {
            subscription_id: MEMBER_ID.into(),
            ..member_request(&["invoices.>"], GROUP, true, 1)
        },
    )
    .await;
    publish_many(broker, "invoices.new", backlog + 1).await;
    wait_until("the group's backlog", || async {
        broker.group(GROUP).await.is_some_and(|g| g.backlog == backlog as u64)
    })
    .await;

    // A subscriber that reads nothing on a narrow connection: its queue
    // fills once the connection's window is full; it stops at 10 of 16.
    let mut lagging = BrokerClient::new(broker.narrow_channel().await);
    let (reports, _) = open(
        &mut lagging,
        pb::OpenSubscriptionRequest {
            subscription_id: LAGGING_ID.into(),
            ..subscribe_request(&["reports.>"])
        },
    )
    .await;
    let payload = "x".repeat(16 << 10);
    while listed(broker.subscriptions().await, LAGGING_ID).is_none_or(|s| s.queue_depth < 10) {
        client
            .publish(publish_request("reports.daily", &payload))
            .await
            .unwrap();
    }

    // Another one is evicted.
    let mut stalled = BrokerClient::new(broker.narrow_channel().await);
    let (_stalled_stream, _) = open(
        &mut stalled,
        pb::OpenSubscriptionRequest {
            subscription_id: EVICTED_ID.into(),
            ..subscribe_request(&["metrics.>"])
        },
    )
    .await;
    while !evictions(&mut admin)
        .await
        .iter()
        .any(|e| e.subscription_id == EVICTED_ID)
    {
        client.publish(publish_request("metrics.cpu", &payload)).await.unwrap();
    }
    Scene {
        _reports: (lagging, reports),
        _member: member,
        _client: client,
        admin,
    }
}

fn field<'a>(value: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(value, |v, key| {
        v.get(key).unwrap_or_else(|| panic!("no {path} ({key}) in {value:#}"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_and_status_json_over_http() {
    timeout(async {
        let broker = start_with_limits(Limits {
            consumer_capacity: 16,
            ..Limits::default()
        })
        .await;
        let _scene = set_scene(&broker, 29).await;
        let addr = broker.metrics_addr;

        // The page: HTML, self-contained, nothing loaded from elsewhere.
        let (status, head, page) = get(addr, "/status", &[]).await;
        assert_eq!(status, 200, "{head}");
        assert!(head.contains("content-type: text/html; charset=utf-8"), "{head}");
        assert!(head.contains("content-security-policy: default-src 'none'"), "{head}");
        assert!(page.starts_with("<!doctype html>"), "{page}");
        for external in ["http://", "https://", "//cdn", " src=", " href=", "<link", "@import"] {
            assert!(!page.contains(external), "the page holds {external:?}");
        }
        assert!(page.contains("status.json"), "the page reads status.json");

        let (status, s) = status_json(addr, "/status.json", &[]).await;
        assert_eq!(status, 200, "{s:#}");
        assert_eq!(field(&s, "version"), env!("CARGO_PKG_VERSION"));
        for number in [
            "generated_at",
            "started_at",
            "uptime_seconds",
            "totals.published",
            "totals.delivered",
        ] {
            assert!(field(&s, number).is_number(), "{number} in {s:#}");
        }
        if test_engine() == TestEngine::Memory {
            assert_eq!(field(&s, "cluster"), &Value::Null);
        } else {
            assert!(field(&s, "cluster.replica_id").is_string(), "{s:#}");
        }
        // The subscriptions, fullest first (the member holds its
        // max_in_flight unacked, the lagging queue 10 of 16): orders-audit
        // is there with every field the page shows.
        assert_eq!(
            field(&s, "subscription_count"),
            4,
            "three broadcast subscriptions and the member: {s:#}"
        );
        assert_eq!(
            s["subscriptions"][0]["subscription_id"], MEMBER_ID,
            "the fullest first: {s:#}"
        );
        assert_eq!(s["subscriptions"][0]["unacked"], 1, "{s:#}");
        assert!(s["subscriptions"][0]["oldest_unacked_age_seconds"].is_number(), "{s:#}");
        assert_eq!(
            s["subscriptions"][1]["subscription_id"], LAGGING_ID,
            "the fullest first: {s:#}"
        );
        let audit = s["subscriptions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["subscription_id"] == AUDIT_ID)
            .unwrap_or_else(|| panic!("{AUDIT_ID} in {s:#}"));
        assert_eq!(audit["topic_patterns"], json!(["orders.>"]));
        assert_eq!(audit["mode"], "multi");
        assert_eq!(audit["consumer_group"], "");
        assert_eq!(audit["capacity"], 16);
        for key in ["queue_depth", "delivered", "opened_at"] {
            assert!(audit[key].is_number(), "{key} in {audit:#}");
        }
        assert!(
            audit["peer"].as_str().is_some_and(|p| p.starts_with("127.0.0.1:")),
            "{audit:#}"
        );
        assert!(audit["replica_id"].is_string(), "{audit:#}");
        let group = &s["groups"][0];
        assert_eq!(group["name"], GROUP, "{s:#}");
        assert_eq!(group["topic_patterns"], json!(["invoices.>"]));
        assert_eq!(
            (&group["members"], &group["backlog"], &group["in_flight"]),
            (&json!(1), &json!(29), &json!(1))
        );
        // The cluster engine's listing has no oldest unacked age (yet).
        if test_engine() == TestEngine::Memory {
            assert!(
                group["oldest_unacked_age_seconds"].as_f64().is_some_and(|a| a >= 0.0),
                "{group:#}"
            );
        }
        assert_eq!(
            (&group["redeliveries"], &group["dead_lettered"]),
            (&json!(0), &json!(0))
        );
        let eviction = &s["evictions"][0];
        assert_eq!(eviction["subscription_id"], EVICTED_ID, "{s:#}");
        assert_eq!(eviction["topic_patterns"], json!(["metrics.>"]));
        for key in ["evicted_at", "queue_depth", "last_delivered_sequence"] {
            assert!(eviction[key].is_number(), "{key} in {eviction:#}");
        }
        // The totals are the metrics' (summed over the delivery modes).
        let metrics = scrape(addr).await;
        let (_, s) = status_json(addr, "/status.json", &[]).await;
        assert_eq!(
            field(&s, "totals.published").as_f64().unwrap(),
            common::process::metric_sum(&metrics, "tinybroker_messages_published_total")
        );
        assert_eq!(
            field(&s, "totals.delivered").as_f64().unwrap(),
            common::process::metric_sum(&metrics, "tinybroker_messages_delivered_total")
        );

        // ?limit= cuts each list; a bad one is refused, naming it.
        let (status, s) = status_json(addr, "/status.json?limit=1", &[]).await;
        assert_eq!(status, 200);
        assert_eq!(s["subscriptions"].as_array().unwrap().len(), 1);
        assert_eq!(field(&s, "subscription_count"), 4);
        let (status, s) = status_json(addr, "/status.json?limit=lots", &[]).await;
        assert_eq!(status, 400);
        assert!(field(&s, "error").as_str().unwrap().contains("\"lots\""), "{s}");
    })
    .await;
}

/// Issue 42: a busy manual-ack group whose members all hold their
/// max_in_flight, one of them never acking. `members[]` lists them oldest
/// unacked first: the hung one first, `looks_hung` (what the page marks
/// HUNG?), the acking ones not; its row among the subscriptions says so
/// too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_lists_a_busy_groups_hung_member_first_and_marks_it() {
    timeout(async {
        let broker = start().await;
        let scene = busy_group_with_a_hung_member(&broker, "busy").await;
        let addr = broker.metrics_addr;
        let mut last = Value::Null;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let (status, s) = status_json(addr, "/status.json", &[]).await;
            assert_eq!(status, 200, "{s:#}");
            let first = &s["members"][0];
            let done = first["subscription_id"] == scene.hung.as_str() && first["looks_hung"] == true;
            last = s;
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let members = last["members"].as_array().unwrap_or_else(|| panic!("{last:#}"));
        assert_eq!(members[0]["subscription_id"], scene.hung.as_str(), "{last:#}");
        assert_eq!(members[0]["looks_hung"], true, "{last:#}");
        assert_eq!(field(&last, "member_count"), 3, "{last:#}");
        assert_eq!(members.len(), 3, "{last:#}");
        for member in members {
            assert_eq!(member["consumer_group"], "busy", "{member:#}");
            assert_eq!(member["unacked"], u64::from(common::hung::MAX_IN_FLIGHT), "{last:#}");
            assert!(member["oldest_unacked_age_seconds"].is_number(), "{member:#}");
        }
        for id in &scene.healthy {
            let row = members.iter().find(|m| m["subscription_id"] == id.as_str());
            assert_eq!(row.map(|m| &m["looks_hung"]), Some(&json!(false)), "{id}: {last:#}");
        }
        let hung_row = last["subscriptions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["subscription_id"] == scene.hung.as_str())
            .unwrap_or_else(|| panic!("{last:#}"));
        assert_eq!(hung_row["looks_hung"], true, "{hung_row:#}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_status_json_needs_it_and_the_page_does_not() {
    timeout(async {
        let broker = start_with(Config {
            auth_token: Some(TOKEN.into()),
            ..config()
        })
        .await;
        let addr = broker.metrics_addr;
        let (status, s) = status_json(addr, "/status.json", &[]).await;
        assert_eq!(status, 401, "{s}");
        assert!(
            field(&s, "error").as_str().unwrap().contains("Authorization: Bearer"),
            "{s}"
        );
        for wrong in [
            "Bearer status-s3cre",
            "Bearer status-s3cret2",
            "Basic status-s3cret",
            TOKEN,
        ] {
            let (status, head, _) = get(addr, "/status.json", &[("Authorization", wrong)]).await;
            assert_eq!(status, 401, "{wrong}");
            assert!(head.contains("www-authenticate: bearer"), "{head}");
        }
        let bearer = format!("Bearer {TOKEN}");
        let (status, s) = status_json(addr, "/status.json", &[("Authorization", &bearer)]).await;
        assert_eq!(status, 200, "{s}");
        assert_eq!(field(&s, "subscription_count"), 0);
        let (status, _, page) = get(addr, "/status", &[]).await;
        assert_eq!(status, 200);
        assert!(page.contains("token-form"));
    })
    .await;
}

// === the page in a real browser ===

/// The chromium to run (`TB_CHROMIUM`, else `chromium` on the PATH);
/// panics when it does not run ([`require_tool`]).
#[track_caller]
fn chromium() -> PathBuf {
    let binary = PathBuf::from(std::env::var("TB_CHROMIUM").unwrap_or_else(|_| "chromium".into()));
    require_tool(
        "chromium (the status page's browser tests)",
        "apt-get install chromium, or TB_CHROMIUM=/path/to/chromium",
        std::process::Command::new(&binary).arg("--version"),
    );
    binary
}

/// Where the tests keep what they produce for people to look at.
fn artifacts() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A headless chromium driven over the DevTools protocol on a pipe
/// (`--remote-debugging-pipe`: commands in on fd 3, answers and events out
/// on fd 4, each a JSON text ending in a NUL byte), with one page.
struct Browser {
    to_browser: tokio::net::unix::pipe::Sender,
    from_browser: tokio::io::BufReader<tokio::net::unix::pipe::Receiver>,
    next_id: u64,
    /// The page's session (flat mode: its commands carry its sessionId).
    session: String,
    profile: PathBuf,
    /// Killed and reaped on drop.
    child: ChildGuard,
}

impl Browser {
    async fn launch(binary: &std::path::Path) -> Self {
        use std::os::fd::{AsRawFd, OwnedFd};
        use std::os::unix::process::CommandExt;
        // A profile of its own: a second chromium on the same profile hands
        // its work to the first and exits.
        static BROWSERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = BROWSERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let profile = artifacts().join(format!("chromium-profile-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&profile).unwrap();
        let log = profile.join("stderr.log");
        let (browser_reads, we_write) = std::io::pipe().unwrap();
        let (we_read, browser_writes) = std::io::pipe().unwrap();
        let (r, w) = (browser_reads.as_raw_fd(), browser_writes.as_raw_fd());
        let mut command = std::process::Command::new(binary);
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        // SAFETY: between fork and exec only async-signal-safe calls (fcntl,
        // dup2, close) on descriptors this process owns. The pipe's ends go
        // first above 10, so that placing them on 3 and 4 cannot overwrite
        // one with the other.
        unsafe {
            command.pre_exec(move || {
                let high_r = libc::fcntl(r, libc::F_DUPFD, 10);
                let high_w = libc::fcntl(w, libc::F_DUPFD, 10);
                if high_r < 0 || high_w < 0 || libc::dup2(high_r, 3) < 0 || libc::dup2(high_w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(high_r);
                libc::close(high_w);
                Ok(())
            });
        }
        let child = ChildGuard::new(command.spawn().expect("spawn chromium"));
        drop((browser_reads, browser_writes));
        let mut browser = Self {
            to_browser: tokio::net::unix::pipe::Sender::from_owned_fd(OwnedFd::from(we_write)).unwrap(),
            from_browser: tokio::io::BufReader::new(
                tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(we_read)).unwrap(),
            ),
            next_id: 0,
            session: String::new(),
            profile,
            child,
        };
        browser.new_page().await;
        browser
    }

    /// Opens a new tab (with a sessionStorage of its own) and drives it from
    /// now on.
    async fn new_page(&mut self) {
        self.session.clear();
        let target = self.call("Target.createTarget", json!({ "url": "about:blank" })).await;
        let attached = self
            .call(
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await;
        self.session = attached["sessionId"].as_str().unwrap().to_owned();
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await;
    }

    /// Sends one command (to the page once there is one) and waits for its
    /// answer, skipping events; panics with the browser's error.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if !self.session.is_empty() {
            message["sessionId"] = json!(self.session);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to_browser.write_all(&bytes).await.expect("write to chromium");
        loop {
            let mut reply = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(30), self.from_browser.read_until(0, &mut reply))
                .await
                .unwrap_or_else(|_| panic!("chromium did not answer {method} within 30 s"))
                .expect("read from chromium");
            if read == 0 {
                let log = std::fs::read_to_string(self.profile.join("stderr.log")).unwrap_or_default();
                panic!("chromium exited (after {method}); its stderr:\n{log}");
            }
            reply.pop();
            let reply: Value = serde_json::from_slice(&reply).unwrap();
            if reply["id"] == id {
                if let Some(error) = reply.get("error") {
                    panic!("{method}: {error}");
                }
                return reply["result"].clone();
            }
        }
    }

    async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({ "url": url })).await;
    }

    /// The value of a JavaScript expression in the page.
    async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("{expression}: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// What the page shows now ([`VIEW`]).
    async fn view(&mut self) -> Value {
        let text = self.eval(VIEW).await;
        serde_json::from_str(text.as_str().unwrap_or("null")).unwrap_or(Value::Null)
    }

    /// Reads the page every 100 ms until `check` holds; returns how long it
    /// took and the last view. Panics, with the view, after `limit`.
    async fn wait_for(&mut self, what: &str, limit: Duration, check: impl Fn(&Value) -> bool) -> (Duration, Value) {
        let start = Instant::now();
        loop {
            let view = self.view().await;
            if check(&view) {
                return (start.elapsed(), view);
            }
            assert!(
                start.elapsed() < limit,
                "the page did not show {what} within {limit:?}; it shows {view:#}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the whole page.
    async fn screenshot(&mut self, path: &std::path::Path) {
        use base64::Engine as _;
        // As tall as what the page shows.
        let height = self
            .eval("Math.ceil(document.body.getBoundingClientRect().bottom) + 24")
            .await
            .as_u64()
            .unwrap_or(900);
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": 1280, "height": height.max(300), "deviceScaleFactor": 1, "mobile": false }),
        )
        .await;
        let shot = self.call("Page.captureScreenshot", json!({ "format": "png" })).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.child.kill();
        // Its helper processes may still be writing there for a moment.
        for _ in 0..20 {
            if std::fs::remove_dir_all(&self.profile).is_ok() || !self.profile.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// What a person sees on the page, as JSON: whether the token form and the
/// data are shown, the status line, the rows' visible text, and a marker
/// the test sets to tell that the page was not reloaded.
const VIEW: &str = r#"JSON.stringify((() => {
  if (!document.getElementById("state")) return null; // not loaded yet
  const text = (root, selector) => [...root.querySelectorAll(selector)].map((e) => e.textContent);
  const rows = (table) => [...document.querySelectorAll(`#${table} tbody tr`)];
  return {
    form: !document.getElementById("token-form").hidden,
    token_error: document.getElementById("token-error").textContent,
    data: !document.getElementById("data").hidden,
    state: document.getElementById("state").textContent,
    broker: document.getElementById("broker").textContent,
    visible: document.body.innerText,
    subscriptions: rows("subscriptions").flatMap((r) => text(r, "td.id")),
    markup_in_rows: document.querySelectorAll("td.id *, td.patterns *").length,
    backlog: Object.fromEntries(rows("groups").filter((r) => r.querySelector("td.name"))
      .map((r) => [r.querySelector("td.name").textContent, r.querySelector("td.backlog").textContent])),
    unacked: Object.fromEntries(rows("subscriptions").filter((r) => r.querySelector("td.id"))
      .map((r) => [r.querySelector("td.id").textContent, r.querySelector("td.unacked").textContent])),
    evictions: rows("evictions").flatMap((r) => text(r, "td.id")),
    published_rate: document.getElementById("published-rate").textContent,
    delivered_rate: document.getElementById("delivered-rate").textContent,
    hash: location.hash,
    marker: window.tbMarker || null,
  };
})())"#;

fn shows(view: &Value, key: &str, value: &str) -> bool {
    view[key].as_array().is_some_and(|a| a.iter().any(|v| v == value))
}

/// A rate the page shows (messages per second), NaN while it shows none.
fn rate(view: &Value, which: &str) -> f64 {
    view[which]
        .as_str()
        .and_then(|r| r.replace(',', "").parse().ok())
        .unwrap_or(f64::NAN)
}

fn backlog(view: &Value, group: &str) -> Option<String> {
    view["backlog"][group].as_str().map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_in_a_browser_shows_the_broker_and_follows_it() {
    let binary = chromium();
    timeout(async {
        let started = Instant::now();
        let broker = start_with_limits(Limits {
            consumer_capacity: 16,
            ..Limits::default()
        })
        .await;
        let mut scene = set_scene(&broker, 29).await;
        // Traffic for the rates: 20 messages every 100 ms, each to the two
        // orders.> subscriptions, through the replica the page asks (the
        // totals are each replica's own, as its metrics).
        let mut publisher = broker.client_on(0).await;
        let traffic = tokio::spawn(async move {
            loop {
                for _ in 0..20 {
                    publisher.publish(publish_request("orders.created", "o")).await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut browser = Browser::launch(&binary).await;
        let url = format!("http://{}/status", broker.metrics_addr);
        browser.navigate(&url).await;

        // The page loads and shows the subscription, the group's backlog and
        // the eviction; rates appear from the second sample on (2 s).
        let (took, view) = browser
            .wait_for("the scene and its rates", Duration::from_secs(10), |v| {
                shows(v, "subscriptions", AUDIT_ID)
                    && backlog(v, GROUP).as_deref() == Some("29")
                    && shows(v, "evictions", EVICTED_ID)
                    && rate(v, "published_rate") > 0.0
                    && (test_engine() == TestEngine::Cluster || rate(v, "delivered_rate") > rate(v, "published_rate"))
            })
            .await;
        eprintln!("the page showed the scene and its rates {took:?} after it was opened");
        let visible = view["visible"].as_str().unwrap();
        for text in [AUDIT_ID, EVICTED_ID, GROUP, "published/s", "delivered/s"] {
            assert!(visible.contains(text), "{text} is visible: {visible}");
        }
        assert!(
            view["broker"].as_str().unwrap().contains(env!("CARGO_PKG_VERSION")),
            "{view:#}"
        );
        // Values clients chose are text, never markup.
        assert!(shows(&view, "subscriptions", MARKUP_ID), "{view:#}");
        assert_eq!(view["markup_in_rows"], 0, "{view:#}");
        assert_eq!(view["form"], false);
        assert_eq!(
            (&view["subscriptions"][0], &view["subscriptions"][1]),
            (&json!(MEMBER_ID), &json!(LAGGING_ID)),
            "the fullest first: {view:#}"
        );
        assert_eq!(view["unacked"][MEMBER_ID], "1", "{view:#}");
        assert_eq!(view["unacked"][LAGGING_ID], "—", "{view:#}");

        let shot = artifacts().join("status-page.png");
        browser.screenshot(&shot).await;
        eprintln!("screenshot of the status page: {}", shot.display());
        traffic.abort();

        // The state changes; the same page (no reload) follows within a few
        // seconds: the backlog grows, the closed subscription goes.
        browser.eval("window.tbMarker = 'same page'").await;
        publish_many(&broker, "invoices.new", 12).await;
        scene
            .admin
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: AUDIT_ID.into(),
            })
            .await
            .unwrap();
        let (took, _) = browser
            .wait_for("the new backlog, without orders-audit", Duration::from_secs(5), |v| {
                backlog(v, GROUP).as_deref() == Some("41")
                    && !shows(v, "subscriptions", AUDIT_ID)
                    && v["marker"] == "same page"
            })
            .await;
        eprintln!("the page followed the change in {took:?}");
        eprintln!("browser test took {:?}", started.elapsed());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_in_a_browser_asks_for_the_token_once() {
    let binary = chromium();
    timeout(async {
        let started = Instant::now();
        let broker = start_with(Config {
            auth_token: Some(TOKEN.into()),
            ..config()
        })
        .await;
        let mut client = broker.client().await;
        let _audit = client
            .open_subscription(authed(pb::OpenSubscriptionRequest {
                subscription_id: AUDIT_ID.into(),
                ..subscribe_request(&["orders.>"])
            }))
            .await
            .unwrap();
        let mut browser = Browser::launch(&binary).await;
        let url = format!("http://{}/status", broker.metrics_addr);
        browser.navigate(&url).await;

        // Without a token: the form, and no data.
        let (_, view) = browser
            .wait_for("the token form", Duration::from_secs(10), |v| v["form"] == true)
            .await;
        assert_eq!(view["data"], false, "{view:#}");
        assert!(!view["visible"].as_str().unwrap().contains(AUDIT_ID), "{view:#}");
        assert!(view["state"].as_str().unwrap().contains("token"), "{view:#}");

        let submit = |token: &str| {
            format!(
                "document.getElementById('token').value = {}; document.getElementById('token-form').requestSubmit()",
                json!(token)
            )
        };
        // A wrong token: refused, the form again.
        browser.eval(&submit("wrong-token")).await;
        browser
            .wait_for("the refusal", Duration::from_secs(5), |v| {
                v["form"] == true && v["token_error"].as_str().unwrap_or("").contains("refused")
            })
            .await;
        // The right one: the data.
        browser.eval(&submit(TOKEN)).await;
        browser
            .wait_for("the data after the token", Duration::from_secs(5), |v| {
                v["form"] == false && v["data"] == true && shows(v, "subscriptions", AUDIT_ID)
            })
            .await;
        // Asked once: a reload of the tab shows the data, no form.
        browser.call("Page.reload", json!({})).await;
        let (_, view) = browser
            .wait_for("the data after a reload", Duration::from_secs(5), |v| {
                v["data"] == true && shows(v, "subscriptions", AUDIT_ID)
            })
            .await;
        assert_eq!(view["form"], false, "{view:#}");

        // A new tab starts without it; a token in the address's fragment is
        // taken, and taken out of the address.
        browser.new_page().await;
        browser.navigate(&format!("{url}#token={TOKEN}")).await;
        let (_, view) = browser
            .wait_for(
                "the data with the token in the fragment",
                Duration::from_secs(10),
                |v| v["data"] == true && shows(v, "subscriptions", AUDIT_ID),
            )
            .await;
        assert_eq!(view["hash"], "", "{view:#}");
        assert_eq!(view["form"], false, "{view:#}");
        eprintln!("browser token test took {:?}", started.elapsed());
    })
    .await;
}
