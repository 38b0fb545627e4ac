//! Whether a publish must go out on core NATS at all: only when another
//! replica has (or may have) a broadcast subscriber. A cluster of consumer
//! groups only (no broadcast subscriber anywhere else) then pays for each
//! message once, in its group stores, not again in a copy to every
//! replica's `<prefix>.m.>` subscription that each one drops.
//!
//! Each replica says whether it has broadcast subscriptions ("some" or
//! "none"), numbered (its incarnation, then a count), to every live
//! replica:
//! - **0 → 1**: before its first broadcast OpenSubscription after having
//!   none answers, it tells every live replica "some" and waits for each
//!   (at most [`ANNOUNCE_TIMEOUT`]): a message published anywhere after the
//!   response headers arrived is sent on core NATS (the contract's "every
//!   message published after the response headers arrived"). Opens that
//!   come meanwhile wait for the same announcement.
//! - **→ 0** lazily: "none" at a heartbeat after a whole [`HEARTBEAT`]
//!   without broadcast subscriptions.
//! - **again at every heartbeat**, not waited for: a replica that missed an
//!   announcement (it did not answer in time, it started since) learns
//!   within a heartbeat; the numbers keep an older "none" from undoing a
//!   newer "some".
//!
//! A publishing replica skips the core publish only while every other
//! replica it knows as live, or heard from, said "none" within the last
//! [`FRESH_FOR`]. A replica it knows nothing of, whose word is older, or
//! that runs a version without announcements, counts as "some".
//!
//! The same word says whether the replica reads batched messages (several
//! envelopes in one NATS message, `wire.rs`): a publishing replica sends
//! a batch's messages that way only while every other replica it knows
//! as live, or heard from, said so within [`FRESH_FOR`]; one it knows
//! nothing of, or of a version before batches, is sent one NATS message
//! per message, as before.
//!
//! [`HEARTBEAT`]: super::HEARTBEAT

use super::rpc::{self, Version};
use super::{ClusterEngine, HEARTBEAT, Inner, REPLICA_TTL};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a first broadcast OpenSubscription waits for each replica to
/// take its "some" (one that did not has it within a heartbeat).
pub const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a replica's word counts: it repeats it every heartbeat.
pub const FRESH_FOR: Duration = Duration::from_secs(3 * HEARTBEAT.as_secs());

/// What a replica says of itself ([`rpc::Call::Interest`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Word {
    pub(super) version: Version,
    /// It has broadcast subscriptions.
    pub(super) some: bool,
    pub(super) reads_batches: bool,
}

/// What a replica said last, and when it was heard.
struct Said {
    version: Version,
    some: bool,
    reads_batches: bool,
    heard: Instant,
}

/// This replica's own word, as last announced.
#[derive(Default)]
struct Own {
    version: Version,
    some: bool,
    /// Heartbeats in a row without broadcast subscriptions.
    idle_beats: u32,
}

#[derive(Default)]
pub(super) struct Interest {
    /// Taken across an announcement: opens wait for the one under way.
    own: tokio::sync::Mutex<Own>,
    /// Broadcast subscriptions of this replica open or being opened.
    open: AtomicUsize,
    /// What every other replica said, the newest word of each.
    others: Mutex<HashMap<String, Said>>,
    /// Whether publishes may skip core NATS: false (they go out) until
    /// every other replica said "none".
    skip: AtomicBool,
    /// Whether a batch's messages may go out several in one NATS message:
    /// false until every other replica said it reads them.
    batch: AtomicBool,
}

impl Interest {
    /// Whether publishes of this replica may skip core NATS.
    pub(super) fn skip(&self) -> bool {
        self.skip.load(Ordering::Acquire)
    }

    /// Whether every other replica reads batched messages.
    pub(super) fn batch(&self) -> bool {
        self.batch.load(Ordering::Acquire)
    }

    pub(super) async fn set_incarnation(&self, incarnation: u64) {
        self.own.lock().await.version = Version { incarnation, n: 0 };
    }

    /// Forgets what the other replicas said: every one counts as "some"
    /// until it says otherwise again. When this replica's NATS connection
    /// drops or comes back: what others announced meanwhile did not reach
    /// it.
    pub(super) fn forget(&self) {
        self.others.lock().clear();
        self.skip.store(false, Ordering::Release);
        self.batch.store(false, Ordering::Release);
    }

    /// Takes replica `replica`'s word if it is newer than what was heard.
    pub(super) fn note(&self, replica: &str, word: Word, live: &[String], me: &str) {
        let Word {
            version,
            some,
            reads_batches,
        } = word;
        {
            let mut others = self.others.lock();
            match others.get_mut(replica) {
                Some(said) if said.version > version => return,
                Some(said) => {
                    said.version = version;
                    said.some = some;
                    said.reads_batches = reads_batches;
                    said.heard = Instant::now();
                }
                None => {
                    others.insert(
                        replica.to_owned(),
                        Said {
                            version,
                            some,
                            reads_batches,
                            heard: Instant::now(),
                        },
                    );
                }
            }
        }
        self.recompute(live, me);
    }

    /// Decides again whether publishes may skip core NATS: only while every
    /// other replica known, live or heard from, said "none" recently. Words
    /// of replicas neither live nor heard from for [`REPLICA_TTL`] are
    /// forgotten.
    pub(super) fn recompute(&self, live: &[String], me: &str) {
        let mut others = self.others.lock();
        let now = Instant::now();
        others.retain(|replica, said| live.contains(replica) || now.duration_since(said.heard) < REPLICA_TTL);
        let unknown = live.iter().any(|r| r != me && !others.contains_key(r));
        let some = others
            .iter()
            .any(|(replica, said)| replica != me && (said.some || now.duration_since(said.heard) > FRESH_FOR));
        self.skip.store(!unknown && !some, Ordering::Release);
        let unbatched = others.iter().any(|(replica, said)| {
            replica != me && (!said.reads_batches || now.duration_since(said.heard) > FRESH_FOR)
        });
        self.batch.store(!unknown && !unbatched, Ordering::Release);
    }
}

/// Held by a broadcast subscription of this replica while it is open (or
/// being opened): this replica says "some" while any is held.
pub(super) struct Interested(Arc<Inner>);

impl Drop for Interested {
    fn drop(&mut self) {
        self.0.interest.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ClusterEngine {
    /// Before a broadcast subscription is opened here: after this returns,
    /// every replica that answered sends its publishes on core NATS.
    pub(super) async fn interested(&self) -> Interested {
        let interest = &self.inner.interest;
        let mut own = interest.own.lock().await;
        interest.open.fetch_add(1, Ordering::AcqRel);
        let held = Interested(self.inner.clone());
        own.idle_beats = 0;
        if !own.some {
            own.some = true;
            own.version.n += 1;
            self.announce(own.version, true).await;
        }
        held
    }

    /// At each heartbeat: "none" once a whole heartbeat passed without
    /// broadcast subscriptions here; then this replica's word, sent again to
    /// every live replica; then what the others said, weighed again.
    pub(super) async fn interest_beat(&self) {
        let interest = &self.inner.interest;
        let (version, some) = {
            let mut own = interest.own.lock().await;
            if interest.open.load(Ordering::Acquire) == 0 {
                own.idle_beats = own.idle_beats.saturating_add(1);
                if own.some && own.idle_beats > 1 {
                    own.some = false;
                    own.version.n += 1;
                }
            } else {
                own.idle_beats = 0;
            }
            (own.version, own.some)
        };
        self.announce(version, some).await;
        let live = self.inner.live.lock().clone();
        interest.recompute(&live, &self.inner.config.replica_id);
    }

    /// Tells every other live replica (as of the last heartbeat), and every
    /// replica heard from lately, this replica's word and waits for their
    /// answers, each at most [`ANNOUNCE_TIMEOUT`].
    async fn announce(&self, version: Version, some: bool) {
        let inner = &self.inner;
        let me = &inner.config.replica_id;
        let mut live = inner.live.lock().clone();
        for heard in inner.interest.others.lock().keys() {
            if !live.contains(heard) {
                live.push(heard.clone());
            }
        }
        let call = rpc::Call::Interest {
            replica: me.clone(),
            version,
            some,
            // A replica speaking the previous wire reads none (as that
            // version did).
            reads_batches: !super::wire::speaks_previous(),
        };
        let calls = live.iter().filter(|r| *r != me).map(|replica| {
            let call = &call;
            async move {
                if let Err(error) =
                    rpc::call_within(&inner.client, &inner.config.prefix, replica, call, ANNOUNCE_TIMEOUT).await
                {
                    tracing::debug!(%replica, %error, some, "a replica did not take this replica's broadcast interest; it hears it again at the next heartbeat");
                }
            }
        });
        futures::future::join_all(calls).await;
    }

    /// Another replica's word (an [`rpc::Call::Interest`]).
    pub(super) fn noted_interest(&self, replica: &str, version: Version, some: bool, reads_batches: bool) {
        let live = self.inner.live.lock().clone();
        let word = Word {
            version,
            some,
            reads_batches,
        };
        self.inner
            .interest
            .note(replica, word, &live, &self.inner.config.replica_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(incarnation: u64, n: u64) -> Version {
        Version { incarnation, n }
    }

    /// A word of a replica that reads batches.
    fn w(version: Version, some: bool) -> Word {
        Word {
            version,
            some,
            reads_batches: true,
        }
    }

    fn live(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn publishes_skip_core_nats_only_while_every_other_replica_said_none() {
        let interest = Interest::default();
        let replicas = live(&["a", "b", "c"]);
        assert!(!interest.skip(), "before anything is known, publishes go out");
        interest.recompute(&replicas, "a");
        assert!(!interest.skip(), "b and c said nothing yet: they count as some");
        interest.note("b", w(v(1, 1), false), &replicas, "a");
        assert!(!interest.skip(), "c said nothing yet");
        interest.note("c", w(v(7, 3), false), &replicas, "a");
        assert!(interest.skip(), "both said none");
        interest.note("c", w(v(7, 4), true), &replicas, "a");
        assert!(!interest.skip(), "c has a subscriber now");
        interest.note("c", w(v(7, 3), false), &replicas, "a");
        assert!(!interest.skip(), "an older none does not undo a newer some");
        interest.note("c", w(v(8, 0), false), &replicas, "a");
        assert!(
            interest.skip(),
            "a new incarnation's word is newer than any count of an old one"
        );
        let more = live(&["a", "b", "c", "d"]);
        interest.recompute(&more, "a");
        assert!(!interest.skip(), "a replica that just started counts as some");
        interest.note("e", w(v(1, 1), true), &more, "a");
        interest.note("d", w(v(1, 0), false), &more, "a");
        assert!(!interest.skip(), "e is not live yet as far as a knows, but said some");
        interest.note("e", w(v(1, 2), false), &more, "a");
        assert!(interest.skip(), "every one said none");
        interest.forget();
        assert!(!interest.skip(), "after a reconnection nothing is known");
        interest.recompute(&more, "a");
        assert!(
            !interest.skip(),
            "and every live replica counts as some until it speaks again"
        );
    }

    #[test]
    fn batches_go_out_only_while_every_other_replica_said_it_reads_them() {
        let interest = Interest::default();
        let replicas = live(&["a", "b", "c"]);
        interest.recompute(&replicas, "a");
        assert!(!interest.batch(), "b and c said nothing yet");
        interest.note("b", w(v(1, 1), true), &replicas, "a");
        assert!(!interest.batch(), "c said nothing yet");
        let old = Word {
            version: v(2, 1),
            some: true,
            reads_batches: false,
        };
        interest.note("c", old, &replicas, "a");
        assert!(!interest.batch(), "c is of a version before batches");
        interest.note("c", w(v(3, 0), true), &replicas, "a");
        assert!(interest.batch(), "every other replica reads them");
        interest.recompute(&live(&["a", "b", "c", "d"]), "a");
        assert!(!interest.batch(), "d just started and said nothing");
        interest.forget();
        assert!(!interest.batch(), "after a reconnection nothing is known");
    }
}
