//! A subscription of this replica as the front sees it: the local
//! fan-out's stream, and its claim on the subscription id.

use super::registry::Release;
use super::{groups, interest};
use crate::broker::SubscriptionStream;
use crate::engine::{Delivery, DeliveryStream, StreamEnd};
use futures::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A subscription of this replica: the local stream, and its claim on the id.
pub struct ClusterStream {
    pub(super) inner: SubscriptionStream,
    pub(super) release: Option<Release>,
    /// For group members: the group's hub on this replica.
    pub(super) member: Option<groups::MemberLink>,
    /// For broadcast subscriptions: this replica says "some" while it is held.
    pub(super) _interested: Option<interest::Interested>,
}

impl Stream for ClusterStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let (Poll::Ready(Some(delivery)), Some(member)) = (&polled, &self.member) {
            member.streamed(delivery);
        }
        polled
    }
}

impl DeliveryStream for ClusterStream {
    fn id(&self) -> &str {
        DeliveryStream::id(&self.inner)
    }

    fn consumer_group(&self) -> Option<&str> {
        DeliveryStream::consumer_group(&self.inner)
    }

    fn end(&self) -> Option<StreamEnd> {
        self.inner.end()
    }

    fn poll_ended(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.inner.poll_ended(cx)
    }

    fn poll_next_drained(&mut self, cx: &mut Context<'_>) -> Poll<Option<(Delivery, bool)>> {
        let polled = self.inner.poll_delivery(cx, true);
        if let (Poll::Ready(Some((delivery, _))), Some(member)) = (&polled, &self.member) {
            member.streamed(delivery);
        }
        polled
    }

    fn close(&mut self) -> StreamEnd {
        // As when dropped: a member's held messages go back to its group
        // first, then the local subscription closes.
        self.member.take();
        DeliveryStream::close(&mut self.inner)
    }

    fn add_credit(&mut self, messages: u64) {
        self.inner.subscription().queue.add_credit(messages);
        if let Some(member) = &self.member {
            member.credit_added();
        }
    }
}

impl Drop for ClusterStream {
    fn drop(&mut self) {
        // A member's held messages go back to its group first; then the id
        // is released (asynchronously: the local subscription, dropped just
        // after this, is gone from the registry long before).
        self.member.take();
        self.release.take();
    }
}
