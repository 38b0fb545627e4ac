"""A MANUAL consumer group: ack, nack and redelivery, all in-band."""

import asyncio

import tinybroker
from conftest import run, until


def test_manual_group_ack_nack_and_redelivery(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            a = await client.subscribe("jobs.>", group="workers", ack_mode="manual", ack_deadline=30)
            for i in range(3):
                await client.publish_confirmed("jobs.run", f"job-{i}")
            first = [await a.next(timeout=5) for _ in range(3)]
            assert [m.payload for m in first] == [b"job-0", b"job-1", b"job-2"]
            assert all(m.delivery_attempt == 1 and m.consumer_group == "workers" for m in first)

            # Nack: handed back at once, redelivered with the next attempt.
            assert await first[0].nack()
            again = await a.next(timeout=5)
            assert (again.payload, again.delivery_attempt) == (b"job-0", 2)
            assert again.sequence == first[0].sequence

            # Ack two; the third stays in flight until its member leaves.
            assert await again.ack()
            assert await first[1].ack()

            async def in_flight():
                groups = {g.name: g for g in await client.admin.groups()}
                return groups["workers"].in_flight

            async def wait_in_flight(n):
                for _ in range(500):
                    if await in_flight() == n:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"in_flight never {n}")

            await wait_in_flight(1)

            # A second member on another client; the first leaves with job-2
            # unacked: it is redelivered to the second.
            async with tinybroker.connect(broker.addr) as other:
                b = await other.subscribe("jobs.>", group="workers", ack_mode="manual", ack_deadline=30)
                await a.close()
                moved = await b.next(timeout=5)
                assert (moved.payload, moved.delivery_attempt) == (b"job-2", 2)
                assert await moved.ack()
                await wait_in_flight(0)
                groups = {g.name: g for g in await client.admin.groups()}
                assert groups["workers"].redeliveries >= 2

    run(body())
