"""Credit per subscription: one left unread stalls (and is evicted) alone;
an eviction is reported with its gap, then the subscription is back."""

import asyncio

import tinybroker
from conftest import run, until

CAPACITY = 32


def test_unread_subscription_is_evicted_alone_and_its_sibling_keeps_receiving(start_broker):
    broker = start_broker({"TINYBROKER_CONSUMER_CAPACITY": str(CAPACITY)})

    async def body():
        window = 16
        async with tinybroker.connect(broker.addr, window=window) as client:
            unread = await client.subscribe("load.>", resubscribe=False)
            read = await client.subscribe("load.>")
            total, batch = 400, 8
            received = []
            # Rounds the sibling keeps up with: each waits for it to catch up.
            async with client.publisher() as pub:
                for start in range(0, total, batch):
                    for i in range(start, start + batch):
                        await pub.publish("load.x", str(i))
                    while len(received) < start + batch:
                        received.append(int((await read.next(timeout=5)).payload))
            assert received == list(range(total))
            # The unread one held no more than its window and was evicted.
            await until(lambda: unread.done, 10, "the unread subscription to end")
            assert unread.pending <= window
            assert unread.stats.evictions == 1
            assert read.stats.ends == 0 and read.is_open
            evicted = {e.subscription_id for e in await client.admin.evictions()}
            assert unread.subscription_id in evicted and read.subscription_id not in evicted
            # Its end is an exception with the reason, after what it held.
            got = 0
            try:
                async for _ in unread:
                    got += 1
                raise AssertionError("iteration should raise")
            except tinybroker.SubscriptionEnded as end:
                assert end.reason == "evicted"
                assert end.dropped > 0 and end.last_sequence > 0
            assert got == window

    run(body())


def test_eviction_is_reported_with_its_gap_then_resubscribed(start_broker):
    broker = start_broker({"TINYBROKER_CONSUMER_CAPACITY": str(CAPACITY)})

    async def body():
        events = []
        async with tinybroker.connect(broker.addr, window=8) as client:
            sub = await client.subscribe("feed.>", subscription_id="feed-reader", on_event=events.append)
            # Nobody reads while messages arrive: evicted (publishing stops
            # there, so the re-opened subscription gets none of them).
            for i in range(1000):
                await client.publish_confirmed("feed.a", str(i))
                if sub.stats.evictions:
                    break
            # It holds a full window: it is not opened again until the
            # application takes one (a credit of 0 would mean no limit).
            await until(lambda: sub.state == "WAITING", 10, "the backoff to end")
            assert sub.pending == 8 and not sub.is_open
            ended = next(e for e in events if isinstance(e, tinybroker.Ended))
            assert ended.reason == "evicted" and ended.resubscribing
            assert ended.dropped > 0 and ended.last_sequence > 0
            # What it had taken in before the eviction, then the next message
            # after the gap.
            before = [await sub.next(timeout=5) for _ in range(8)]
            await until(lambda: sub.stats.resubscribes >= 1 and sub.is_open, 10, "re-subscribed")
            assert sub.subscription_id == "feed-reader"  # the id it named is kept
            assert any(isinstance(e, tinybroker.Resubscribed) for e in events)
            result = await client.publish_confirmed("feed.a", b"after")
            msg = await sub.next(timeout=5)
            assert msg.payload == b"after"
            gap = sub.last_gap
            assert gap is not None and sub.stats.gaps == 1
            assert gap.last_before == ended.last_sequence == before[-1].sequence
            assert gap.first_after == result.sequence > gap.last_before + 1
            assert gap.missed == (gap.last_before + 1, gap.first_after - 1)
            assert gap.cause == "evicted" and gap.dropped == ended.dropped
            assert isinstance(events[-1], tinybroker.Gap)

    run(body())
