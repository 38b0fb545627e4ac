//! Consumer groups across replicas: members on three replicas share the
//! work, each message once; a new group is known cluster-wide when its
//! first join answers, and a replica started later knows the groups from
//! its first publish; a group's stream refused (beyond the NATS servers'
//! memory) or failing (deleted under a PublishStream); a memberless group
//! removed cluster-wide after its idle TTL; a full backlog dropping the
//! oldest, or the new message when members hold every one, each counted
//! once.

use crate::common;
use crate::common::nats::NatsCluster;
use crate::common::*;
use crate::{
    group_stream_state, next_message, publish_n, replica_config, replicas, replicas_with, urls_from, wait_members,
    wait_serving,
};
use std::time::Duration;
use tinybroker::pb;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_members_on_three_replicas_share_the_work_each_message_once() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas(&nats, 3, "share").await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (i, broker) in brokers.iter().enumerate() {
            let mut client = broker.client().await;
            let mut stream = client
                .open_subscription(member_request(&["jobs.*"], "workers", false, 4))
                .await
                .unwrap()
                .into_inner();
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(m)) = stream.message().await {
                    let _ = tx.send((i, m.sequence, m.consumer_group.clone()));
                }
            }));
        }
        // A second group member asking for other patterns is refused, from
        // any replica.
        let err = brokers[2]
            .client()
            .await
            .open_subscription(member_request(&["jobs.>"], "workers", false, 4))
            .await
            .expect_err("other patterns");
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        let sent = publish_n(&brokers[0], "jobs.build", 60).await;
        let mut got = std::collections::HashMap::new();
        let mut by_member = [0usize; 3];
        while got.len() < sent.len() {
            let (i, seq, group) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("every message delivered")
                .unwrap();
            assert_eq!(group, "workers");
            assert!(got.insert(seq, i).is_none(), "sequence {seq} delivered twice");
            by_member[i] += 1;
        }
        let mut keys: Vec<u64> = got.keys().copied().collect();
        keys.sort();
        assert_eq!(keys, sent);
        assert!(
            by_member.iter().all(|&n| n > 0),
            "every replica's member got work: {by_member:?}"
        );
        // JetStream was told: every message acked, so the work-queue
        // stream holds none (unacked, they would come again after ack_wait).
        wait_until("JetStream to have every delivered message acked", || async {
            group_stream_state(&nats, 0, "share").await == Some((0, 0))
        })
        .await;
        // So nothing more can come (no duplicates later): the members were
        // handed the 60 and no more, and none waits in a queue.
        let groups = groups(&mut brokers[1].admin().await).await;
        assert_eq!(groups.len(), 1, "{groups:?}");
        assert_eq!((groups[0].name.as_str(), groups[0].members), ("workers", 3));
        assert_eq!(
            (groups[0].backlog, groups[0].in_flight, groups[0].redeliveries),
            (0, 0, 0),
            "{groups:?}"
        );
        let members: Vec<_> = brokers[1]
            .subscriptions()
            .await
            .into_iter()
            .filter(|s| s.consumer_group == "workers")
            .collect();
        assert_eq!(members.len(), 3, "{members:?}");
        let handed: u64 = members.iter().map(|s| s.delivered + s.queue_depth).sum();
        assert_eq!(handed, 60, "each message handed to a member once: {members:?}");
        // Every replica's group gauges give the cluster-wide value.
        for broker in &brokers {
            wait_until("cluster-wide group gauges", || async {
                let (_, metrics) = broker.http_get("/metrics").await;
                common::process::metric_with_label(
                    &metrics,
                    "tinybroker_consumer_group_members",
                    "consumer_group=\"workers\"",
                ) == Some(3.0)
            })
            .await;
        }
        for task in tasks {
            task.abort();
        }
    })
    .await;
}

/// A group's first member, on one replica, sees a message published on
/// another replica right after its OpenSubscription answered: the new
/// group is known cluster-wide by then, not when the table's watch brings
/// it (docs/contract.md, Cluster mode). Eight new groups, each joined on
/// one replica and published to at once on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_takes_a_message_published_on_another_replica_right_after_its_first_join() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        // Eight groups' streams, each reserving its byte budget on every
        // server: a small budget, so they fit the test servers' memory.
        let brokers = replicas_with(&nats, 2, "newgroup", |c| c.limits.group_max_bytes = 1 << 20).await;
        let mut joiner = brokers[0].client().await;
        let mut publisher = brokers[1].client().await;
        let mut missed = Vec::new();
        for i in 0..8 {
            let topic = format!("fresh.{i}");
            let (mut member, _) = open(
                &mut joiner,
                member_request(&[topic.as_str()], &format!("g{i}"), false, 4),
            )
            .await;
            let r = publisher
                .publish(publish_request(&topic, "right away"))
                .await
                .unwrap()
                .into_inner();
            if r.matched_groups != 1 {
                missed.push(i);
                continue;
            }
            let m = next_message(&mut member, "the message published right after the join").await;
            assert_eq!(m.sequence, r.sequence);
        }
        assert!(missed.is_empty(), "groups that missed the first message: {missed:?}");
    })
    .await;
}

/// A replica started while a group exists routes to it from its very first
/// accepted publish: it reads the group table before it serves (a publish
/// loop from the moment it starts takes the first one it accepts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_later_knows_the_groups_from_its_first_publish() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let first = replicas(&nats, 1, "late").await;
        let mut client = first[0].client().await;
        let mut member = client
            .open_subscription(member_request(&["late.*"], "early", false, 16))
            .await
            .unwrap()
            .into_inner();
        let late = start_with(replica_config(urls_from(&nats, 1), "late", "late")).await;
        // Connect as soon as the listener answers, then publish until the
        // replica accepts one.
        let channel = loop {
            if let Ok(channel) = tonic::transport::Endpoint::from_shared(late.url())
                .unwrap()
                .connect()
                .await
            {
                break channel;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let mut publisher = pb::broker_client::BrokerClient::new(channel);
        let mut refused = 0;
        let accepted = loop {
            match publisher.publish(publish_request("late.job", "first")).await {
                Ok(response) => break response.into_inner(),
                Err(status) => {
                    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                    refused += 1;
                }
            }
        };
        eprintln!("the late replica refused {refused} publishes before its first");
        assert_eq!(
            accepted.matched_groups, 1,
            "the first accepted publish reaches the group"
        );
        let m = tokio::time::timeout(Duration::from_secs(10), member.message())
            .await
            .expect("the group's member gets it")
            .unwrap()
            .unwrap();
        assert_eq!((m.sequence, &m.payload[..]), (accepted.sequence, &b"first"[..]));
    })
    .await;
}

/// A PublishStream whose group store fails for good (the group's stream
/// deleted under it, no member to make it again) ends with UNAVAILABLE
/// once the store's retries run out: `accepted` counts only the messages
/// before it, and the message says how many sent after it reached
/// subscribers anyway (their stores overlapped with its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_group_store_fails_ends_counting_only_what_was_stored() {
    let nats = NatsCluster::start(1).await;
    timeout(async {
        let mut config = replica_config(urls_from(&nats, 0), "r0", "gone");
        if let Some(c) = config.cluster.as_mut() {
            c.nats_replicas = 1;
        }
        let broker = start_with(config).await;
        wait_serving(&broker).await;
        let mut client = broker.client().await;
        let (member, _) = open(&mut client, member_request(&["gone.>"], "g", false, 4)).await;
        drop(member);
        wait_members(&broker, 0).await;
        // A broadcast subscriber sees what reached subscribers.
        let (mut watcher, _) = open(&mut client, subscribe_request(&["gone.>"])).await;
        let js = async_nats::jetstream::new(async_nats::connect(nats.url(0).as_str()).await.unwrap());
        let names: Vec<String> = futures::StreamExt::collect(futures::StreamExt::filter_map(
            js.stream_names(),
            |n| async move { n.ok() },
        ))
        .await;
        let group_stream = names
            .iter()
            .find(|n| n.starts_with("gone_g_"))
            .expect("the group's stream");
        js.delete_stream(group_stream).await.unwrap();

        let requests: Vec<_> = (0..3).map(|i| publish_request("gone.x", &format!("m{i}"))).collect();
        let status = client
            .publish_stream(futures::stream::iter(requests))
            .await
            .expect_err("the group's store fails");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        for needed in [
            "consumer group \"g\"",
            "the 2 messages sent after it",
            "0 earlier messages",
        ] {
            assert!(status.message().contains(needed), "{needed} in {:?}", status.message());
        }
        for i in 0..3 {
            let m = next_message(&mut watcher, "a message routed before its store failed").await;
            assert_eq!(m.payload, format!("m{i}").into_bytes());
        }
    })
    .await;
}

/// Each group's stream reserves its byte budget on every server it is on:
/// a group beyond what the NATS servers' JetStream memory holds is refused
/// with RESOURCE_EXHAUSTED naming the budget's variable (not UNAVAILABLE,
/// as for an outage), and the groups already there go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_beyond_the_nats_servers_memory_is_refused_naming_the_budget() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        // 100 MiB per group on each of the 3 servers (256 MB each): two fit.
        let mut config = replica_config(urls_from(&nats, 0), "r0", "nomem");
        config.limits.group_max_bytes = 100 << 20;
        let broker = start_with(config).await;
        wait_serving(&broker).await;
        let mut client = broker.client().await;
        let (mut a, _) = open(&mut client, member_request(&["mem.a"], "a", false, 4)).await;
        let (_b, _) = open(&mut client, member_request(&["mem.b"], "b", false, 4)).await;
        let refused = client
            .open_subscription(member_request(&["mem.c"], "c", false, 4))
            .await
            .expect_err("a third group does not fit");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        for needed in ["\"c\"", "TINYBROKER_GROUP_MAX_BYTES=104857600", "max_memory_store"] {
            assert!(
                refused.message().contains(needed),
                "{needed} in {:?}",
                refused.message()
            );
        }
        let sent = publish_n(&broker, "mem.a", 1).await;
        assert_eq!(
            next_message(&mut a, "a message to a group that fitted").await.sequence,
            sent[0]
        );
        // The refused group is not left in the table: a publish to its
        // topic matches no group at once (it would wait 10 s for a stream
        // that is not there, then fail).
        let r = tokio::time::timeout(Duration::from_secs(2), client.publish(publish_request("mem.c", "x")))
            .await
            .expect("a publish to the refused group's topic answers at once")
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_groups, 0);
        assert!(groups(&mut broker.admin().await).await.iter().all(|g| g.name != "c"));
    })
    .await;
}

/// The group streams of `prefix` that server `i` reports: (name, messages).
async fn group_streams(nats: &NatsCluster, i: usize, prefix: &str) -> Option<Vec<(String, u64)>> {
    let jsz = nats.monitor(i, "/jsz?streams=true").await?;
    let group_prefix = format!("{prefix}_g_");
    let mut names = Vec::new();
    for account in jsz["account_details"].as_array()? {
        for stream in account["stream_detail"].as_array().into_iter().flatten() {
            let name = stream["name"].as_str().unwrap_or_default();
            if name.starts_with(&group_prefix) {
                names.push((
                    name.to_owned(),
                    stream["state"]["messages"].as_u64().unwrap_or_default(),
                ));
            }
        }
    }
    Some(names)
}

/// A group that has had no member on any replica for its idle TTL is
/// removed cluster-wide, as in single-node mode: gone from every replica's
/// listing, its stream and consumer deleted with what they held (counted
/// as `group_expired` by the replica that removed it), and its name free
/// for other patterns. Within the TTL it is listed with its backlog; a
/// group with a member stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memberless_group_is_removed_cluster_wide_after_its_idle_ttl() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        const TTL: Duration = Duration::from_secs(3);
        let brokers = replicas_with(&nats, 2, "idle", |c| c.limits.group_idle_ttl = TTL).await;
        let mut busy = brokers[1]
            .client()
            .await
            .open_subscription(member_request(&["busy.*"], "busy", false, 4))
            .await
            .unwrap()
            .into_inner();
        let mut member = brokers[0]
            .client()
            .await
            .open_subscription(member_request(&["idle.*"], "idle", true, 4))
            .await
            .unwrap()
            .into_inner();
        publish_n(&brokers[1], "idle.x", 1).await;
        next_message(&mut member, "the message it leaves unacked").await;
        // Before it leaves: no replica can see the group memberless earlier.
        let left_at = std::time::Instant::now();
        drop(member);
        wait_until("the member to be gone", || async {
            brokers[1].group("idle").await.is_some_and(|g| g.members == 0)
        })
        .await;
        publish_n(&brokers[1], "idle.x", 2).await;
        // Within the TTL: listed without members, its three messages kept
        // in its stream (the busy group's is empty).
        let within = brokers[0].group("idle").await.expect("listed within its TTL");
        let mut streams = group_streams(&nats, 0, "idle").await.unwrap_or_default();
        streams.sort_by_key(|(_, messages)| *messages);
        assert!(left_at.elapsed() < TTL, "checked within the TTL");
        assert_eq!(within.members, 0, "{within:?}");
        assert_eq!(
            streams.iter().map(|(_, m)| *m).collect::<Vec<_>>(),
            [0, 3],
            "{streams:?}"
        );

        // Its memberless gauge counts up on some replica meanwhile.
        wait_until("a memberless gauge of the idle group above 0", || async {
            for broker in &brokers {
                let (_, metrics) = broker.http_get("/metrics").await;
                let gauge = common::process::metric_with_label(
                    &metrics,
                    "tinybroker_consumer_group_memberless_seconds",
                    "consumer_group=\"idle\"",
                );
                if gauge.is_some_and(|s| s > 0.0) {
                    return true;
                }
            }
            false
        })
        .await;
        wait_until("the idle group gone from every replica's listing", || async {
            for broker in &brokers {
                if broker.group("idle").await.is_some() {
                    return false;
                }
            }
            true
        })
        .await;
        let removed_after = left_at.elapsed();
        eprintln!("idle: removed {removed_after:?} after its last member left (TTL {TTL:?})");
        assert!(removed_after >= TTL, "not before its TTL: {removed_after:?}");
        wait_until("its stream deleted", || async {
            group_streams(&nats, 0, "idle").await.is_some_and(|s| s.len() == 1)
        })
        .await;
        let expired = dropped_total(&brokers, "group_expired").await;
        eprintln!("idle: dropped as group_expired (all replicas): {expired}");
        assert_eq!(expired, 3.0, "what it held is dropped and counted");
        // The group with a member is still there.
        let busy_info = brokers[0].group("busy").await.expect("a group with a member stays");
        assert_eq!(busy_info.members, 1);
        // A publish to its topic matches no group now, at once.
        let started = std::time::Instant::now();
        let r = brokers[0]
            .client()
            .await
            .publish(publish_request("idle.x", "after"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.matched_groups, 0);
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        // The name is free: a member with other patterns creates it anew,
        // and gets none of the old messages.
        let mut reborn = brokers[1]
            .client()
            .await
            .open_subscription(member_request(&["other.*"], "idle", false, 4))
            .await
            .expect("the name is free again")
            .into_inner();
        let fresh = publish_n(&brokers[0], "other.y", 1).await;
        let m = next_message(&mut reborn, "the new group's first message").await;
        assert_eq!(m.sequence, fresh[0]);
        // The busy member still gets its messages.
        let sent = publish_n(&brokers[0], "busy.z", 1).await;
        assert_eq!(
            next_message(&mut busy, "the busy group's message").await.sequence,
            sent[0]
        );
    })
    .await;
}

/// A full group backlog on a 3-server NATS cluster (R3 streams): the oldest
/// messages are dropped, and every one of them is counted once, by the
/// replica whose publish dropped it, while two replicas publish into the
/// full backlog at once: published = backlog + dropped, in Admin and in the
/// metrics. The member that comes back gets the newest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_group_backlog_drops_the_oldest_and_counts_each_once_across_replicas() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let brokers = replicas_with(&nats, 2, "full", |c| c.limits.group_capacity = 4).await;
        let mut client = brokers[0].client().await;
        let first = client
            .open_subscription(member_request(&["work"], "slow", false, 1))
            .await
            .unwrap()
            .into_inner();
        drop(first);
        wait_members(&brokers[1], 0).await;
        let mut admin = brokers[1].admin().await;

        // Two replicas publish 20 each at the same time into a backlog of 4:
        // one a message at a time, the other on a PublishStream (its
        // stores overlap, and each refused one is retried after the others
        // were sent).
        let (a, b) = tokio::join!(
            publish_n(&brokers[0], "work", 20),
            publish_many(&brokers[1], "work", 20)
        );
        // The backlog is read from the consumer, whose server may apply the
        // last stored messages a moment after the publish was acked.
        let last = std::sync::Arc::new(std::sync::Mutex::new(None));
        let waited = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let g = groups(&mut admin.clone()).await.remove(0);
                if g.backlog == 4 {
                    break;
                }
                *last.lock().unwrap() = Some(g);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "timed out waiting for the backlog to read 4 (publishes: {a:?} and {b:?}); last read: {:?}",
            last.lock().unwrap()
        );
        let g = groups(&mut admin).await.remove(0);
        assert_eq!(g.dropped, 36, "every message dropped is counted once: {g:?}");
        let counted = dropped_total(&brokers, "group_overflow").await;
        assert_eq!(counted, 36.0, "group_overflow summed over the replicas");

        // The member back gets the 4 kept, and they are the newest: each is
        // among the last 4 its replica published (a publish into the full
        // backlog always drops the oldest, so a message with 4 of its own
        // replica's after it is gone).
        let mut member = brokers[1]
            .client()
            .await
            .open_subscription(member_request(&["work"], "slow", false, 10))
            .await
            .unwrap()
            .into_inner();
        let mut kept = Vec::new();
        for _ in 0..4 {
            kept.push(next_message(&mut member, "a kept message").await.sequence);
        }
        for seq in &kept {
            let newest = [&a[a.len() - 4..], &b[b.len() - 4..]];
            assert!(
                newest.iter().any(|last| last.contains(seq)),
                "{seq} is among the newest: kept {kept:?}, a {a:?}, b {b:?}"
            );
        }
        // Nothing beyond the 4 kept: a message published now is the
        // member's next (the group hands its stream's messages out in
        // order, to its one member).
        let marker = publish_n(&brokers[0], "work", 1).await[0];
        assert_eq!(
            next_message(&mut member, "the message after the kept ones")
                .await
                .sequence,
            marker,
            "nothing beyond the 4 kept"
        );
    })
    .await;
}

/// A full group backlog whose every message is with a member has nothing
/// older to drop for a new message: the new one is dropped, and counted
/// (docs/contract.md, Cluster mode). Once the member acks, the group takes
/// messages again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_backlog_held_by_members_drops_the_new_message_and_counts_it() {
    let nats = NatsCluster::start(3).await;
    timeout(async {
        let mut config = replica_config(urls_from(&nats, 0), "r0", "held");
        config.limits.group_capacity = 2;
        let broker = start_with(config).await;
        wait_serving(&broker).await;
        let mut client = broker.client().await;
        let (mut member, id) = open(&mut client, member_request(&["work"], "busy", true, 2)).await;
        let held = publish_n(&broker, "work", 2).await;
        let got = [
            next_message(&mut member, "the first").await.sequence,
            next_message(&mut member, "the second").await.sequence,
        ];
        assert_eq!(got.to_vec(), held);

        // Both stored messages are with the member: the third is dropped.
        publish_n(&broker, "work", 1).await;
        let g = groups(&mut broker.admin().await).await.remove(0);
        assert_eq!((g.dropped, g.in_flight), (1, 2), "{g:?}");
        assert_eq!(dropped_total([&broker], "group_overflow").await, 1.0);

        assert_eq!(ack(&mut client, &id, &held).await, (2, 0));
        let next = publish_n(&broker, "work", 1).await;
        assert_eq!(
            next_message(&mut member, "a message after the acks").await.sequence,
            next[0]
        );
    })
    .await;
}
