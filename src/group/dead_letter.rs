//! Dead letters, for both engines: a message whose last allowed delivery
//! attempt failed is published to `_dlq.<group>` as a new message, with
//! its original payload and headers and two headers of the broker's
//! ([`ORIGINAL_TOPIC_HEADER`], [`DELIVERY_ATTEMPTS_HEADER`]). It obeys the
//! limits of every message: one that breaks them with those two headers
//! (its original had more than `MAX_HEADERS - 2` headers, or was within
//! their bytes of `max_message_bytes`) is dropped, logged at WARN and
//! counted (`reason="dead_letter_invalid"`), never delivered over a limit
//! a client may rely on (docs/contract.md, "Dead letters").
//!
//! [`letter`] decides; the engine publishes what it returns, and is done
//! with the original either way (the single-node engine releases it; a
//! cluster replica acks it in JetStream).

use crate::engine::NewMessage;
use crate::engine::validate::{self, DEAD_LETTER_PREFIX};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Header of a dead letter naming the topic it was first published to.
pub const ORIGINAL_TOPIC_HEADER: &str = "tinybroker-original-topic";
/// Header of a dead letter giving how many deliveries were tried.
pub const DELIVERY_ATTEMPTS_HEADER: &str = "tinybroker-delivery-attempts";

/// A message that used its last allowed attempt, as the engine holds it.
#[derive(Debug)]
pub struct Original<'a> {
    pub group: &'a str,
    pub sequence: u64,
    pub topic: &'a str,
    pub payload: Bytes,
    pub headers: HashMap<String, String>,
    /// The deliveries tried.
    pub attempts: u32,
}

/// A dead letter to publish, and its size as the message limit counts it.
#[derive(Debug)]
pub struct Letter {
    pub message: NewMessage,
    pub size: usize,
}

/// The dead letter of `original`, under `max_message_bytes`. None when it
/// breaks a message limit: then it is logged and counted in
/// `dropped_invalid` here, and the engine drops the original.
pub fn letter(original: Original<'_>, max_message_bytes: usize, dropped_invalid: &AtomicU64) -> Option<Letter> {
    let Original {
        group,
        sequence,
        topic,
        payload,
        mut headers,
        attempts,
    } = original;
    tracing::warn!(
        consumer_group = group,
        sequence,
        topic = %topic,
        attempts,
        "message dead-lettered after its last delivery attempt"
    );
    headers.insert(ORIGINAL_TOPIC_HEADER.into(), topic.to_owned());
    headers.insert(DELIVERY_ATTEMPTS_HEADER.into(), attempts.to_string());
    let message = NewMessage {
        topic: format!("{DEAD_LETTER_PREFIX}{group}"),
        payload,
        headers,
        ..Default::default()
    };
    match validate::message(&message, max_message_bytes) {
        Ok(size) => Some(Letter { message, size }),
        Err(error) => {
            dropped_invalid.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                consumer_group = group,
                sequence,
                %error,
                "dead letter dropped: with the broker's two dead-letter headers it breaks a message limit"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::validate::MAX_HEADERS;

    fn original(headers: usize, payload: usize) -> Original<'static> {
        Original {
            group: "jobs",
            sequence: 7,
            topic: "jobs.a",
            payload: Bytes::from(vec![b'p'; payload]),
            headers: (0..headers).map(|i| (format!("h{i:02}"), "v".to_owned())).collect(),
            attempts: 3,
        }
    }

    #[test]
    fn a_dead_letter_carries_the_original_and_the_two_headers() {
        let dropped = AtomicU64::new(0);
        let mut o = original(1, 5);
        o.headers.insert("k".into(), "v".into());
        let letter = letter(o, 1 << 20, &dropped).expect("fits");
        let m = &letter.message;
        assert_eq!(m.topic, "_dlq.jobs");
        assert_eq!(&m.payload[..], b"ppppp");
        assert_eq!(m.headers[ORIGINAL_TOPIC_HEADER], "jobs.a");
        assert_eq!(m.headers[DELIVERY_ATTEMPTS_HEADER], "3");
        assert_eq!(m.headers["k"], "v");
        assert_eq!(m.headers.len(), 4);
        assert_eq!(letter.size, validate::message(m, 1 << 20).unwrap());
        assert_eq!(dropped.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_dead_letter_over_a_message_limit_is_dropped_and_counted() {
        let dropped = AtomicU64::new(0);
        // Headers: the two of the broker's make one too many.
        assert!(letter(original(MAX_HEADERS - 2, 1), 1 << 20, &dropped).is_some());
        assert!(letter(original(MAX_HEADERS - 1, 1), 1 << 20, &dropped).is_none());
        assert_eq!(dropped.load(Ordering::Relaxed), 1);
        // Bytes: exactly at the limit is a letter, one byte more is not.
        let m = letter(original(0, 100), usize::MAX, &dropped).unwrap().message;
        let at_limit = m.payload.len() + m.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        assert!(letter(original(0, 100), at_limit, &dropped).is_some());
        assert!(letter(original(0, 100), at_limit - 1, &dropped).is_none());
        assert_eq!(dropped.load(Ordering::Relaxed), 2);
    }
}
