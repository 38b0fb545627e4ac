"""Cluster mode: two replicas over one nats-server (JetStream); the client
has both addresses, its replica is stopped, and it is back on the other."""

import tinybroker
from broker import Broker, NatsServer, free_port
from conftest import run, until


def test_client_moves_to_the_other_replica_when_its_own_is_stopped(tmp_path):
    nats = NatsServer(tmp_path)
    replicas = []
    try:
        for rid in ("a", "b"):
            env = {
                "TINYBROKER_NATS_URL": nats.url,
                "TINYBROKER_NATS_REPLICAS": "1",
                "TINYBROKER_REPLICA_ID": rid,
            }
            replicas.append(Broker(env, port=free_port(), wait_serving=True))
        a, b = replicas

        async def body():
            events = []
            async with tinybroker.connect([a.addr, b.addr]) as client:
                assert client.address == f"http://{a.addr}"
                broadcast = await client.subscribe("c.>", on_event=events.append)
                member = await client.subscribe("c.>", group="cg", ack_mode="manual")
                assert (await client.admin.info()).replica_id == "a"
                # A message published on b reaches the subscriptions on a.
                async with tinybroker.connect(b.addr) as other:
                    await other.publish_confirmed("c.1", b"via-b")
                    assert (await broadcast.next(timeout=10)).payload == b"via-b"
                    m = await member.next(timeout=10)
                    assert await m.ack()

                    a.kill()
                    await until(
                        lambda: broadcast.stats.resubscribes >= 1 and broadcast.is_open and member.is_open,
                        30, "both subscriptions back on replica b",
                    )
                    assert client.address == f"http://{b.addr}"
                    assert (await client.admin.info()).replica_id == "b"
                    # Published on b, received on b: the client needed no code.
                    await other.publish_confirmed("c.2", b"after")
                    assert (await broadcast.next(timeout=10)).payload == b"after"
                    m = await member.next(timeout=10)
                    assert m.payload == b"after" and await m.ack()
                    # A lost session is no end; the gap is unknown (another replica).
                    assert not [e for e in events if isinstance(e, tinybroker.Ended)]
                    assert broadcast.last_gap is not None and broadcast.last_gap.missed is None
                    assert broadcast.last_gap.reason in ("instance_changed", "sequence_scope")

        run(body(), timeout=90)
    finally:
        for r in replicas:
            r.kill()
        nats.kill()


def test_a_replica_that_cannot_serve_is_passed_over_for_the_next_address(tmp_path):
    nats = NatsServer(tmp_path)
    brokers = []
    try:
        # A replica whose NATS does not answer: it listens, NOT_SERVING, and
        # refuses opens with UNAVAILABLE.
        dead_nats = f"nats://127.0.0.1:{free_port()}"
        cut_off = Broker({"TINYBROKER_NATS_URL": dead_nats, "TINYBROKER_NATS_REPLICAS": "1",
                          "TINYBROKER_REPLICA_ID": "cut-off"})
        brokers.append(cut_off)
        good = Broker({"TINYBROKER_NATS_URL": nats.url, "TINYBROKER_NATS_REPLICAS": "1",
                       "TINYBROKER_REPLICA_ID": "good"}, port=free_port(), wait_serving=True)
        brokers.append(good)

        async def body():
            async with tinybroker.connect([cut_off.addr, good.addr]) as client:
                assert client.address == f"http://{cut_off.addr}"
                sub = await client.subscribe("d.>", timeout=20)
                assert client.address == f"http://{good.addr}"
                await client.publish_confirmed("d.1", b"served")
                assert (await sub.next(timeout=10)).payload == b"served"

        run(body(), timeout=40)
    finally:
        for b in brokers:
            b.kill()
        nats.kill()
