//! A published message, shared by every queue it fans out to, and what it
//! is charged against byte limits.

use super::NewMessage;
use crate::memory::{self, MemoryBudget};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

/// A message as published: shared by every subscription it fans out to.
/// Charged to the broker's memory budget from its creation until the last
/// queue, group or stream holding it lets go.
#[derive(Debug)]
pub struct Published {
    pub topic: String,
    pub payload: Bytes,
    pub headers: HashMap<String, String>,
    pub sequence: u64,
    pub publish_time: SystemTime,
    /// What it is charged: see [`message_size`].
    size: usize,
    budget: &'static MemoryBudget,
}

impl Published {
    /// `message`, numbered `sequence`, whose `size` ([`message_size`]) the
    /// caller has already charged to `budget`: released when the last
    /// holder lets go.
    pub fn charged(
        message: NewMessage,
        sequence: u64,
        publish_time: SystemTime,
        size: usize,
        budget: &'static MemoryBudget,
    ) -> Self {
        Self {
            topic: message.topic,
            payload: message.payload,
            headers: message.headers,
            sequence,
            publish_time,
            size,
            budget,
        }
    }

    /// The bytes it is charged, in the broker's budget and in every queue's
    /// and group's byte limit.
    pub fn size(&self) -> usize {
        self.size
    }

    #[cfg(test)]
    pub(crate) fn for_test(topic: &str, sequence: u64) -> Self {
        static UNLIMITED: MemoryBudget = MemoryBudget::unlimited();
        let size = message_size(topic, &Bytes::new(), &HashMap::new());
        UNLIMITED.charge(size);
        Self {
            topic: topic.into(),
            payload: Bytes::new(),
            headers: HashMap::new(),
            sequence,
            publish_time: SystemTime::now(),
            size,
            budget: &UNLIMITED,
        }
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        self.budget.release(self.size);
    }
}

/// What a message is charged against byte limits: its topic, payload and
/// headers, plus the bookkeeping around them.
pub fn message_size(topic: &str, payload: &Bytes, headers: &HashMap<String, String>) -> usize {
    let headers: usize = headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + memory::HEADER_OVERHEAD)
        .sum();
    memory::MESSAGE_OVERHEAD + topic.len() + payload.len() + headers
}

/// One message on its way to one subscriber.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: Arc<Published>,
    /// 1 on first delivery, +1 on each redelivery.
    pub attempt: u32,
}
