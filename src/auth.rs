//! Bearer-token authentication: a tower layer in front of every gRPC service
//! that asks for `authorization: Bearer <token>` on the tinybroker services
//! (Broker, Admin) and lets health and reflection through, so probes and
//! grpcurl `list` work without the token.

use std::sync::Arc;
use std::task::{Context, Poll};
use subtle::ConstantTimeEq;
use tonic::Status;
use tonic::codegen::http;

/// The path prefix of every method of the tinybroker services.
const PROTECTED_PREFIX: &str = "/tinybroker.v1.";

/// Checks the token when one is configured; passes everything through when
/// it is `None`.
#[derive(Clone)]
pub struct AuthLayer {
    token: Option<Arc<[u8]>>,
}

impl AuthLayer {
    pub fn new(token: Option<&str>) -> Self {
        Self {
            token: token.map(|t| Arc::from(t.as_bytes())),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            token: self.token.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    token: Option<Arc<[u8]>>,
}

/// Whether `request` carries `authorization: Bearer <token>` (also the side
/// server's `/status.json`).
pub(crate) fn authorized<B>(token: &[u8], request: &http::Request<B>) -> bool {
    let Some(value) = request.headers().get(http::header::AUTHORIZATION) else {
        return false;
    };
    let value = value.as_bytes();
    // The scheme is case-insensitive (RFC 9110 §11.1); the token is not.
    const SCHEME: &[u8] = b"bearer ";
    if value.len() < SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return false;
    }
    // Constant time in the token's bytes; only a length mismatch returns early.
    value[SCHEME.len()..].ct_eq(token).into()
}

impl<S, B, R> tower::Service<http::Request<B>> for Auth<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<S::Future, std::future::Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match &self.token {
            Some(token) if request.uri().path().starts_with(PROTECTED_PREFIX) && !authorized(token, &request) => {
                tracing::debug!(
                    path = request.uri().path(),
                    "refused a call without a valid bearer token"
                );
                let status = if request.headers().contains_key(http::header::AUTHORIZATION) {
                    Status::unauthenticated("the bearer token in the authorization metadata is not valid")
                } else {
                    Status::unauthenticated("this broker needs `authorization: Bearer <token>` metadata on every call")
                };
                futures::future::Either::Right(std::future::ready(Ok(status.into_http())))
            }
            _ => futures::future::Either::Left(self.inner.call(request)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(authorization: Option<&str>) -> http::Request<()> {
        let mut builder = http::Request::builder().uri("/tinybroker.v1.Broker/Publish");
        if let Some(v) = authorization {
            builder = builder.header(http::header::AUTHORIZATION, v);
        }
        builder.body(()).unwrap()
    }

    #[test]
    fn only_the_exact_token_after_bearer_passes() {
        let token = b"s3cret";
        assert!(authorized(token, &request(Some("Bearer s3cret"))));
        assert!(authorized(token, &request(Some("bearer s3cret"))));
        for bad in [
            None,
            Some(""),
            Some("Bearer"),
            Some("Bearer "),
            Some("Bearer s3cre"),
            Some("Bearer s3cret "),
            Some("Bearer S3CRET"),
            Some("Basic s3cret"),
            Some("s3cret"),
        ] {
            assert!(!authorized(token, &request(bad)), "{bad:?}");
        }
    }
}
