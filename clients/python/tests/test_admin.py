"""The Admin calls; a subscription an admin closes ends for good."""

import asyncio

import grpc
import pytest

import tinybroker
from conftest import run


def test_admin_lists_subscriptions_groups_info_and_closes_one(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe(["a.*", "b.>"], subscription_id="watched")
            member = await client.subscribe("jobs.>", group="workers", ack_mode="manual", max_in_flight=5)
            await client.publish_confirmed("a.x", b"1")
            await sub.next(timeout=5)

            subs = {s.subscription_id: s for s in await client.admin.subscriptions()}
            assert subs["watched"].topic_patterns == ["a.*", "b.>"] and subs["watched"].mode == "multi"
            assert subs["watched"].delivered == 1 and subs["watched"].opened_at is not None
            assert subs[member.subscription_id].consumer_group == "workers"
            assert subs[member.subscription_id].ack_mode == "manual"
            # A member that takes a message and does not ack it: named by it.
            await client.publish_confirmed("jobs.1", b"job")
            await member.next(timeout=5)
            for _ in range(100):
                held = {s.subscription_id: s for s in await client.admin.subscriptions()}[member.subscription_id]
                if held.unacked == 1:
                    break
                await asyncio.sleep(0.05)
            assert held.unacked == 1 and held.oldest_unacked_age is not None
            assert subs["watched"].unacked == 0 and subs["watched"].oldest_unacked_age is None
            groups = {g.name: g for g in await client.admin.groups()}
            assert groups["workers"].members == 1 and groups["workers"].topic_patterns == ["jobs.>"]
            info = await client.admin.info()
            assert info.version and info.subscriptions == 2 and info.last_sequence >= 1
            assert info.limits.consumer_capacity > 0 and not info.auth_enabled
            assert await client.admin.evictions() == []

            events = []
            sub._on_event = events.append
            await client.admin.close_subscription("watched")
            with pytest.raises(tinybroker.SubscriptionEnded) as caught:
                await sub.next(timeout=5)
            assert caught.value.reason == "closed_by_admin" and caught.value.last_sequence > 0
            assert isinstance(events[0], tinybroker.Ended) and not events[0].resubscribing
            with pytest.raises(tinybroker.TinybrokerError) as caught:
                await client.admin.close_subscription("watched")
            assert caught.value.code == grpc.StatusCode.NOT_FOUND

    run(body())
