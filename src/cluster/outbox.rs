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
//! unreachable. A message queued here goes out: the sender waits for the
//! client as long as it takes (the client keeps its queue across a
//! reconnection); one that arrives too late is dropped and counted by its
//! receiver (`liveness.rs`), one that never arrives is a gap in this
//! replica's count there (`fanout.rs`).

use super::ClusterEngine;
use super::wire;
use crate::engine::{BrokerError, WakeBatch};
use bytes::{Bytes, BytesMut};
use futures::FutureExt;
use parking_lot::Mutex;
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
}

impl Default for Outbox {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::default()),
            room: tokio::sync::Semaphore::new(ROOM),
            emptied: tokio::sync::Notify::new(),
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
    /// The room it holds (a batch takes its room at once, on its first
    /// message).
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
        Poll::Ready(())
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
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            WakeBatch::wake(waker);
        }
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
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            WakeBatch::wake(waker);
        }
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
            let mut room = Some(room);
            for (subject, body) in out {
                state.queue.push(Pending {
                    subject,
                    body,
                    room: room.take().unwrap_or(0),
                });
            }
            if let Some(waker) = state.waker.take() {
                drop(state);
                WakeBatch::wake(waker);
            }
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
                outbox
                    .room
                    .add_permits(taken[i..end].iter().map(|p| p.room as usize).sum());
                i = end;
            }
            taken.clear();
        }
    }
}
