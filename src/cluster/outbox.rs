//! What this replica sends on core NATS for the other replicas' fan-out:
//! numbered here by each publish (in order, under one lock). The first
//! message of a publisher's burst ([`WakeBatch::open`]) goes to the NATS
//! client at once when nothing is queued before it; the rest are queued
//! and handed to the client by one task, the **sender**, which takes
//! everything queued at once. While every other replica reads batches
//! (`interest.rs`), each run of messages to one subject goes out as one
//! NATS message of envelopes (`wire.rs`'s batches): one NATS publish,
//! one message routed by the NATS servers, and one NATS delivery per
//! replica for a burst of messages, not for each.
//!
//! A burst forms by itself: a publisher routing what has arrived wakes the
//! sender once, at the end of its burst ([`WakeBatch::wake`]), and a paced
//! message goes out alone, at once, without the sender. Nothing waits for
//! more to come.
//!
//! The queue is bounded ([`ROOM`] messages): a publish finding no room
//! waits for it while NATS answers (as it waited for room in the NATS
//! client's queue before), and is UNAVAILABLE once NATS is found
//! unreachable. Each message holds one unit of room from when it is
//! queued until the sender hands its run to the client; a batch larger
//! than the whole room takes all of it and queues its first messages
//! beyond it, holding none (the outbox then holds at most [`ROOM`] plus
//! that batch's excess). A message queued here goes out: the sender waits
//! for the client as long as it takes (the client keeps its queue across
//! a reconnection); one that arrives too late is dropped and counted by
//! its receiver (`liveness.rs`), one that never arrives is a gap in this
//! replica's count there (`fanout.rs`). At shutdown, what NATS did not
//! take in time (queued, or taken by the sender: [`Outbox::unsent`]) is
//! counted as discarded (`engine.rs`, `maintain`).

use super::ClusterEngine;
use super::wire;
use crate::engine::{BrokerError, WakeBatch};
use bytes::{Bytes, BytesMut};
use futures::FutureExt;
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

/// Most messages queued here at once.
pub(super) const ROOM: usize = 4096;
/// What a batch's header (`Tinybroker-Batch: <n>`) adds to its payload at
/// most, against the NATS server's max_payload.
const BATCH_HEADER_ROOM: usize = 64;

pub(super) struct Outbox {
    state: Mutex<State>,
    /// Room for messages: taken by a publish, given back as the sender
    /// hands them to the NATS client.
    room: tokio::sync::Semaphore,
    /// Told when the sender has handed everything to the client (leaving
    /// waits for it before the client's flush).
    emptied: tokio::sync::Notify,
    /// Messages the sender took and has not handed to the client yet: set
    /// as it takes them (under the state's lock), lowered by each run it
    /// hands over. What shutdown counts as lost with the queue.
    unsent: AtomicUsize,
}

impl Default for Outbox {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::default()),
            room: tokio::sync::Semaphore::new(ROOM),
            emptied: tokio::sync::Notify::new(),
            unsent: AtomicUsize::new(0),
        }
    }
}

#[derive(Default)]
struct State {
    /// Numbered, not yet taken by the sender, in order.
    queue: Vec<Pending>,
    /// The sender's waker while it waits for messages.
    waker: Option<Waker>,
    /// The sender took messages and may not have handed them all to the
    /// client yet: a publish queues.
    sending: bool,
    /// The publisher's batch ([`WakeBatch::open`]) whose first message
    /// went to the client directly: the rest of it queues, for the sender.
    direct_in: Option<u64>,
    /// Messages numbered so far: the count of the last one.
    counted: u64,
}

struct Pending {
    subject: async_nats::Subject,
    body: Bytes,
    /// The room it holds: 1, or 0 beyond the room (the first part of a
    /// batch larger than [`ROOM`], a message the client had no room for
    /// at once).
    room: u32,
}

impl Outbox {
    /// Whether everything queued was handed to the NATS client.
    fn is_emptied(&self) -> bool {
        let state = self.state.lock();
        state.queue.is_empty() && !state.sending
    }

    /// Resolves once everything queued was handed to the NATS client.
    pub(super) async fn emptied(&self) {
        loop {
            let told = self.emptied.notified();
            let mut told = std::pin::pin!(told);
            told.as_mut().enable();
            if self.is_emptied() {
                return;
            }
            told.await;
        }
    }

    /// Messages not yet handed to the NATS client: queued, or taken by the
    /// sender and not handed over. What the client itself buffers is not
    /// known here.
    pub(super) fn unsent(&self) -> usize {
        let state = self.state.lock();
        state.queue.len() + self.unsent.load(Ordering::Acquire)
    }

    /// Queues a batch's messages (numbered, in order) holding `room`: one
    /// each for the last `room`, none for those before (a batch larger
    /// than [`ROOM`]). Its room comes back as its runs are handed to the
    /// client, and only once no more than [`ROOM`] of it is left: what
    /// waits for room then finds the outbox holding at most [`ROOM`] plus
    /// one batch's excess.
    fn queue_batch(state: &mut State, out: Vec<(async_nats::Subject, Bytes)>, room: u32) {
        let beyond = out.len().saturating_sub(room as usize);
        state.queue.reserve(out.len());
        for (i, (subject, body)) in out.into_iter().enumerate() {
            state.queue.push(Pending {
                subject,
                body,
                room: u32::from(i >= beyond),
            });
        }
    }

    /// The sender handed `run` to the client: its room comes back.
    fn handed_over(&self, run: &[Pending]) {
        self.unsent.fetch_sub(run.len(), Ordering::Release);
        self.room.add_permits(run.iter().map(|p| p.room as usize).sum());
    }

    /// Takes everything queued into `taken` (empty), or registers the
    /// sender to be woken.
    fn poll_take(&self, taken: &mut Vec<Pending>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.state.lock();
        if state.queue.is_empty() {
            state.sending = false;
            state.waker = Some(cx.waker().clone());
            drop(state);
            self.emptied.notify_waiters();
            return Poll::Pending;
        }
        state.sending = true;
        std::mem::swap(&mut state.queue, taken);
        self.unsent.store(taken.len(), Ordering::Release);
        Poll::Ready(())
    }
}

/// Wakes the sender if it waits for something queued (at the end of the
/// publisher's burst), after letting go of the lock it was queued under.
fn wake_sender(mut state: MutexGuard<'_, State>) {
    if let Some(waker) = state.waker.take() {
        drop(state);
        WakeBatch::wake(waker);
    }
}

impl ClusterEngine {
    /// Room in the outbox for `n` messages (at most all of it), taken at
    /// once if there is; else waited for while NATS answers.
    async fn outbox_room(&self, n: usize) -> Result<u32, BrokerError> {
        let n = n.clamp(1, ROOM) as u32;
        let room = &self.inner.outbox.room;
        match room.try_acquire_many(n) {
            Ok(permit) => permit.forget(),
            Err(_) => match self.unless_cut_off(room.acquire_many(n)).await {
                Some(Ok(permit)) => permit.forget(),
                // The semaphore is never closed.
                Some(Err(_)) => unreachable!("the outbox's room is never closed"),
                None => return Err(self.cut_off("the message reached this replica's subscribers only")),
            },
        }
        Ok(n)
    }

    /// Sends one routed message on core NATS: numbered and queued in one
    /// go, so the numbers go out in order whichever of this replica's
    /// streams publishes. Returns the envelope as sent. With nothing
    /// queued before it and room in the NATS client's queue, it is handed
    /// to the client here, at once (a paced message takes no hop through
    /// the sender).
    pub(super) async fn send_core(
        &self,
        subject: String,
        body: &mut BytesMut,
        count_at: usize,
    ) -> Result<Bytes, BrokerError> {
        let subject = async_nats::Subject::from(subject);
        if let Some(sent) = self.send_core_now(&subject, body, count_at)? {
            return Ok(sent);
        }
        let room = self.outbox_room(1).await?;
        let outbox = &self.inner.outbox;
        let mut state = outbox.state.lock();
        state.counted += 1;
        wire::set_count(body, count_at, state.counted);
        let body = body.split().freeze();
        state.queue.push(Pending {
            subject,
            body: body.clone(),
            room,
        });
        wake_sender(state);
        Ok(body)
    }

    /// [`ClusterEngine::send_core`] without waiting: handed to the client
    /// when nothing is queued before it, else queued if there is room;
    /// `None` when there is none.
    fn send_core_now(
        &self,
        subject: &async_nats::Subject,
        body: &mut BytesMut,
        count_at: usize,
    ) -> Result<Option<Bytes>, BrokerError> {
        let outbox = &self.inner.outbox;
        let mut state = outbox.state.lock();
        // Nothing queued before it, and the first of its publisher's
        // burst: straight to the client, if it has room.
        let burst = WakeBatch::open();
        let direct = !state.sending && state.queue.is_empty() && (burst.is_none() || burst != state.direct_in);
        let room = match direct {
            true => 0,
            false => match outbox.room.try_acquire() {
                Ok(permit) => {
                    permit.forget();
                    1
                }
                Err(_) => return Ok(None),
            },
        };
        state.counted += 1;
        wire::set_count(body, count_at, state.counted);
        let sent = body.split().freeze();
        if direct {
            // Polled once: in the client's queue, or not yet.
            match self.inner.client.publish(subject.clone(), sent.clone()).now_or_never() {
                Some(Ok(())) => {
                    // What follows it in this burst queues, for the sender,
                    // woken when the burst ends: one NATS message for the
                    // rest of the burst. A paced message goes alone, the
                    // sender not woken.
                    state.direct_in = burst;
                    return Ok(Some(sent));
                }
                Some(Err(e)) => {
                    // Not sent: its number is the next one's.
                    state.counted -= 1;
                    return Err(BrokerError::Unavailable(format!(
                        "NATS is unreachable ({e}): the message reached this replica's subscribers only"
                    )));
                }
                // The client's queue is full: the sender waits for room
                // for it (one message beyond the outbox's room).
                None => {}
            }
        }
        state.queue.push(Pending {
            subject: subject.clone(),
            body: sent.clone(),
            room,
        });
        wake_sender(state);
        Ok(Some(sent))
    }

    /// Sends a batch's routed messages on core NATS, numbered in one go; a
    /// message that goes out on no subject (no other replica has a
    /// broadcast subscriber) as it is. Returns each message's envelope as
    /// sent, or why it was not.
    pub(super) async fn send_core_batched(
        &self,
        locals: &mut [(u32, super::fanout::Local)],
    ) -> Vec<Result<Bytes, BrokerError>> {
        let going = locals.iter().filter(|(_, l)| l.core.is_some()).count();
        let room = if going > 0 {
            match self.outbox_room(going).await {
                Ok(room) => room,
                Err(error) => {
                    return locals
                        .iter_mut()
                        .map(|(_, local)| match local.core {
                            Some(_) => Err(error.clone()),
                            None => Ok(local.body.split().freeze()),
                        })
                        .collect();
                }
            }
        } else {
            0
        };
        let mut results = Vec::with_capacity(locals.len());
        let mut out = Vec::with_capacity(going);
        {
            let mut state = self.inner.outbox.state.lock();
            for (_, local) in locals.iter_mut() {
                if let Some((subject, count_at)) = local.core.take() {
                    state.counted += 1;
                    wire::set_count(&mut local.body, count_at, state.counted);
                    let body = local.body.split().freeze();
                    out.push((async_nats::Subject::from(subject), body.clone()));
                    results.push(Ok(body));
                } else {
                    results.push(Ok(local.body.split().freeze()));
                }
            }
            // Queued under the same lock as numbered: in order.
            Outbox::queue_batch(&mut state, out, room);
            wake_sender(state);
        }
        results
    }

    /// The sender: hands what the publishes queued to the NATS client,
    /// everything queued at once, runs to one subject batched while every
    /// other replica reads batches.
    pub(super) async fn send_out(self) {
        let outbox = &self.inner.outbox;
        let client = &self.inner.client;
        let mut taken = Vec::new();
        let mut run = BytesMut::new();
        loop {
            std::future::poll_fn(|cx| outbox.poll_take(&mut taken, cx)).await;
            let batch = self.inner.interest.batch();
            let max = self
                .inner
                .max_payload
                .load(std::sync::atomic::Ordering::Relaxed)
                .saturating_sub(BATCH_HEADER_ROOM);
            let mut i = 0;
            while i < taken.len() {
                let subject = &taken[i].subject;
                // The run: messages to the same subject, within max_payload.
                let mut size = wire::batched_len(taken[i].body.len());
                let mut end = i + 1;
                while batch
                    && let Some(next) = taken.get(end)
                    && next.subject == *subject
                    && size + wire::batched_len(next.body.len()) <= max
                {
                    size += wire::batched_len(next.body.len());
                    end += 1;
                }
                let published = if end - i == 1 {
                    client.publish(subject.clone(), taken[i].body.clone()).await
                } else {
                    run.reserve(size);
                    for pending in &taken[i..end] {
                        wire::put_batched(&mut run, &pending.body);
                    }
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert(wire::BATCH_HEADER, (end - i).to_string().as_str());
                    client
                        .publish_with_headers(subject.clone(), headers, run.split().freeze())
                        .await
                };
                if let Err(error) = published {
                    // The client is closed (shutting down): what is not sent
                    // is a gap in this replica's count at the receivers.
                    tracing::warn!(%error, messages = end - i, "messages for the other replicas not sent on core NATS");
                }
                // Room given back as soon as it is in the client's queue.
                outbox.handed_over(&taken[i..end]);
                i = end;
            }
            taken.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` messages to two subjects in turn (runs of one message, as the
    /// sender hands them over when the subjects alternate).
    fn batch(n: usize) -> Vec<(async_nats::Subject, Bytes)> {
        (0..n)
            .map(|i| {
                (
                    async_nats::Subject::from(format!("s.{}", i % 2)),
                    Bytes::from(i.to_string()),
                )
            })
            .collect()
    }

    /// Takes what is queued as the sender does, and hands it over `run`
    /// messages at a time, checking after each run that the room free and
    /// the room held by what is not handed over yet add up to [`ROOM`].
    fn hand_over_by(outbox: &Outbox, run: usize) {
        let mut taken = Vec::new();
        let waker = Waker::noop();
        assert!(outbox.poll_take(&mut taken, &mut Context::from_waker(waker)).is_ready());
        let mut left = taken.len();
        assert_eq!(outbox.unsent(), left);
        for run in taken.chunks(run) {
            outbox.handed_over(run);
            left -= run.len();
            assert_eq!(outbox.unsent(), left);
            assert_eq!(
                outbox.room.available_permits(),
                ROOM - left.min(ROOM),
                "room free with {left} messages not handed over yet"
            );
        }
        assert!(
            outbox
                .poll_take(&mut taken, &mut Context::from_waker(waker))
                .is_pending()
        );
        assert_eq!(outbox.unsent(), 0);
    }

    /// A batch's room (all of it for a batch larger than the room) comes
    /// back one unit per message handed to the client, never the whole
    /// batch's with its first run: a publish waiting for room finds the
    /// outbox holding at most ROOM plus one batch's excess.
    #[test]
    fn a_batchs_room_comes_back_as_its_messages_are_handed_over() {
        let outbox = Outbox::default();
        for n in [1, 10, ROOM, ROOM + 1, 3 * ROOM] {
            // As send_core_batched takes it (`outbox_room`).
            let room = n.clamp(1, ROOM) as u32;
            outbox.room.try_acquire_many(room).unwrap().forget();
            Outbox::queue_batch(&mut outbox.state.lock(), batch(n), room);
            hand_over_by(&outbox, 7);
            assert_eq!(
                outbox.room.available_permits(),
                ROOM,
                "a batch of {n}: all its room back"
            );
        }
    }
}
