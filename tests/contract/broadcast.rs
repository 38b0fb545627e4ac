//! Broadcast publish/subscribe over real gRPC: fan-out, message fields,
//! ordering, eviction, subscription ids and error codes.

use crate::common::*;
use crate::transport::{subscribe, try_open};
use std::collections::HashMap;
use tinybroker::config::Limits;
use tinybroker::pb;
use tokio::sync::watch;
use tonic::Code;

#[tokio::test]
async fn three_subscribers_on_a_wildcard_each_receive_the_message() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let mut streams = Vec::new();
        for _ in 0..3 {
            streams.push(subscribe(&mut client, &["deploy.*"]).await);
        }
        let mut publisher = broker.client().await;
        let response = publisher
            .publish(publish_request("deploy.rollout", "v42"))
            .await
            .unwrap()
            .into_inner();
        if test_engine() == TestEngine::Cluster {
            // docs/contract.md, Cluster mode: `matched_subscriptions` counts
            // the publishing replica's matches; the three are on the other.
            assert_eq!(response.matched_subscriptions, 0);
        } else {
            assert_eq!(response.matched_subscriptions, 3);
        }
        assert_eq!(response.matched_groups, 0);
        for (stream, id) in &mut streams {
            let m = stream.message().await.unwrap().unwrap();
            assert_eq!(m.topic, "deploy.rollout");
            assert_eq!(&m.payload[..], b"v42");
            assert_eq!(m.sequence, response.sequence);
            assert_eq!(&m.subscription_id, id);
        }
    })
    .await
}

#[tokio::test]
async fn messages_carry_sequence_time_headers_and_subscription_id() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut stream, id) = subscribe(&mut client, &["orders.>"]).await;
        assert!(!id.is_empty(), "a blank id gets a generated one");
        let before = std::time::SystemTime::now();
        let headers = HashMap::from([
            ("trace".to_string(), "abc".to_string()),
            ("k".to_string(), "v=1".to_string()),
        ]);
        let mut publisher = broker.client().await;
        let mut sequences = Vec::new();
        for i in 0..3 {
            let r = publisher
                .publish(pb::PublishRequest {
                    topic: format!("orders.eu.{i}"),
                    payload: vec![i as u8, 0, 255].into(),
                    headers: headers.clone(),
                })
                .await
                .unwrap()
                .into_inner();
            sequences.push(r.sequence);
        }
        assert!(sequences.windows(2).all(|w| w[0] < w[1]), "{sequences:?}");
        for (i, seq) in sequences.iter().enumerate() {
            let m = stream.message().await.unwrap().unwrap();
            assert_eq!(m.topic, format!("orders.eu.{i}"));
            assert_eq!(&m.payload[..], &[i as u8, 0, 255]);
            assert_eq!(m.headers, headers);
            assert_eq!(m.sequence, *seq);
            assert_eq!(m.subscription_id, id);
            assert_eq!(m.consumer_group, "");
            assert_eq!(m.delivery_attempt, 1);
            let t = m.publish_time.expect("publish_time");
            let t = std::time::SystemTime::try_from(t).unwrap();
            assert!(t >= before - std::time::Duration::from_secs(1));
        }
    })
    .await
}

#[tokio::test]
async fn a_message_matching_two_patterns_is_delivered_once() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut stream, _) = subscribe(&mut client, &["deploy.*", "deploy.>", "deploy.rollout"]).await;
        let mut publisher = broker.client().await;
        let r = publisher
            .publish(publish_request("deploy.rollout", "once"))
            .await
            .unwrap()
            .into_inner();
        if test_engine() == TestEngine::Cluster {
            // docs/contract.md, Cluster mode: `matched_subscriptions` counts
            // the publishing replica's matches; the subscriber is on the other.
            assert_eq!(r.matched_subscriptions, 0);
        } else {
            assert_eq!(r.matched_subscriptions, 1);
        }
        publisher
            .publish(publish_request("deploy.next", "marker"))
            .await
            .unwrap();
        let first = stream.message().await.unwrap().unwrap();
        assert_eq!(&first.payload[..], b"once");
        let second = stream.message().await.unwrap().unwrap();
        assert_eq!(&second.payload[..], b"marker", "the first message must not repeat");
    })
    .await
}

#[tokio::test]
async fn patterns_follow_nats_semantics() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        // One client for the subscriptions and the publishes: the count is
        // what this test observes, and in cluster mode it counts the
        // publishing replica's matches (docs/contract.md, Cluster mode).
        let cases = [
            ("deploy.*", "deploy.a", 1),
            ("deploy.*", "deploy", 0),
            ("deploy.*", "deploy.a.b", 0),
            ("deploy.>", "deploy.a.b", 1),
            ("deploy.>", "deploy", 0),
            ("Deploy.a", "deploy.a", 0),
        ];
        for (pattern, topic, expected) in cases {
            let (stream, _) = subscribe(&mut client, &[pattern]).await;
            let r = client.publish(publish_request(topic, "x")).await.unwrap().into_inner();
            assert_eq!(r.matched_subscriptions, expected, "{pattern} vs {topic}");
            drop(stream);
            // Each case starts with no other subscription open, so the count
            // above is this pattern's alone. (A probe publish would not do:
            // most of these patterns never match any one probe topic.)
            wait_until("the subscription to close", || async {
                broker.subscriptions().await.is_empty()
            })
            .await;
        }
    })
    .await
}

#[tokio::test]
async fn slow_subscriber_is_evicted_and_a_reader_receives_all_5000_in_order() {
    timeout(async {
        let broker = start_with_limits(Limits {
            consumer_capacity: 16,
            ..Limits::default()
        })
        .await;
        // The stalled subscriber never reads: once its (small) HTTP/2 window
        // is full, its queue fills and it is evicted.
        let mut stalled_client = pb::broker_client::BrokerClient::new(broker.narrow_channel().await);
        let (mut stalled, _) = subscribe(&mut stalled_client, &["load.>"]).await;
        // The reader has its own connection and reports its progress.
        let mut reader_client = pb::broker_client::BrokerClient::new(broker.wide_channel().await);
        let (mut reader, _) = subscribe(&mut reader_client, &["load.>"]).await;
        let (progress_tx, mut progress) = watch::channel(0u64);
        let reader_task = tokio::spawn(async move {
            let mut sequences = Vec::new();
            while sequences.len() < 5000 {
                let m = reader.message().await.unwrap().expect("the reader must not be evicted");
                assert_eq!(m.payload, format!("{}", sequences.len()).into_bytes());
                sequences.push(m.sequence);
                progress_tx.send_replace(sequences.len() as u64);
            }
            sequences
        });
        let mut publisher = broker.client().await;
        let payload = "p".repeat(200);
        for i in 0..5000u64 {
            // Stay at most 8 messages ahead of the reader, so it never has
            // more than 8 of its 16 slots in use whatever the scheduling.
            progress.wait_for(|done| i < done + 8).await.unwrap();
            let mut request = publish_request(&format!("load.{}", i % 7), &payload);
            request.payload = format!("{i}").into_bytes().into();
            if i % 2 == 0 {
                request.headers.insert("pad".into(), payload.clone());
            }
            publisher.publish(request).await.unwrap();
        }
        let sequences = reader_task.await.unwrap();
        assert!(sequences.windows(2).all(|w| w[0] < w[1]), "in publish order");

        // The stalled stream yields what reached its connection, then ends
        // cleanly (status OK) instead of an error.
        let mut received = 0;
        while let Some(_m) = stalled.message().await.expect("eviction ends the stream with OK") {
            received += 1;
        }
        assert!(received < 5000, "the stalled subscriber was evicted after {received}");
    })
    .await
}

#[tokio::test]
async fn publish_stream_reports_counts_and_sequences() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut stream, _) = subscribe(&mut client, &["s.*"]).await;
        let mut publisher = broker.client().await;
        let requests: Vec<_> = (0..100).map(|i| publish_request("s.x", &i.to_string())).collect();
        let r = publisher
            .publish_stream(futures::stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.accepted, 100);
        assert_eq!(r.last_sequence - r.first_sequence, 99);
        for i in 0..100 {
            let m = stream.message().await.unwrap().unwrap();
            assert_eq!(m.payload, i.to_string().into_bytes());
            assert_eq!(m.sequence, r.first_sequence + i);
        }
        let empty = publisher
            .publish_stream(futures::stream::iter(Vec::<pb::PublishRequest>::new()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((empty.accepted, empty.first_sequence, empty.last_sequence), (0, 0, 0));
    })
    .await
}

#[tokio::test]
async fn publish_stream_ends_at_the_first_bad_message_and_keeps_the_earlier_ones() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut stream, _) = subscribe(&mut client, &["s.>"]).await;
        let mut publisher = broker.client().await;
        let requests = vec![
            publish_request("s.a", "1"),
            publish_request("s.b", "2"),
            publish_request("s..bad", "3"),
            publish_request("s.c", "4"),
        ];
        let err = publisher
            .publish_stream(futures::stream::iter(requests))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("\"s..bad\""), "{}", err.message());
        assert!(err.message().contains("2 earlier messages"), "{}", err.message());
        for expected in ["1", "2"] {
            let m = stream.message().await.unwrap().unwrap();
            assert_eq!(m.payload, expected.as_bytes());
        }
        // Nothing after the bad one was published.
        publisher.publish(publish_request("s.marker", "m")).await.unwrap();
        let m = stream.message().await.unwrap().unwrap();
        assert_eq!(&m.payload[..], b"m");
    })
    .await
}

#[tokio::test]
async fn subscription_ids_are_returned_and_unique_while_open() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let mut request = subscribe_request(&["a.b"]);
        request.subscription_id = "worker-1".into();
        let (stream, id) = try_open(&mut client, request.clone()).await.unwrap();
        assert_eq!(id, "worker-1");
        let mut other = broker.client().await;
        let err = try_open(&mut other, request.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists);
        assert!(err.message().contains("worker-1"), "{}", err.message());

        // Cancelling the stream frees the id (and stops routing to it).
        drop(stream);
        wait_until("the cancelled subscription to be removed", || {
            let mut client = other.clone();
            let request = request.clone();
            async move { try_open(&mut client, request).await.is_ok() }
        })
        .await;
    })
    .await
}

/// The headers a client reads to tell sequence spaces apart
/// (docs/clients.md, "Gaps"): a restarted broker counts again from 1, so a
/// gap computed across it would be a range of nonsense.
fn instance_headers(metadata: &tonic::metadata::MetadataMap) -> (String, String) {
    let get = |name: &str| {
        metadata
            .get(name)
            .unwrap_or_else(|| panic!("no {name} response header"))
            .to_str()
            .unwrap()
            .to_owned()
    };
    (get("tinybroker-instance"), get("tinybroker-sequence-scope"))
}

#[tokio::test]
async fn sessions_and_subscriptions_name_the_instance_and_its_sequence_scope() {
    timeout(async {
        let scope = match test_engine() {
            TestEngine::Memory => "instance",
            TestEngine::Cluster => "replica",
        };
        let mut seen = Vec::new();
        for _ in 0..2 {
            // Each broker (replica) started is an instance of its own.
            let broker = start().await;
            for i in 0..broker.replica_count() {
                let mut client = broker.client_on(i).await;
                let session = client
                    .session(tokio_stream::iter(Vec::<pb::SessionRequest>::new()))
                    .await
                    .unwrap();
                let (instance, session_scope) = instance_headers(session.metadata());
                assert_eq!(session_scope, scope);
                assert!(instance.len() >= 16, "{instance:?}");
                let stream = client.open_subscription(subscribe_request(&["a.b"])).await.unwrap();
                assert_eq!(
                    instance_headers(stream.metadata()),
                    (instance.clone(), scope.to_owned())
                );
                assert!(!seen.contains(&instance), "{instance} named two instances");
                seen.push(instance);
            }
            broker.stop().await;
        }
    })
    .await
}

#[tokio::test]
async fn a_cancelled_subscription_disappears() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        // One client: the publishing replica's count is what this test
        // observes (docs/contract.md, Cluster mode).
        let (stream, _) = subscribe(&mut client, &["gone.*"]).await;
        let r = client
            .publish(publish_request("gone.x", "1"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_subscriptions, 1);
        drop(stream);
        wait_until("no subscription matches", || {
            let mut client = client.clone();
            async move {
                let r = client
                    .publish(publish_request("gone.x", "2"))
                    .await
                    .unwrap()
                    .into_inner();
                r.matched_subscriptions == 0
            }
        })
        .await;
    })
    .await
}

#[tokio::test]
async fn bad_topics_and_patterns_are_invalid_argument_naming_the_value() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let long = "a".repeat(257);
        for topic in [
            "",
            "a..b",
            ".a",
            "a.",
            "a b",
            "a\tb",
            "caf\u{e9}",
            "a.*",
            "a.>",
            long.as_str(),
        ] {
            let err = client.publish(publish_request(topic, "x")).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{topic:?}");
            assert!(err.message().contains("invalid topic"), "{}", err.message());
            if !topic.is_empty() && topic.is_ascii() && !topic.contains('\t') && topic.len() < 100 {
                assert!(err.message().contains(topic), "{}", err.message());
            }
        }
        let ok = "a".repeat(256);
        client.publish(publish_request(&ok, "x")).await.unwrap();

        for pattern in ["a.>.b", "a*", "a..b", "", "x y"] {
            let err = try_open(&mut client, subscribe_request(&[pattern])).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{pattern:?}");
            assert!(err.message().contains("invalid topic pattern"), "{}", err.message());
        }
        let err = try_open(&mut client, subscribe_request(&[])).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("topic_patterns is empty"), "{}", err.message());
        let too_many: Vec<String> = (0..65).map(|i| format!("p.{i}")).collect();
        let refs: Vec<&str> = too_many.iter().map(String::as_str).collect();
        let err = try_open(&mut client, subscribe_request(&refs)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("65 topic_patterns"), "{}", err.message());
    })
    .await
}

#[tokio::test]
async fn mode_and_group_must_agree() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let mut multi_with_group = subscribe_request(&["a"]);
        multi_with_group.consumer_group = "workers".into();
        let err = try_open(&mut client, multi_with_group.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("workers"), "{}", err.message());
        multi_with_group.mode = pb::DeliveryMode::Multi as i32;
        let err = try_open(&mut client, multi_with_group).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);

        let mut single_without_group = subscribe_request(&["a"]);
        single_without_group.mode = pb::DeliveryMode::Single as i32;
        let err = try_open(&mut client, single_without_group).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("consumer_group"), "{}", err.message());

        let mut bad_mode = subscribe_request(&["a"]);
        bad_mode.mode = 9;
        let err = try_open(&mut client, bad_mode).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("mode 9"), "{}", err.message());
    })
    .await
}

#[tokio::test]
async fn oversized_messages_are_resource_exhausted() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_message_bytes: 1000,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let (mut stream, _) = subscribe(&mut client, &["big"]).await;
        // The publisher: another connection (another replica in cluster mode).
        let mut client = broker.client().await;
        // Exactly at the limit (payload plus headers) is fine.
        let mut at_limit = publish_request("big", &"x".repeat(990));
        at_limit.headers.insert("abc".into(), "1234567".into());
        client.publish(at_limit).await.unwrap();
        assert_eq!(stream.message().await.unwrap().unwrap().payload.len(), 990);

        let mut over = publish_request("big", &"x".repeat(990));
        over.headers.insert("abc".into(), "12345678".into());
        let err = client.publish(over).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert!(err.message().contains("1001 bytes"), "{}", err.message());
        assert!(err.message().contains("max_message_bytes 1000"), "{}", err.message());

        // Far past the gRPC decoding limit: refused before it is buffered.
        let huge = publish_request("big", &"x".repeat(1 << 20));
        let err = client.publish(huge.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
        // Both sizes: the encoded request's (1 MiB of payload, the topic and
        // their framing) and the limit the operator set.
        assert!(
            err.message().contains("request of 1048585 bytes") && err.message().contains("max_message_bytes 1000"),
            "{}",
            err.message()
        );
        let err = client
            .publish_stream(futures::stream::iter(vec![publish_request("big", "ok"), huge]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
        assert!(err.message().contains("1 earlier messages"), "{}", err.message());
    })
    .await
}

#[tokio::test]
async fn too_many_subscriptions_is_resource_exhausted() {
    timeout(async {
        let broker = start_with_limits(Limits {
            max_subscriptions: 2,
            ..Limits::default()
        })
        .await;
        let mut client = broker.client().await;
        let _a = subscribe(&mut client, &["a"]).await;
        let b = subscribe(&mut client, &["a"]).await;
        let err = try_open(&mut client, subscribe_request(&["a"])).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert!(err.message().contains("max_subscriptions 2"), "{}", err.message());
        drop(b);
        wait_until("a slot to free up", || {
            let mut client = client.clone();
            async move { try_open(&mut client, subscribe_request(&["a"])).await.is_ok() }
        })
        .await;
    })
    .await
}

#[tokio::test]
async fn bad_input_does_not_disturb_other_subscribers() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let (mut stream, _) = subscribe(&mut client, &["ok.*"]).await;
        // The publisher: another connection (another replica in cluster mode).
        let mut client = broker.client().await;
        client.publish(publish_request("ok.1", "1")).await.unwrap();
        let _ = client.publish(publish_request("bad topic", "x")).await.unwrap_err();
        let _ = try_open(&mut client, subscribe_request(&[">.x"])).await.unwrap_err();
        client.publish(publish_request("ok.2", "2")).await.unwrap();
        for expected in ["1", "2"] {
            assert_eq!(stream.message().await.unwrap().unwrap().payload, expected.as_bytes());
        }
    })
    .await
}

#[tokio::test]
async fn bad_headers_are_invalid_argument() {
    timeout(async {
        let broker = start().await;
        let mut client = broker.client().await;
        let mut too_many = publish_request("h", "x");
        too_many.headers = (0..65).map(|i| (format!("k{i}"), "v".to_string())).collect();
        let err = client.publish(too_many).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(
            err.message().contains("65 headers, the limit is 64"),
            "{}",
            err.message()
        );

        let mut empty_name = publish_request("h", "x");
        empty_name.headers.insert(String::new(), "v".into());
        let err = client.publish(empty_name).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("empty name"), "{}", err.message());

        let mut long_value = publish_request("h", "x");
        long_value.headers.insert("big".into(), "v".repeat(8193));
        let err = client.publish(long_value).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(
            err.message().contains("\"big\"") && err.message().contains("8192"),
            "{}",
            err.message()
        );

        let mut at_limit = publish_request("h", "x");
        at_limit.headers = (0..64).map(|i| (format!("k{i}"), "v".repeat(8192))).collect();
        client.publish(at_limit).await.unwrap();
    })
    .await
}
