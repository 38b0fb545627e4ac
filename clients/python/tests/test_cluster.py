"""Cluster mode: two replicas over one nats-server (JetStream); the client
has both addresses, its replica is stopped, and it is back on the other."""

import grpc

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
                    await other.publish("c.1", b"via-b")
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
                    await other.publish("c.2", b"after")
                    assert (await broadcast.next(timeout=10)).payload == b"after"
                    m = await member.next(timeout=10)
                    assert m.payload == b"after" and await m.ack()
                    ended = [e for e in events if isinstance(e, tinybroker.Ended)]
                    assert ended and ended[0].reason == "connection_lost"
                    assert ended[0].code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                             grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)

        run(body(), timeout=90)
    finally:
        for r in replicas:
            r.kill()
        nats.kill()
