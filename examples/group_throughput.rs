//! Measures messages/s through a 3-member consumer group on a running broker.
//!
//!     cargo run --release &                                   # the broker
//!     cargo run --release --example group_throughput -- auto 200000
//!     cargo run --release --example group_throughput -- manual 200000
//!
//! One PublishStream publishes N 256-byte messages; three members share them
//! (manual mode acks in batches of up to 64 sequences). Prints the rate and
//! each member's share, and fails if any message is lost or duplicated.

use std::collections::HashSet;
use std::time::{Duration, Instant};
use tinybroker::pb;
use tinybroker::pb::broker_client::BrokerClient;
use tokio::sync::mpsc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let manual = args.next().as_deref() == Some("manual");
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(100_000);
    let addr = args.next().unwrap_or_else(|| "http://127.0.0.1:50051".into());
    let group = format!("bench-{}", std::process::id());
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, u64)>();
    for member in 0..3 {
        let mut client = BrokerClient::connect(addr.clone()).await?;
        let request = pb::OpenSubscriptionRequest {
            topic_patterns: vec!["bench.>".into()],
            mode: pb::DeliveryMode::Single as i32,
            consumer_group: group.clone(),
            ack_mode: if manual { pb::AckMode::Manual } else { pb::AckMode::Auto } as i32,
            max_in_flight: 256,
            ..Default::default()
        };
        let response = client.open_subscription(request).await?;
        let id = response
            .metadata()
            .get("tinybroker-subscription-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let mut stream = response.into_inner();
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut pending = Vec::new();
            loop {
                let next = if pending.is_empty() {
                    stream.message().await
                } else {
                    match tokio::time::timeout(Duration::from_millis(1), stream.message()).await {
                        Ok(m) => m,
                        Err(_) => {
                            ack(&mut client, &id, &mut pending).await;
                            continue;
                        }
                    }
                };
                let Ok(Some(m)) = next else { return };
                let _ = tx.send((member, m.sequence));
                if manual {
                    pending.push(m.sequence);
                    if pending.len() >= 64 {
                        ack(&mut client, &id, &mut pending).await;
                    }
                }
            }
        });
    }
    let mut publisher = BrokerClient::connect(addr).await?;
    let payload = bytes::Bytes::from(vec![b'x'; 256]);
    let started = Instant::now();
    let requests = futures::stream::iter((0..n).map(move |i| pb::PublishRequest {
        topic: format!("bench.{}", i % 8),
        payload: payload.clone(),
        headers: Default::default(),
    }));
    let published = publisher.publish_stream(requests).await?.into_inner();
    let publish_secs = started.elapsed().as_secs_f64();
    let mut seen = HashSet::with_capacity(n);
    let mut share = [0usize; 3];
    while seen.len() < n {
        let (member, seq) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("members stopped"))?;
        anyhow::ensure!(seen.insert(seq), "sequence {seq} delivered twice");
        share[member] += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(published.accepted as usize == n);
    println!(
        "mode={} messages={n} published/s={:.0} delivered/s={:.0} shares={:?}",
        if manual { "manual" } else { "auto" },
        n as f64 / publish_secs,
        n as f64 / secs,
        share
    );
    Ok(())
}

async fn ack(client: &mut BrokerClient<tonic::transport::Channel>, id: &str, pending: &mut Vec<u64>) {
    let request = pb::AckRequest {
        subscription_id: id.to_owned(),
        sequences: std::mem::take(pending),
    };
    if let Err(e) = client.ack(request).await {
        eprintln!("ack failed: {e}");
    }
}
