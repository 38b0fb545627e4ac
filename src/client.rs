//! A small Rust client for tinybroker, used by the CLI: publish, and a
//! subscription that re-subscribes with backoff after an eviction or a lost
//! connection. Sends `authorization: Bearer <token>` when a token is set
//! (by default from `TINYBROKER_AUTH_TOKEN`).

use crate::grpc::SUBSCRIPTION_ID_METADATA;
use crate::pb;
use crate::pb::broker_client::BrokerClient;
use bytes::Bytes;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status, Streaming};

pub use crate::pb::Message;

/// The address the CLI uses when none is given.
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// A connection to one broker. Cheap to clone (clones share the channel).
#[derive(Clone)]
pub struct Client {
    broker: BrokerClient<Channel>,
    authorization: Option<MetadataValue<Ascii>>,
}

/// How to reach a broker beyond its address.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// Sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// PEM file of the CA that signed the broker's certificate, for an
    /// `https://` address; without it the system's roots are used.
    pub ca: Option<PathBuf>,
}

impl ConnectOptions {
    /// The token from `TINYBROKER_AUTH_TOKEN`, if set and not empty.
    pub fn from_env() -> Self {
        Self {
            token: std::env::var("TINYBROKER_AUTH_TOKEN").ok().filter(|t| !t.is_empty()),
            ca: None,
        }
    }
}

impl Client {
    /// Connects to `addr` (`http://host:port`, or `https://` for TLS with the
    /// system's roots), with the token from `TINYBROKER_AUTH_TOKEN` if set.
    pub async fn connect(addr: &str) -> anyhow::Result<Self> {
        Self::connect_with(addr, &ConnectOptions::from_env()).await
    }

    pub async fn connect_with(addr: &str, options: &ConnectOptions) -> anyhow::Result<Self> {
        let mut endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(|e| anyhow::anyhow!("invalid broker address {addr:?}: {e}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5));
        let https = addr.starts_with("https://");
        if !https && options.ca.is_some() {
            anyhow::bail!("--ca is given but the address {addr:?} is not https://");
        }
        if https {
            let mut tls = ClientTlsConfig::new();
            tls = match &options.ca {
                Some(path) => {
                    let pem = std::fs::read(path)
                        .map_err(|e| anyhow::anyhow!("cannot read the CA file {}: {e}", path.display()))?;
                    tls.ca_certificate(Certificate::from_pem(pem))
                }
                None => tls.with_native_roots(),
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| anyhow::anyhow!("cannot set up TLS for {addr}: {e}"))?;
        }
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to {addr}: {:#}", anyhow::Error::new(e)))?;
        Self::from_channel(channel, options.token.as_deref())
    }

    /// Wraps an existing channel.
    pub fn from_channel(channel: Channel, token: Option<&str>) -> anyhow::Result<Self> {
        let authorization = token
            .map(|t| {
                MetadataValue::try_from(format!("Bearer {t}"))
                    .map_err(|_| anyhow::anyhow!("the auth token contains characters not allowed in a header"))
            })
            .transpose()?;
        Ok(Self {
            broker: BrokerClient::new(channel).max_decoding_message_size(usize::MAX),
            authorization,
        })
    }

    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// Publishes one message.
    pub async fn publish(
        &mut self,
        topic: impl Into<String>,
        payload: impl Into<Bytes>,
        headers: HashMap<String, String>,
    ) -> Result<pb::PublishResponse, Status> {
        let request = self.request(pb::PublishRequest {
            topic: topic.into(),
            payload: payload.into(),
            headers,
        });
        Ok(self.broker.publish(request).await?.into_inner())
    }

    /// Acknowledges manual-ack group messages.
    pub async fn ack(&mut self, subscription_id: &str, sequences: Vec<u64>) -> Result<pb::AckResponse, Status> {
        let request = self.request(pb::AckRequest {
            subscription_id: subscription_id.to_owned(),
            sequences,
        });
        Ok(self.broker.ack(request).await?.into_inner())
    }

    /// Hands manual-ack group messages back for redelivery.
    pub async fn nack(&mut self, subscription_id: &str, sequences: Vec<u64>) -> Result<pb::NackResponse, Status> {
        let request = self.request(pb::NackRequest {
            subscription_id: subscription_id.to_owned(),
            sequences,
        });
        Ok(self.broker.nack(request).await?.into_inner())
    }

    /// A subscription that is opened on the first [`Subscriber::next`].
    pub fn subscriber(&self, request: pb::OpenSubscriptionRequest, reconnect: bool) -> Subscriber {
        Subscriber {
            client: self.clone(),
            request,
            stream: None,
            subscription_id: None,
            reconnect,
            backoff: Backoff::default(),
            opened_once: false,
        }
    }
}

/// An open subscription. With `reconnect`, a stream that ends (eviction,
/// admin close) or fails with a transient error is opened again after a
/// backoff, so the caller just keeps calling [`Subscriber::next`].
pub struct Subscriber {
    client: Client,
    request: pb::OpenSubscriptionRequest,
    stream: Option<Streaming<pb::Message>>,
    subscription_id: Option<String>,
    reconnect: bool,
    backoff: Backoff,
    opened_once: bool,
}

impl Subscriber {
    /// The id the broker gave the current stream.
    pub fn subscription_id(&self) -> Option<&str> {
        self.subscription_id.as_deref()
    }

    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    /// Opens the stream now (the first `next` does it otherwise).
    pub async fn open(&mut self) -> Result<(), Status> {
        loop {
            let request = self.client.request(self.request.clone());
            match self.client.broker.open_subscription(request).await {
                Ok(response) => {
                    self.subscription_id = response
                        .metadata()
                        .get(SUBSCRIPTION_ID_METADATA)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    self.stream = Some(response.into_inner());
                    self.opened_once = true;
                    return Ok(());
                }
                Err(status) if self.reconnect && self.retryable(&status) => {
                    tracing::debug!(%status, "subscribe failed; retrying");
                    self.backoff.wait().await;
                }
                Err(status) => return Err(status),
            }
        }
    }

    /// The next message; `Ok(None)` when the stream ended and `reconnect` is off.
    pub async fn next(&mut self) -> Result<Option<pb::Message>, Status> {
        loop {
            if self.stream.is_none() {
                self.open().await?;
            }
            let Some(stream) = self.stream.as_mut() else {
                continue;
            };
            match stream.message().await {
                Ok(Some(message)) => {
                    self.backoff.reset();
                    return Ok(Some(message));
                }
                Ok(None) => {
                    self.stream = None;
                    if !self.reconnect {
                        return Ok(None);
                    }
                    tracing::info!(
                        subscription_id = self.subscription_id.as_deref().unwrap_or(""),
                        "subscription ended by the broker (evicted, closed or shutting down); re-subscribing"
                    );
                    self.backoff.wait().await;
                }
                Err(status) if self.reconnect && self.retryable(&status) => {
                    self.stream = None;
                    tracing::info!(%status, "subscription stream failed; re-subscribing");
                    self.backoff.wait().await;
                }
                Err(status) => {
                    self.stream = None;
                    return Err(status);
                }
            }
        }
    }

    fn retryable(&self, status: &Status) -> bool {
        match status.code() {
            Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted | Code::DeadlineExceeded => true,
            // Our own earlier subscription may not be reaped yet.
            Code::AlreadyExists => self.opened_once,
            _ => false,
        }
    }
}

/// Exponential backoff with jitter: 100 ms doubling to 5 s.
struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: Self::FIRST }
    }
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(5);

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }

    async fn wait(&mut self) {
        let jitter_pct = u64::from(uuid::Uuid::new_v4().as_bytes()[0]) % 25;
        let delay = self.next + self.next * jitter_pct as u32 / 100;
        tokio::time::sleep(delay).await;
        self.next = (self.next * 2).min(Self::MAX);
    }
}
