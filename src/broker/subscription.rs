//! One open subscription and the stream of its deliveries.

use super::Broker;
use super::group::ConsumerGroup;
use crate::engine::Delivery;
use crate::engine::queue::{Push, Queue};
use crate::engine::{AckMode, CloseReason, DeliveryMode, Peaks, SubscriptionInfo};
use crate::group::MemberSettings;
use crate::topic::TopicPattern;
use futures::Stream;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::SystemTime;

/// A subscription: its patterns, its queue, and what it has delivered.
/// What only members have is boxed, and a broadcast subscription's queue is
/// in the same allocation, so it is small (many of them sit idle: 208
/// bytes with its queue, 224 with the `Arc`'s counts, jemalloc's 224-byte
/// class, against two allocations of 128).
pub struct Subscription {
    /// Key of this subscription's entries in the routing trie.
    pub(crate) key: u64,
    id: Arc<str>,
    patterns: Box<[TopicPattern]>,
    peer: Peer,
    /// When it was opened, in nanoseconds since the Unix epoch (8 bytes, not
    /// `SystemTime`'s 16).
    opened_at: u64,
    /// Its own, or shared with its group's machine when it is a member (the
    /// queue the group pushes into).
    pub(crate) queue: QueueSlot,
    delivered: AtomicU64,
    last_delivered_sequence: AtomicU64,
    /// Set once the subscription has left routing and the registry.
    pub(crate) detached: AtomicBool,
    /// Set for consumer-group members.
    role: Option<Box<Role>>,
}

/// A subscription's queue: in the subscription itself for a broadcast
/// one, shared (an `Arc`) for a group member, whose group's machine holds
/// it too. The same 112 bytes as a `Queue` (its `bool` gives the variant a
/// place).
pub(crate) enum QueueSlot {
    Own(Queue),
    Shared(Arc<Queue>),
}

impl std::ops::Deref for QueueSlot {
    type Target = Queue;

    #[inline]
    fn deref(&self) -> &Queue {
        match self {
            QueueSlot::Own(queue) => queue,
            QueueSlot::Shared(queue) => queue,
        }
    }
}

impl QueueSlot {
    /// The queue a group's machine holds, for a member's.
    pub(crate) fn shared(&self) -> Option<&Arc<Queue>> {
        match self {
            QueueSlot::Own(_) => None,
            QueueSlot::Shared(queue) => Some(queue),
        }
    }
}

/// What makes a subscription a consumer-group member.
enum Role {
    /// A member of a group this engine runs.
    Member(Membership),
    /// A member of a group another engine runs (cluster mode).
    External(ExternalMember),
}

/// A subscriber's address in 20 bytes, where an `Option<SocketAddr>` takes
/// 32: the IP as 16 bytes (an IPv4 address mapped), the port, and which of
/// none, IPv4 or IPv6 it is. An IPv6 address's flow label and scope id are
/// not kept; listings and logs show the address and port.
#[derive(Clone, Copy)]
struct Peer {
    ip: [u8; 16],
    port: u16,
    kind: PeerKind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PeerKind {
    None,
    V4,
    V6,
}

impl Peer {
    fn new(peer: Option<SocketAddr>) -> Self {
        match peer {
            None => Self {
                ip: [0; 16],
                port: 0,
                kind: PeerKind::None,
            },
            Some(SocketAddr::V4(a)) => Self {
                ip: a.ip().to_ipv6_mapped().octets(),
                port: a.port(),
                kind: PeerKind::V4,
            },
            Some(SocketAddr::V6(a)) => Self {
                ip: a.ip().octets(),
                port: a.port(),
                kind: PeerKind::V6,
            },
        }
    }

    fn get(self) -> Option<SocketAddr> {
        let ip = std::net::Ipv6Addr::from(self.ip);
        match self.kind {
            PeerKind::None => None,
            PeerKind::V4 => ip.to_ipv4_mapped().map(|v4| SocketAddr::from((v4, self.port))),
            PeerKind::V6 => Some(SocketAddr::from((ip, self.port))),
        }
    }
}

/// What makes a subscription a consumer-group member: its group, and the
/// settings it joined with.
pub(crate) struct Membership {
    pub(crate) group: Arc<ConsumerGroup>,
    pub(crate) settings: MemberSettings,
}

/// A member of a consumer group that another engine runs (the cluster
/// engine, over JetStream): not routed by the trie; that engine fills its
/// queue and takes back what is left when it closes.
#[derive(Debug, Clone)]
pub struct ExternalMember {
    pub group: String,
    pub ack_mode: AckMode,
}

impl Subscription {
    pub(crate) fn new(
        key: u64,
        id: Arc<str>,
        patterns: Vec<TopicPattern>,
        peer: Option<SocketAddr>,
        queue: QueueSlot,
        membership: Option<Membership>,
    ) -> Self {
        Self {
            key,
            id,
            patterns: patterns.into_boxed_slice(),
            peer: Peer::new(peer),
            opened_at: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |since| u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)),
            queue,
            delivered: AtomicU64::new(0),
            last_delivered_sequence: AtomicU64::new(0),
            detached: AtomicBool::new(false),
            role: membership.map(|m| Box::new(Role::Member(m))),
        }
    }

    /// A broadcast subscription (routed by the trie, its losses its own).
    pub(crate) fn is_broadcast(&self) -> bool {
        self.role.is_none()
    }

    pub(crate) fn set_external(&mut self, member: ExternalMember) {
        self.role = Some(Box::new(Role::External(member)));
    }

    /// Hands a delivery to an external member's queue; gives it back when
    /// the queue is closed or full.
    pub fn hand(&self, delivery: Delivery) -> Result<(), Delivery> {
        match self.queue.push(delivery) {
            Push::Queued => Ok(()),
            Push::Full { item, .. } | Push::Closed(item) => Err(item),
        }
    }

    pub(crate) fn external(&self) -> Option<&ExternalMember> {
        match self.role.as_deref() {
            Some(Role::External(e)) => Some(e),
            _ => None,
        }
    }

    pub(crate) fn membership(&self) -> Option<&Membership> {
        match self.role.as_deref() {
            Some(Role::Member(m)) => Some(m),
            _ => None,
        }
    }

    /// The group's name, for consumer-group members.
    pub fn consumer_group(&self) -> Option<&str> {
        match self.role.as_deref()? {
            Role::Member(m) => Some(m.group.name()),
            Role::External(e) => Some(&e.group),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn patterns(&self) -> &[TopicPattern] {
        &self.patterns
    }

    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer.get()
    }

    pub fn opened_at(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(self.opened_at)
    }

    /// Messages handed to the subscriber's stream so far.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    pub fn last_delivered_sequence(&self) -> u64 {
        self.last_delivered_sequence.load(Ordering::Relaxed)
    }

    /// Why the broker ended it, once it has (None while open).
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.queue.close_reason()
    }

    /// What it lost when it was closed: the messages its queue still held
    /// and, for an eviction, the one that did not fit (0 for group members,
    /// whose messages go back to the group).
    pub fn dropped_at_close(&self) -> u64 {
        self.queue.lost()
    }

    /// Live queue depth.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    pub fn capacity(&self) -> usize {
        self.queue.capacity()
    }

    /// What Admin and the metrics see. With [`Peaks::Take`] the queue
    /// starts a new peak period: called once per scrape, so every scrape
    /// sees the peak of the last two scrape intervals (see
    /// [`Queue::take_peak`]).
    pub fn info(&self, peaks: Peaks, replica_id: &str) -> SubscriptionInfo {
        let (mode, consumer_group, ack_mode) = match self.role.as_deref() {
            Some(Role::Member(m)) => (
                DeliveryMode::Single,
                m.group.name().to_owned(),
                Some(m.settings.ack_mode),
            ),
            Some(Role::External(e)) => (DeliveryMode::Single, e.group.clone(), Some(e.ack_mode)),
            None => (DeliveryMode::Multi, String::new(), None),
        };
        SubscriptionInfo {
            subscription_id: self.id.to_string(),
            mode,
            consumer_group,
            ack_mode,
            topic_patterns: self.patterns.iter().map(|p| p.to_string()).collect(),
            queue_depth: self.queue_depth(),
            queue_peak: match peaks {
                Peaks::Take => self.queue.take_peak(),
                Peaks::Keep => self.queue.peak(),
            },
            capacity: self.capacity(),
            delivered: self.delivered(),
            opened_at: self.opened_at(),
            peer: self.peer(),
            replica_id: replica_id.to_owned(),
            unacked: 0,
            oldest_unacked_age: None,
            stalled: None,
        }
    }
}

/// The deliveries of one subscription, in queue order. Ends when the
/// subscription is evicted, closed by an admin, or the broker shuts down.
/// Dropping it (the client went away) closes the subscription at once.
pub struct SubscriptionStream {
    broker: Broker,
    subscription: Arc<Subscription>,
    /// Deliveries not yet added to the broker-wide counter; flushed when the
    /// queue runs dry and on drop, so busy streams don't contend on it.
    unflushed: u32,
    /// Auto-ack group members: messages streamed but not yet reported to
    /// the group (which then counts the member as having room for them).
    /// Reported every `report_every` and whenever the queue runs dry, so the
    /// group's lock is taken once per run, not per message.
    unreported: u32,
    /// `Some` for auto-ack group members only.
    report_every: Option<NonZeroU32>,
    /// Deliveries handed out since the queue last ran dry or the stream
    /// last yielded (see [`TURN`]).
    turn: u32,
}

/// Most deliveries a stream hands out in a row before it yields once: a
/// stream whose queue is always full would otherwise keep its connection's
/// task (and worker) to itself, starving the connection's other
/// subscriptions and its writes, and in a consumer group it would take every
/// refill of the backlog for itself. The stream's own count, not tokio's
/// cooperative budget: a connection's requests share its task
/// ([`crate::grpc::executor`]), and one budget shared by 50 subscriptions ran out
/// after two or three deliveries each.
const TURN: u32 = 128;

impl SubscriptionStream {
    pub(crate) fn new(broker: Broker, subscription: Arc<Subscription>) -> Self {
        let report_every = subscription
            .membership()
            .filter(|m| m.settings.ack_mode == AckMode::Auto)
            .and_then(|m| NonZeroU32::new((m.settings.max_in_flight / 4).clamp(1, 64)));
        Self {
            broker,
            subscription,
            unflushed: 0,
            turn: 0,
            unreported: 0,
            report_every,
        }
    }

    #[inline]
    fn report_streamed(&mut self) {
        if self.unreported > 0 {
            self.report_to_group();
        }
    }

    /// Out of line: only an AUTO member has anything to report, and with
    /// the group's lock and machine inlined here `report_streamed` was no
    /// longer inlined into the stream's poll, a call on every broadcast
    /// delivery (the guard's wide fan-out: about 28 instructions each).
    #[inline(never)]
    fn report_to_group(&mut self) {
        if let Some(m) = self.subscription.membership() {
            m.group
                .streamed(self.subscription.key, self.unreported, tokio::time::Instant::now());
        }
        self.unreported = 0;
    }

    pub fn subscription(&self) -> &Arc<Subscription> {
        &self.subscription
    }

    pub fn id(&self) -> &str {
        self.subscription.id()
    }

    fn flush_delivered(&mut self) {
        if self.unflushed > 0 {
            let stats = self.broker.stats();
            let counter = if !self.subscription.is_broadcast() {
                &stats.delivered_single
            } else {
                &stats.delivered_multi
            };
            counter.fetch_add(u64::from(self.unflushed), Ordering::Relaxed);
            if let Some(m) = self.subscription.membership() {
                m.group.add_delivered(u64::from(self.unflushed));
            }
            self.unflushed = 0;
        }
    }
}

impl SubscriptionStream {
    /// Closes the subscription as its client going away does (see
    /// [`crate::engine::DeliveryStream::close`]).
    pub(crate) fn close(&mut self) {
        self.flush_delivered();
        self.broker.close_on_drop(&self.subscription);
    }

    /// A session's in-band ack or nack, through this subscription: how many
    /// of `sequences` it did not hold.
    pub(super) fn settle(&self, sequences: &[u64], nack: bool) -> u32 {
        match nack {
            false => self.broker.ack_held(&self.subscription, sequences).unknown,
            true => self.broker.nack_held(&self.subscription, sequences).unknown,
        }
    }
}

impl Stream for SubscriptionStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        self.poll_delivery(cx, false)
            .map(|next| next.map(|(delivery, _)| delivery))
    }
}

impl SubscriptionStream {
    /// The next delivery. `drained`: ask the queue whether it was the last
    /// one queued, and if so do now what finding it empty would do.
    pub(crate) fn poll_delivery(&mut self, cx: &mut Context<'_>, drained: bool) -> Poll<Option<(Delivery, bool)>> {
        const FLUSH_EVERY: u32 = 256;
        if self.turn >= TURN {
            self.turn = 0;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let queue = &self.subscription.queue;
        let polled = if drained {
            queue.poll_pop_drained(cx)
        } else {
            queue.poll_pop(cx).map(|next| next.map(|delivery| (delivery, false)))
        };
        match &polled {
            Poll::Ready(Some((delivery, emptied))) => {
                self.turn += 1;
                let sub = &self.subscription;
                sub.delivered.fetch_add(1, Ordering::Relaxed);
                sub.last_delivered_sequence
                    .store(delivery.message.sequence, Ordering::Relaxed);
                if let Some(every) = self.report_every {
                    self.unreported += 1;
                    if self.unreported >= every.get() {
                        self.report_streamed();
                    }
                }
                self.unflushed += 1;
                if *emptied {
                    self.waiting();
                } else if self.unflushed >= FLUSH_EVERY {
                    self.flush_delivered();
                }
            }
            Poll::Ready(None) => self.flush_delivered(),
            Poll::Pending => self.waiting(),
        }
        polled
    }

    /// The queue is empty and the waker left: what was counted goes out,
    /// and a group refills this member now (its pushes wake that waker).
    fn waiting(&mut self) {
        self.turn = 0;
        self.flush_delivered();
        self.report_streamed();
    }
}

impl Drop for SubscriptionStream {
    fn drop(&mut self) {
        self.flush_delivered();
        self.broker.close_on_drop(&self.subscription);
    }
}
