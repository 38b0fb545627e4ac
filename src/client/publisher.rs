//! A buffered publisher on a client's session ([`Publisher`]): messages are
//! gathered into `SessionPublish` batches, sent when a batch is full by
//! count or bytes (or when the application says so), a few batches in
//! flight at once; [`Publisher::flush`] says what became of every message
//! published before it: accepted, rejected (by index, with the broker's
//! code and message), or in a batch that has no answer.

use super::{Client, PendingBatch, PublishError};
use crate::pb;
use prost::Message as _;
use std::collections::VecDeque;
use tonic::Code;

/// Messages in one batch at most, by default: the broker's default
/// `max_batch_messages` (TINYBROKER_MAX_BATCH_MESSAGES).
pub const DEFAULT_BATCH_MESSAGES: usize = 1024;
/// Encoded bytes of one batch at most, by default; a message larger than
/// this is a batch of its own. Well under the request limit of a broker
/// with the default `max_message_bytes` (1 MiB, + 64 KiB).
pub const DEFAULT_BATCH_BYTES: usize = 512 * 1024;
/// Batches sent and not answered, at most: beyond them [`Publisher::publish`]
/// waits for the oldest answer (the broker itself reads no more than 4
/// publishes ahead of its answers), so a publisher holds a bounded amount.
const BATCHES_IN_FLIGHT: usize = 4;
/// What a request adds around a batch's messages, at most: the
/// `SessionRequest` and `SessionPublish` keys and lengths, and the id.
const BATCH_FRAMING: usize = 32;
/// What a batch adds around each message, at most: its key and length.
const MESSAGE_FRAMING: usize = 6;
/// What the broker reads in one request beyond `max_message_bytes`.
const REQUEST_SLACK: usize = 64 * 1024;

/// Publishes through batches on its client's session (see
/// [`Client::publisher`]). [`Publisher::publish`] adds a message to the
/// batch being gathered and returns its index (counted from 0 over the
/// publisher's life); the batch is sent when it holds
/// [`Publisher::max_messages`] messages or the next message would take it
/// over [`Publisher::max_bytes`], or when [`Publisher::send_buffered`] or
/// [`Publisher::flush`] is called. Nothing is sent before then: call
/// `send_buffered` when a lull comes, if a message must not wait for
/// others. Up to 4 batches are in flight; `publish` waits for the oldest
/// answer beyond them.
///
/// A batch lost with its session is reported by `flush` as unconfirmed
/// ([`PublishError::Unconfirmed`]) and never sent again. Messages still
/// buffered when the publisher is dropped are not sent: flush first.
pub struct Publisher {
    client: Client,
    max_messages: usize,
    max_bytes: usize,
    /// The largest request the broker reads (`max_message_bytes` + 64
    /// KiB), when the application said what its `max_message_bytes` is.
    request_limit: Option<usize>,
    /// The batch being gathered; its messages' indexes follow on from
    /// `buffer_first`.
    buffer: Vec<pb::PublishRequest>,
    buffer_bytes: usize,
    buffer_first: u64,
    /// The index the next message published gets.
    next_index: u64,
    /// Batches sent and not answered, oldest first.
    in_flight: VecDeque<InFlight>,
    /// What the answers collected since the last flush said.
    summary: PublishSummary,
}

/// A batch sent: its first message's index and every message's topic (to
/// name those rejected), and its answer to come.
struct InFlight {
    first_index: u64,
    topics: Vec<String>,
    batch: PendingBatch,
}

/// What became of the messages a [`Publisher`] sent since its last flush.
#[derive(Debug, Clone, Default)]
pub struct PublishSummary {
    /// Messages the broker accepted (published).
    pub accepted: u64,
    /// The sequence of the first message accepted, and of the last (the
    /// accepted messages of one batch have consecutive sequences; other
    /// publishers' may come between two batches).
    pub first_sequence: Option<u64>,
    pub last_sequence: Option<u64>,
    /// Each message rejected, by index: by the broker, with the code and
    /// message `Publish` would have given, or (RESOURCE_EXHAUSTED) by the
    /// publisher, for a message larger than the broker reads in a request.
    pub rejected: Vec<Rejection>,
    /// Batches with no answer: unconfirmed (lost with their session), or
    /// not sent.
    pub failed: Vec<FailedBatch>,
}

/// A message that was not published, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Its index among the messages of its publisher (0 for the first).
    pub index: u64,
    pub topic: String,
    pub code: Code,
    pub message: String,
}

/// A batch that has no answer: its messages are `first_index` and the
/// `error.messages() - 1` after it.
#[derive(Debug, Clone)]
pub struct FailedBatch {
    pub first_index: u64,
    pub error: PublishError,
}

impl PublishSummary {
    /// Messages in batches lost with their session: they may or may not
    /// have been published.
    pub fn unconfirmed(&self) -> u64 {
        self.failed_where(true)
    }

    /// Messages in batches that were not sent: none of them was published.
    pub fn not_sent(&self) -> u64 {
        self.failed_where(false)
    }

    fn failed_where(&self, unconfirmed: bool) -> u64 {
        self.failed
            .iter()
            .filter(|f| f.error.is_unconfirmed() == unconfirmed)
            .map(|f| f.error.messages() as u64)
            .sum()
    }

    /// Whether every message was accepted.
    pub fn all_accepted(&self) -> bool {
        self.rejected.is_empty() && self.failed.is_empty()
    }
}

impl Publisher {
    pub(super) fn new(client: Client) -> Self {
        Self {
            client,
            max_messages: DEFAULT_BATCH_MESSAGES,
            max_bytes: DEFAULT_BATCH_BYTES,
            request_limit: None,
            buffer: Vec::new(),
            buffer_bytes: 0,
            buffer_first: 0,
            next_index: 0,
            in_flight: VecDeque::new(),
            summary: PublishSummary::default(),
        }
    }

    /// Messages in one batch at most (default 1024): at most the broker's
    /// `max_batch_messages`, which rejects a larger batch whole.
    pub fn max_messages(mut self, messages: usize) -> Self {
        self.max_messages = messages.max(1);
        self
    }

    /// Encoded bytes of one batch at most (default 512 KiB); a message
    /// larger than this is sent in a batch of its own.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// The broker's `max_message_bytes` (Admin/GetBrokerInfo lists it):
    /// batches are then kept within the largest request it reads, and a
    /// message larger than that is rejected here (RESOURCE_EXHAUSTED)
    /// instead of ending the session, with every batch in flight on it.
    pub fn broker_max_message_bytes(mut self, max_message_bytes: usize) -> Self {
        self.request_limit = Some(max_message_bytes.saturating_add(REQUEST_SLACK));
        self
    }

    /// The most bytes of messages a batch is given.
    fn batch_bytes(&self) -> usize {
        match self.request_limit {
            Some(limit) => self.max_bytes.min(limit.saturating_sub(BATCH_FRAMING)),
            None => self.max_bytes,
        }
    }

    /// Adds `message` to the batch being gathered (sending the batch
    /// first if it would not fit, and once it is full by count) and
    /// returns its index. Waits only when 4 batches are unanswered.
    pub async fn publish(&mut self, message: pb::PublishRequest) -> u64 {
        self.collect_answered();
        let index = self.next_index;
        self.next_index += 1;
        let size = message.encoded_len() + MESSAGE_FRAMING;
        if let Some(limit) = self.request_limit
            && size + BATCH_FRAMING > limit
        {
            // Indexes of a batch follow on: what is gathered goes first.
            self.send_buffered().await;
            self.summary.rejected.push(Rejection {
                index,
                message: format!(
                    "message to {:?} is {size} bytes encoded, larger than the largest request the broker reads \
                     ({limit} bytes: max_message_bytes {} + 64 KiB): not sent",
                    message.topic,
                    limit - REQUEST_SLACK
                ),
                topic: message.topic,
                code: Code::ResourceExhausted,
            });
            return index;
        }
        if !self.buffer.is_empty() && self.buffer_bytes + size > self.batch_bytes() {
            self.send_buffered().await;
        }
        if self.buffer.is_empty() {
            self.buffer_first = index;
        }
        self.buffer.push(message);
        self.buffer_bytes += size;
        if self.buffer.len() >= self.max_messages {
            self.send_buffered().await;
        }
        index
    }

    /// Sends the batch being gathered now, without waiting for its answer
    /// (only for room, when 4 batches are unanswered).
    pub async fn send_buffered(&mut self) {
        if self.buffer.is_empty() {
            return;
        }
        while self.in_flight.len() >= BATCHES_IN_FLIGHT {
            self.answer_oldest().await;
        }
        let messages = std::mem::take(&mut self.buffer);
        self.buffer_bytes = 0;
        let topics = messages.iter().map(|m| m.topic.clone()).collect();
        let batch = self.client.send_batch(messages);
        self.in_flight.push_back(InFlight {
            first_index: self.buffer_first,
            topics,
            batch,
        });
    }

    /// Sends what is gathered and waits until every batch is answered (or
    /// has failed); returns what became of the messages sent since the last
    /// flush, rejections in the order of their indexes.
    pub async fn flush(&mut self) -> PublishSummary {
        self.send_buffered().await;
        while !self.in_flight.is_empty() {
            self.answer_oldest().await;
        }
        let mut summary = std::mem::take(&mut self.summary);
        summary.rejected.sort_by_key(|r| r.index);
        summary
    }

    /// Whether a batch answered so far (since the last flush) has no
    /// answer: its session was lost, or none could be started.
    pub fn failed(&self) -> bool {
        !self.summary.failed.is_empty()
    }

    /// Messages published and not yet answered: gathered or in flight.
    pub fn unanswered(&self) -> usize {
        self.buffer.len() + self.in_flight.iter().map(|f| f.topics.len()).sum::<usize>()
    }

    async fn answer_oldest(&mut self) {
        if let Some(sent) = self.in_flight.pop_front() {
            let answer = sent.batch.answer().await;
            self.record(sent.first_index, &sent.topics, answer);
        }
    }

    /// Takes in the answers that have come, oldest first.
    fn collect_answered(&mut self) {
        while let Some(sent) = self.in_flight.front_mut() {
            let Some(answer) = sent.batch.try_answer() else {
                return;
            };
            let sent = self.in_flight.pop_front().expect("looked at above");
            self.record(sent.first_index, &sent.topics, answer);
        }
    }

    fn record(&mut self, first_index: u64, topics: &[String], answer: Result<pb::SessionPublished, PublishError>) {
        let summary = &mut self.summary;
        match answer {
            Ok(published) => {
                if published.accepted > 0 {
                    let accepted = u64::from(published.accepted);
                    summary.accepted += accepted;
                    summary.first_sequence.get_or_insert(published.first_sequence);
                    summary.last_sequence = Some(published.first_sequence + accepted - 1);
                }
                for r in published.rejected {
                    summary.rejected.push(Rejection {
                        index: first_index + u64::from(r.index),
                        topic: topics.get(r.index as usize).cloned().unwrap_or_default(),
                        code: Code::from_i32(r.code as i32),
                        message: r.message,
                    });
                }
            }
            Err(error) => summary.failed.push(FailedBatch { first_index, error }),
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if !self.buffer.is_empty() {
            tracing::warn!(
                messages = self.buffer.len(),
                "a publisher was dropped with messages it had not sent (flush before dropping it)"
            );
        }
    }
}
