//! A rolling update, mid-way: replicas of the previous version and of this
//! one in one cluster (src/cluster/wire.rs says how they interoperate).
//!
//! The previous version is this build with `TB_TEST_PREVIOUS_WIRE` set
//! (the replica then speaks the wire of the version before
//! `tinybroker.cluster.v1`: JSON calls, envelopes read as public
//! `Message`s), so CI needs no second build of the crate (5 minutes on its
//! 2 cores). `TB_PREVIOUS_BROKER_BIN=<path>` runs the real previous binary
//! instead (built from main, e.g. `git worktree add /tmp/main main && cargo
//! build --manifest-path /tmp/main/Cargo.toml`): the same test then shows
//! the same things against it.
//!
//! Replicas `a` and `c` are new, `b` old. Shown across them: broadcast both
//! ways (each decodes the other's envelope), a MANUAL group with a member
//! on `a` and one on `b` fed by both (each decodes the other's stored
//! envelope), Ack forwarded both ways and CloseSubscription forwarded to
//! the old replica, the Admin listings gathered from every replica through
//! each; the calls on the wire (seen by a raw NATS subscriber): JSON to the
//! old replica, proto between the new ones. Then `c` is rolled back to the
//! previous version under the same id: `a`, which called it in proto, gets
//! an answer without the wire header, calls it in JSON again, and its
//! listing is whole.

mod common;

use common::nats::NatsCluster;
use common::process::BrokerProcess;
use common::*;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
use tinybroker::pb;
use tinybroker::pb::admin_client::AdminClient;
use tinybroker::pb::broker_client::BrokerClient;
use tonic::transport::Channel;

const PREFIX: &str = "wire";
/// The header a call in `tinybroker.cluster.v1` carries (src/cluster/wire.rs).
const WIRE_HEADER: &str = "Tinybroker-Wire";

/// The binary of the previous version, when one is given.
fn previous_binary() -> Option<PathBuf> {
    std::env::var_os("TB_PREVIOUS_BROKER_BIN")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// Replica `id` as a process (`tinybroker serve`), of the previous version
/// when `old`; returned once it is SERVING.
async fn replica(nats: &NatsCluster, id: &str, old: bool) -> BrokerProcess {
    let binary = match previous_binary() {
        Some(path) if old => path,
        _ => PathBuf::from(env!("CARGO_BIN_EXE_tinybroker")),
    };
    let mut command = Command::new(binary);
    command
        .env_clear()
        .env("RUST_LOG", "info")
        .env("TINYBROKER_GRPC_ADDR", "127.0.0.1:0")
        .env("TINYBROKER_METRICS_ADDR", "127.0.0.1:0")
        .env("TINYBROKER_NATS_URL", nats.url(0))
        .env("TINYBROKER_NATS_PREFIX", PREFIX)
        .env("TINYBROKER_NATS_REPLICAS", "1")
        .env("TINYBROKER_REPLICA_ID", id)
        .env("TINYBROKER_SHUTDOWN_GRACE_SECONDS", "1")
        .arg("serve")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if old && previous_binary().is_none() {
        command.env("TB_TEST_PREVIOUS_WIRE", "1");
    }
    let process = tokio::task::spawn_blocking(move || BrokerProcess::from_command(command))
        .await
        .unwrap();
    wait_serving_at(&process.url()).await;
    process
}

async fn client(replica: &BrokerProcess) -> BrokerClient<Channel> {
    BrokerClient::connect(replica.url()).await.unwrap()
}

async fn admin(replica: &BrokerProcess) -> AdminClient<Channel> {
    AdminClient::connect(replica.url()).await.unwrap()
}

fn publish(topic: &str, payload: &str) -> pb::PublishRequest {
    pb::PublishRequest {
        topic: topic.into(),
        payload: payload.as_bytes().to_vec().into(),
        headers: HashMap::from([("from".to_owned(), payload.to_owned())]),
    }
}

/// The next message of `stream`, within 10 s.
async fn next(stream: &mut tonic::Streaming<pb::Message>, what: &str) -> pb::Message {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within 10 s"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .unwrap_or_else(|| panic!("{what}: the stream ended"))
}

/// Publishes on `from` and checks that the message reaches `stream` as it
/// was sent: payload, header, the sequence the publisher was given. Its
/// sequence.
async fn crosses(from: &BrokerProcess, stream: &mut tonic::Streaming<pb::Message>, topic: &str, what: &str) -> u64 {
    let sent = client(from)
        .await
        .publish(publish(topic, what))
        .await
        .unwrap()
        .into_inner();
    let got = next(stream, what).await;
    assert_eq!(
        (
            got.topic.as_str(),
            &got.payload[..],
            got.headers.get("from").map(String::as_str),
            got.sequence
        ),
        (topic, what.as_bytes(), Some(what), sent.sequence),
        "{what}"
    );
    got.sequence
}

/// Every subscription id listed through `replica`.
async fn listed(replica: &BrokerProcess) -> Vec<String> {
    let mut ids: Vec<String> = admin(replica)
        .await
        .list_subscriptions(pb::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
        .into_iter()
        .map(|s| s.subscription_id)
        .collect();
    ids.sort();
    ids
}

/// The calls a raw NATS subscriber sees on `<prefix>.rpc.>`: (subject,
/// carries the wire header, payload is JSON).
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, bool, bool)>>>;

async fn watch_calls(nats: &NatsCluster) -> (Seen, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    let raw = async_nats::connect(nats.url(0)).await.unwrap();
    let mut calls = raw.subscribe(format!("{PREFIX}.rpc.>")).await.unwrap();
    raw.flush().await.unwrap();
    let seen = Seen::default();
    let task = {
        let seen = seen.clone();
        tokio::spawn(async move {
            let _raw = raw;
            while let Some(m) = calls.next().await {
                let header = m.headers.as_ref().is_some_and(|h| h.get(WIRE_HEADER).is_some());
                let json = serde_json::from_slice::<serde_json::Value>(&m.payload).is_ok();
                seen.lock().unwrap().push((m.subject.to_string(), header, json));
            }
        })
    };
    (seen, task)
}

/// `<prefix>.rpc.<replica>` (the replica id in base64url, as the broker
/// keys it).
fn rpc_subject(replica: &str) -> String {
    use base64::Engine as _;
    format!(
        "{PREFIX}.rpc.{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(replica)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_of_the_previous_version_and_of_this_one_serve_one_cluster() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let (seen, watcher) = watch_calls(&nats).await;
        let a = replica(&nats, "a", false).await;
        let b = replica(&nats, "b", true).await;
        let mut c = replica(&nats, "c", false).await;
        if previous_binary().is_none() {
            let mut lines = b.before_start.clone();
            lines.extend(b.drain_lines());
            assert!(
                lines.iter().any(|l| l.contains("TB_TEST_PREVIOUS_WIRE is set")),
                "the old replica says, at WARN, that it speaks the previous wire: {lines:#?}"
            );
        }

        // Broadcast, both ways: each replica decodes the other's envelope.
        let (mut on_a, on_a_id) = subscribe(&mut client(&a).await, &["wire.live"]).await;
        let (mut on_b, on_b_id) = subscribe(&mut client(&b).await, &["wire.live"]).await;
        crosses(&b, &mut on_a, "wire.live", "old to new").await;
        assert_eq!(&next(&mut on_b, "b's own").await.payload[..], b"old to new");
        crosses(&a, &mut on_b, "wire.live", "new to old").await;
        assert_eq!(&next(&mut on_a, "a's own").await.payload[..], b"new to old");

        // A MANUAL group, one message in flight per member. Its member on
        // the new replica takes what the old one stored in the group's
        // stream...
        let group = member_request(&["wire.jobs"], "wire-workers", true, 1);
        let (mut member_a, member_a_id) = open(&mut client(&a).await, group.clone()).await;
        let held_by_a = crosses(&b, &mut member_a, "wire.jobs", "stored by the old replica").await;
        // ...and its member on the old replica what the new one stored (the
        // new replica's member is full).
        let (mut member_b, member_b_id) = open(&mut client(&b).await, group).await;
        let held_by_b = crosses(&a, &mut member_b, "wire.jobs", "stored by the new replica").await;

        // Acks through the replica that does not serve the member:
        // forwarded new → old, and old → new.
        assert_eq!(ack(&mut client(&a).await, &member_b_id, &[held_by_b]).await, (1, 0));
        assert_eq!(ack(&mut client(&b).await, &member_a_id, &[held_by_a]).await, (1, 0));
        // Acked once: again is unknown, wherever it is sent.
        assert_eq!(ack(&mut client(&b).await, &member_b_id, &[held_by_b]).await, (0, 1));
        assert_eq!(ack(&mut client(&a).await, &member_a_id, &[held_by_a]).await, (0, 1));

        // The listings, through each replica, gather every replica's part.
        let (_on_c, on_c_id) = subscribe(&mut client(&c).await, &["wire.live"]).await;
        let mut all = vec![
            on_a_id,
            on_b_id,
            on_c_id.clone(),
            member_a_id.clone(),
            member_b_id.clone(),
        ];
        all.sort();
        for replica in [&a, &b, &c] {
            assert_eq!(
                listed(replica).await,
                all,
                "ListSubscriptions through {}",
                replica.url()
            );
            let groups = common::groups(&mut admin(replica).await).await;
            let workers = groups
                .iter()
                .find(|g| g.name == "wire-workers")
                .expect("the group is listed");
            assert_eq!(
                (workers.members, workers.in_flight),
                (2, 0),
                "through {}",
                replica.url()
            );
            admin(replica)
                .await
                .list_evictions(pb::ListEvictionsRequest {})
                .await
                .expect("ListEvictions gathers from every replica");
        }

        // CloseSubscription forwarded to the old replica ends its member's
        // stream there.
        admin(&a)
            .await
            .close_subscription(pb::CloseSubscriptionRequest {
                subscription_id: member_b_id.clone(),
            })
            .await
            .expect("CloseSubscription forwarded to the old replica");
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            while let Ok(Some(_)) = member_b.message().await {}
        })
        .await;
        assert!(ended.is_ok(), "the old replica's member stream ends");
        wait_until("the group to have one member", || async {
            let groups = common::groups(&mut admin(&b).await).await;
            groups.iter().any(|g| g.name == "wire-workers" && g.members == 1)
        })
        .await;

        // On the wire: the old replica was only ever called in JSON; the
        // new ones called each other in proto (after one JSON call each,
        // answered with the header).
        let calls = seen.lock().unwrap().clone();
        let to = |replica: &str| {
            calls
                .iter()
                .filter(|(s, ..)| *s == rpc_subject(replica))
                .collect::<Vec<_>>()
        };
        let to_b = to("b");
        assert!(!to_b.is_empty(), "calls to the old replica were seen");
        assert!(
            to_b.iter().all(|(_, header, json)| !header && *json),
            "every call to the old replica is JSON without the header: {to_b:?}"
        );
        let proto_between_new = to("a")
            .iter()
            .chain(&to("c"))
            .filter(|(_, header, json)| *header && !json)
            .count();
        assert!(
            proto_between_new > 0,
            "the new replicas call each other in proto: {calls:?}"
        );
        let malformed = calls.iter().filter(|(_, header, json)| header == json).count();
        assert_eq!(
            malformed, 0,
            "a call is proto with the header or JSON without: {calls:?}"
        );

        // `c` rolled back to the previous version under the same id: `a`
        // calls it in proto, hears an old replica, and calls it in JSON.
        c.guard.signal("TERM");
        c.wait_exit();
        let c = replica(&nats, "c", true).await;
        let (_on_old_c, on_old_c_id) = subscribe(&mut client(&c).await, &["wire.live"]).await;
        let ids = listed(&a).await;
        assert!(
            ids.contains(&on_old_c_id),
            "a's listing has the rolled-back c's subscription: {ids:?}"
        );
        let line = a.line_containing("speaks the previous version's wire format");
        assert!(line.contains("replica=c"), "{line}");
        let to_c = seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, ..)| *s == rpc_subject("c"))
            .count();
        assert!(to_c > 0);

        drop(member_a);
        watcher.abort();
    })
    .await;
}

/// The NATS messages a raw subscriber sees on `subject`: how many
/// envelopes each carried (its `Tinybroker-Batch` header, 1 without).
type Batches = std::sync::Arc<std::sync::Mutex<Vec<usize>>>;

async fn watch_messages(nats: &NatsCluster, subject: &str) -> (Batches, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    let raw = async_nats::connect(nats.url(0)).await.unwrap();
    let mut messages = raw.subscribe(subject.to_owned()).await.unwrap();
    raw.flush().await.unwrap();
    let seen = Batches::default();
    let task = {
        let seen = seen.clone();
        tokio::spawn(async move {
            let _raw = raw;
            while let Some(m) = messages.next().await {
                let n = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Tinybroker-Batch"))
                    .map_or(1, |v| v.as_str().parse().unwrap());
                seen.lock().unwrap().push(n);
            }
        })
    };
    (seen, task)
}

/// Publishes `count` messages to `topic` as one batch on a session of
/// `from`; the sequences they were given (checked consecutive).
async fn publish_batch(from: &BrokerProcess, topic: &str, count: usize) -> Vec<u64> {
    use tinybroker::pb::session_event::Event;
    use tinybroker::pb::session_request::Request;
    let mut session = common::session::TestSession::start(&mut client(from).await).await;
    let messages = (0..count).map(|i| publish(topic, &format!("m{i}"))).collect();
    session.send(Request::Publish(pb::SessionPublish { id: 9, messages }));
    match session.event().await {
        Event::Published(p) => {
            assert_eq!((p.id, p.accepted, p.rejected.len()), (9, count as u32, 0), "{p:?}");
            (p.first_sequence..p.first_sequence + count as u64).collect()
        }
        other => panic!("{other:?}"),
    }
}

/// A session's batch to one topic goes out on core NATS as one NATS
/// message of envelopes while every replica reads batches, and each
/// replica's subscriber gets every message, in order, with its sequence;
/// once a replica of the previous version (which reads none) has a
/// subscriber, the next batch goes out one NATS message per message, and
/// both the new and the old replica get all of it. (Batched regardless,
/// the old replica drops the batch as undecodable; never batched, the
/// first batch is 300 NATS messages.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_reaches_nats_as_one_message_only_while_every_replica_reads_batches() {
    timeout(async {
        let nats = NatsCluster::start(1).await;
        let a = replica(&nats, "a", false).await;
        let b = replica(&nats, "b", false).await;
        let subject = format!("{PREFIX}.m.batch.t");
        let (seen, watching) = watch_messages(&nats, &subject).await;
        let on_b = client(&b)
            .await
            .open_subscription(subscribe_request(&["batch.t"]))
            .await
            .unwrap();
        let mut on_b = on_b.into_inner();
        // A group's stream stores each envelope of the batch alone.
        let mut member = client(&b)
            .await
            .open_subscription(member_request(&["batch.t"], "workers", false, 1000))
            .await
            .unwrap()
            .into_inner();

        let sent = publish_batch(&a, "batch.t", 300).await;
        for (i, sequence) in sent.iter().enumerate() {
            let got = next(&mut on_b, "b, first batch").await;
            assert_eq!(
                (got.sequence, &got.payload[..]),
                (*sequence, format!("m{i}").as_bytes())
            );
        }
        let mut taken: Vec<u64> = Vec::new();
        for _ in &sent {
            taken.push(next(&mut member, "the group member").await.sequence);
        }
        taken.sort_unstable();
        assert_eq!(taken, sent, "the group took each message once");
        wait_until("the raw subscriber to see the batch", || async {
            seen.lock().unwrap().iter().sum::<usize>() == 300
        })
        .await;
        assert_eq!(*seen.lock().unwrap(), [300], "one NATS message of 300 envelopes");
        seen.lock().unwrap().clear();

        let c = replica(&nats, "c", true).await;
        let mut on_c = client(&c)
            .await
            .open_subscription(subscribe_request(&["batch.t"]))
            .await
            .unwrap()
            .into_inner();
        let sent = publish_batch(&a, "batch.t", 300).await;
        for stream in [&mut on_b, &mut on_c] {
            for sequence in &sent {
                assert_eq!(next(stream, "second batch").await.sequence, *sequence);
            }
        }
        assert_eq!(
            *seen.lock().unwrap(),
            vec![1; 300],
            "a NATS message per message while an old replica listens"
        );
        watching.abort();
    })
    .await
}
