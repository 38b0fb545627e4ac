"""Every subscription back, with no application code, after the broker is
killed and restarted on the same port, and after it shuts down."""

import asyncio

import tinybroker
from broker import free_port
from conftest import run, until


async def _receives(client, subs, topic, timeout=10):
    """Publishes to ``topic`` until every subscription got that message."""
    result = await client.publish_confirmed(topic, b"ping")
    for sub in subs:
        while True:
            msg = await sub.next(timeout=timeout)
            if msg.sequence == result.sequence:
                break


def test_every_subscription_is_back_after_the_broker_is_killed_and_restarted(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        events = []
        async with tinybroker.connect(broker.addr) as client:
            subs = [await client.subscribe(f"room.{i}.>", on_event=events.append) for i in range(20)]
            named = await client.subscribe("room.>", subscription_id="my-named-sub")
            member = await client.subscribe("room.>", group="g", ack_mode="manual")
            everyone = subs + [named, member]
            await client.publish_confirmed("room.1.x", b"before")
            assert (await subs[1].next(timeout=5)).payload == b"before"

            broker.kill()
            await until(lambda: all(not s.is_open for s in everyone), 10, "every subscription to notice")
            # A lost session is not an end of a subscription: no event of its own.
            assert not [e for e in events if isinstance(e, tinybroker.Ended)]

            broker.start()  # the same port
            await until(lambda: all(s.is_open for s in everyone), 15, "every subscription back")
            assert client.reconnects == 1
            assert all(s.stats.resubscribes == 1 for s in everyone)
            assert named.subscription_id == "my-named-sub"
            for i in (0, 1, 7, 19):
                await _receives(client, [subs[i], named, member], f"room.{i}.y")
            # The broker restarted: what was missed is unknown.
            gap = subs[1].last_gap
            assert gap is not None and gap.cause == "connection_lost"
            assert gap.missed is None and gap.reason == "instance_changed"
            assert subs[0].last_gap is not None and subs[0].last_gap.reason == "nothing_before"
            ids = {s.subscription_id for s in await client.admin.subscriptions()}
            assert {s.subscription_id for s in everyone} <= ids

    run(body())


def test_subscriptions_come_back_after_a_graceful_shutdown_and_restart(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        events = []
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("a.>", on_event=events.append)
            broker.stop()
            await until(lambda: any(isinstance(e, tinybroker.Ended) for e in events), 10, "the end")
            ended = next(e for e in events if isinstance(e, tinybroker.Ended))
            assert ended.reason == "shutdown" and ended.resubscribing
            broker.start()
            await until(lambda: sub.is_open, 15, "back")
            await _receives(client, [sub], "a.b")

    run(body())


def test_resubscription_can_be_turned_off(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr, resubscribe=False) as client:
            sub = await client.subscribe("a.>")
            broker.stop()
            try:
                await sub.next(timeout=10)
                raise AssertionError("should have ended")
            except tinybroker.SubscriptionEnded as end:
                assert end.reason == "shutdown"
                assert sub.done

    run(body())
