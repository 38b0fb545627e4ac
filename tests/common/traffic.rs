//! Traffic for the partition tests (`cluster_partition.rs`,
//! `nats_partition.rs`): publishers that record every answer, subscribers
//! that record every arrival (and ack), and the checks on a cut-off
//! replica's answers.

use super::{publish_request, serving_status_at};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tinybroker::pb;
use tinybroker::pb::broker_client::BrokerClient;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

/// "At once", for an UNAVAILABLE answer.
pub const AT_ONCE: Duration = Duration::from_secs(1);
/// A client's own deadline: what a hang would run into.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(10);

/// What a publisher sent: the number of each accepted message and when its
/// Publish began, and each refusal with how long it took.
#[derive(Default)]
pub struct Sent {
    pub ok: Vec<(u64, Instant)>,
    pub refused: Vec<(u64, Instant, Duration, tonic::Status)>,
}

/// Publishes `<topic>.<n>` (payload n) through `client` every `every`
/// until `stop`, recording each outcome.
pub async fn publisher(
    mut client: BrokerClient<Channel>,
    topic: &'static str,
    every: Duration,
    stop: CancellationToken,
    sent: Arc<Mutex<Sent>>,
) {
    let mut n = 0;
    while !stop.is_cancelled() {
        n += 1;
        let started = Instant::now();
        let request = publish_request(&format!("{topic}.{n}"), &n.to_string());
        match tokio::time::timeout(CLIENT_DEADLINE, client.publish(request)).await {
            Ok(Ok(_)) => sent.lock().ok.push((n, started)),
            Ok(Err(status)) => sent.lock().refused.push((n, started, started.elapsed(), status)),
            Err(_) => sent.lock().refused.push((
                n,
                started,
                started.elapsed(),
                tonic::Status::deadline_exceeded("the client's deadline"),
            )),
        }
        tokio::time::sleep(every).await;
    }
}

/// What a subscriber got: topic and arrival time, in order.
pub type Got = Arc<Mutex<Vec<(String, Instant)>>>;

/// Reads `stream` into `got`; acks each message through `acker` (a member
/// and its own replica's client) when given.
pub fn receive(mut stream: tonic::Streaming<pb::Message>, got: Got, acker: Option<(BrokerClient<Channel>, String)>) {
    tokio::spawn(async move {
        let mut acker = acker;
        while let Ok(Some(m)) = stream.message().await {
            got.lock().push((m.topic.clone(), Instant::now()));
            if let Some((client, id)) = acker.as_mut() {
                let ack = client.ack(pb::AckRequest {
                    subscription_id: id.clone(),
                    sequences: vec![m.sequence],
                });
                let _ = tokio::time::timeout(Duration::from_secs(2), ack).await;
            }
        }
    });
}

/// Polls the health of the broker at `url` until it is `want`; how long
/// that took from `since`, or a panic after `limit`.
pub async fn wait_status(url: &str, want: ServingStatus, since: Instant, limit: Duration) -> Duration {
    loop {
        if serving_status_at(url).await == Some(want) {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < limit,
            "the cut-off replica was not {want:?} within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `call` under the client's deadline; its status and how long it took.
pub async fn refused<T>(
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> (tonic::Status, Duration) {
    let started = Instant::now();
    match tokio::time::timeout(CLIENT_DEADLINE, call).await {
        Ok(Ok(_)) => panic!("accepted on a cut-off replica"),
        Ok(Err(status)) => (status, started.elapsed()),
        Err(_) => panic!("no answer within the client's deadline of {CLIENT_DEADLINE:?}: a hang"),
    }
}

pub fn assert_unavailable_naming_nats(what: &str, status: &tonic::Status, took: Duration) {
    assert_eq!(status.code(), tonic::Code::Unavailable, "{what}: {status:?}");
    assert!(status.message().contains("NATS"), "{what} names NATS: {status:?}");
    assert!(took < AT_ONCE, "{what} answered in {took:?}, not at once: {status:?}");
}
