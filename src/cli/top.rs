//! `tinybroker top`: a live view of one broker in the terminal (ratatui over
//! crossterm: no shell, terminfo or external program needed, so it runs in
//! the image through `kubectl exec -it`), redrawn every second until `q` or
//! Ctrl-C, laid out again for each size of the terminal; `--once` prints one
//! plain-text frame for scripts.

use super::Connection;
use super::admin::{
    age, duration, fill, human_duration, or_dash, percent, sort_by_backlog, sort_by_fill, sort_newest_first,
    unacked_cell,
};
use super::failure::error_chain;
use crate::client::Client;
use crate::pb;
use clap::Args;
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table, Widget};
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

/// How often the view is refreshed (and, with `--once`, how far apart its
/// two samples are).
const REFRESH: Duration = Duration::from_secs(1);
/// Most a refresh waits for the broker before showing the error.
const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// Width of a `--once` frame written to a pipe or a file.
const ONCE_WIDTH: u16 = 120;
/// Most rows of each list in a `--once` frame.
const ONCE_ROWS: usize = 20;

#[derive(Args, Debug)]
pub(super) struct TopArgs {
    /// Print one plain-text frame to stdout and exit (no terminal needed):
    /// two samples a second apart, for the rates.
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    connection: Connection,
}

pub(super) async fn run(args: TopArgs) -> anyhow::Result<()> {
    let terminal = std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
    if !args.once && !terminal {
        anyhow::bail!(
            "top needs a terminal (with kubectl: exec -it); for scripts use `tinybroker top --once`, which prints one frame"
        );
    }
    let client = args.connection.connect().await?;
    let mut view = View::new(&args.connection.addr);
    if args.once {
        return once(client, view).await;
    }
    view.refresh(&client).await;
    live(client, view).await
}

/// Two samples [`REFRESH`] apart, then the frame as text.
async fn once(client: Client, mut view: View) -> anyhow::Result<()> {
    view.refresh(&client).await;
    if let Some(error) = &view.error {
        anyhow::bail!("top failed: {error}");
    }
    tokio::time::sleep(REFRESH).await;
    view.refresh(&client).await;
    if let Some(error) = &view.error {
        anyhow::bail!("top failed: {error}");
    }
    let width = match ratatui::crossterm::terminal::size() {
        Ok((w, _)) if std::io::stdout().is_terminal() => w,
        _ => ONCE_WIDTH,
    };
    super::out(view.text(width))?;
    Ok(())
}

/// What the event thread tells the drawing loop.
enum Input {
    Quit,
    Resized,
}

async fn live(client: Client, mut view: View) -> anyhow::Result<()> {
    let mut terminal = ratatui::try_init().map_err(|e| {
        ratatui::restore();
        anyhow::anyhow!("cannot set up the terminal: {e}")
    })?;
    // From here on every way out (return, error, panic: ratatui's hook)
    // gives the terminal back as it was.
    let _restore = RestoreTerminal;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, mut inputs) = tokio::sync::mpsc::unbounded_channel();
    let reader = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("top-keys".into())
            .spawn(move || read_keys(&stop, &tx))?
    };
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        if let Err(e) = terminal.draw(|frame| view.render(frame.area(), frame.buffer_mut(), Fit::Screen)) {
            break Err(anyhow::anyhow!("cannot draw: {e}"));
        }
        tokio::select! {
            _ = tick.tick() => view.refresh(&client).await,
            input = inputs.recv() => match input {
                Some(Input::Resized) => {}
                Some(Input::Quit) => break Ok(()),
                None => break Err(anyhow::anyhow!("cannot read the keyboard")),
            },
            _ = tokio::signal::ctrl_c() => break Ok(()),
        }
    };
    stop.store(true, Ordering::Relaxed);
    let _ = terminal.show_cursor();
    drop(terminal);
    let _ = reader.join();
    result
}

/// Gives the terminal back (raw mode off, main screen) when dropped.
struct RestoreTerminal;

impl Drop for RestoreTerminal {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// Reads the keyboard until `stop`: `q`, Esc or Ctrl-C quit (in raw mode
/// Ctrl-C is a key, not SIGINT); a resize redraws at once.
fn read_keys(stop: &AtomicBool, tx: &tokio::sync::mpsc::UnboundedSender<Input>) {
    while !stop.load(Ordering::Relaxed) {
        match event::poll(Duration::from_millis(100)) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => return,
        }
        let input = match event::read() {
            Ok(Event::Key(key)) if key.kind != KeyEventKind::Release => match key.code {
                KeyCode::Char('q' | 'Q') | KeyCode::Esc => Input::Quit,
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Input::Quit,
                _ => continue,
            },
            Ok(Event::Resize(..)) => Input::Resized,
            Ok(_) => continue,
            Err(_) => return,
        };
        if tx.send(input).is_err() {
            return;
        }
    }
}

/// One look at the broker.
struct Sample {
    info: pb::GetBrokerInfoResponse,
    subscriptions: Vec<pb::SubscriptionInfo>,
    groups: Vec<pb::ConsumerGroupInfo>,
    /// The manual-ack group members, oldest unacked message first, each
    /// with whether it looks hung beside its group's others.
    members: Vec<(pb::SubscriptionInfo, bool)>,
    evictions: Vec<pb::EvictionInfo>,
}

/// Messages per second between two samples, by the broker's own uptime.
#[derive(Debug, Clone, Copy)]
struct Rates {
    published: f64,
    delivered: f64,
}

impl Rates {
    fn between(before: &pb::GetBrokerInfoResponse, after: &pb::GetBrokerInfoResponse) -> Option<Self> {
        let seconds = after.uptime.map(duration)?.checked_sub(before.uptime.map(duration)?)?;
        let seconds = seconds.as_secs_f64();
        // Another broker (restarted, or another replica behind a Service):
        // its counters are not comparable.
        if seconds < 0.1
            || before.started_at != after.started_at
            || before.replica_id != after.replica_id
            || after.messages_published < before.messages_published
            || after.messages_delivered < before.messages_delivered
        {
            return None;
        }
        Some(Self {
            published: (after.messages_published - before.messages_published) as f64 / seconds,
            delivered: (after.messages_delivered - before.messages_delivered) as f64 / seconds,
        })
    }
}

/// What is on the screen: the latest sample, the rates since the one
/// before, and the last error.
struct View {
    addr: String,
    sample: Option<Sample>,
    rates: Option<Rates>,
    error: Option<String>,
    refreshed: Option<SystemTime>,
}

/// How the lists share the height.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fit {
    /// Live: the terminal's height, each list cut to what fits.
    Screen,
    /// `--once`: every list with up to [`ONCE_ROWS`] rows.
    All,
}

impl View {
    fn new(addr: &str) -> Self {
        Self {
            addr: addr.to_owned(),
            sample: None,
            rates: None,
            error: None,
            refreshed: None,
        }
    }

    async fn refresh(&mut self, client: &Client) {
        match tokio::time::timeout(FETCH_TIMEOUT, fetch(client)).await {
            Ok(Ok(sample)) => {
                self.rates = self
                    .sample
                    .as_ref()
                    .and_then(|before| Rates::between(&before.info, &sample.info));
                self.sample = Some(sample);
                self.error = None;
                self.refreshed = Some(SystemTime::now());
            }
            Ok(Err(status)) => {
                let causes =
                    std::error::Error::source(&status).map_or_else(String::new, |e| format!(": {}", error_chain(e)));
                self.error = Some(format!("{:?}: {}{causes}", status.code(), status.message()));
            }
            Err(_) => {
                self.error = Some(format!(
                    "the broker did not answer within {} s",
                    FETCH_TIMEOUT.as_secs()
                ));
            }
        }
    }

    /// The frame as plain text, `width` columns wide, trailing blanks cut.
    fn text(&self, width: u16) -> String {
        let height = self.height_of_all();
        let area = Rect::new(0, 0, width, height);
        let mut buffer = Buffer::empty(area);
        self.render(area, &mut buffer, Fit::All);
        let mut out = String::new();
        for y in 0..height {
            let line: String = (0..width).map(|x| buffer[(x, y)].symbol()).collect();
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    /// Rows each list would like: its title, its column header and one
    /// per entry ("none" takes one too), at most `most` entries.
    fn wanted_rows(&self, most: usize) -> [u16; LISTS] {
        let counts = self.sample.as_ref().map_or([0; LISTS], |s| {
            [
                s.subscriptions.len(),
                s.groups.len(),
                s.members.len(),
                s.evictions.len(),
            ]
        });
        counts.map(|n| 2 + n.clamp(1, most.max(1)) as u16)
    }

    fn height_of_all(&self) -> u16 {
        HEADER_ROWS + self.wanted_rows(ONCE_ROWS).iter().sum::<u16>() + FOOTER_ROWS
    }

    fn render(&self, area: Rect, buf: &mut Buffer, fit: Fit) {
        let lists = match fit {
            Fit::Screen => share_rows(
                area.height.saturating_sub(HEADER_ROWS + FOOTER_ROWS),
                self.wanted_rows(usize::from(area.height)),
            ),
            Fit::All => self.wanted_rows(ONCE_ROWS),
        };
        let [header, subscriptions, groups, members, evictions, _, footer] = Layout::vertical([
            Constraint::Length(HEADER_ROWS),
            Constraint::Length(lists[0]),
            Constraint::Length(lists[1]),
            Constraint::Length(lists[2]),
            Constraint::Length(lists[3]),
            Constraint::Fill(1),
            Constraint::Length(FOOTER_ROWS),
        ])
        .areas(area);
        Paragraph::new(self.header_lines()).render(header, buf);
        Paragraph::new(self.footer_line(fit)).render(footer, buf);
        let Some(sample) = &self.sample else {
            return;
        };
        let replica = sample.info.cluster_mode
            || sample.subscriptions.iter().any(|s| !s.replica_id.is_empty())
            || sample.evictions.iter().any(|e| !e.replica_id.is_empty());
        let now = SystemTime::now();
        subscriptions_list(sample, replica).render(subscriptions, buf);
        groups_list(sample).render(groups, buf);
        members_list(sample, replica).render(members, buf);
        evictions_list(sample, replica, now).render(evictions, buf);
    }

    fn header_lines(&self) -> Vec<Line<'static>> {
        let bold = Style::new().add_modifier(Modifier::BOLD);
        let Some(sample) = &self.sample else {
            return vec![Line::styled(
                format!("tinybroker top · {} · connecting", self.addr),
                bold,
            )];
        };
        let i = &sample.info;
        let mut first = format!("tinybroker {} · {}", i.version, self.addr);
        if i.cluster_mode {
            first.push_str(&format!(" · cluster, replica {}", or_dash(&i.replica_id)));
        }
        if let Some(uptime) = i.uptime {
            first.push_str(&format!(" · up {}", human_duration(duration(uptime))));
        }
        let rates = match self.rates {
            Some(r) => format!("published {:.1}/s · delivered {:.1}/s", r.published, r.delivered),
            None => "published n/a · delivered n/a (rates need two samples)".to_owned(),
        };
        let scope = if i.cluster_mode { " (this replica)" } else { "" };
        // The totals of the lists below, not GetBrokerInfo's counts: in
        // cluster mode those are this replica's own, while the lists are the
        // cluster's (docs/contract.md, "tinybroker top").
        let second = format!(
            "{rates}{scope} · subscriptions {} · groups {} · last sequence {}",
            sample.subscriptions.len(),
            sample.groups.len(),
            i.last_sequence
        );
        vec![Line::styled(first, bold), Line::raw(second)]
    }

    fn footer_line(&self, fit: Fit) -> Line<'static> {
        let mut text = match fit {
            Fit::Screen => "q or Ctrl-C: quit · refreshed every second".to_owned(),
            Fit::All => format!("rates over {} s", REFRESH.as_secs()),
        };
        if let Some(at) = self.refreshed {
            // RFC 3339 to the second.
            let at = prost_types::Timestamp::from(at).to_string();
            let at = at.split_once('.').map_or(at.clone(), |(s, _)| format!("{s}Z"));
            text.push_str(&format!(" · {at}"));
        }
        match &self.error {
            Some(error) => Line::styled(
                format!("{text} · error: {error}"),
                Style::new().add_modifier(Modifier::REVERSED),
            ),
            None => Line::raw(text),
        }
    }
}

/// The lists under the header: subscriptions, groups, members, evictions.
const LISTS: usize = 4;

/// Shares `height` rows among the lists: first each list's title and
/// column header and one entry, in order, then one more row to each list
/// that wants more, in turn, until the rows or the wishes run out. A list
/// with few entries leaves the rest to the others.
fn share_rows<const N: usize>(height: u16, wanted: [u16; N]) -> [u16; N] {
    let mut rows = [0u16; N];
    let mut left = height;
    for (i, want) in wanted.iter().enumerate() {
        let first = (*want).min(3).min(left);
        rows[i] = first;
        left -= first;
    }
    while left > 0 && rows.iter().zip(&wanted).any(|(r, w)| r < w) {
        for i in 0..N {
            if left > 0 && rows[i] < wanted[i] {
                rows[i] += 1;
                left -= 1;
            }
        }
    }
    rows
}

const HEADER_ROWS: u16 = 2;
const FOOTER_ROWS: u16 = 1;

async fn fetch(client: &Client) -> Result<Sample, tonic::Status> {
    let (mut a, mut b, mut c, mut d) = (client.clone(), client.clone(), client.clone(), client.clone());
    let (info, subscriptions, groups, evictions) = tokio::join!(
        a.broker_info(),
        b.list_subscriptions(),
        c.list_groups(),
        d.list_evictions()
    );
    let (mut subscriptions, mut groups, mut evictions) = (subscriptions?, groups?, evictions?);
    sort_by_fill(&mut subscriptions);
    sort_by_backlog(&mut groups);
    sort_newest_first(&mut evictions);
    Ok(Sample {
        info: info?,
        members: members_by_oldest_unacked(&subscriptions),
        subscriptions,
        groups,
        evictions,
    })
}

/// The manual-ack group members among `subscriptions`, oldest unacked
/// message first, each marked as [`crate::group::hung`] says (the status
/// page marks the same members).
fn members_by_oldest_unacked(subscriptions: &[pb::SubscriptionInfo]) -> Vec<(pb::SubscriptionInfo, bool)> {
    let members: Vec<&pb::SubscriptionInfo> = subscriptions
        .iter()
        .filter(|s| s.ack_mode == pb::AckMode::Manual as i32 && !s.consumer_group.is_empty())
        .collect();
    let ages: Vec<(&str, Option<Duration>)> = members
        .iter()
        .map(|s| (s.consumer_group.as_str(), s.oldest_unacked_age.map(duration)))
        .collect();
    let marks = crate::group::hung::marks(&ages);
    let mut members: Vec<(pb::SubscriptionInfo, bool)> = members.into_iter().cloned().zip(marks).collect();
    members.sort_by(|(a, _), (b, _)| {
        let age = |s: &pb::SubscriptionInfo| s.oldest_unacked_age.map(duration);
        age(b)
            .cmp(&age(a))
            .then(b.unacked.cmp(&a.unacked))
            .then_with(|| a.consumer_group.cmp(&b.consumer_group))
            .then_with(|| a.subscription_id.cmp(&b.subscription_id))
    });
    members
}

/// A column of a list: its header, its width, the fewest columns it
/// needs, and its rank (1 is kept longest when the terminal is narrow).
struct Column {
    name: &'static str,
    width: Constraint,
    min: u16,
    rank: u8,
    number: bool,
}

const fn text(name: &'static str, width: Constraint, min: u16, rank: u8) -> Column {
    Column {
        name,
        width,
        min,
        rank,
        number: false,
    }
}

const fn number(name: &'static str, width: u16, rank: u8) -> Column {
    Column {
        name,
        width: Constraint::Length(width),
        min: width,
        rank,
        number: true,
    }
}

/// A titled table that fits its area: the rows that fit (the title says
/// how many of how many), the columns that fit by rank.
struct ListWidget {
    title: &'static str,
    columns: Vec<Column>,
    rows: Vec<Vec<String>>,
    /// Rows drawn in reverse video (a member that looks hung); empty: none.
    highlight: Vec<bool>,
}

const COLUMN_SPACING: u16 = 2;

impl ListWidget {
    /// Which columns fit `width`, in their order: the best ranked first.
    fn fitting(&self, width: u16) -> Vec<usize> {
        let mut by_rank: Vec<usize> = (0..self.columns.len()).collect();
        by_rank.sort_by_key(|&i| self.columns[i].rank);
        let mut kept = Vec::new();
        let mut used = 0u16;
        for i in by_rank {
            let need = self.columns[i].min + if kept.is_empty() { 0 } else { COLUMN_SPACING };
            if used + need > width {
                break;
            }
            used += need;
            kept.push(i);
        }
        kept.sort_unstable();
        kept
    }
}

impl Widget for ListWidget {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let total = self.rows.len();
        // The title line and the column header take two rows.
        let shown = total.min(usize::from(area.height.saturating_sub(2)));
        let title = if total == 0 {
            format!(" {} (none) ", self.title)
        } else if shown < total {
            format!(" {} ({shown} of {total}) ", self.title)
        } else {
            format!(" {} ({total}) ", self.title)
        };
        let block = Block::new()
            .borders(Borders::TOP)
            .title(Line::styled(title, Style::new().add_modifier(Modifier::BOLD)));
        let kept = self.fitting(area.width);
        let cell = |column: &Column, value: String| {
            if column.number {
                Cell::from(Line::from(value).right_aligned())
            } else {
                Cell::from(value)
            }
        };
        let header = Row::new(
            kept.iter()
                .map(|&i| cell(&self.columns[i], self.columns[i].name.to_owned())),
        )
        .style(Style::new().add_modifier(Modifier::UNDERLINED));
        let highlight = self.highlight;
        let rows = self.rows.into_iter().take(shown).enumerate().map(|(n, mut values)| {
            let row = Row::new(
                kept.iter()
                    .map(|&i| cell(&self.columns[i], std::mem::take(&mut values[i])))
                    .collect::<Vec<_>>(),
            );
            if highlight.get(n).copied().unwrap_or(false) {
                row.style(Style::new().add_modifier(Modifier::REVERSED | Modifier::BOLD))
            } else {
                row
            }
        });
        let widths: Vec<Constraint> = kept.iter().map(|&i| self.columns[i].width).collect();
        Table::new(rows, widths)
            .header(header)
            .block(block)
            .column_spacing(COLUMN_SPACING)
            .render(area, buf);
    }
}

fn subscriptions_list(sample: &Sample, replica: bool) -> ListWidget {
    // A generated id is 36 characters; on a narrow terminal the patterns
    // give way first, then the columns of least use.
    let mut columns = vec![
        text("ID", Constraint::Max(36), 16, 1),
        text("GROUP", Constraint::Max(16), 8, 5),
        text("PATTERNS", Constraint::Fill(1), 8, 6),
        number("QUEUE", 13, 2),
        number("FILL", 5, 3),
        number("UNACKED", 8, 3),
        number("DELIVERED", 10, 4),
    ];
    if replica {
        columns.push(text("REPLICA", Constraint::Max(12), 7, 5));
    }
    let rows = sample
        .subscriptions
        .iter()
        .map(|s| {
            let mut cells = vec![
                s.subscription_id.clone(),
                or_dash(&s.consumer_group),
                s.topic_patterns.join(","),
                format!("{}/{}", s.queue_depth, s.capacity),
                percent(fill(s)),
                unacked_cell(s),
                s.delivered.to_string(),
            ];
            if replica {
                cells.push(or_dash(&s.replica_id));
            }
            cells
        })
        .collect();
    ListWidget {
        title: "Subscriptions, fullest first",
        columns,
        rows,
        highlight: Vec::new(),
    }
}

fn groups_list(sample: &Sample) -> ListWidget {
    let columns = vec![
        text("GROUP", Constraint::Fill(1), 16, 1),
        number("MEMBERS", 7, 4),
        number("BACKLOG", 9, 2),
        number("IN FLIGHT", 9, 5),
        number("OLDEST UNACKED", 14, 3),
        number("REDELIVERED", 11, 6),
        number("DEAD", 6, 7),
    ];
    let rows = sample
        .groups
        .iter()
        .map(|g| {
            vec![
                g.name.clone(),
                g.members.to_string(),
                g.backlog.to_string(),
                g.in_flight.to_string(),
                g.oldest_unacked_age
                    .map_or_else(|| "-".to_owned(), |d| human_duration(duration(d))),
                g.redeliveries.to_string(),
                g.dead_lettered.to_string(),
            ]
        })
        .collect();
    ListWidget {
        title: "Consumer groups, largest backlog first",
        columns,
        rows,
        highlight: Vec::new(),
    }
}

/// What marks a member that looks hung, in its own first column.
const HUNG_MARK: &str = "HUNG?";

fn members_list(sample: &Sample, replica: bool) -> ListWidget {
    let mut columns = vec![
        text("", Constraint::Length(5), 5, 1),
        text("ID", Constraint::Max(36), 16, 1),
        text("GROUP", Constraint::Max(16), 8, 4),
        number("OLDEST UNACKED", 14, 2),
        number("UNACKED", 8, 3),
        number("QUEUE", 13, 6),
        number("DELIVERED", 10, 5),
    ];
    if replica {
        columns.push(text("REPLICA", Constraint::Max(12), 7, 4));
    }
    let (rows, highlight): (Vec<Vec<String>>, Vec<bool>) = sample
        .members
        .iter()
        .map(|(s, hung)| {
            let mut cells = vec![
                if *hung { HUNG_MARK.to_owned() } else { String::new() },
                s.subscription_id.clone(),
                s.consumer_group.clone(),
                s.oldest_unacked_age
                    .map_or_else(|| "-".to_owned(), |d| human_duration(duration(d))),
                s.unacked.to_string(),
                format!("{}/{}", s.queue_depth, s.capacity),
                s.delivered.to_string(),
            ];
            if replica {
                cells.push(or_dash(&s.replica_id));
            }
            (cells, *hung)
        })
        .unzip();
    ListWidget {
        title: "Group members, oldest unacked first",
        columns,
        rows,
        highlight,
    }
}

fn evictions_list(sample: &Sample, replica: bool, now: SystemTime) -> ListWidget {
    let mut columns = vec![
        number("EVICTED", 11, 2),
        text("ID", Constraint::Max(36), 16, 1),
        text("PATTERNS", Constraint::Fill(1), 8, 5),
        number("QUEUE DEPTH", 11, 3),
        number("LAST SEQUENCE", 13, 4),
    ];
    if replica {
        columns.push(text("REPLICA", Constraint::Max(12), 7, 4));
    }
    let rows = sample
        .evictions
        .iter()
        .map(|e| {
            let mut cells = vec![
                e.evicted_at
                    .map_or_else(|| "-".to_owned(), |t| format!("{} ago", human_duration(age(t, now)))),
                e.subscription_id.clone(),
                e.topic_patterns.join(","),
                e.queue_depth.to_string(),
                e.last_delivered_sequence.to_string(),
            ];
            if replica {
                cells.push(or_dash(&e.replica_id));
            }
            cells
        })
        .collect();
    ListWidget {
        title: "Latest evictions",
        columns,
        rows,
        highlight: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(uptime_s: i64, published: u64, delivered: u64) -> pb::GetBrokerInfoResponse {
        pb::GetBrokerInfoResponse {
            uptime: Some(prost_types::Duration {
                seconds: uptime_s,
                nanos: 0,
            }),
            messages_published: published,
            messages_delivered: delivered,
            ..Default::default()
        }
    }

    #[test]
    fn rates_are_per_second_of_the_brokers_uptime_and_only_between_samples_of_one_broker() {
        let r = Rates::between(&info(10, 100, 300), &info(12, 300, 900)).unwrap();
        assert_eq!((r.published, r.delivered), (100.0, 300.0));
        assert!(
            Rates::between(&info(10, 100, 300), &info(10, 100, 300)).is_none(),
            "no time"
        );
        assert!(
            Rates::between(&info(10, 100, 300), &info(2, 5, 5)).is_none(),
            "restarted"
        );
    }

    fn sample(subscriptions: usize) -> Sample {
        Sample {
            info: info(5, 0, 0),
            subscriptions: (0..subscriptions)
                .map(|i| pb::SubscriptionInfo {
                    subscription_id: format!("sub-{i:03}"),
                    topic_patterns: vec!["a.>".into()],
                    capacity: 1024,
                    ..Default::default()
                })
                .collect(),
            groups: vec![pb::ConsumerGroupInfo {
                name: "workers".into(),
                backlog: 42,
                ..Default::default()
            }],
            members: Vec::new(),
            evictions: Vec::new(),
        }
    }

    fn screen(view: &View, width: u16, height: u16) -> Vec<String> {
        let area = Rect::new(0, 0, width, height);
        let mut buffer = Buffer::empty(area);
        view.render(area, &mut buffer, Fit::Screen);
        (0..height)
            .map(|y| (0..width).map(|x| buffer[(x, y)].symbol()).collect::<String>())
            .collect()
    }

    #[test]
    fn a_small_screen_shows_what_fits_and_says_how_many_there_are() {
        let mut view = View::new("http://b:1");
        view.sample = Some(sample(30));
        let lines = screen(&view, 60, 16);
        let text = lines.join("\n");
        assert!(text.contains("of 30)"), "{text}");
        assert!(text.contains("sub-000"), "{text}");
        assert!(!text.contains("sub-029"), "{text}");
        assert!(text.contains("workers"), "{text}");
        assert!(lines.last().unwrap().starts_with("q or Ctrl-C: quit"), "{text}");
    }

    /// In cluster mode GetBrokerInfo counts this replica's subscriptions
    /// and groups, the lists the cluster's: the header says what the lists
    /// hold (r2 once said "subscriptions 2 · groups 0" over 3 and 1).
    #[test]
    fn the_headers_totals_are_those_of_the_lists_under_it() {
        let mut view = View::new("http://b:1");
        let mut sample = sample(3);
        sample.info.cluster_mode = true;
        sample.info.subscriptions = 2;
        sample.info.consumer_groups = 0;
        view.sample = Some(sample);
        let text = screen(&view, 120, 30).join("\n");
        assert!(text.contains("subscriptions 3 · groups 1 ·"), "{text}");
    }

    #[test]
    fn rows_go_to_every_list_before_any_gets_many() {
        // Room for all: each gets what it wants.
        assert_eq!(share_rows(40, [12, 3, 4]), [12, 3, 4]);
        // Little room: title, header and one entry each, then in turn.
        assert_eq!(share_rows(13, [32, 12, 3]), [5, 5, 3]);
        // Less than that: the first lists first.
        assert_eq!(share_rows(5, [32, 12, 3]), [3, 2, 0]);
    }

    #[test]
    fn a_narrow_screen_keeps_the_columns_that_matter_most() {
        let mut view = View::new("http://b:1");
        let mut s = sample(1);
        s.groups[0].oldest_unacked_age = Some(prost_types::Duration { seconds: 75, nanos: 0 });
        view.sample = Some(s);
        let text = screen(&view, 50, 20).join("\n");
        for kept in [
            "BACKLOG",
            "OLDEST UNACKED",
            "workers",
            "42",
            "1m15s",
            "QUEUE",
            "sub-000",
        ] {
            assert!(text.contains(kept), "{kept} in {text}");
        }
        for dropped in ["REDELIVERED", "DEAD", "PATTERNS"] {
            assert!(!text.contains(dropped), "{dropped} in {text}");
        }
    }

    /// A busy group: every member holds its max_in_flight, and the one
    /// whose oldest unacked message is far older than the others' is
    /// listed first among the members, marked.
    #[test]
    fn a_hung_member_comes_first_among_the_members_marked() {
        let member = |id: &str, seconds: Option<i64>| pb::SubscriptionInfo {
            subscription_id: id.into(),
            consumer_group: "workers".into(),
            mode: pb::DeliveryMode::Single as i32,
            ack_mode: pb::AckMode::Manual as i32,
            unacked: 16,
            capacity: 16,
            oldest_unacked_age: seconds.map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
            ..Default::default()
        };
        let mut view = View::new("http://b:1");
        let mut s = sample(0);
        let listed = vec![
            member("worker-1", Some(2)),
            member("worker-hung", Some(13)),
            member("worker-2", Some(1)),
            pb::SubscriptionInfo {
                subscription_id: "watcher".into(),
                ..Default::default()
            },
        ];
        s.members = members_by_oldest_unacked(&listed);
        s.subscriptions = listed;
        view.sample = Some(s);
        let text = view.text(120);
        let members: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with(" Group members, oldest unacked first (3)"))
            .skip(2)
            .take(3)
            .collect();
        assert!(members[0].starts_with("HUNG?  worker-hung"), "{text}");
        assert!(members[0].contains(" 13s "), "{text}");
        assert!(members[1].trim_start().starts_with("worker-1"), "{text}");
        assert!(!text.contains("HUNG?  worker-1"), "{text}");
        // On a narrow screen the mark and the id stay.
        let narrow = screen(&view, 40, 30).join("\n");
        assert!(narrow.contains("HUNG?  worker-hung"), "{narrow}");
    }

    #[test]
    fn a_once_frame_lists_everything_up_to_its_row_limit() {
        let mut view = View::new("http://b:1");
        view.sample = Some(sample(3));
        let text = view.text(100);
        for id in ["sub-000", "sub-001", "sub-002", "workers", "rates need two samples"] {
            assert!(text.contains(id), "{id} in {text}");
        }
        assert!(text.lines().all(|l| l.chars().count() <= 100));
    }
}
