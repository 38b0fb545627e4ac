//! Configuration from `TINYBROKER_*` environment variables, read with envy and
//! validated once, before any port is bound. Every error names the variable,
//! the value and what is expected, in one line.

use serde::Deserialize;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Effective settings of one broker process.
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub limits: Limits,
    pub shutdown_grace: Duration,
    pub auth_token: Option<String>,
    pub tls: Option<TlsFiles>,
    pub metrics_per_subscription: bool,
    pub log_format: LogFormat,
    pub connections: ConnectionLimits,
    /// Cluster mode: set by `TINYBROKER_NATS_URL`.
    pub cluster: Option<ClusterConfig>,
}

/// Cluster mode: this replica and the NATS cluster that carries messages
/// between replicas (docs/contract.md, "Cluster mode").
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// `nats://host:port` or `tls://host:port` servers, tried in turn.
    pub nats_urls: Vec<String>,
    /// Prefix of every subject, stream, consumer and bucket tinybroker makes.
    pub prefix: String,
    /// JetStream replicas of group state.
    pub nats_replicas: usize,
    pub nats_token: Option<String>,
    pub nats_creds: Option<PathBuf>,
    pub nats_ca: Option<PathBuf>,
    /// Names this replica in logs, Admin and metrics.
    pub replica_id: String,
    /// `TINYBROKER_MAX_MESSAGE_BYTES` is unset: the limit is at most what
    /// the NATS server's `max_payload` carries (found when connected).
    pub max_message_bytes_from_nats: bool,
}

impl fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("nats_urls", &self.nats_urls)
            .field("prefix", &self.prefix)
            .field("nats_replicas", &self.nats_replicas)
            .field("nats_token", &self.nats_token.as_ref().map(|_| "<redacted>"))
            .field("nats_creds", &self.nats_creds)
            .field("nats_ca", &self.nats_ca)
            .field("replica_id", &self.replica_id)
            .field("max_message_bytes_from_nats", &self.max_message_bytes_from_nats)
            .finish()
    }
}

/// HTTP/2 settings of the gRPC listener that bound what one connection can
/// hold and how soon a vanished client is noticed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A PING goes out when a connection has been quiet this long...
    pub keepalive_interval: Duration,
    /// ...and the connection (with all its streams) is closed when the PING
    /// is not answered within this.
    pub keepalive_timeout: Duration,
    /// SETTINGS_MAX_CONCURRENT_STREAMS: open calls (subscriptions included)
    /// on one connection; a client opening more waits for a free slot.
    pub max_streams_per_connection: u32,
    /// Open gRPC connections in all; one more is closed at once.
    pub max_connections: usize,
    /// Time a new connection has to complete the TLS handshake (when TLS is
    /// on) and send the HTTP/2 preface.
    pub handshake_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            max_streams_per_connection: 1024,
            max_connections: 10_000,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Limits the broker core enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub consumer_capacity: usize,
    pub group_capacity: usize,
    pub default_max_in_flight: u32,
    pub default_ack_deadline: Duration,
    /// 0 means no limit.
    pub max_delivery_attempts: u32,
    pub group_idle_ttl: Duration,
    pub max_message_bytes: usize,
    pub max_subscriptions: usize,
    /// Subscriptions one Session stream may hold at once.
    pub max_subscriptions_per_session: usize,
    /// Messages one `SessionPublish` may carry.
    pub max_batch_messages: usize,
    /// Bytes one broadcast subscription's queue may hold before it is evicted.
    pub consumer_max_bytes: usize,
    /// Bytes one group's backlog may hold before its oldest message is dropped.
    pub group_max_bytes: usize,
    /// Bytes of messages and incoming requests the whole broker may hold;
    /// None: no limit (no container limit was found and none was set).
    pub max_memory_bytes: Option<usize>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            consumer_capacity: 1024,
            group_capacity: 65536,
            default_max_in_flight: 64,
            default_ack_deadline: Duration::from_millis(30_000),
            max_delivery_attempts: 0,
            group_idle_ttl: Duration::from_secs(300),
            max_message_bytes: 1_048_576,
            max_subscriptions: 10_000,
            max_subscriptions_per_session: 65_536,
            max_batch_messages: 1024,
            consumer_max_bytes: 64 << 20,
            group_max_bytes: 128 << 20,
            max_memory_bytes: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Reads both PEM files, checking that the certificate file holds at
    /// least one certificate and the key file a private key, so a wrong path
    /// or a swapped pair stops start-up with a line naming the variable.
    pub fn load(&self) -> Result<tonic::transport::Identity, ConfigError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let cert = read_pem(&self.cert, "TLS_CERT")?;
        let key = read_pem(&self.key, "TLS_KEY")?;
        let certs = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_error("TLS_CERT", &self.cert, &format!("is not valid PEM ({e})")))?;
        if certs.is_empty() {
            return Err(pem_error("TLS_CERT", &self.cert, "holds no PEM certificate"));
        }
        PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
            pem_error(
                "TLS_KEY",
                &self.key,
                &format!("holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
            )
        })?;
        Ok(tonic::transport::Identity::from_pem(cert, key))
    }
}

impl TlsFiles {
    /// The TLS settings of the gRPC listener: this certificate and key,
    /// HTTP/2 offered through ALPN.
    pub fn server_config(&self) -> Result<tokio_rustls::rustls::ServerConfig, ConfigError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        use tokio_rustls::rustls;
        self.load()?;
        let cert = read_pem(&self.cert, "TLS_CERT")?;
        let key = read_pem(&self.key, "TLS_KEY")?;
        let certs = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_error("TLS_CERT", &self.cert, &format!("is not valid PEM ({e})")))?;
        let key = PrivateKeyDer::from_pem_slice(&key)
            .map_err(|e| pem_error("TLS_KEY", &self.key, &format!("holds no usable PEM private key: {e}")))?;
        let mut config =
            rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
                .map_err(|e| {
                    ConfigError(format!(
                        "{PREFIX}TLS_CERT={:?} and {PREFIX}TLS_KEY={:?} are not a usable certificate and key: {e}",
                        self.cert.display().to_string(),
                        self.key.display().to_string()
                    ))
                })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

fn read_pem(path: &std::path::Path, name: &str) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| pem_error(name, path, &format!("cannot be read: {e}")))
}

fn pem_error(name: &str, path: &std::path::Path, what: &str) -> ConfigError {
    ConfigError(format!("{PREFIX}{name}={:?} {what}", path.display().to_string()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl fmt::Debug for Config {
    // Hand-written so the auth token can never reach a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("grpc_addr", &self.grpc_addr)
            .field("metrics_addr", &self.metrics_addr)
            .field("limits", &self.limits)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .field("metrics_per_subscription", &self.metrics_per_subscription)
            .field("log_format", &self.log_format)
            .field("connections", &self.connections)
            .field("cluster", &self.cluster)
            .finish()
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], 50051)),
            metrics_addr: SocketAddr::from(([0, 0, 0, 0], 9090)),
            limits: Limits::default(),
            shutdown_grace: Duration::from_secs(10),
            auth_token: None,
            tls: None,
            metrics_per_subscription: true,
            log_format: LogFormat::Text,
            connections: ConnectionLimits::default(),
            cluster: None,
        }
    }
}

/// A start-up configuration error: one line naming the variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    pub(crate) fn new(message: String) -> Self {
        Self(message)
    }
}

/// The raw variables as envy reads them (all strings, so that every parse
/// error can be reported in our own words).
#[derive(Deserialize, Default)]
struct RawEnv {
    grpc_addr: Option<String>,
    metrics_addr: Option<String>,
    consumer_capacity: Option<String>,
    group_capacity: Option<String>,
    default_max_in_flight: Option<String>,
    default_ack_deadline_ms: Option<String>,
    max_delivery_attempts: Option<String>,
    group_idle_ttl_seconds: Option<String>,
    max_message_bytes: Option<String>,
    max_subscriptions: Option<String>,
    max_subscriptions_per_session: Option<String>,
    max_batch_messages: Option<String>,
    shutdown_grace_seconds: Option<String>,
    auth_token: Option<String>,
    tls_cert: Option<String>,
    tls_key: Option<String>,
    metrics_per_subscription: Option<String>,
    log_format: Option<String>,
    keepalive_interval_seconds: Option<String>,
    keepalive_timeout_seconds: Option<String>,
    max_streams_per_connection: Option<String>,
    consumer_max_bytes: Option<String>,
    group_max_bytes: Option<String>,
    max_memory_bytes: Option<String>,
    max_connections: Option<String>,
    handshake_timeout_seconds: Option<String>,
    nats_url: Option<String>,
    nats_prefix: Option<String>,
    nats_replicas: Option<String>,
    nats_token: Option<String>,
    nats_creds: Option<String>,
    nats_ca: Option<String>,
    replica_id: Option<String>,
}

/// Every variable [`RawEnv`] reads, without the prefix: a `TINYBROKER_*`
/// variable not in this list is reported at start-up (a misspelling would
/// otherwise be ignored without a word).
pub const VARIABLES: &[&str] = &[
    "GRPC_ADDR",
    "METRICS_ADDR",
    "CONSUMER_CAPACITY",
    "GROUP_CAPACITY",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_ACK_DEADLINE_MS",
    "MAX_DELIVERY_ATTEMPTS",
    "GROUP_IDLE_TTL_SECONDS",
    "MAX_MESSAGE_BYTES",
    "MAX_SUBSCRIPTIONS",
    "MAX_SUBSCRIPTIONS_PER_SESSION",
    "MAX_BATCH_MESSAGES",
    "SHUTDOWN_GRACE_SECONDS",
    "AUTH_TOKEN",
    "TLS_CERT",
    "TLS_KEY",
    "METRICS_PER_SUBSCRIPTION",
    "LOG_FORMAT",
    "KEEPALIVE_INTERVAL_SECONDS",
    "KEEPALIVE_TIMEOUT_SECONDS",
    "MAX_STREAMS_PER_CONNECTION",
    "CONSUMER_MAX_BYTES",
    "GROUP_MAX_BYTES",
    "MAX_MEMORY_BYTES",
    "MAX_CONNECTIONS",
    "HANDSHAKE_TIMEOUT_SECONDS",
    "NATS_URL",
    "NATS_PREFIX",
    "NATS_REPLICAS",
    "NATS_TOKEN",
    "NATS_CREDS",
    "NATS_CA",
    "REPLICA_ID",
];

const PREFIX: &str = "TINYBROKER_";

impl Config {
    /// Reads the process environment; `TINYBROKER_MAX_MEMORY_BYTES` defaults
    /// from this process's container memory limit.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars_in(std::env::vars(), crate::memory::container_memory_limit())
    }

    /// Reads the given variables (tests pass their own), as outside any
    /// container.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, ConfigError> {
        Self::from_vars_in(vars, None)
    }

    /// Reads the given variables in a container with this memory limit.
    pub fn from_vars_in(
        vars: impl IntoIterator<Item = (String, String)>,
        container_memory_limit: Option<u64>,
    ) -> Result<Self, ConfigError> {
        let vars: Vec<(String, String)> = vars.into_iter().filter(|(k, _)| k.starts_with(PREFIX)).collect();
        no_near_miss(vars.iter().map(|(k, _)| k.as_str()))?;
        let raw: RawEnv = envy::prefixed(PREFIX)
            .from_iter(vars)
            .map_err(|e| ConfigError(format!("could not read the {PREFIX}* environment: {e}")))?;
        let defaults = Config::default();
        let d = &defaults.limits;
        let limits = Limits {
            consumer_capacity: positive(&raw.consumer_capacity, "CONSUMER_CAPACITY", d.consumer_capacity)?,
            group_capacity: positive(&raw.group_capacity, "GROUP_CAPACITY", d.group_capacity)?,
            default_max_in_flight: positive(
                &raw.default_max_in_flight,
                "DEFAULT_MAX_IN_FLIGHT",
                d.default_max_in_flight,
            )?,
            default_ack_deadline: Duration::from_millis(positive(
                &raw.default_ack_deadline_ms,
                "DEFAULT_ACK_DEADLINE_MS",
                30_000u64,
            )?),
            max_delivery_attempts: number(
                &raw.max_delivery_attempts,
                "MAX_DELIVERY_ATTEMPTS",
                d.max_delivery_attempts,
                "a whole number (0 = no limit)",
            )?,
            group_idle_ttl: Duration::from_secs(number(
                &raw.group_idle_ttl_seconds,
                "GROUP_IDLE_TTL_SECONDS",
                300u64,
                "a whole number of seconds",
            )?),
            max_message_bytes: positive(&raw.max_message_bytes, "MAX_MESSAGE_BYTES", d.max_message_bytes)?,
            max_subscriptions: positive(&raw.max_subscriptions, "MAX_SUBSCRIPTIONS", d.max_subscriptions)?,
            max_subscriptions_per_session: positive(
                &raw.max_subscriptions_per_session,
                "MAX_SUBSCRIPTIONS_PER_SESSION",
                d.max_subscriptions_per_session,
            )?,
            max_batch_messages: positive(&raw.max_batch_messages, "MAX_BATCH_MESSAGES", d.max_batch_messages)?,
            consumer_max_bytes: positive(&raw.consumer_max_bytes, "CONSUMER_MAX_BYTES", d.consumer_max_bytes)?,
            group_max_bytes: positive(&raw.group_max_bytes, "GROUP_MAX_BYTES", d.group_max_bytes)?,
            max_memory_bytes: match raw.max_memory_bytes {
                None => crate::memory::default_limit(container_memory_limit),
                Some(_) => Some(positive(&raw.max_memory_bytes, "MAX_MEMORY_BYTES", 1usize)?),
            },
        };
        // The gRPC decoder must be able to hold a maximal message plus framing.
        const MESSAGE_BYTES_CEILING: usize = 1 << 30;
        if limits.max_message_bytes > MESSAGE_BYTES_CEILING {
            return Err(invalid(
                "MAX_MESSAGE_BYTES",
                &limits.max_message_bytes.to_string(),
                &format!("at most {MESSAGE_BYTES_CEILING} (1 GiB)"),
            ));
        }
        let cluster = cluster(&raw)?;
        let tls = match (nonblank(&raw.tls_cert), nonblank(&raw.tls_key)) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.into(),
                key: key.into(),
            }),
            (Some(cert), None) => {
                return Err(ConfigError(format!(
                    "{PREFIX}TLS_CERT is set ({cert:?}) but {PREFIX}TLS_KEY is not: set both or neither"
                )));
            }
            (None, Some(key)) => {
                return Err(ConfigError(format!(
                    "{PREFIX}TLS_KEY is set ({key:?}) but {PREFIX}TLS_CERT is not: set both or neither"
                )));
            }
        };
        let auth_token = match raw.auth_token {
            // An empty token would quietly turn authentication off.
            Some(t) if t.is_empty() => {
                return Err(ConfigError(format!(
                    "{PREFIX}AUTH_TOKEN=\"\" is empty, which would leave the broker open to anyone: set a token, or unset the variable to run without authentication"
                )));
            }
            Some(t) if t.trim().is_empty() => {
                return Err(ConfigError(format!(
                    "{PREFIX}AUTH_TOKEN is only whitespace: expected a non-blank token, or leave it unset"
                )));
            }
            other => other,
        };
        let c = &defaults.connections;
        let connections = ConnectionLimits {
            keepalive_interval: Duration::from_secs(positive(
                &raw.keepalive_interval_seconds,
                "KEEPALIVE_INTERVAL_SECONDS",
                c.keepalive_interval.as_secs(),
            )?),
            keepalive_timeout: Duration::from_secs(positive(
                &raw.keepalive_timeout_seconds,
                "KEEPALIVE_TIMEOUT_SECONDS",
                c.keepalive_timeout.as_secs(),
            )?),
            max_streams_per_connection: positive(
                &raw.max_streams_per_connection,
                "MAX_STREAMS_PER_CONNECTION",
                c.max_streams_per_connection,
            )?,
            max_connections: positive(&raw.max_connections, "MAX_CONNECTIONS", c.max_connections)?,
            handshake_timeout: Duration::from_secs(positive(
                &raw.handshake_timeout_seconds,
                "HANDSHAKE_TIMEOUT_SECONDS",
                c.handshake_timeout.as_secs(),
            )?),
        };
        Ok(Config {
            cluster,
            connections,
            grpc_addr: addr(&raw.grpc_addr, "GRPC_ADDR", defaults.grpc_addr)?,
            metrics_addr: addr(&raw.metrics_addr, "METRICS_ADDR", defaults.metrics_addr)?,
            limits,
            shutdown_grace: Duration::from_secs(number(
                &raw.shutdown_grace_seconds,
                "SHUTDOWN_GRACE_SECONDS",
                10u64,
                "a whole number of seconds",
            )?),
            auth_token,
            tls,
            metrics_per_subscription: boolean(&raw.metrics_per_subscription, "METRICS_PER_SUBSCRIPTION", true)?,
            log_format: match nonblank(&raw.log_format).map(str::to_ascii_lowercase).as_deref() {
                None | Some("text") => LogFormat::Text,
                Some("json") => LogFormat::Json,
                Some(_) => {
                    return Err(invalid(
                        "LOG_FORMAT",
                        raw.log_format.as_deref().unwrap_or_default(),
                        "\"text\" or \"json\"",
                    ));
                }
            },
        })
    }
}

/// `TINYBROKER_*` variables that are not the broker's but are set beside it
/// on purpose: the address the CLI's and client libraries' users export
/// (docs/contract.md, "Command line"). Not reported.
const NOT_THE_BROKERS: &[&str] = &["ADDR"];

/// A `TINYBROKER_*` variable the broker does not read, and what start-up
/// makes of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnknownVariable {
    /// A near miss of a known variable ([`near_miss`]): start-up stops,
    /// since running without the setting the operator meant (auth off, a
    /// default limit) is worse than not starting.
    NearMiss { name: String, known: String },
    /// Ignored with a WARN naming the known variable it may have meant, if
    /// one is close enough to suggest.
    Ignored { name: String, may_mean: Option<String> },
}

/// The `TINYBROKER_*` variables among `names` that the broker does not know,
/// each a near miss of a known one or ignored (with the known one it may
/// have meant). A name that is a known one in other letter case is known
/// (envy reads it). Kubernetes' service links (`TINYBROKER_SERVICE_HOST`,
/// `TINYBROKER_PORT_50051_TCP`, and those of any Service whose name begins
/// with `tinybroker-`, `TINYBROKER_NATS_SERVICE_HOST`, ...) and
/// [`NOT_THE_BROKERS`] are not reported.
pub fn unknown_variables<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<UnknownVariable> {
    names
        .into_iter()
        .filter_map(|name| Some((name, name.strip_prefix(PREFIX)?.to_ascii_uppercase())))
        .filter(|(_, rest)| !VARIABLES.contains(&rest.as_str()) && !NOT_THE_BROKERS.contains(&rest.as_str()))
        .filter(|(_, rest)| !is_service_link(rest))
        .map(|(name, rest)| {
            let closest = VARIABLES
                .iter()
                .map(|known| (edit_distance(&rest, known), *known))
                .min_by_key(|(distance, _)| *distance);
            let name = name.to_owned();
            match closest {
                Some((distance, known)) if distance <= near_miss(known) => UnknownVariable::NearMiss {
                    name,
                    known: format!("{PREFIX}{known}"),
                },
                closest => UnknownVariable::Ignored {
                    name,
                    may_mean: closest
                        .filter(|(distance, known)| *distance <= 3.max(known.len() / 4))
                        .map(|(_, known)| format!("{PREFIX}{known}")),
                },
            }
        })
        .collect()
}

/// How many edits away from the known variable `known` (without the
/// prefix) an unknown name is a near miss of it: 1 for a name of up to 8
/// characters (`TLS_CERT`), 2 for a longer one (`AUTH_TOKEN`). An edit is
/// one character inserted, deleted or replaced, or two neighbours swapped
/// ([`edit_distance`]). Longer names allow more, but never so many that one
/// known name is a near miss of another (`TLS_KEY` and `TLS_CERT`,
/// `NATS_TOKEN` and `AUTH_TOKEN` are 3 apart; a unit test checks every
/// pair). A name near two known ones is taken for the closer.
pub fn near_miss(known: &str) -> usize {
    if known.len() <= 8 { 1 } else { 2 }
}

/// The remainder, after `TINYBROKER_`, of a variable Kubernetes sets for a
/// Service named `tinybroker` or `tinybroker-<something>` when service
/// links are on: `[<SOMETHING>_]SERVICE_HOST`, `..._SERVICE_PORT[_<NAME>]`,
/// `[<SOMETHING>_]PORT`, `..._PORT_<number>_<protocol>[_...]`.
fn is_service_link(rest: &str) -> bool {
    let rest = format!("_{rest}");
    if rest.contains("_SERVICE_HOST") || rest.contains("_SERVICE_PORT") || rest.ends_with("_PORT") {
        return true;
    }
    rest.match_indices("_PORT_").any(|(at, _)| {
        let after = &rest[at + "_PORT_".len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        digits > 0 && ["_TCP", "_UDP", "_SCTP"].iter().any(|p| after[digits..].starts_with(p))
    })
}

/// The number of edits between two short ASCII names: characters inserted,
/// deleted or replaced, and neighbours swapped (the optimal string
/// alignment distance).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    // d[i][j]: the distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    d[0] = (0..=b.len()).collect();
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// Stops start-up for the first near miss among `names` ([`UnknownVariable::NearMiss`]).
fn no_near_miss<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), ConfigError> {
    for unknown in unknown_variables(names) {
        if let UnknownVariable::NearMiss { name, known } = unknown {
            return Err(ConfigError(format!(
                "{name} is not a tinybroker setting, and it is so close to {known} that it looks like a misspelling of it: rename it to {known} (or unset it); start-up stops rather than run without the setting you meant"
            )));
        }
    }
    Ok(())
}

/// Cluster mode, when `TINYBROKER_NATS_URL` is set; the other `NATS_*`
/// variables and `REPLICA_ID` only mean something then.
fn cluster(raw: &RawEnv) -> Result<Option<ClusterConfig>, ConfigError> {
    let Some(urls) = nonblank(&raw.nats_url) else {
        for (name, value) in [
            ("NATS_PREFIX", &raw.nats_prefix),
            ("NATS_REPLICAS", &raw.nats_replicas),
            ("NATS_TOKEN", &raw.nats_token),
            ("NATS_CREDS", &raw.nats_creds),
            ("NATS_CA", &raw.nats_ca),
        ] {
            if nonblank(value).is_some() {
                return Err(ConfigError(format!(
                    "{PREFIX}{name} is set but {PREFIX}NATS_URL is not: cluster mode needs the NATS servers (nats://host:port, comma-separated)"
                )));
            }
        }
        return Ok(None);
    };
    let mut nats_urls = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let rest = url
            .strip_prefix("nats://")
            .or_else(|| url.strip_prefix("tls://"))
            .ok_or_else(|| invalid("NATS_URL", url, "nats://host:port or tls://host:port, comma-separated"))?;
        let host_port = rest.rsplit_once('@').map_or(rest, |(_, hp)| hp);
        let port_ok = host_port
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
        if !port_ok {
            return Err(invalid(
                "NATS_URL",
                url,
                "nats://host:port or tls://host:port, comma-separated",
            ));
        }
        nats_urls.push(url.to_owned());
    }
    if nats_urls.is_empty() {
        return Err(invalid(
            "NATS_URL",
            urls,
            "nats://host:port or tls://host:port, comma-separated",
        ));
    }
    let prefix = nonblank(&raw.nats_prefix).unwrap_or("tinybroker").to_owned();
    let prefix_ok = prefix.len() <= 32
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !prefix_ok {
        return Err(invalid(
            "NATS_PREFIX",
            &prefix,
            "at most 32 letters, digits, '_' or '-' (it names NATS subjects, streams and buckets)",
        ));
    }
    let nats_replicas: usize = positive(&raw.nats_replicas, "NATS_REPLICAS", 3)?;
    if nats_replicas > 5 {
        return Err(invalid(
            "NATS_REPLICAS",
            &nats_replicas.to_string(),
            "1 to 5 (JetStream's limit)",
        ));
    }
    let nats_token = match &raw.nats_token {
        Some(t) if t.trim().is_empty() => {
            return Err(ConfigError(format!(
                "{PREFIX}NATS_TOKEN is empty: set the NATS token, or unset the variable"
            )));
        }
        other => other.clone(),
    };
    let replica_id = match nonblank(&raw.replica_id) {
        Some(id) => id.to_owned(),
        None => host_name().ok_or_else(|| {
            ConfigError(format!(
                "{PREFIX}REPLICA_ID is unset and the host name cannot be read: set {PREFIX}REPLICA_ID"
            ))
        })?,
    };
    if replica_id.len() > 128 || !replica_id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "REPLICA_ID",
            &replica_id,
            "at most 128 printable ASCII characters without spaces",
        ));
    }
    Ok(Some(ClusterConfig {
        nats_urls,
        prefix,
        nats_replicas,
        nats_token,
        nats_creds: nonblank(&raw.nats_creds).map(PathBuf::from),
        nats_ca: nonblank(&raw.nats_ca).map(PathBuf::from),
        replica_id,
        max_message_bytes_from_nats: raw.max_message_bytes.is_none(),
    }))
}

/// This host's name (a pod's name in Kubernetes).
pub(crate) fn host_name() -> Option<String> {
    if let Ok(name) = std::env::var("HOSTNAME")
        && !name.trim().is_empty()
    {
        return Some(name.trim().to_owned());
    }
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_owned())
}

fn invalid(name: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError(format!("{PREFIX}{name}={value:?} is invalid: expected {expected}"))
}

fn nonblank(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

fn number<N: std::str::FromStr>(
    value: &Option<String>,
    name: &str,
    default: N,
    expected: &str,
) -> Result<N, ConfigError> {
    match value.as_deref() {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|_| invalid(name, v, expected)),
    }
}

fn positive<N>(value: &Option<String>, name: &str, default: N) -> Result<N, ConfigError>
where
    N: std::str::FromStr + PartialEq + From<u8>,
{
    let expected = "a whole number greater than 0";
    let n = number(value, name, default, expected)?;
    if n == N::from(0u8) {
        return Err(invalid(name, value.as_deref().unwrap_or("0"), expected));
    }
    Ok(n)
}

fn addr(value: &Option<String>, name: &str, default: SocketAddr) -> Result<SocketAddr, ConfigError> {
    number(value, name, default, "an IP:port socket address such as 0.0.0.0:50051")
}

fn boolean(value: &Option<String>, name: &str, default: bool) -> Result<bool, ConfigError> {
    match value.as_deref().map(|v| v.trim().to_ascii_lowercase()) {
        None => Ok(default),
        Some(v) => match v.as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            _ => Err(invalid(name, value.as_deref().unwrap_or_default(), "true or false")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_match_the_contract() {
        let c = Config::from_vars(vars(&[("PATH", "/bin"), ("RUST_LOG", "debug")])).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.grpc_addr.to_string(), "0.0.0.0:50051");
        assert_eq!(c.metrics_addr.to_string(), "0.0.0.0:9090");
        assert_eq!(c.limits.consumer_capacity, 1024);
        assert_eq!(c.limits.group_capacity, 65536);
        assert_eq!(c.limits.default_max_in_flight, 64);
        assert_eq!(c.limits.default_ack_deadline, Duration::from_secs(30));
        assert_eq!(c.limits.max_delivery_attempts, 0);
        assert_eq!(c.limits.group_idle_ttl, Duration::from_secs(300));
        assert_eq!(c.limits.max_message_bytes, 1_048_576);
        assert_eq!(c.limits.max_subscriptions, 10_000);
        assert_eq!(c.limits.consumer_max_bytes, 64 << 20);
        assert_eq!(c.limits.group_max_bytes, 128 << 20);
        assert_eq!(c.limits.max_memory_bytes, None, "no container limit");
        assert_eq!(c.connections.max_connections, 10_000);
        assert_eq!(c.connections.handshake_timeout, Duration::from_secs(10));
        assert_eq!(c.shutdown_grace, Duration::from_secs(10));
        assert!(c.metrics_per_subscription);
        assert_eq!(c.log_format, LogFormat::Text);
    }

    #[test]
    fn every_variable_is_read() {
        let c = Config::from_vars(vars(&[
            ("TINYBROKER_GRPC_ADDR", "127.0.0.1:1"),
            ("TINYBROKER_METRICS_ADDR", "127.0.0.1:2"),
            ("TINYBROKER_CONSUMER_CAPACITY", "3"),
            ("TINYBROKER_GROUP_CAPACITY", "4"),
            ("TINYBROKER_DEFAULT_MAX_IN_FLIGHT", "5"),
            ("TINYBROKER_DEFAULT_ACK_DEADLINE_MS", "6"),
            ("TINYBROKER_MAX_DELIVERY_ATTEMPTS", "7"),
            ("TINYBROKER_GROUP_IDLE_TTL_SECONDS", "8"),
            ("TINYBROKER_MAX_MESSAGE_BYTES", "9"),
            ("TINYBROKER_MAX_SUBSCRIPTIONS", "10"),
            ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "11"),
            ("TINYBROKER_AUTH_TOKEN", "s3cret"),
            ("TINYBROKER_TLS_CERT", "/c.pem"),
            ("TINYBROKER_TLS_KEY", "/k.pem"),
            ("TINYBROKER_METRICS_PER_SUBSCRIPTION", "false"),
            ("TINYBROKER_LOG_FORMAT", "json"),
            ("TINYBROKER_KEEPALIVE_INTERVAL_SECONDS", "12"),
            ("TINYBROKER_KEEPALIVE_TIMEOUT_SECONDS", "13"),
            ("TINYBROKER_MAX_STREAMS_PER_CONNECTION", "14"),
            ("TINYBROKER_CONSUMER_MAX_BYTES", "15"),
            ("TINYBROKER_GROUP_MAX_BYTES", "16"),
            ("TINYBROKER_MAX_MEMORY_BYTES", "17"),
            ("TINYBROKER_MAX_CONNECTIONS", "18"),
            ("TINYBROKER_HANDSHAKE_TIMEOUT_SECONDS", "19"),
            ("TINYBROKER_MAX_SUBSCRIPTIONS_PER_SESSION", "20"),
            ("TINYBROKER_MAX_BATCH_MESSAGES", "21"),
        ]))
        .unwrap();
        assert_eq!(c.grpc_addr.port(), 1);
        assert_eq!(c.metrics_addr.port(), 2);
        let l = &c.limits;
        assert_eq!(
            (l.consumer_capacity, l.group_capacity, l.default_max_in_flight),
            (3, 4, 5)
        );
        assert_eq!(l.default_ack_deadline, Duration::from_millis(6));
        assert_eq!(l.max_delivery_attempts, 7);
        assert_eq!(l.group_idle_ttl, Duration::from_secs(8));
        assert_eq!((l.max_message_bytes, l.max_subscriptions), (9, 10));
        assert_eq!(l.max_subscriptions_per_session, 20);
        assert_eq!(l.max_batch_messages, 21);
        assert_eq!(c.shutdown_grace, Duration::from_secs(11));
        assert_eq!(c.auth_token.as_deref(), Some("s3cret"));
        assert_eq!(c.tls.as_ref().unwrap().key, PathBuf::from("/k.pem"));
        assert!(!c.metrics_per_subscription);
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(
            c.connections,
            ConnectionLimits {
                keepalive_interval: Duration::from_secs(12),
                keepalive_timeout: Duration::from_secs(13),
                max_streams_per_connection: 14,
                max_connections: 18,
                handshake_timeout: Duration::from_secs(19),
            }
        );
        assert_eq!(
            (l.consumer_max_bytes, l.group_max_bytes, l.max_memory_bytes),
            (15, 16, Some(17))
        );
        assert!(!format!("{c:?}").contains("s3cret"), "Debug must redact the token");
    }

    #[test]
    fn bad_values_name_variable_value_and_expectation() {
        let cases = [
            ("TINYBROKER_CONSUMER_CAPACITY", "abc", "a whole number greater than 0"),
            ("TINYBROKER_CONSUMER_CAPACITY", "0", "a whole number greater than 0"),
            ("TINYBROKER_CONSUMER_CAPACITY", "-1", "a whole number greater than 0"),
            ("TINYBROKER_GROUP_CAPACITY", "0", "greater than 0"),
            ("TINYBROKER_DEFAULT_MAX_IN_FLIGHT", "0", "greater than 0"),
            ("TINYBROKER_DEFAULT_ACK_DEADLINE_MS", "1.5", "greater than 0"),
            ("TINYBROKER_MAX_DELIVERY_ATTEMPTS", "x", "0 = no limit"),
            ("TINYBROKER_MAX_MESSAGE_BYTES", "0", "greater than 0"),
            ("TINYBROKER_MAX_MESSAGE_BYTES", "99999999999", "at most"),
            ("TINYBROKER_MAX_SUBSCRIPTIONS", "", "greater than 0"),
            ("TINYBROKER_MAX_SUBSCRIPTIONS_PER_SESSION", "0", "greater than 0"),
            ("TINYBROKER_MAX_BATCH_MESSAGES", "-1", "greater than 0"),
            ("TINYBROKER_GRPC_ADDR", "localhost", "IP:port"),
            ("TINYBROKER_METRICS_ADDR", "1.2.3.4", "IP:port"),
            ("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "ten", "seconds"),
            ("TINYBROKER_METRICS_PER_SUBSCRIPTION", "maybe", "true or false"),
            ("TINYBROKER_LOG_FORMAT", "xml", "\"text\" or \"json\""),
            ("TINYBROKER_KEEPALIVE_INTERVAL_SECONDS", "0", "greater than 0"),
            ("TINYBROKER_KEEPALIVE_TIMEOUT_SECONDS", "1m", "greater than 0"),
            ("TINYBROKER_MAX_STREAMS_PER_CONNECTION", "4294967296", "greater than 0"),
            ("TINYBROKER_CONSUMER_MAX_BYTES", "0", "greater than 0"),
            ("TINYBROKER_GROUP_MAX_BYTES", "64MiB", "greater than 0"),
            ("TINYBROKER_MAX_MEMORY_BYTES", "0", "greater than 0"),
            ("TINYBROKER_MAX_CONNECTIONS", "-5", "greater than 0"),
            ("TINYBROKER_HANDSHAKE_TIMEOUT_SECONDS", "0", "greater than 0"),
            ("TINYBROKER_AUTH_TOKEN", "", "empty"),
        ];
        for (name, value, expected) in cases {
            let err = Config::from_vars(vars(&[(name, value)])).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
            assert!(err.contains(expected), "{err}");
            assert!(!err.contains('\n'), "one line: {err}");
            if name != "TINYBROKER_MAX_MESSAGE_BYTES" || value == "0" {
                assert!(err.contains(&format!("{value:?}")), "{err}");
            }
        }
    }

    #[test]
    fn the_memory_limit_defaults_to_three_quarters_of_the_container_limit() {
        let c = Config::from_vars_in(vars(&[]), Some(512 << 20)).unwrap();
        assert_eq!(c.limits.max_memory_bytes, Some(384 << 20));
        let set = Config::from_vars_in(vars(&[("TINYBROKER_MAX_MEMORY_BYTES", "1000")]), Some(512 << 20)).unwrap();
        assert_eq!(set.limits.max_memory_bytes, Some(1000), "the variable wins");
    }

    fn ignored(name: &str, may_mean: Option<&str>) -> UnknownVariable {
        UnknownVariable::Ignored {
            name: name.into(),
            may_mean: may_mean.map(Into::into),
        }
    }

    fn near(name: &str, known: &str) -> UnknownVariable {
        UnknownVariable::NearMiss {
            name: name.into(),
            known: known.into(),
        }
    }

    #[test]
    fn unknown_variables_are_named_with_the_closest_known_one() {
        let found = unknown_variables([
            "TINYBROKER_CONSUMER_CAPACITY",
            "TINYBROKER_MAX_MSG_BYTES",
            "TINYBROKER_WHATEVER_ELSE_ENTIRELY",
            "TINYBROKER_SERVICE_HOST",
            "TINYBROKER_PORT_50051_TCP_ADDR",
            "TINYBROKER_PORT",
            "PATH",
        ]);
        assert_eq!(
            found,
            [
                ignored("TINYBROKER_MAX_MSG_BYTES", Some("TINYBROKER_MAX_MESSAGE_BYTES")),
                ignored("TINYBROKER_WHATEVER_ELSE_ENTIRELY", None),
            ]
        );
    }

    #[test]
    fn a_near_miss_is_one_edit_from_a_short_name_or_two_from_a_longer_one() {
        let found = unknown_variables([
            "TINYBROKER_AUTH_TOKN",
            "TINYBROKER_AUTH_TOEKN",
            "TINYBROKER_ATH_TOKN",
            "TINYBROKER_CONSUMER_CAPACTY",
            "TINYBROKER_TLS_CRT",
            "TINYBROKER_TLS_CRET",
            "TINYBROKER_TLS_CRTT",
            "TINYBROKER_NATS_URLS",
            "TINYBROKER_auth_tokn",
            "TINYBROKER_AUTH_TKN_",
        ]);
        assert_eq!(
            found,
            [
                near("TINYBROKER_AUTH_TOKN", "TINYBROKER_AUTH_TOKEN"),
                near("TINYBROKER_AUTH_TOEKN", "TINYBROKER_AUTH_TOKEN"),
                near("TINYBROKER_ATH_TOKN", "TINYBROKER_AUTH_TOKEN"),
                near("TINYBROKER_CONSUMER_CAPACTY", "TINYBROKER_CONSUMER_CAPACITY"),
                near("TINYBROKER_TLS_CRT", "TINYBROKER_TLS_CERT"),
                near("TINYBROKER_TLS_CRET", "TINYBROKER_TLS_CERT"),
                // Two edits from an 8-character name: a hint only.
                ignored("TINYBROKER_TLS_CRTT", Some("TINYBROKER_TLS_CERT")),
                near("TINYBROKER_NATS_URLS", "TINYBROKER_NATS_URL"),
                near("TINYBROKER_auth_tokn", "TINYBROKER_AUTH_TOKEN"),
                // Three edits.
                ignored("TINYBROKER_AUTH_TKN_", Some("TINYBROKER_AUTH_TOKEN")),
            ]
        );
    }

    /// No known name is a near miss of another.
    #[test]
    fn no_known_variable_is_a_near_miss_of_another() {
        for a in VARIABLES {
            for b in VARIABLES.iter().filter(|b| *b != a) {
                assert!(
                    edit_distance(a, b) > near_miss(b),
                    "{a} and {b} are {} edits apart",
                    edit_distance(a, b)
                );
            }
        }
    }

    /// The `TINYBROKER_` names the project's chart, scripts, tests, client
    /// libraries and Kubernetes set beside the broker start it.
    #[test]
    fn no_variable_the_project_or_kubernetes_sets_stops_start_up() {
        let names = [
            "TINYBROKER_ADDR",
            "TINYBROKER_BIN",
            "TINYBROKER_SERVICE_HOST",
            "TINYBROKER_SERVICE_PORT",
            "TINYBROKER_SERVICE_PORT_GRPC",
            "TINYBROKER_PORT",
            "TINYBROKER_PORT_50051_TCP",
            "TINYBROKER_PORT_50051_TCP_PROTO",
            "TINYBROKER_PORT_9090_TCP_ADDR",
            "TINYBROKER_NATS_SERVICE_HOST",
            "TINYBROKER_NATS_SERVICE_PORT",
            "TINYBROKER_NATS_PORT",
            "TINYBROKER_NATS_PORT_4222_TCP_PORT",
            "TINYBROKER_HEADLESS_SERVICE_HOST",
        ];
        let mut vars: Vec<(String, String)> = names.iter().map(|n| (n.to_string(), "x".into())).collect();
        vars.extend(VARIABLES.iter().map(|v| (format!("{PREFIX}{v}"), String::new())));
        assert!(
            unknown_variables(names)
                .iter()
                .all(|u| !matches!(u, UnknownVariable::NearMiss { .. })),
            "{:?}",
            unknown_variables(names)
        );
        assert_eq!(unknown_variables(names), [ignored("TINYBROKER_BIN", None)]);
        assert!(no_near_miss(vars.iter().map(|(k, _)| k.as_str())).is_ok());
    }

    #[test]
    fn a_near_miss_stops_start_up_naming_both() {
        let error = Config::from_vars(vars(&[("TINYBROKER_AUTH_TOKN", "secret")])).unwrap_err();
        let line = error.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(
            line.contains("TINYBROKER_AUTH_TOKN") && line.contains("TINYBROKER_AUTH_TOKEN"),
            "{line}"
        );
        assert!(!line.contains("secret"), "the value may be a secret: {line}");
        Config::from_vars(vars(&[("TINYBROKER_AUTH_TOKEN_FILE", "/x")])).expect("not a near miss: a WARN");
    }

    #[test]
    fn cluster_mode_is_read_and_checked() {
        let c = Config::from_vars(vars(&[
            ("TINYBROKER_NATS_URL", "nats://a:4222, tls://user:pw@b:4223"),
            ("TINYBROKER_NATS_PREFIX", "tb-2"),
            ("TINYBROKER_NATS_REPLICAS", "1"),
            ("TINYBROKER_NATS_TOKEN", "t0k"),
            ("TINYBROKER_NATS_CREDS", "/creds"),
            ("TINYBROKER_NATS_CA", "/ca.pem"),
            ("TINYBROKER_REPLICA_ID", "pod-0"),
        ]))
        .unwrap();
        let cluster = c.cluster.expect("cluster mode");
        assert_eq!(cluster.nats_urls, ["nats://a:4222", "tls://user:pw@b:4223"]);
        assert_eq!((cluster.prefix.as_str(), cluster.nats_replicas), ("tb-2", 1));
        assert_eq!(cluster.nats_token.as_deref(), Some("t0k"));
        assert_eq!(cluster.replica_id, "pod-0");
        assert!(!format!("{:?}", c.limits).is_empty());
        let shown = format!("{cluster:?}");
        assert!(!shown.contains("t0k"), "the token never reaches a log: {shown}");
        let defaults = Config::from_vars(vars(&[("TINYBROKER_NATS_URL", "nats://n:4222"), ("HOSTNAME", "x")]))
            .unwrap()
            .cluster
            .unwrap();
        assert_eq!((defaults.prefix.as_str(), defaults.nats_replicas), ("tinybroker", 3));
        assert!(!defaults.replica_id.is_empty());
        assert_eq!(Config::from_vars(vars(&[])).unwrap().cluster, None);
        for (pairs, names) in [
            (vec![("TINYBROKER_NATS_URL", "http://a:1")], "TINYBROKER_NATS_URL"),
            (vec![("TINYBROKER_NATS_URL", "nats://a")], "TINYBROKER_NATS_URL"),
            (vec![("TINYBROKER_NATS_URL", " , ")], "TINYBROKER_NATS_URL"),
            (
                vec![("TINYBROKER_NATS_URL", "nats://a:1"), ("TINYBROKER_NATS_PREFIX", "a.b")],
                "TINYBROKER_NATS_PREFIX",
            ),
            (
                vec![("TINYBROKER_NATS_URL", "nats://a:1"), ("TINYBROKER_NATS_REPLICAS", "7")],
                "TINYBROKER_NATS_REPLICAS",
            ),
            (
                vec![("TINYBROKER_NATS_URL", "nats://a:1"), ("TINYBROKER_NATS_TOKEN", " ")],
                "TINYBROKER_NATS_TOKEN",
            ),
            (
                vec![("TINYBROKER_NATS_URL", "nats://a:1"), ("TINYBROKER_REPLICA_ID", "a b")],
                "TINYBROKER_REPLICA_ID",
            ),
            (vec![("TINYBROKER_NATS_PREFIX", "x")], "TINYBROKER_NATS_PREFIX"),
        ] {
            let err = Config::from_vars(vars(&pairs)).unwrap_err().to_string();
            assert!(err.contains(names), "{pairs:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn tls_needs_both_files() {
        let err = Config::from_vars(vars(&[("TINYBROKER_TLS_CERT", "/c.pem")])).unwrap_err();
        assert!(err.to_string().contains("TINYBROKER_TLS_KEY is not"), "{err}");
        let err = Config::from_vars(vars(&[("TINYBROKER_TLS_KEY", "/k.pem")])).unwrap_err();
        assert!(err.to_string().contains("TINYBROKER_TLS_CERT is not"), "{err}");
    }

    #[test]
    fn unreadable_or_invalid_pem_names_the_variable_and_path() {
        let dir = std::env::temp_dir().join(format!("tinybroker-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let garbage = dir.join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let missing = dir.join("missing.pem");
        let cases = [
            (&missing, &garbage, "TINYBROKER_TLS_CERT", "cannot be read"),
            (&garbage, &garbage, "TINYBROKER_TLS_CERT", "holds no PEM certificate"),
        ];
        for (cert, key, name, expected) in cases {
            let files = TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            };
            let err = files.load().expect_err("must fail").to_string();
            assert!(err.starts_with(name), "{err}");
            assert!(err.contains(expected), "{err}");
            assert!(err.contains(&cert.display().to_string()), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
