//! Topic and pattern syntax: validation and the reference (naive) matcher.
//!
//! A topic is dot-separated tokens (`deploy.rollout`); a pattern may use `*`
//! for exactly one token and `>` as its last token for one or more tokens.
//! Tokens are non-empty printable ASCII without spaces; a topic or pattern is
//! at most [`MAX_TOPIC_BYTES`] bytes. Wildcards are whole tokens only, so a `*`
//! or `>` inside a token (`de*ploy`) is rejected, and a published topic never
//! contains either character.

use std::fmt;

/// Longest topic or pattern, in bytes.
pub const MAX_TOPIC_BYTES: usize = 256;

/// Why a topic or pattern was rejected. The `Display` form names the value and
/// the reason, and is what clients see in the INVALID_ARGUMENT status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicError {
    kind: Kind,
    value: String,
    reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Topic,
    Pattern,
}

impl fmt::Display for TopicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            Kind::Topic => "topic",
            Kind::Pattern => "topic pattern",
        };
        // The value is already escaped (see `truncate_for_error`).
        write!(f, "invalid {what} \"{}\": {}", self.value, self.reason)
    }
}

impl std::error::Error for TopicError {}

/// Checks a topic to publish to. Returns the error naming the topic and why.
pub fn validate_topic(topic: &str) -> Result<(), TopicError> {
    // Every publish passes through here: a valid topic takes one pass over
    // its bytes; only a bad one goes through `check` to say what is wrong.
    if is_valid_topic(topic.as_bytes()) {
        return Ok(());
    }
    check(topic, Kind::Topic).map_err(|reason| TopicError {
        kind: Kind::Topic,
        value: truncate_for_error(topic),
        reason,
    })
}

/// A validated subscription pattern such as `deploy.*` or `deploy.>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicPattern(Box<str>);

impl TopicPattern {
    /// Parses and validates a pattern.
    pub fn parse(pattern: &str) -> Result<Self, TopicError> {
        check(pattern, Kind::Pattern).map_err(|reason| TopicError {
            kind: Kind::Pattern,
            value: truncate_for_error(pattern),
            reason,
        })?;
        Ok(Self(pattern.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn tokens(&self) -> std::str::Split<'_, char> {
        self.0.split('.')
    }

    /// Token-by-token reference matcher (NATS semantics). The routing trie
    /// ([`crate::sublist`]) must always agree with it.
    pub fn matches(&self, topic: &str) -> bool {
        let mut pattern = self.tokens().peekable();
        let mut topic = topic.split('.');
        loop {
            match (pattern.next(), topic.next()) {
                (Some(">"), Some(_)) if pattern.peek().is_none() => return true,
                (Some("*"), Some(_)) => {}
                (Some(p), Some(t)) if p == t => {}
                (None, None) => return true,
                _ => return false,
            }
        }
    }
}

impl fmt::Display for TopicPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `check(value, Kind::Topic).is_ok()` in one pass over the bytes: 1 to
/// [`MAX_TOPIC_BYTES`] bytes of non-empty dot-separated tokens of printable
/// ASCII other than the wildcards.
fn is_valid_topic(value: &[u8]) -> bool {
    if value.is_empty() || value.len() > MAX_TOPIC_BYTES {
        return false;
    }
    // True at the start of a token, where a dot (an empty token) is an error.
    let mut token_start = true;
    for &b in value {
        if b == b'.' {
            if token_start {
                return false;
            }
            token_start = true;
        } else if b.is_ascii_graphic() && b != b'*' && b != b'>' {
            token_start = false;
        } else {
            return false;
        }
    }
    !token_start
}

fn check(value: &str, kind: Kind) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if value.len() > MAX_TOPIC_BYTES {
        return Err(format!("is {} bytes long, the limit is {MAX_TOPIC_BYTES}", value.len()));
    }
    let token_count = value.split('.').count();
    for (index, token) in value.split('.').enumerate() {
        let position = index + 1;
        if token.is_empty() {
            return Err(format!(
                "token {position} is empty (tokens are separated by single dots, with none at either end)"
            ));
        }
        if let Some(bad) = token.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(format!(
                "token {position} contains {bad:?}; only printable ASCII without spaces is allowed"
            ));
        }
        let is_wildcard = token == "*" || token == ">";
        match kind {
            Kind::Topic if token.contains(['*', '>']) => {
                return Err(format!(
                    "token {position} ({token:?}) contains a wildcard; a published topic cannot contain '*' or '>'"
                ));
            }
            Kind::Pattern if !is_wildcard && token.contains(['*', '>']) => {
                return Err(format!(
                    "token {position} ({token:?}) mixes a wildcard with other characters; '*' and '>' must be whole tokens"
                ));
            }
            Kind::Pattern if token == ">" && position != token_count => {
                return Err(format!(
                    "'>' is token {position} of {token_count}; it may only be the last token"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// The value as an error message shows it: escaped as `{:?}` would (control
/// characters, quotes and backslashes), so it is safe in a status message or
/// a log line, then cut to at most 300 characters, so a huge or hostile value
/// cannot make the message large.
fn truncate_for_error(value: &str) -> String {
    const SHOWN: usize = 300;
    let mut escaped: String = value.escape_debug().take(SHOWN + 1).collect();
    if escaped.chars().count() > SHOWN {
        escaped.pop();
        escaped.push('…');
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every string of up to 5 characters over an alphabet of each kind of
    /// character that matters: the one-pass check and the detailed one agree.
    #[test]
    fn the_fast_topic_check_agrees_with_the_detailed_one() {
        let alphabet = ['a', 'Z', '.', '*', '>', ' ', '\n', 'é', '~', '\u{7f}'];
        let mut words = vec![String::new()];
        let mut checked = 0;
        for _ in 0..5 {
            let mut longer = Vec::with_capacity(words.len() * alphabet.len());
            for word in &words {
                for c in alphabet {
                    let mut w = word.clone();
                    w.push(c);
                    longer.push(w);
                }
            }
            for word in longer.iter().chain(std::iter::once(&String::new())) {
                assert_eq!(
                    is_valid_topic(word.as_bytes()),
                    check(word, Kind::Topic).is_ok(),
                    "{word:?}"
                );
                checked += 1;
            }
            words = longer;
        }
        assert!(checked > 100_000);
        let longest = "a".repeat(MAX_TOPIC_BYTES);
        assert!(is_valid_topic(longest.as_bytes()));
        assert!(!is_valid_topic(format!("{longest}b").as_bytes()));
        assert!(validate_topic(&format!("{longest}b")).is_err());
    }

    #[test]
    fn valid_topics() {
        for topic in [
            "a",
            "deploy.rollout",
            "a.b.c.d",
            "UPPER.lower",
            "x-y_z.1~2!@#$%^&()",
            &"a".repeat(MAX_TOPIC_BYTES),
        ] {
            assert_eq!(validate_topic(topic), Ok(()), "{topic}");
        }
    }

    #[test]
    fn invalid_topics_name_value_and_reason() {
        let cases = [
            ("", "must not be empty"),
            (".a", "token 1 is empty"),
            ("a.", "token 2 is empty"),
            ("a..b", "token 2 is empty"),
            ("a b", "contains ' '"),
            ("a\tb", "contains '\\t'"),
            ("caf\u{e9}", "contains 'é'"),
            ("a.*", "contains a wildcard"),
            ("a.>", "contains a wildcard"),
            ("a.b*", "contains a wildcard"),
        ];
        for (topic, reason) in cases {
            let err = validate_topic(topic).unwrap_err().to_string();
            assert!(err.starts_with("invalid topic "), "{err}");
            assert!(err.contains(&format!("{topic:?}")), "{err}");
            assert!(err.contains(reason), "{topic:?}: {err}");
        }
        let long = "a".repeat(MAX_TOPIC_BYTES + 1);
        let err = validate_topic(&long).unwrap_err().to_string();
        assert!(err.contains("257 bytes long, the limit is 256"), "{err}");
    }

    #[test]
    fn pattern_validation() {
        for ok in ["a", "*", ">", "a.*", "a.>", "*.*.>", "a.*.c"] {
            assert!(TopicPattern::parse(ok).is_ok(), "{ok}");
        }
        let cases = [
            ("", "must not be empty"),
            ("a.>.b", "may only be the last token"),
            (">.a", "may only be the last token"),
            ("a.b*", "must be whole tokens"),
            ("a.>>", "must be whole tokens"),
            ("a..*", "token 2 is empty"),
            ("a. b", "contains ' '"),
        ];
        for (pattern, reason) in cases {
            let err = TopicPattern::parse(pattern).unwrap_err().to_string();
            assert!(err.starts_with("invalid topic pattern "), "{err}");
            assert!(err.contains(reason), "{pattern:?}: {err}");
        }
        assert!(TopicPattern::parse(&"a".repeat(MAX_TOPIC_BYTES)).is_ok());
        assert!(TopicPattern::parse(&"a".repeat(MAX_TOPIC_BYTES + 1)).is_err());
    }

    #[test]
    fn matching_table() {
        let cases = [
            ("deploy.*", "deploy.a", true),
            ("deploy.*", "deploy", false),
            ("deploy.*", "deploy.a.b", false),
            ("deploy.>", "deploy.a", true),
            ("deploy.>", "deploy.a.b", true),
            ("deploy.>", "deploy", false),
            ("deploy.rollout", "deploy.rollout", true),
            ("deploy.rollout", "Deploy.rollout", false),
            ("*", "a", true),
            ("*", "a.b", false),
            (">", "a", true),
            (">", "a.b.c", true),
            ("*.b.>", "a.b.c", true),
            ("*.b.>", "a.b", false),
            ("a.*.c", "a.x.c", true),
            ("a.*.c", "a.x.d", false),
        ];
        for (pattern, topic, expected) in cases {
            let p = TopicPattern::parse(pattern).unwrap();
            assert_eq!(p.matches(topic), expected, "{pattern} vs {topic}");
        }
    }

    #[test]
    fn huge_values_are_truncated_in_errors() {
        let huge = "é".repeat(10_000);
        let err = validate_topic(&huge).unwrap_err().to_string();
        assert!(err.len() < 1_000, "{}", err.len());
        // Escaping happens before the cut: control characters cannot grow it.
        let hostile = "\u{1}".repeat(10_000);
        let err = validate_topic(&hostile).unwrap_err().to_string();
        assert!(err.len() < 600, "{}", err.len());
        assert!(err.starts_with("invalid topic \"\\u{1}\\u{1}"), "{err}");
        let err = validate_topic("a\tb").unwrap_err().to_string();
        assert!(err.starts_with("invalid topic \"a\\tb\""), "{err}");
    }
}
