//! Runs the broker: the gRPC server (Broker, health, reflection) and the HTTP
//! side server, on listeners the caller has already bound, until the shutdown
//! future resolves; then drains and stops as docs/contract.md, Lifecycle, says.

use crate::auth::AuthLayer;
use crate::broker::Broker;
use crate::cluster::ClusterEngine;
use crate::config::Config;
use crate::engine::{Engine, EngineHealth};
use crate::grpc::connections::{self, ConnectionStats, Rejection};
use crate::grpc::request_budget::IncomingLimits;
use crate::grpc::{self, AdminService, BrokerService};
use crate::ops::http_server::{self, Readiness};
use crate::ops::metrics::{FrontCounters, FrontSource, Metrics};
use crate::pb;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// How long the servers get to finish once every stream has ended.
const CONNECTION_CLOSE_TIMEOUT: Duration = connections::GRACEFUL_CLOSE;

/// How long `/metrics` stays up after a shutdown discarded messages, so that
/// a scrape every second or two sees the final count. The chart's
/// `terminationGraceMarginSeconds` (10) covers it.
pub const LOSS_REPORT_TIME: Duration = Duration::from_secs(3);

/// Listeners bound before the broker starts (tests bind `127.0.0.1:0`).
pub struct Listeners {
    pub grpc: TcpListener,
    pub metrics: TcpListener,
}

impl Listeners {
    /// Binds both addresses of `config`, naming the one that fails.
    pub async fn bind(config: &Config) -> anyhow::Result<Self> {
        let grpc = connections::bind(config.grpc_addr)
            .map_err(|e| anyhow::anyhow!("cannot listen on TINYBROKER_GRPC_ADDR={}: {e}", config.grpc_addr))?;
        let metrics = TcpListener::bind(config.metrics_addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on TINYBROKER_METRICS_ADDR={}: {e}", config.metrics_addr))?;
        Ok(Self { grpc, metrics })
    }
}

struct Health {
    reporter: HealthReporter,
    readiness: Readiness,
}

impl Health {
    async fn set(&self, status: ServingStatus) {
        for service in ["", pb::BROKER_SERVICE_NAME] {
            self.reporter.set_service_status(service, status).await;
        }
        self.readiness.set(status == ServingStatus::Serving);
    }
}

/// Runs until `shutdown` resolves, then drains for up to the configured grace
/// period, ends every stream and returns. The engine is picked here, once:
/// the embedded single-node one, or the cluster engine when
/// `TINYBROKER_NATS_URL` is set.
pub async fn run(config: Config, listeners: Listeners, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    match config.cluster.clone() {
        None => serve(Broker::new(config.limits.clone()), config, listeners, shutdown).await,
        Some(cluster) => {
            let engine = ClusterEngine::start(cluster, config.limits.clone()).await?;
            serve(engine, config, listeners, shutdown).await
        }
    }
}

/// [`run`] with the engine chosen.
async fn serve<E: Engine>(
    engine: E,
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let grpc_addr = listeners.grpc.local_addr()?;
    let metrics_addr = listeners.metrics.local_addr()?;
    let tls = match &config.tls {
        Some(files) => Some(tokio_rustls::TlsAcceptor::from(Arc::new(files.server_config()?))),
        None => None,
    };
    let connection_stats = Arc::new(ConnectionStats::default());
    let incoming = Arc::new(IncomingLimits::new(
        grpc::decoding_limit(config.limits.max_message_bytes),
        crate::memory::MemoryBudget::leak(crate::memory::split(config.limits.max_memory_bytes).1),
    ));
    let metrics = Metrics::new(engine.clone(), config.metrics_per_subscription)
        .with_front(front_counters(connection_stats.clone(), incoming.clone()));
    let (stop_maintenance, maintenance_stopped) = tokio::sync::oneshot::channel::<()>();
    let maintenance = tokio::spawn(engine.clone().maintain(async {
        let _ = maintenance_stopped.await;
    }));

    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = Health {
        reporter,
        readiness: Readiness::default(),
    };
    health.set(ServingStatus::NotServing).await;

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let routes = tonic::service::Routes::new(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(BrokerService::new(engine.clone(), metrics.clone()).into_server())
        .add_service(
            AdminService::new(engine.clone(), config.auth_token.is_some(), config.tls.is_some())
                .with_shutdown_grace(config.shutdown_grace)
                .with_connection_limits(config.connections.clone())
                .into_server(),
        );
    let service = tower::ServiceBuilder::new()
        .layer(tower::util::MapResponseLayer::new(grpc::map_oversized_response))
        .layer(AuthLayer::new(config.auth_token.as_deref()))
        .layer(tower::util::MapResponseLayer::new(grpc::install_subscription_body))
        .service(routes);
    let stop_grpc = CancellationToken::new();
    let grpc_server = connections::serve(
        listeners.grpc,
        service,
        connections::Settings {
            limits: config.connections.clone(),
            tls,
            incoming,
        },
        connection_stats,
        stop_grpc.clone(),
    );
    let grpc_task = tokio::spawn(grpc_server);

    let (stop_side, side_stopped) = tokio::sync::oneshot::channel::<()>();
    let side_task = tokio::spawn(http_server::serve(
        listeners.metrics,
        health.readiness.clone(),
        metrics,
        http_server::StatusPage::new(
            crate::ops::status::StatusSource::new(engine.clone()),
            config.auth_token.as_deref(),
        ),
        async {
            let _ = side_stopped.await;
        },
    ));

    log_started(&config, grpc_addr, metrics_addr);
    // Health follows the engine until shutdown is asked for or the engine
    // fails for good (then the process stops with its reason).
    let failed = follow_health(&engine, &health, shutdown).await;
    tracing::info!(
        grace_seconds = config.shutdown_grace.as_secs(),
        "shutdown requested: health NOT_SERVING, refusing new work, draining queues"
    );
    health.set(ServingStatus::NotServing).await;
    engine.begin_shutdown();
    let drained = drain(&engine, config.shutdown_grace).await;
    let _ = stop_maintenance.send(());
    let _ = maintenance.await;
    let by_kind = engine.close_all();
    let discarded = by_kind.total();
    if discarded == 0 {
        tracing::info!("all queues drained");
    } else {
        tracing::warn!(
            discarded,
            queued_broadcast = by_kind.queued,
            group_backlog = by_kind.backlog,
            in_flight_to_members = by_kind.in_flight,
            "{}",
            by_kind.describe(drained)
        );
    }
    stop_grpc.cancel();
    let close_grpc = async {
        match tokio::time::timeout(CONNECTION_CLOSE_TIMEOUT + Duration::from_secs(1), grpc_task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "gRPC server task failed"),
            Err(_) => tracing::warn!("gRPC connections did not close in time; stopping anyway"),
        }
    };
    // A loss must be seen: /metrics keeps answering a little longer, so a
    // scrape can read tinybroker_messages_discarded_on_shutdown_total.
    // (A replica's broadcasts it could not hand to NATS are counted
    // there too, before: `ClusterEngine::maintain`.)
    let counted = engine.counters().discarded_on_shutdown;
    let report_loss = async {
        if discarded > 0 || counted > 0 {
            tokio::time::sleep(LOSS_REPORT_TIME).await;
        }
    };
    tokio::join!(close_grpc, report_loss);
    let _ = stop_side.send(());
    if tokio::time::timeout(CONNECTION_CLOSE_TIMEOUT, side_task).await.is_err() {
        tracing::warn!("side server did not stop in time; stopping anyway");
    }
    tracing::info!(discarded, "tinybroker stopped");
    match failed {
        Some(reason) => Err(anyhow::anyhow!(reason)),
        None => Ok(()),
    }
}

/// Sets health SERVING or NOT_SERVING as the engine can serve or not, until
/// `shutdown` resolves (None) or the engine fails (Some(why)).
async fn follow_health(engine: &impl Engine, health: &Health, shutdown: impl Future<Output = ()>) -> Option<String> {
    let mut engine_health = engine.health();
    tokio::pin!(shutdown);
    loop {
        let state = engine_health.borrow_and_update().clone();
        match state {
            EngineHealth::Serving => health.set(ServingStatus::Serving).await,
            EngineHealth::NotServing(_) => health.set(ServingStatus::NotServing).await,
            EngineHealth::Failed(reason) => return Some(reason),
        }
        tokio::select! {
            _ = &mut shutdown => return None,
            changed = engine_health.changed() => {
                if changed.is_err() {
                    // The engine's health is settled for good.
                    shutdown.await;
                    return None;
                }
            }
        }
    }
}

/// Waits until nothing that can drain is left or `grace` has passed; true
/// if drained.
async fn drain(engine: &impl Engine, grace: Duration) -> bool {
    let deadline = Instant::now() + grace;
    loop {
        if engine.drainable() == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn log_started(config: &Config, grpc_addr: SocketAddr, metrics_addr: SocketAddr) {
    let l = &config.limits;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        %grpc_addr,
        %metrics_addr,
        consumer_capacity = l.consumer_capacity,
        group_capacity = l.group_capacity,
        default_max_in_flight = l.default_max_in_flight,
        default_ack_deadline_ms = l.default_ack_deadline.as_millis() as u64,
        max_delivery_attempts = l.max_delivery_attempts,
        group_idle_ttl_seconds = l.group_idle_ttl.as_secs(),
        max_message_bytes = l.max_message_bytes,
        max_subscriptions = l.max_subscriptions,
        consumer_max_bytes = l.consumer_max_bytes,
        group_max_bytes = l.group_max_bytes,
        max_memory_bytes = l.max_memory_bytes.map_or_else(|| "none".to_owned(), |b| b.to_string()),
        max_connections = config.connections.max_connections,
        handshake_timeout_seconds = config.connections.handshake_timeout.as_secs(),
        shutdown_grace_seconds = config.shutdown_grace.as_secs(),
        auth = config.auth_token.is_some(),
        tls = config.tls.is_some(),
        keepalive_interval_seconds = config.connections.keepalive_interval.as_secs(),
        keepalive_timeout_seconds = config.connections.keepalive_timeout.as_secs(),
        max_streams_per_connection = config.connections.max_streams_per_connection,
        "tinybroker started"
    );
}

/// What the metrics read of the front at each scrape.
fn front_counters(connections: Arc<ConnectionStats>, incoming: Arc<IncomingLimits>) -> FrontSource {
    Arc::new(move || FrontCounters {
        open_connections: connections.open(),
        rejected: Rejection::ALL
            .iter()
            .map(|&reason| (reason.label(), connections.rejected(reason)))
            .collect(),
        accept_errors: connections.accept_errors(),
        incoming_bytes: incoming.memory.used(),
        incoming_limit: incoming.memory.limit(),
        refused_memory_limit: incoming.refused_memory_limit.load(Ordering::Relaxed),
        refused_connection_limit: incoming.refused_connection_limit.load(Ordering::Relaxed),
    })
}
