//! Messages of every size, from empty to near the limit, arrive whole and in
//! order, to a broadcast subscriber and to a group member. Each stream's
//! encode buffer is reserved a chunk at a time (`wire::ServerEncoder`,
//! 8 KiB): these sizes sit on both sides of a chunk and of tonic's 32 KiB
//! frame threshold, and come in one burst so that several share a frame.

use crate::common::*;
use crate::transport::{open, subscribe};
use std::collections::HashMap;
use tinybroker::pb;

/// Payload sizes around the encoder's chunk (8 KiB, less the frame header
/// and the message's other fields) and tonic's yield threshold (32 KiB),
/// up to 900,000 bytes (below the 1 MiB default limit and NATS's default
/// max_payload, so that the cluster engine takes them too).
const SIZES: &[usize] = &[
    0, 1, 255, 256, 1_000, 8_100, 8_150, 8_191, 8_192, 8_193, 16_384, 32_700, 32_768, 32_769, 65_536, 100_000, 900_000,
];

/// Payload `i`: its size from [`SIZES`], interleaved with small ones, and
/// bytes that depend on its index, so a piece of another message or a
/// shifted copy is seen.
fn payload(i: usize) -> Vec<u8> {
    let len = if i.is_multiple_of(2) { SIZES[i / 2] } else { 3 };
    (0..len).map(|j| (i * 7 + j * 13 % 251) as u8).collect()
}

fn count() -> usize {
    SIZES.len() * 2
}

#[tokio::test]
async fn messages_of_every_size_arrive_whole_and_in_order() {
    timeout(async {
        let broker = start().await;
        let mut subscriber = pb::broker_client::BrokerClient::new(broker.wide_channel().await);
        let (mut broadcast, _) = subscribe(&mut subscriber, &["sizes.>"]).await;
        let mut member_client = pb::broker_client::BrokerClient::new(broker.wide_channel().await);
        let (mut member, _) = open(&mut member_client, member_request(&["sizes.>"], "sizes", false, 0)).await;

        let mut publisher = broker.client().await;
        let requests: Vec<pb::PublishRequest> = (0..count())
            .map(|i| pb::PublishRequest {
                topic: format!("sizes.m{i}"),
                payload: payload(i).into(),
                headers: HashMap::from([("index".to_string(), i.to_string())]),
            })
            .collect();
        let published = publisher
            .publish_stream(futures::stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(published.accepted as usize, count());

        for (what, stream) in [("broadcast subscriber", &mut broadcast), ("group member", &mut member)] {
            let mut last_sequence = 0;
            for i in 0..count() {
                let m = stream
                    .message()
                    .await
                    .unwrap_or_else(|e| panic!("{what}: message {i}: {e}"))
                    .unwrap_or_else(|| panic!("{what}: stream ended before message {i}"));
                assert_eq!(m.topic, format!("sizes.m{i}"), "{what}: in order");
                assert_eq!(m.headers.get("index").map(String::as_str), Some(i.to_string().as_str()));
                let want = payload(i);
                assert_eq!(m.payload.len(), want.len(), "{what}: message {i}'s length");
                assert!(m.payload[..] == want[..], "{what}: message {i}'s bytes");
                assert!(m.sequence > last_sequence, "{what}: sequences increase");
                last_sequence = m.sequence;
            }
        }
    })
    .await
}
