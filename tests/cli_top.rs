//! `tinybroker top` against a real broker: live in a real terminal (a
//! detached tmux session of a given size: read the screen, resize it, quit
//! with `q`), and `--once` for scripts. The terminal tests need tmux and
//! fail, saying how to install it, where it is missing (`.ci/run` installs
//! it).

mod common;

use common::hung::busy_group_with_a_hung_member;
use common::process::run_cli;
use common::*;
use std::process::{Command, Output};
use std::time::Duration;
use tinybroker::pb;

/// A broker with a broadcast subscription `top-watcher` and a manual-ack
/// group `top-workers` (one member holding its one message in flight, 3
/// in the backlog); the streams are held open.
async fn scene() -> (TestBroker, Vec<tonic::Streaming<pb::Message>>) {
    let broker = start().await;
    let mut client = broker.client().await;
    let mut request = subscribe_request(&["top.>"]);
    request.subscription_id = "top-watcher".into();
    let (watcher, _) = open(&mut client, request).await;
    let mut request = member_request(&["jobs.*"], "top-workers", true, 1);
    request.subscription_id = "top-worker-1".into();
    let (worker, _) = open(&mut client, request).await;
    for i in 0..4 {
        client
            .publish(publish_request("jobs.x", &format!("job {i}")))
            .await
            .unwrap();
    }
    wait_until("1 in flight and 3 in the backlog", || async {
        broker
            .group("top-workers")
            .await
            .is_some_and(|g| (g.in_flight, g.backlog) == (1, 3))
    })
    .await;
    (broker, vec![watcher, worker])
}

/// The group's row of a frame, split into its cells: GROUP, MEMBERS,
/// BACKLOG, ... (as many as fit).
fn group_row(lines: &[String], name: &str) -> Option<Vec<String>> {
    lines
        .iter()
        .find(|l| l.starts_with(name))
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
}

/// The rule line of a list's title (" Subscriptions, ... ───"), which the
/// layout draws across the whole width.
fn title_rule<'a>(lines: &'a [String], title: &str) -> Option<&'a String> {
    lines.iter().find(|l| l.starts_with(&format!(" {title}")))
}

// === --once ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_once_prints_one_frame_with_rates_from_two_samples() {
    timeout(async {
        let (broker, _streams) = scene().await;
        let url = broker.url();
        // Messages keep coming while it takes its two samples.
        let publishing = {
            let mut client = broker.client().await;
            tokio::spawn(async move {
                loop {
                    client.publish(publish_request("top.tick", "t")).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let (status, stdout, stderr) =
            tokio::task::spawn_blocking(move || run_cli(&["top", "--once", "--addr", &url], &[]))
                .await
                .unwrap();
        publishing.abort();
        assert!(status.success(), "{stderr}");
        let lines: Vec<String> = stdout.lines().map(str::to_owned).collect();
        assert!(lines.iter().all(|l| l.chars().count() <= 120), "{stdout}");
        assert!(lines[0].starts_with("tinybroker "), "{stdout}");
        // published N/s: a rate from the broker's counters, not "n/a".
        let published: f64 = lines[1]
            .strip_prefix("published ")
            .and_then(|rest| rest.split_once("/s"))
            .and_then(|(n, _)| n.parse().ok())
            .unwrap_or_else(|| panic!("a rate in {stdout}"));
        assert!(published > 0.0, "messages were published every 5 ms: {stdout}");
        assert!(lines[1].contains("delivered "), "{stdout}");
        assert!(stdout.contains("top-watcher"), "{stdout}");
        let row = group_row(&lines, "top-workers").unwrap_or_else(|| panic!("{stdout}"));
        assert_eq!(row[1..4], ["1", "3", "1"], "members, backlog, in flight: {stdout}");
        assert!(title_rule(&lines, "Latest evictions (none)").is_some(), "{stdout}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_without_a_terminal_says_to_use_once() {
    timeout(async {
        let broker = start().await;
        let (status, _, stderr) = run_cli(&["top", "--addr", &broker.url()], &[]);
        assert!(!status.success());
        assert!(stderr.contains("top needs a terminal"), "{stderr}");
        assert!(stderr.contains("--once"), "{stderr}");
        let (status, _, stderr) = run_cli(&["top", "--once", "--addr", "http://127.0.0.1:1"], &[]);
        assert!(!status.success());
        assert!(stderr.contains("cannot connect to http://127.0.0.1:1"), "{stderr}");
    })
    .await
}

// === live, in tmux ===

/// Panics unless tmux runs here ([`require_tool`]).
#[track_caller]
fn require_tmux() {
    require_tool(
        "tmux (the terminal test of `tinybroker top`)",
        "apt-get install tmux",
        Command::new("tmux").arg("-V"),
    );
}

/// A tmux server of this test's own (its own socket), killed on drop.
struct Tmux {
    socket: String,
}

const SESSION: &str = "top";

impl Tmux {
    /// A server on the socket `tinybroker-<test>-<pid>`.
    fn new(test: &str) -> Self {
        Self {
            socket: format!("tinybroker-{test}-{}", std::process::id()),
        }
    }

    /// Starts `tinybroker top --addr URL` in a `width` × `height` session,
    /// with an empty environment (no TERM, PATH or HOME, as in the
    /// distroless image under `kubectl exec`); after it, its exit status,
    /// then the terminal's modes (raw mode turns icanon and echo off), then
    /// a wait to read the screen.
    fn start_top(&self, url: &str, width: u16, height: u16) {
        let script = format!(
            "env -i '{}' top --addr {url}; echo top-exited-$?; stty -a; echo modes-listed; sleep 60",
            env!("CARGO_BIN_EXE_tinybroker"),
        );
        let (width, height) = (width.to_string(), height.to_string());
        self.run(&[
            "new-session",
            "-d",
            "-s",
            SESSION,
            "-x",
            &width,
            "-y",
            &height,
            "sh",
            "-c",
            &script,
        ]);
    }

    /// Waits for top to exit and its shell to list the terminal's modes;
    /// everything the pane showed.
    async fn wait_for_exit(&self) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.history();
            if text.contains("modes-listed") {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for top to exit:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Asserts that top exited 0 and gave the terminal back: the main
    /// screen (the frame gone), the cursor shown, the line discipline on.
    fn assert_exited_and_restored(&self, text: &str) {
        assert_eq!(
            self.format("#{alternate_on}"),
            "0",
            "the alternate screen was left:\n{text}"
        );
        assert!(text.contains("top-exited-0"), "exit status 0:\n{text}");
        assert!(
            !self.screen().iter().any(|l| l.contains("top-watcher")),
            "the frame is gone:\n{text}"
        );
        assert_eq!(self.format("#{cursor_flag}"), "1", "the cursor is shown again");
        let modes: Vec<&str> = text.split_whitespace().collect();
        for mode in ["icanon", "echo", "isig"] {
            assert!(modes.contains(&mode), "{mode} is on again:\n{text}");
            assert!(!modes.contains(&format!("-{mode}").as_str()), "{mode}:\n{text}");
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let output = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .env("TERM", "xterm-256color")
            .output()
            .expect("run tmux");
        assert!(
            output.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }

    /// The visible screen, one string per row (trailing blanks cut).
    fn screen(&self) -> Vec<String> {
        let output = self.run(&["capture-pane", "-p", "-t", SESSION]);
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Everything the pane showed, its history too, wrapped lines joined.
    fn history(&self) -> String {
        let output = self.run(&["capture-pane", "-p", "-J", "-S", "-", "-t", SESSION]);
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn format(&self, format: &str) -> String {
        let output = self.run(&["display-message", "-p", "-t", SESSION, format]);
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Waits up to 20 s for a screen `check` accepts; panics with the last
    /// screen otherwise.
    async fn wait_for(&self, what: &str, check: impl Fn(&[String]) -> bool) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let screen = self.screen();
            if check(&screen) {
                return screen;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; the screen:\n{}",
                screen.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["-L", &self.socket, "kill-server"]).output();
    }
}

/// Whether a frame of `top` fills a `width` × `height` terminal: the list
/// titles' rules span the width and the footer is on the last row.
fn fits(screen: &[String], width: usize, height: usize) -> bool {
    let rule = title_rule(screen, "Subscriptions");
    screen.len() == height
        && screen.iter().all(|l| l.chars().count() <= width)
        && rule.is_some_and(|r| r.chars().count() == width && r.ends_with('─'))
        && screen[height - 1].starts_with("q or Ctrl-C: quit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_queues_and_backlogs_fits_a_resized_terminal_and_quits_on_q() {
    require_tmux();
    timeout(async {
        let (broker, _streams) = scene().await;
        let tmux = Tmux::new("top");
        tmux.start_top(&broker.url(), 120, 40);

        let screen = tmux
            .wait_for("the subscription and the group's backlog", |s| {
                s.iter().any(|l| l.starts_with("top-watcher"))
                    && group_row(s, "top-workers").is_some_and(|row| row[2] == "3")
            })
            .await;
        assert_eq!(tmux.format("#{alternate_on}"), "1", "top draws on the alternate screen");
        assert!(fits(&screen, 120, 40), "a 120x40 frame:\n{}", screen.join("\n"));
        let row = group_row(&screen, "top-workers").unwrap();
        assert_eq!(row[1..4], ["1", "3", "1"], "members, backlog, in flight");
        // A second sample gives the rates.
        tmux.wait_for("the rates", |s| {
            s.len() > 1 && s[1].starts_with("published ") && !s[1].contains("n/a")
        })
        .await;

        tmux.run(&["resize-window", "-t", SESSION, "-x", "70", "-y", "20"]);
        let screen = tmux.wait_for("a 70x20 frame", |s| fits(s, 70, 20)).await;
        assert!(
            screen.iter().any(|l| l.starts_with("top-watcher")),
            "{}",
            screen.join("\n")
        );
        let row = group_row(&screen, "top-workers").unwrap_or_else(|| panic!("{}", screen.join("\n")));
        assert_eq!(row[2], "3", "the backlog still shows: {}", screen.join("\n"));

        tmux.run(&["send-keys", "-t", SESSION, "q"]);
        let text = tmux.wait_for_exit().await;
        tmux.assert_exited_and_restored(&text);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_quits_on_ctrl_c_and_restores_the_terminal() {
    require_tmux();
    timeout(async {
        let (broker, _streams) = scene().await;
        let tmux = Tmux::new("top-ctrl-c");
        tmux.start_top(&broker.url(), 100, 30);
        tmux.wait_for("the first frame", |s| s.iter().any(|l| l.starts_with("top-watcher")))
            .await;
        // In raw mode Ctrl-C is a key, not SIGINT.
        tmux.run(&["send-keys", "-t", SESSION, "C-c"]);
        let text = tmux.wait_for_exit().await;
        tmux.assert_exited_and_restored(&text);
    })
    .await
}

/// The rows of the list titled `title` (after its title and column
/// header), up to the next list's title.
fn list_rows<'a>(screen: &'a [String], title: &str) -> Vec<&'a String> {
    screen
        .iter()
        .skip_while(|l| !l.starts_with(&format!(" {title}")))
        .skip(2)
        .take_while(|l| !l.contains('─') && !l.trim().is_empty())
        .collect()
}

/// Issue 42: in a busy manual-ack group every member holds its
/// max_in_flight; the one that never acks is listed first among the group
/// members, marked HUNG?, and the acking ones are not. Prints how long top
/// took from its start to show the mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_lists_a_hung_member_first_among_the_members_and_marks_it() {
    require_tmux();
    timeout(async {
        let broker = start().await;
        let scene = busy_group_with_a_hung_member(&broker, "busy").await;
        // Far older than the others' (who ack every 250 ms): 5 s and more.
        wait_until("the hung member's oldest unacked message to be 6 s old", || async {
            listed(broker.subscriptions().await, &scene.hung)
                .and_then(|s| s.oldest_unacked_age)
                .is_some_and(|age| age.seconds >= 6)
        })
        .await;
        let tmux = Tmux::new("top-hung");
        let started = std::time::Instant::now();
        tmux.start_top(&broker.url(), 120, 40);
        let marked = format!("HUNG?  {}", scene.hung);
        let screen = tmux
            .wait_for("the hung member first among the members, marked", |s| {
                list_rows(s, "Group members, oldest unacked first")
                    .first()
                    .is_some_and(|row| row.starts_with(&marked))
            })
            .await;
        eprintln!(
            "top marked {} {:.1} s after it started",
            scene.hung,
            started.elapsed().as_secs_f64()
        );
        let members = list_rows(&screen, "Group members, oldest unacked first");
        let all = screen.join("\n");
        assert_eq!(members.len(), 3, "{all}");
        assert!(members[1..].iter().all(|r| !r.contains("HUNG?")), "{all}");
        for id in &scene.healthy {
            assert!(members.iter().any(|r| r.contains(id.as_str())), "{id}: {all}");
        }
        // Every member holds its max_in_flight: UNACKED names no one.
        let header = screen
            .iter()
            .skip_while(|l| !l.starts_with(" Group members"))
            .nth(1)
            .unwrap();
        let end = header.rfind("UNACKED").unwrap() + "UNACKED".len();
        for row in &members {
            assert_eq!(row[..end].split_whitespace().last(), Some("4"), "{all}");
        }
        tmux.run(&["send-keys", "-t", SESSION, "q"]);
        let text = tmux.wait_for_exit().await;
        assert!(text.contains("top-exited-0"), "{text}");
    })
    .await
}
