//! What every engine checks in what clients send, and the limits it checks
//! against (docs/contract.md, "Topics and patterns", "Errors", "Resource
//! limits"). Errors name the bad value, bounded in length.

use super::{AckMode, BrokerError, NewMessage, TracingHeaders};
use super::{TRACEPARENT, TRACESTATE};
use crate::memory;
use crate::topic::{self, TopicPattern};
use std::collections::HashMap;

/// Most patterns one subscription may hold.
pub const MAX_PATTERNS_PER_SUBSCRIPTION: usize = 64;
/// Most headers one message may carry.
pub const MAX_HEADERS: usize = 64;
/// Longest header name or value.
pub const MAX_HEADER_BYTES: usize = 8192;
/// Longest subscription id or consumer group name.
pub const MAX_NAME_BYTES: usize = 256;
/// Prefix of dead-letter topics: `_dlq.<group>`.
pub const DEAD_LETTER_PREFIX: &str = "_dlq.";

/// Checks a message against the limits; returns the bytes it is charged
/// (what [`crate::engine::message_size`] says, from this one pass over its
/// headers). The headers the broker added for tracing
/// ([`NewMessage::tracing`]) count against neither the number of headers
/// nor `max_message_bytes`, but are charged.
pub fn message(message: &NewMessage, max_message_bytes: usize) -> Result<usize, BrokerError> {
    let added = message.tracing;
    if added == TracingHeaders::default() {
        // Without tracing: the checks with nothing left out, constants
        // folded in (the publish path costs what it did before tracing's
        // headers were left out).
        return checked(message, max_message_bytes, 0, |_| 0);
    }
    let count = usize::from(added.traceparent) + usize::from(added.tracestate);
    checked(message, max_message_bytes, count, |headers| {
        tracing_bytes(headers, added)
    })
}

/// [`message`], leaving `added_headers` headers of `added_bytes` out of
/// the limits.
#[inline(always)]
fn checked(
    message: &NewMessage,
    max_message_bytes: usize,
    added_headers: usize,
    added_bytes: impl FnOnce(&HashMap<String, String>) -> usize,
) -> Result<usize, BrokerError> {
    topic::validate_topic(&message.topic).map_err(|e| BrokerError::InvalidArgument(e.to_string()))?;
    let own_headers = message.headers.len().saturating_sub(added_headers);
    if own_headers > MAX_HEADERS {
        return Err(BrokerError::InvalidArgument(format!(
            "message to {:?} has {own_headers} headers, the limit is {MAX_HEADERS}",
            message.topic,
        )));
    }
    let mut size = message.payload.len();
    for (name, value) in &message.headers {
        if name.is_empty() {
            return Err(BrokerError::InvalidArgument(format!(
                "message to {:?} has a header with an empty name",
                message.topic
            )));
        }
        if name.len() > MAX_HEADER_BYTES || value.len() > MAX_HEADER_BYTES {
            return Err(BrokerError::InvalidArgument(format!(
                "header {:?} of a message to {:?} is longer than {MAX_HEADER_BYTES} bytes",
                truncate(name),
                message.topic
            )));
        }
        size += name.len() + value.len();
    }
    let own_size = size - added_bytes(&message.headers);
    if own_size > max_message_bytes {
        return Err(BrokerError::ResourceExhausted(format!(
            "message to {:?} is {own_size} bytes (payload plus headers), larger than max_message_bytes {max_message_bytes} (TINYBROKER_MAX_MESSAGE_BYTES)",
            message.topic
        )));
    }
    Ok(memory::MESSAGE_OVERHEAD + message.topic.len() + size + message.headers.len() * memory::HEADER_OVERHEAD)
}

/// The bytes (names and values) of the headers the broker `added` for
/// tracing.
fn tracing_bytes(headers: &HashMap<String, String>, added: TracingHeaders) -> usize {
    let bytes = |name: &str| headers.get(name).map_or(0, |value| name.len() + value.len());
    let mut total = 0;
    if added.traceparent {
        total += bytes(TRACEPARENT);
    }
    if added.tracestate {
        total += bytes(TRACESTATE);
    }
    total
}

/// A subscription's patterns: at least one, at most
/// [`MAX_PATTERNS_PER_SUBSCRIPTION`], each valid; sorted, duplicates removed.
pub fn patterns(raw: &[String]) -> Result<Vec<TopicPattern>, BrokerError> {
    if raw.is_empty() {
        return Err(BrokerError::InvalidArgument(
            "topic_patterns is empty; give at least one pattern such as \"deploy.>\"".into(),
        ));
    }
    if raw.len() > MAX_PATTERNS_PER_SUBSCRIPTION {
        return Err(BrokerError::InvalidArgument(format!(
            "{} topic_patterns given, the limit is {MAX_PATTERNS_PER_SUBSCRIPTION} per subscription",
            raw.len()
        )));
    }
    let mut patterns = raw
        .iter()
        .map(|p| TopicPattern::parse(p).map_err(|e| BrokerError::InvalidArgument(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    patterns.sort();
    patterns.dedup();
    Ok(patterns)
}

/// A group name must also make a valid dead-letter topic `_dlq.<group>`.
pub fn group_name(name: &str) -> Result<(), BrokerError> {
    name_field("consumer_group", name)?;
    topic::validate_topic(&format!("{DEAD_LETTER_PREFIX}{name}")).map_err(|e| {
        BrokerError::InvalidArgument(format!(
            "consumer_group {:?} cannot name its dead-letter topic: {e}",
            truncate(name)
        ))
    })
}

/// A client-chosen name (`subscription_id`, `consumer_group`): printable
/// ASCII without spaces, at most [`MAX_NAME_BYTES`].
pub fn name_field(field: &str, value: &str) -> Result<(), BrokerError> {
    if value.len() > MAX_NAME_BYTES {
        return Err(BrokerError::InvalidArgument(format!(
            "{field} {:?} is {} bytes long, the limit is {MAX_NAME_BYTES}",
            truncate(value),
            value.len()
        )));
    }
    if let Some(bad) = value.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(BrokerError::InvalidArgument(format!(
            "{field} {:?} contains {bad:?}; only printable ASCII without spaces is allowed",
            truncate(value)
        )));
    }
    Ok(())
}

/// The subscription id an Ack, Nack or CloseSubscription (`call`) names
/// must be given.
pub fn subscription_id_given(call: &str, id: &str) -> Result<(), BrokerError> {
    if id.is_empty() {
        return Err(BrokerError::InvalidArgument(format!(
            "{call} needs a subscription_id; it was empty"
        )));
    }
    Ok(())
}

/// An Ack or Nack (`call`) must name a subscription and list sequences.
pub fn ack_request(call: &str, id: &str, sequences: &[u64]) -> Result<(), BrokerError> {
    subscription_id_given(call, id)?;
    if sequences.is_empty() {
        return Err(BrokerError::InvalidArgument(format!(
            "{call} for subscription {:?} lists no sequences",
            truncate(id)
        )));
    }
    Ok(())
}

/// The contract's name of an ack mode.
pub fn ack_mode_name(mode: AckMode) -> &'static str {
    match mode {
        AckMode::Auto => "ACK_MODE_AUTO",
        AckMode::Manual => "ACK_MODE_MANUAL",
    }
}

/// A pattern set for an error message, bounded so that two of them fit a
/// `grpc-message` trailer with room to spare: at most 8 patterns of at
/// most 64 bytes each are named, then how many more there are.
pub fn pattern_list(patterns: &[TopicPattern]) -> String {
    const SHOWN: usize = 8;
    const SHOWN_BYTES: usize = 64;
    let mut names: Vec<String> = patterns
        .iter()
        .take(SHOWN)
        .map(|p| {
            let p = p.as_str();
            if p.len() > SHOWN_BYTES {
                // Patterns are ASCII, so any byte index is a char boundary.
                format!("{}...", &p[..SHOWN_BYTES])
            } else {
                p.to_owned()
            }
        })
        .collect();
    if patterns.len() > SHOWN {
        names.push(format!("... and {} more", patterns.len() - SHOWN));
    }
    format!("[{}]", names.join(", "))
}

/// Bounds client-supplied values quoted in error messages.
pub fn truncate(value: &str) -> &str {
    let mut end = value.len().min(128);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message to `t` with `count` headers of its own and `payload`
    /// bytes, plus the tracing headers `added`.
    fn traced(count: usize, payload: usize, added: TracingHeaders) -> NewMessage {
        let mut headers: HashMap<String, String> = (0..count).map(|i| (format!("h{i:02}"), "v".into())).collect();
        if added.traceparent {
            headers.insert(
                TRACEPARENT.into(),
                format!("00-{}-{}-01", "a".repeat(32), "b".repeat(16)),
            );
        }
        if added.tracestate {
            headers.insert(TRACESTATE.into(), "vendor=abc".into());
        }
        NewMessage {
            topic: "t".into(),
            payload: vec![b'p'; payload].into(),
            headers,
            tracing: added,
        }
    }

    #[test]
    fn tracing_headers_count_against_no_limit_but_are_charged() {
        let both = TracingHeaders {
            traceparent: true,
            tracestate: true,
        };
        // 64 headers of 4 bytes each (name and value) and a payload to
        // exactly max_message_bytes: valid, with or without the two added.
        let max = 1000;
        let own = MAX_HEADERS * 4;
        let untraced = message(&traced(MAX_HEADERS, max - own, TracingHeaders::default()), max).unwrap();
        let charged = message(&traced(MAX_HEADERS, max - own, both), max).unwrap();
        let added = TRACEPARENT.len() + 55 + TRACESTATE.len() + "vendor=abc".len();
        assert_eq!(charged, untraced + added + 2 * memory::HEADER_OVERHEAD);
        // One header or one byte more of the publisher's own: refused,
        // naming the publisher's count or size.
        assert_eq!(
            message(&traced(MAX_HEADERS + 1, 0, both), max),
            Err(BrokerError::InvalidArgument(format!(
                "message to \"t\" has {} headers, the limit is {MAX_HEADERS}",
                MAX_HEADERS + 1
            )))
        );
        assert_eq!(
            message(&traced(MAX_HEADERS, max - own + 1, both), max),
            Err(BrokerError::ResourceExhausted(format!(
                "message to \"t\" is {} bytes (payload plus headers), larger than max_message_bytes {max} (TINYBROKER_MAX_MESSAGE_BYTES)",
                max + 1
            )))
        );
        // A traceparent the publisher set counts like any of its headers.
        let mut own_traceparent = traced(MAX_HEADERS, 0, both);
        own_traceparent.tracing = TracingHeaders {
            traceparent: false,
            tracestate: true,
        };
        assert!(
            matches!(message(&own_traceparent, max), Err(BrokerError::InvalidArgument(m)) if m.contains("has 65 headers")),
        );
    }

    #[test]
    fn pattern_lists_in_errors_are_bounded() {
        let patterns: Vec<TopicPattern> = (0..64)
            .map(|i| TopicPattern::parse(&format!("{i:03}{}", "a".repeat(250))).unwrap())
            .collect();
        let listed = pattern_list(&patterns);
        assert!(listed.len() < 1024, "{} bytes", listed.len());
        assert!(listed.contains("... and 56 more"), "{listed}");
        assert!(listed.starts_with("[000aaa"), "{listed}");
        let short = [TopicPattern::parse("a.*").unwrap(), TopicPattern::parse("b.>").unwrap()];
        assert_eq!(pattern_list(&short), "[a.*, b.>]");
    }
}
