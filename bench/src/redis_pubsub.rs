//! Redis pub/sub adapter (redis-rs): one RESP2 pub/sub connection per
//! subscriber (PSUBSCRIBE), and a multiplexed connection for the publisher
//! that keeps many PUBLISH commands in flight (redis-rs pipelines them).

use crate::measure::{Delivery, Recorder, Tally, drive};
use crate::systems::{Server, before, within};
use anyhow::{Context, Result};
use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisResult};
use std::convert::Infallible;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const NET: Duration = Duration::from_secs(10);
/// PUBLISH commands the publisher keeps in flight on its connection.
pub const PUBLISH_IN_FLIGHT: usize = 256;

impl Delivery for redis::Msg {
    fn payload(&self) -> &[u8] {
        self.get_payload_bytes()
    }
}

fn client(server: &Server) -> Result<Client> {
    Client::open(format!("redis://{}/", server.addr)).context("building the Redis client")
}

/// PSUBSCRIBEs on its own connection and starts its receive loop.
pub async fn subscribe(
    server: &Server,
    pattern: &str,
    rec: Recorder,
    stop: CancellationToken,
) -> Result<JoinHandle<Tally>> {
    let client = client(server)?;
    let mut pubsub = within(NET, "connecting to Redis", client.get_async_pubsub())
        .await?
        .context("Redis pub/sub connection")?;
    // Returns once Redis confirmed the subscription.
    within(NET, "PSUBSCRIBE", pubsub.psubscribe(pattern))
        .await?
        .context("Redis PSUBSCRIBE")?;
    let stream = pubsub.into_on_message();
    Ok(tokio::spawn(drive(
        stream.map(Ok::<_, Infallible>),
        rec,
        stop,
        |_: &redis::Msg| {},
    )))
}

pub struct Publisher {
    con: MultiplexedConnection,
    topic: String,
    in_flight: FuturesUnordered<BoxFuture<'static, RedisResult<i64>>>,
}

impl Publisher {
    pub async fn new(server: &Server, topic: &str) -> Result<Publisher> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(NET))
            .set_response_timeout(Some(NET));
        let con = within(
            NET,
            "connecting to Redis",
            client(server)?.get_multiplexed_async_connection_with_config(&config),
        )
        .await?
        .context("Redis connection")?;
        Ok(Publisher {
            con,
            topic: topic.to_owned(),
            in_flight: FuturesUnordered::new(),
        })
    }

    async fn settle_one(&mut self, deadline: tokio::time::Instant) -> Result<()> {
        if let Some(r) = before(deadline, "waiting for a PUBLISH reply", self.in_flight.next()).await? {
            r.context("Redis PUBLISH")?;
        }
        Ok(())
    }

    pub async fn send(&mut self, payload: Bytes, deadline: tokio::time::Instant) -> Result<()> {
        while self.in_flight.len() >= PUBLISH_IN_FLIGHT {
            self.settle_one(deadline).await?;
        }
        let mut con = self.con.clone();
        let cmd = redis::cmd("PUBLISH").arg(&self.topic).arg(&payload[..]).clone();
        self.in_flight
            .push(Box::pin(async move { cmd.query_async::<i64>(&mut con).await }));
        // Let the pushed command start without waiting for anything.
        while let Some(Some(r)) = futures::FutureExt::now_or_never(self.in_flight.next()) {
            r.context("Redis PUBLISH")?;
        }
        Ok(())
    }

    /// Waits for every PUBLISH reply: then Redis has sent every message.
    pub async fn finish(mut self, _sent: u64) -> Result<()> {
        while !self.in_flight.is_empty() {
            self.settle_one(tokio::time::Instant::now() + NET).await?;
        }
        Ok(())
    }
}
