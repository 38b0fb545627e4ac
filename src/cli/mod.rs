//! The `tinybroker` command line: `serve` (the default), `publish`,
//! `subscribe`, the Admin views (`subscriptions`, `groups`, `evictions`,
//! `info`, `close`: [`admin`]) and the live view `top` ([`top`]).

mod admin;
mod failure;
mod top;

use crate::client::{Client, ConnectOptions, DEFAULT_ADDR, DEFAULT_BATCH_MESSAGES, PublishSummary};
use crate::config::Config;
use crate::pb;
use crate::server::{self, Listeners};
use base64::Engine as _;
use clap::{Args, Parser, Subcommand};
use failure::failed;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Read, Write};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "tinybroker",
    version,
    about = "tinybroker: an in-memory publish/subscribe broker served over gRPC, single-node or clustered over NATS, and its command-line client",
    long_about = "tinybroker: an in-memory publish/subscribe broker served over gRPC, single-node or clustered over NATS \
(TINYBROKER_NATS_URL), and its command-line client: publish and subscribe, the Admin views (subscriptions, \
groups, evictions, info, close) and a live view (top).\n\n\
Without a subcommand it runs the broker, configured from TINYBROKER_* environment variables. The client \
subcommands reach a broker at --addr and send the token from TINYBROKER_AUTH_TOKEN when it is set."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the broker (the default), configured from TINYBROKER_* environment variables.
    Serve,
    /// Publish one message, or each line of stdin as one (--lines).
    Publish(PublishArgs),
    /// Subscribe and print each message's payload on its own line.
    Subscribe(SubscribeArgs),
    /// List the open subscriptions, fullest queue first (Admin/ListSubscriptions).
    Subscriptions(admin::SubscriptionsArgs),
    /// List the consumer groups, largest backlog first (Admin/ListConsumerGroups).
    Groups(admin::ListArgs),
    /// List the most recent evictions of slow consumers, newest first (Admin/ListEvictions).
    Evictions(admin::ListArgs),
    /// Show the broker's version, uptime, counters and limits (Admin/GetBrokerInfo).
    Info(admin::ListArgs),
    /// Close one subscription by id; its stream ends (Admin/CloseSubscription).
    Close(admin::CloseArgs),
    /// A live view, redrawn every second until q or Ctrl-C: rates, fullest
    /// queues, largest backlogs, latest evictions.
    Top(top::TopArgs),
}

#[derive(Args, Debug)]
struct Connection {
    /// Broker address: host:port or http://host:port; `https://` for a
    /// broker serving TLS. TINYBROKER_ADDR when not given, as the client
    /// libraries read it.
    #[arg(long, env = "TINYBROKER_ADDR", default_value = DEFAULT_ADDR)]
    addr: String,
    /// PEM file of the CA that signed the broker's certificate (with an
    /// `https://` address; the system's roots are used without it).
    #[arg(long, value_name = "PEM_FILE")]
    ca: Option<std::path::PathBuf>,
}

impl Connection {
    /// Connects with the token from `TINYBROKER_AUTH_TOKEN`.
    async fn connect(&self) -> anyhow::Result<Client> {
        let options = ConnectOptions {
            ca: self.ca.clone(),
            ..ConnectOptions::from_env()
        };
        Client::connect_with(&self.addr, &options)
            .await
            .map_err(|e| failure::connect_failed(&self.addr, e))
    }
}

#[derive(Args, Debug)]
#[command(
    after_help = "With --lines, each line of stdin (without its line end) is one message to TOPIC, \
sent in batches of up to --batch messages or about 512 KiB on one session, as stdin gives them; \
prints `published=N first_sequence=F last_sequence=L rejected=M unconfirmed=U not_sent=S` on stdout \
and each rejected line on stderr with its line number; exits non-zero if any line was rejected or \
the session failed (a batch lost with the session is unconfirmed: never sent again)."
)]
struct PublishArgs {
    /// Topic, e.g. deploy.rollout.
    topic: String,
    /// Payload; read from stdin when absent.
    #[arg(conflicts_with = "lines")]
    payload: Option<String>,
    /// A header as key=value; repeatable (with --lines, on every line's message).
    #[arg(long = "header", value_name = "KEY=VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Publish each line of stdin as one message, in batches on one session.
    #[arg(long)]
    lines: bool,
    /// With --lines: messages per batch at most; when not given, the
    /// broker's TINYBROKER_MAX_BATCH_MESSAGES (GetBrokerInfo), else 1024.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    batch: Option<u32>,
    #[command(flatten)]
    connection: Connection,
}

#[derive(Args, Debug)]
struct SubscribeArgs {
    /// Topic patterns: `*` matches one token, a final `>` one or more.
    #[arg(required = true)]
    patterns: Vec<String>,
    /// Join this consumer group (each message goes to one member).
    #[arg(long)]
    group: Option<String>,
    /// Ack each message after printing it (consumer groups only); unprinted
    /// messages are redelivered to another member.
    #[arg(long, requires = "group")]
    manual_ack: bool,
    /// Print one JSON object per message (topic, sequence, headers, payload).
    #[arg(long)]
    json: bool,
    /// Subscription id (generated when absent).
    #[arg(long)]
    id: Option<String>,
    /// Exit after this many messages.
    #[arg(long)]
    count: Option<u64>,
    #[command(flatten)]
    connection: Connection,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Most worker threads `TOKIO_WORKER_THREADS` may ask for.
const MAX_WORKER_THREADS: usize = 1024;

/// The runtime's worker threads from `TOKIO_WORKER_THREADS`, checked here:
/// tokio itself would panic on a bad value. `None`: one per CPU this process
/// may use (tokio's default, which honours a cgroup CPU quota).
fn worker_threads() -> Result<Option<usize>, String> {
    const VAR: &str = "TOKIO_WORKER_THREADS";
    let bad = |value: &dyn std::fmt::Debug| {
        format!("{VAR}={value:?} is not a number of worker threads (a whole number from 1 to {MAX_WORKER_THREADS})")
    };
    match std::env::var(VAR) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(value)) => Err(bad(&value)),
        Ok(value) => match value.parse::<usize>() {
            Ok(n) if (1..=MAX_WORKER_THREADS).contains(&n) => Ok(Some(n)),
            _ => Err(bad(&value)),
        },
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    match worker_threads() {
        Ok(Some(n)) => {
            builder.worker_threads(n);
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("tinybroker: {e}");
            return ExitCode::from(2);
        }
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tinybroker: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command.unwrap_or(Command::Serve) {
            Command::Serve => serve().await,
            Command::Publish(args) => publish(args).await,
            Command::Subscribe(args) => subscribe(args).await,
            Command::Subscriptions(args) => admin::subscriptions(args).await,
            Command::Groups(args) => admin::groups(args).await,
            Command::Evictions(args) => admin::evictions(args).await,
            Command::Info(args) => admin::info(args).await,
            Command::Close(args) => admin::close(args).await,
            Command::Top(args) => top::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if stdout_went_away(&e) => die_of_sigpipe(),
        Err(e) => {
            eprintln!("tinybroker: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// What a client command prints on stdout. A closed stdout (`tinybroker
/// subscriptions --json | head`) is an error its command returns, never a
/// panic as in `print!` (Rust ignores SIGPIPE, so such a write fails
/// instead of ending the process); [`main`] then ends the process as a Unix
/// filter ends, by SIGPIPE, without a word ([`stdout_went_away`]).
pub(super) fn out(text: impl std::fmt::Display) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{text}")?;
    stdout.flush()
}

/// Whether `error` is a write to a stdout whose reader went away. The
/// broker's sockets cannot be it: their errors reach a command as gRPC
/// statuses, turned into text by [`failed`].
fn stdout_went_away(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
            || cause
                .downcast_ref::<serde_json::Error>()
                .is_some_and(|e| e.io_error_kind() == Some(std::io::ErrorKind::BrokenPipe))
    })
}

/// Ends the process by SIGPIPE, as `head`'s writer ends in a pipeline: the
/// shell sees 141 and the pipeline's status is its reader's.
fn die_of_sigpipe() -> ExitCode {
    // SAFETY: the default disposition needs no handler; raise(3) delivers
    // the signal to this thread, which ends the process.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    ExitCode::FAILURE
}

async fn serve() -> anyhow::Result<()> {
    let mut config = Config::from_env()?;
    if let Some(files) = &config.tls {
        files.load()?;
    }
    let telemetry = crate::ops::telemetry::init(config.log_format)?;
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .collect();
    for unknown in crate::config::unknown_variables(names.iter().map(String::as_str)) {
        use crate::config::UnknownVariable;
        match unknown {
            UnknownVariable::Ignored {
                name,
                may_mean: Some(closest),
            } => {
                tracing::warn!(variable = %name, "{name} is not a tinybroker setting and is ignored; did you mean {closest}?")
            }
            UnknownVariable::Ignored { name, may_mean: None } => {
                tracing::warn!(variable = %name, "{name} is not a tinybroker setting and is ignored")
            }
            // Config::from_env stopped start-up for it.
            UnknownVariable::NearMiss { .. } => {}
        }
    }
    // Each connection takes a descriptor: keep room beside max_connections
    // for the broker's own (listeners, metrics scrapes, the refusal of
    // connection max_connections + 1), so that it never runs out of them.
    const RESERVED_FDS: u64 = 64;
    match crate::grpc::connections::raise_fd_limit() {
        Ok(limit) if limit < config.connections.max_connections as u64 + RESERVED_FDS => {
            let fitting = limit.saturating_sub(RESERVED_FDS).max(1) as usize;
            tracing::warn!(
                fd_limit = limit,
                configured = config.connections.max_connections,
                max_connections = fitting,
                "the open-files limit leaves room for only {fitting} connections: max_connections lowered to that; raise the limit (ulimit -n) to allow TINYBROKER_MAX_CONNECTIONS"
            );
            config.connections.max_connections = fitting;
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
    }
    let shutdown = shutdown_signal();
    let listeners = Listeners::bind(&config).await?;
    let result = server::run(config, listeners, shutdown).await;
    // Flushes spans in the exporter's own thread; keep the runtime free.
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    result
}

/// Resolves on SIGTERM or SIGINT: the one place signals become shutdown.
/// The handlers are installed here, when it is called (before the
/// listeners are bound), not when the future is first polled: a SIGTERM
/// that comes right after the `tinybroker started` line must drain, not
/// kill the process with the default disposition.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                }
                (term, int) => {
                    let error = term.err().or(int.err()).map(|e| e.to_string()).unwrap_or_default();
                    tracing::error!(%error, "cannot listen for SIGTERM or SIGINT; the broker stops only when killed");
                    std::future::pending::<()>().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn publish(args: PublishArgs) -> anyhow::Result<()> {
    if args.lines {
        return publish_lines(args).await;
    }
    // (clap's `requires` takes a flag's default of false for present.)
    if args.batch.is_some() {
        anyhow::bail!("--batch is for --lines");
    }
    let payload = match args.payload {
        Some(p) => p.into_bytes(),
        None => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            buf
        }
    };
    let mut client = args.connection.connect().await?;
    let headers: HashMap<String, String> = args.headers.into_iter().collect();
    let response = client
        .publish_confirmed(args.topic, payload, headers)
        .await
        .map_err(|s| failed("publish", &args.connection.addr, s))?;
    out(format_args!(
        "sequence={} matched_subscriptions={} matched_groups={}\n",
        response.sequence, response.matched_subscriptions, response.matched_groups
    ))?;
    Ok(())
}

/// Lines of stdin handed over together: those read while more were already
/// buffered (so that a file goes in full batches and a line typed or
/// tailed goes at once), at most this many.
const LINES_PER_CHUNK: usize = 1024;

/// `publish --lines`: each line of stdin one message to the topic, through
/// the client's [`crate::client::Publisher`] on one session. What is
/// gathered is sent whenever stdin has nothing more ready, so a line never
/// waits for the next. Stops reading at the first batch without an answer.
async fn publish_lines(args: PublishArgs) -> anyhow::Result<()> {
    let addr = &args.connection.addr;
    let mut client = args.connection.connect().await?;
    let mut publisher = client
        .publisher()
        .max_messages(args.batch.map_or(DEFAULT_BATCH_MESSAGES, |n| n as usize));
    // Batches within the largest request the broker reads (a line too
    // large for one rejected here rather than ending the session), and
    // within its batch limit unless --batch says otherwise.
    match client.broker_info().await {
        Ok(info) => {
            if let Some(limits) = info.limits {
                publisher = publisher.broker_max_message_bytes(limits.max_message_bytes as usize);
                if args.batch.is_none() && limits.max_batch_messages > 0 {
                    publisher = publisher.max_messages(limits.max_batch_messages as usize);
                }
            }
        }
        Err(status) if status.code() == tonic::Code::Unimplemented => {}
        Err(status) => return Err(failed("publish", addr, status)),
    }
    let headers: HashMap<String, String> = args.headers.into_iter().collect();
    let (chunks_tx, mut chunks) = tokio::sync::mpsc::channel(4);
    // A thread of its own, not left for the runtime to wait for: reading a
    // terminal blocks until a line is typed.
    std::thread::spawn(move || read_lines(std::io::stdin().lock(), chunks_tx));
    let mut read_error = None;
    'reading: while let Some(chunk) = chunks.recv().await {
        let lines = match chunk {
            Ok(lines) => lines,
            Err(e) => {
                read_error = Some(e);
                break;
            }
        };
        for line in lines {
            publisher
                .publish(pb::PublishRequest {
                    topic: args.topic.clone(),
                    payload: line.into(),
                    headers: headers.clone(),
                })
                .await;
            if publisher.failed() {
                break 'reading;
            }
        }
        if chunks.is_empty() {
            publisher.send_buffered().await;
        }
    }
    let summary = publisher.flush().await;
    report_lines(addr, &summary)?;
    if let Some(e) = read_error {
        anyhow::bail!("cannot read stdin: {e}");
    }
    if summary.failed.is_empty() && summary.rejected.is_empty() {
        return Ok(());
    }
    let lines = |n: u64| {
        if n == 1 {
            "1 line".to_owned()
        } else {
            format!("{n} lines")
        }
    };
    let mut problems = Vec::new();
    if !summary.rejected.is_empty() {
        problems.push(format!("{} rejected", lines(summary.rejected.len() as u64)));
    }
    if summary.unconfirmed() > 0 {
        problems.push(format!("{} unconfirmed", lines(summary.unconfirmed())));
    }
    if summary.not_sent() > 0 {
        problems.push(format!("{} not sent", lines(summary.not_sent())));
    }
    if !summary.failed.is_empty() {
        problems.push("stopped reading stdin after the session failed".into());
    }
    anyhow::bail!("publish --lines: {}", problems.join(", "))
}

/// Reads `input` line by line (each without its `\n` or `\r\n`) and hands
/// the lines over in chunks: what was read while more input was buffered.
fn read_lines(mut input: impl BufRead, chunks: tokio::sync::mpsc::Sender<std::io::Result<Vec<Vec<u8>>>>) {
    let mut chunk = Vec::new();
    loop {
        let mut line = Vec::new();
        match input.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {
                if line.last() == Some(&b'\n') {
                    line.pop();
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                }
                chunk.push(line);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                if !chunk.is_empty() && chunks.blocking_send(Ok(std::mem::take(&mut chunk))).is_err() {
                    return;
                }
                let _ = chunks.blocking_send(Err(e));
                return;
            }
        }
        // The next line would mean waiting for input: hand over these.
        let waiting = input.fill_buf().map_or(true, |b| b.is_empty());
        if (waiting || chunk.len() >= LINES_PER_CHUNK) && chunks.blocking_send(Ok(std::mem::take(&mut chunk))).is_err()
        {
            return;
        }
    }
    if !chunk.is_empty() {
        let _ = chunks.blocking_send(Ok(chunk));
    }
}

/// The summary of `publish --lines` on stdout, and each line that was not
/// published on stderr, by its line number.
fn report_lines(addr: &str, summary: &PublishSummary) -> anyhow::Result<()> {
    for r in &summary.rejected {
        eprintln!(
            "tinybroker publish: line {} rejected: {:?}: {}",
            r.index + 1,
            r.code,
            r.message
        );
    }
    for f in &summary.failed {
        let (first, last) = (f.first_index + 1, f.first_index + f.error.messages() as u64);
        let what = match f.error.is_unconfirmed() {
            true => {
                "unconfirmed: the session was lost before the broker answered (they may or may not have been published, and were not sent again)"
            }
            false => "not sent (not published)",
        };
        eprintln!(
            "tinybroker publish: lines {first}-{last} {what}: {:#}",
            failed("publish", addr, f.error.cause().clone())
        );
    }
    out(format_args!(
        "published={} first_sequence={} last_sequence={} rejected={} unconfirmed={} not_sent={}\n",
        summary.accepted,
        summary.first_sequence.unwrap_or(0),
        summary.last_sequence.unwrap_or(0),
        summary.rejected.len(),
        summary.unconfirmed(),
        summary.not_sent()
    ))?;
    Ok(())
}

async fn subscribe(args: SubscribeArgs) -> anyhow::Result<()> {
    let client = args.connection.connect().await?;
    let request = pb::OpenSubscriptionRequest {
        topic_patterns: args.patterns,
        mode: if args.group.is_some() {
            pb::DeliveryMode::Single
        } else {
            pb::DeliveryMode::Multi
        } as i32,
        subscription_id: args.id.unwrap_or_default(),
        consumer_group: args.group.unwrap_or_default(),
        ack_mode: if args.manual_ack {
            pb::AckMode::Manual
        } else {
            pb::AckMode::Auto
        } as i32,
        max_in_flight: 0,
        ack_deadline_ms: 0,
    };
    let mut subscriber = client.subscriber(request, true);
    // Every eviction, close, lost connection and re-subscription is one line
    // on stderr: a reader must never lose messages without a word.
    subscriber.on_event(|event| eprintln!("tinybroker subscribe: {event}"));
    let addr = args.connection.addr.clone();
    subscriber.open().await.map_err(|s| failed("subscribe", &addr, s))?;
    eprintln!("tinybroker subscribe: {}", subscribed_line(&subscriber));
    let mut received = 0u64;
    let stdout = std::io::stdout();
    loop {
        if args.count.is_some_and(|n| received >= n) {
            close(&mut subscriber).await;
            return Ok(());
        }
        let message = tokio::select! {
            m = subscriber.next() => m.map_err(|s| failed("subscribe", &addr, s))?,
            _ = tokio::signal::ctrl_c() => {
                close(&mut subscriber).await;
                return Ok(());
            }
        };
        let Some(message) = message else {
            return Ok(());
        };
        {
            let mut out = stdout.lock();
            if args.json {
                serde_json::to_writer(&mut out, &json_message(&message))?;
            } else {
                out.write_all(&message.payload)?;
            }
            out.write_all(b"\n")?;
            out.flush()?;
        }
        received += 1;
        if args.manual_ack {
            // In-band on the session; a message of a session that was lost
            // meanwhile is redelivered by the broker anyway.
            if let Err(status) = subscriber.ack(vec![message.sequence]) {
                tracing::debug!(%status, "ack not sent");
            }
        }
    }
}

/// Closes the subscription before `subscribe` exits: once the broker has
/// ended it, the acks sent on the session were applied. A broker that does
/// not answer within 5 s redelivers what was not acked.
async fn close(subscriber: &mut crate::client::Subscriber) {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), subscriber.close()).await;
}

/// What `subscribe` says once its subscription is open: its id (from the
/// session's `opened` event), group and patterns.
fn subscribed_line(subscriber: &crate::client::Subscriber) -> String {
    let request = subscriber.request();
    let mut line = format!("subscribed: id={}", subscriber.subscription_id().unwrap_or("?"));
    if !request.consumer_group.is_empty() {
        line.push_str(&format!(" group={}", request.consumer_group));
    }
    line.push_str(&format!(" patterns={}", request.topic_patterns.join(",")));
    line
}

fn json_message(m: &pb::Message) -> serde_json::Value {
    let mut value = serde_json::json!({
        "topic": m.topic,
        "sequence": m.sequence,
        "headers": m.headers.iter().collect::<BTreeMap<_, _>>(),
        "subscription_id": m.subscription_id,
        "delivery_attempt": m.delivery_attempt,
    });
    if !m.consumer_group.is_empty() {
        value["consumer_group"] = m.consumer_group.clone().into();
    }
    if let Some(t) = &m.publish_time {
        value["publish_time"] = t.to_string().into();
    }
    match std::str::from_utf8(&m.payload) {
        Ok(text) => value["payload"] = text.into(),
        Err(_) => value["payload_base64"] = base64::engine::general_purpose::STANDARD.encode(&m.payload).into(),
    }
    value
}
