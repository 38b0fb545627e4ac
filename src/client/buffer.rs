//! The client's publish buffer (docs/clients.md, "Publishing"), kept by the
//! session task: [`super::Client::publish`] puts a message in it and
//! returns; the task writes what it holds as `SessionPublish` batches
//! whenever the session is open and fewer than [`BATCHES_IN_FLIGHT`] are
//! unanswered (after each turn of its loop, so a message never waits for
//! others to arrive), and [`super::Client::flush`] hears what became of
//! every message published before it.
//!
//! The bound in bytes is not kept here but by the client's semaphore: a
//! message takes its permits before it is handed to the task and gives them
//! back once it is written to a session.

use super::Rejection;
use crate::pb;
use prost::Message as _;
use std::collections::VecDeque;
use std::ops::RangeInclusive;
use tokio::sync::oneshot;

/// docs/clients.md `BUFFER_BYTES`: encoded bytes published and not yet
/// written to a session, at most (a larger message waits for an empty
/// buffer).
pub const BUFFER_BYTES: usize = 8 << 20;
/// docs/clients.md `BATCH_BYTES`.
pub(crate) const BATCH_BYTES: usize = 512 * 1024;
/// docs/clients.md `BATCHES_IN_FLIGHT`: buffered batches written and not
/// answered, at most (the broker reads no further ahead either).
pub(crate) const BATCHES_IN_FLIGHT: usize = 4;
/// What a batch adds around each message, at most: its key and length.
const MESSAGE_FRAMING: usize = 6;

/// What became of the messages published since the previous flush (each
/// message is in exactly one report).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// How many the broker accepted.
    pub accepted: u64,
    /// Each one it rejected: `index` counts the client's publishes from 0.
    pub rejected: Vec<Rejection>,
    /// Indexes of messages written to a session lost before the broker
    /// answered: they may or may not have been published, and were not
    /// sent again.
    pub unconfirmed: Vec<RangeInclusive<u64>>,
}

impl FlushReport {
    /// How many messages were unconfirmed.
    pub fn unconfirmed_count(&self) -> u64 {
        self.unconfirmed.iter().map(|r| r.end() - r.start() + 1).sum()
    }
}

/// What a message counts for in the buffer's bound: its encoded size in a
/// batch.
pub(crate) fn message_bytes(message: &pb::PublishRequest) -> usize {
    message.encoded_len() + MESSAGE_FRAMING
}

/// A message published and not yet written.
struct Queued {
    request: pb::PublishRequest,
    bytes: usize,
    /// The semaphore permits it holds until it is written.
    permits: u32,
}

/// A buffered batch written and not answered.
struct InFlight {
    id: u64,
    first_index: u64,
    topics: Vec<String>,
}

/// A batch to write: its messages, their first index and their topics (for
/// the rejections), and the permits to give back.
pub(crate) struct Batch {
    pub(crate) first_index: u64,
    pub(crate) messages: Vec<pb::PublishRequest>,
    pub(crate) topics: Vec<String>,
    pub(crate) permits: u32,
    /// Their bytes as [`message_bytes`] counts them.
    pub(crate) bytes: usize,
}

pub(crate) struct PublishBuffer {
    queued: VecDeque<Queued>,
    queued_bytes: usize,
    /// The index of the oldest queued message.
    first_queued: u64,
    in_flight: VecDeque<InFlight>,
    report: FlushReport,
    /// Flushes waiting, each for every index below its own.
    flushes: Vec<(u64, oneshot::Sender<FlushReport>)>,
    /// Messages in one batch at most: the broker's `max_batch_messages`
    /// once known.
    pub(crate) batch_messages: usize,
}

impl Default for PublishBuffer {
    fn default() -> Self {
        Self {
            queued: VecDeque::new(),
            queued_bytes: 0,
            first_queued: 0,
            in_flight: VecDeque::new(),
            report: FlushReport::default(),
            flushes: Vec::new(),
            batch_messages: super::DEFAULT_BATCH_MESSAGES,
        }
    }
}

impl PublishBuffer {
    /// Adds a message; it holds `permits` until written.
    pub(crate) fn push(&mut self, request: pb::PublishRequest, permits: u32) {
        let bytes = message_bytes(&request);
        self.queued_bytes += bytes;
        self.queued.push_back(Queued {
            request,
            bytes,
            permits,
        });
    }

    pub(crate) fn has_queued(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Whether a message published has no outcome yet.
    pub(crate) fn outstanding(&self) -> bool {
        !self.queued.is_empty() || !self.in_flight.is_empty()
    }

    /// The next batch to write, if there is one and room in flight: the
    /// oldest messages, at most `batch_messages` and [`BATCH_BYTES`] (a
    /// larger message alone).
    pub(crate) fn next_batch(&mut self) -> Option<Batch> {
        if self.queued.is_empty() || self.in_flight.len() >= BATCHES_IN_FLIGHT {
            return None;
        }
        let first_index = self.first_queued;
        let mut batch = Batch {
            first_index,
            messages: Vec::new(),
            topics: Vec::new(),
            permits: 0,
            bytes: 0,
        };
        let mut bytes = 0;
        while let Some(next) = self.queued.front() {
            let full = batch.messages.len() >= self.batch_messages.max(1)
                || (!batch.messages.is_empty() && bytes + next.bytes > BATCH_BYTES);
            if full {
                break;
            }
            let next = self.queued.pop_front().expect("looked at above");
            bytes += next.bytes;
            self.queued_bytes -= next.bytes;
            batch.permits += next.permits;
            batch.topics.push(next.request.topic.clone());
            batch.messages.push(next.request);
        }
        self.first_queued += batch.messages.len() as u64;
        batch.bytes = bytes;
        Some(batch)
    }

    /// `batch` was written under publish `id`.
    pub(crate) fn written(&mut self, id: u64, first_index: u64, topics: Vec<String>) {
        self.in_flight.push_back(InFlight {
            id,
            first_index,
            topics,
        });
    }

    /// The broker answered publish `published.id`; false if that was not a
    /// buffered batch.
    pub(crate) fn answered(&mut self, published: pb::SessionPublished) -> bool {
        let Some(at) = self.in_flight.iter().position(|b| b.id == published.id) else {
            return false;
        };
        let batch = self.in_flight.remove(at).expect("found above");
        self.report.accepted += u64::from(published.accepted);
        for r in published.rejected {
            self.report.rejected.push(Rejection {
                index: batch.first_index + u64::from(r.index),
                topic: batch.topics.get(r.index as usize).cloned().unwrap_or_default(),
                code: tonic::Code::from_i32(r.code as i32),
                message: r.message,
            });
        }
        self.settle_flushes();
        true
    }

    /// The session is lost: every batch on it is unconfirmed.
    pub(crate) fn lost(&mut self) {
        for batch in self.in_flight.drain(..) {
            let last = batch.first_index + batch.topics.len() as u64 - 1;
            self.report.unconfirmed.push(batch.first_index..=last);
        }
        self.settle_flushes();
    }

    /// A flush of everything published so far: answered once each of it
    /// has an outcome.
    pub(crate) fn flush(&mut self, answer: oneshot::Sender<FlushReport>) {
        let cut = self.first_queued + self.queued.len() as u64;
        self.flushes.push((cut, answer));
        self.settle_flushes();
    }

    /// The index below which every message has an outcome.
    fn settled_below(&self) -> u64 {
        match self.in_flight.front() {
            Some(batch) => batch.first_index,
            None => self.first_queued,
        }
    }

    fn settle_flushes(&mut self) {
        let settled = self.settled_below();
        // A flush whose caller is gone leaves its outcomes to the next.
        self.flushes.retain(|(_, answer)| !answer.is_closed());
        while let Some(at) = self.flushes.iter().position(|(cut, _)| *cut <= settled) {
            let (_, answer) = self.flushes.swap_remove(at);
            if let Err(report) = answer.send(std::mem::take(&mut self.report)) {
                self.report = report;
            }
        }
    }

    /// Drops every message still queued (the client is closing): how many,
    /// and their bytes.
    pub(crate) fn drop_queued(&mut self) -> (usize, usize) {
        let count = self.queued.len();
        self.queued.clear();
        self.first_queued += count as u64;
        (count, std::mem::take(&mut self.queued_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(topic: &str, payload: usize) -> pb::PublishRequest {
        pb::PublishRequest {
            topic: topic.into(),
            payload: vec![0; payload].into(),
            headers: Default::default(),
        }
    }

    #[test]
    fn batches_are_cut_by_count_and_bytes_and_at_most_four_are_in_flight() {
        let mut buffer = PublishBuffer {
            batch_messages: 3,
            ..Default::default()
        };
        for _ in 0..7 {
            buffer.push(message("a", 10), 1);
        }
        buffer.push(message("big", BATCH_BYTES), 1);
        buffer.push(message("b", 10), 1);
        let mut sizes = Vec::new();
        let mut id = 0;
        while let Some(batch) = buffer.next_batch() {
            id += 1;
            sizes.push((batch.first_index, batch.messages.len()));
            buffer.written(id, batch.first_index, batch.topics);
        }
        // By count (3, 3), then 1 before the message over the bytes, which
        // goes alone; the fifth waits for an answer.
        assert_eq!(sizes, [(0, 3), (3, 3), (6, 1), (7, 1)]);
        assert!(buffer.has_queued());
        assert!(buffer.answered(pb::SessionPublished {
            id: 1,
            accepted: 3,
            ..Default::default()
        }));
        assert_eq!(
            buffer.next_batch().map(|b| (b.first_index, b.messages.len())),
            Some((8, 1))
        );
    }

    #[test]
    fn a_flush_hears_every_outcome_before_it_once() {
        let mut buffer = PublishBuffer::default();
        for topic in ["ok", "bad topic", "ok"] {
            buffer.push(message(topic, 1), 1);
        }
        let batch = buffer.next_batch().unwrap();
        buffer.written(1, batch.first_index, batch.topics);
        buffer.push(message("late", 1), 1);
        let batch = buffer.next_batch().unwrap();
        buffer.written(2, batch.first_index, batch.topics);
        let (answer, mut flushed) = oneshot::channel();
        buffer.flush(answer);
        // A message published after the flush is not waited for.
        buffer.push(message("after", 1), 1);
        assert!(flushed.try_recv().is_err(), "answered before the outcomes");
        buffer.answered(pb::SessionPublished {
            id: 1,
            first_sequence: 10,
            accepted: 2,
            rejected: vec![pb::PublishRejection {
                index: 1,
                code: tonic::Code::InvalidArgument as u32,
                message: "invalid topic \"bad topic\"".into(),
            }],
        });
        assert!(flushed.try_recv().is_err(), "batch 2 is not answered yet");
        buffer.lost();
        let report = flushed.try_recv().unwrap();
        assert_eq!(report.accepted, 2);
        assert_eq!(
            report.rejected,
            [Rejection {
                index: 1,
                topic: "bad topic".into(),
                code: tonic::Code::InvalidArgument,
                message: "invalid topic \"bad topic\"".into(),
            }]
        );
        assert_eq!(report.unconfirmed, [3..=3]);
        // The next flush has nothing of them, and waits for "after".
        let (answer, mut second) = oneshot::channel();
        buffer.flush(answer);
        assert!(second.try_recv().is_err());
        let batch = buffer.next_batch().unwrap();
        assert_eq!(batch.first_index, 4);
        buffer.written(3, batch.first_index, batch.topics);
        buffer.answered(pb::SessionPublished {
            id: 3,
            accepted: 1,
            ..Default::default()
        });
        assert_eq!(
            second.try_recv().unwrap(),
            FlushReport {
                accepted: 1,
                ..Default::default()
            }
        );
    }
}
