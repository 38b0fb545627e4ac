//! Why a command failed, in one line: the call, the status code as grpcurl
//! prints it, every cause once, and a hint when the address's scheme looks
//! wrong for the broker (plaintext to a TLS port, TLS to a plaintext one)
//! or the token is missing or not the broker's.

/// A failed connect as one line: the client's error (naming the address),
/// each of its causes once, and a hint about the scheme.
pub(super) fn connect_failed(addr: &str, error: anyhow::Error) -> anyhow::Error {
    let Some(cause) = error.source() else {
        return error;
    };
    let causes = error_chain(cause);
    let hint = scheme_hint(addr, &causes).map_or_else(String::new, |h| format!(" ({h})"));
    anyhow::anyhow!("{error}: {causes}{hint}")
}

/// One line naming the call, the status code (as grpcurl prints it) and the
/// broker's message.
pub(super) fn failed(call: &str, addr: &str, status: tonic::Status) -> anyhow::Error {
    // The message may be only "transport error" or "operation was canceled":
    // what tells a TLS broker (a broken pipe, a closed connection, ...) is in
    // the status's sources.
    let causes = std::error::Error::source(&status).map_or_else(String::new, error_chain);
    let failure = format!("{}: {causes}", status.message());
    let hint = match status.code() {
        tonic::Code::Unauthenticated => {
            let token = match std::env::var_os("TINYBROKER_AUTH_TOKEN") {
                Some(_) => "the token in TINYBROKER_AUTH_TOKEN is not the broker's",
                None => "the broker needs a token: set TINYBROKER_AUTH_TOKEN",
            };
            format!(" ({token})")
        }
        _ => scheme_hint(addr, &failure).map_or_else(String::new, |h| format!(" ({h})")),
    };
    anyhow::anyhow!("{call} failed: {:?}: {}{hint}", status.code(), status.message())
}

/// An error and its sources as one line, each cause once: transport errors
/// repeat their source in their own text ("tcp connect error: tcp connect
/// error: Connection refused").
pub(super) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// A hint when a failure looks like the wrong scheme for the broker: plain
/// HTTP/2 to a TLS port fails as a protocol or transport error, TLS to a
/// plaintext port as a TLS record error.
pub(super) fn scheme_hint(addr: &str, failure: &str) -> Option<&'static str> {
    let failure = failure.to_ascii_lowercase();
    if failure.contains("connection refused") || failure.contains("dns error") {
        return None;
    }
    // An address without a scheme is plain HTTP/2, as the client takes it.
    if !addr.starts_with("https://")
        && [
            "h2 protocol error",
            "connection reset",
            "frame with invalid size",
            "broken pipe",
            "connection closed",
            "connection was not ready",
        ]
        .iter()
        .any(|t| failure.contains(t))
    {
        return Some("if the broker serves TLS (TINYBROKER_TLS_CERT is set), use an https:// address");
    }
    if addr.starts_with("https://")
        && [
            "invalidcontenttype",
            "corrupt message",
            "wrong version number",
            "handshake",
            // The broker closes a connection that does not begin with the
            // HTTP/2 preface, unread ClientHello and all.
            "connection reset",
        ]
        .iter()
        .any(|t| failure.contains(t))
    {
        return Some("if the broker serves plaintext (no TINYBROKER_TLS_CERT), use an http:// address");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_scheme_gets_a_hint_and_a_refused_connection_does_not() {
        // Each way a plaintext call to a TLS port was seen to fail.
        for plain_to_tls in [
            "h2 protocol error: http2 error",
            "transport error: connection error: stream closed because of a broken pipe",
            "operation was canceled: transport error: connection closed",
            "operation was canceled: transport error: connection was not ready",
        ] {
            assert!(
                scheme_hint("http://b:1", plain_to_tls).unwrap().contains("https://"),
                "{plain_to_tls}"
            );
        }
        for tls_to_plain in [
            "transport error: received corrupt message of type InvalidContentType",
            "transport error: Connection reset by peer (os error 104)",
        ] {
            assert!(
                scheme_hint("https://b:1", tls_to_plain).unwrap().contains("http://"),
                "{tls_to_plain}"
            );
        }
        let refused = "transport error: tcp connect error: Connection refused (os error 111)";
        assert_eq!(scheme_hint("http://b:1", refused), None);
        assert!(
            scheme_hint("b:1", "h2 protocol error: http2 error")
                .unwrap()
                .contains("https://")
        );
        assert_eq!(scheme_hint("https://b:1", refused), None);
    }

    #[test]
    fn each_cause_is_named_once() {
        #[derive(Debug)]
        struct E(&'static str, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let inner = E("Connection refused", None);
        let middle = E("tcp connect error", Some(Box::new(inner)));
        let outer = E(
            "transport error",
            Some(Box::new(E("tcp connect error", Some(Box::new(middle))))),
        );
        assert_eq!(
            error_chain(&outer),
            "transport error: tcp connect error: Connection refused"
        );
    }
}
