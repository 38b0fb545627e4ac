"""docs/clients.md "The scenario list": one test per row, under its name,
against the real broker binary (and nats-server for the cluster one)."""

import asyncio
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import urllib.request
import warnings

import grpc
import pytest

import tinybroker
import tinybroker.sync
from tinybroker import session as tb_session
from tinybroker._pb import broker_pb2_grpc
from broker import Broker, NatsServer, free_port
from conftest import run, until


def metrics(port):
    """The broker's /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def stopped(pid):
    """Whether every thread of the process is stopped (SIGSTOP), as /proc
    says. Not the main thread's state alone: a thread stops when the group
    stop reaches it, and on a loaded machine a worker can run on long enough
    to answer a request written after the signal."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(s == "T" for s in states)


def with_metrics(env=None):
    port = free_port()
    return dict(env or {}, TINYBROKER_METRICS_ADDR=f"127.0.0.1:{port}"), port


def test_publish_returns_at_once_and_flush_reports(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("pub.>")
            for i in range(500):
                # The coroutine finishes at its first step: it never waited
                # for the broker (nor for anything else).
                coro = client.publish("pub.a", str(i))
                with pytest.raises(StopIteration):
                    coro.send(None)
            assert client.stats().pending_messages == 500  # nothing written yet
            result = await client.flush(timeout=10)
            assert (result.accepted, result.rejected, result.unconfirmed) == (500, [], 0)
            assert client.stats().pending_messages == 0
            got = [int((await sub.next(timeout=5)).payload) for _ in range(500)]
            assert got == list(range(500))
            # Each outcome is reported by one flush only.
            assert (await client.flush(timeout=5)).accepted == 0

    run(body())


def test_flush_reports_each_rejection(start_broker):
    broker = start_broker({"TINYBROKER_MAX_MESSAGE_BYTES": "1024"})

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            await client.publish("ok.1", b"a")
            await client.publish("bad topic", b"b")
            await client.publish("ok.2", b"c")
            await client.publish("ok.big", b"x" * 2000)
            await client.publish("ok.3", b"d")
            result = await client.flush(timeout=10)
            assert result.accepted == 3 and result.unconfirmed == 0
            assert [(r.index, r.topic, r.code) for r in result.rejected] == [
                (1, "bad topic", grpc.StatusCode.INVALID_ARGUMENT),
                (3, "ok.big", grpc.StatusCode.RESOURCE_EXHAUSTED),
            ]
            assert "bad topic" in result.rejected[0].message
            assert "max_message_bytes" in result.rejected[1].message or "1024" in result.rejected[1].message

    run(body())


def test_publish_waits_when_the_buffer_is_full(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr, buffer_bytes=4096) as client:
            sub = await client.subscribe("full.>")
            broker.kill()
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")

            async def publish_all():
                for i in range(20):
                    await client.publish("full.a", str(i).encode() + b"." * 1000)

            task = asyncio.ensure_future(publish_all())
            await until(lambda: client.stats().pending_bytes >= 4096, 10, "the buffer to fill")
            done, _ = await asyncio.wait([task], timeout=0.5)
            assert not done, "publish() should wait while the buffer is full"
            assert client.stats().pending_bytes < 4096 + 1100  # never grown without bound
            broker.start()
            await asyncio.wait_for(task, 15)
            result = await client.flush(timeout=15)
            assert result.accepted == 20 and result.unconfirmed == 0 and not result.rejected
            got = [int((await sub.next(timeout=5)).payload.rstrip(b".")) for _ in range(20)]
            assert got == list(range(20))

    run(body())


def test_publishers_share_one_clients_batches(start_broker):
    env, port = with_metrics()
    broker = start_broker(env)

    async def body():
        async with tinybroker.connect(broker.addr) as client:

            async def publisher(k):
                for i in range(100):
                    await client.publish(f"share.{k}", str(i))
                    await asyncio.sleep(0)  # a task that yields after each message

            await asyncio.gather(*(publisher(k) for k in range(10)))
            assert (await client.flush(timeout=10)).accepted == 1000
        m = metrics(port)
        batches = m["tinybroker_publish_batch_size_count"]
        assert m["tinybroker_publish_batch_size_sum"] == 1000
        assert 1000 / batches >= 5, f"{batches} batches for 1000 messages"

    run(body())


def test_buffered_publishes_go_out_after_a_restart(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("restart.>")
            broker.kill()
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
            for i in range(100):
                await client.publish("restart.a", str(i))
            assert client.stats().pending_messages == 100
            broker.start()
            result = await client.flush(timeout=15)
            assert result.accepted == 100 and result.unconfirmed == 0 and not result.rejected
            # The subscription is opened before the buffer is written: all of
            # them, once each, in order.
            got = [int((await sub.next(timeout=5)).payload) for _ in range(100)]
            assert got == list(range(100))
            with pytest.raises(tinybroker.Timeout):
                await sub.next(timeout=0.3)
            assert (await client.admin.info()).messages_published == 100

    run(body())


def test_unanswered_batches_are_unconfirmed(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            await client.publish("un.a", b"first")
            assert (await client.flush(timeout=5)).accepted == 1
            broker.proc.send_signal(signal.SIGSTOP)  # it answers nothing now
            await until(lambda: stopped(broker.proc.pid), 5, "the broker to stop")
            try:
                for i in range(10):
                    await client.publish("un.a", str(i))
                await until(lambda: client.stats().msgs_out == 11, 10, "the batch to be written")
                with pytest.raises(tinybroker.Timeout):
                    await client.flush(timeout=0.3)
            finally:
                broker.kill()  # the connection is cut before any answer
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
            broker.start()
            await client.publish("un.a", b"after")
            result = await client.flush(timeout=15)
            assert result.unconfirmed == 10 and result.unconfirmed_ranges == [(1, 10)]
            assert result.accepted == 1 and not result.rejected
            # Never written again: the restarted broker got only "after".
            assert (await client.admin.info()).messages_published == 1
            assert client.stats().msgs_out == 12

    run(body())


def test_deliveries_come_in_batches(start_broker, monkeypatch):
    env, port = with_metrics()
    broker = start_broker(env)
    sent_metadata = []
    original = tb_session.Session._serve

    async def spy(self):
        real = self._conn.session

        def session_call(requests, metadata=None, **kw):
            sent_metadata.append(dict(metadata or ()))
            return real(requests, metadata=metadata, **kw)

        self._conn.session = session_call
        try:
            return await original(self)
        finally:
            self._conn.session = real

    monkeypatch.setattr(tb_session.Session, "_serve", spy)

    async def body():
        async with tinybroker.connect(broker.addr) as receiver, tinybroker.connect(broker.addr) as sender:
            sub = await receiver.subscribe("burst.>")
            for i in range(200):
                await sender.publish("burst.a", str(i))
            assert (await sender.flush(timeout=10)).accepted == 200
            await until(lambda: sub.pending == 200, 10, "the whole burst")
            got = [int((await sub.next(timeout=5)).payload) for _ in range(200)]
            assert got == list(range(200))
        assert sent_metadata and all(m.get("tinybroker-batch") == "1" for m in sent_metadata)
        m = metrics(port)
        events = m["tinybroker_delivery_batch_size_count"]
        assert m["tinybroker_delivery_batch_size_sum"] >= 200 and events < 200

    run(body())


def test_acks_are_coalesced(start_broker, monkeypatch):
    env, port = with_metrics()
    broker = start_broker(env)
    acks = []
    put = tb_session._Requests.put

    def counting_put(self, request):
        if type(request) is not bytes and request.WhichOneof("request") == "ack":
            acks.append(list(request.ack.sequences))
        put(self, request)

    monkeypatch.setattr(tb_session._Requests, "put", counting_put)

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            member = await client.subscribe("job.>", group="workers", ack_mode="manual", ack_deadline=60,
                                          max_in_flight=200)
            for i in range(100):
                await client.publish("job.a", str(i))
            await client.flush(timeout=10)
            taken = [await member.next(timeout=5) for _ in range(100)]
            for msg in taken:
                assert await msg.ack()
            assert acks == []  # nothing sent by ack() itself

            async def in_flight():
                return {g.name: g for g in await client.admin.groups()}["workers"].in_flight

            for _ in range(500):
                if await in_flight() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await in_flight() == 0
            assert acks == [[m.sequence for m in taken]]  # one SessionAck
            acked = sum(v for k, v in metrics(port).items() if k.startswith("tinybroker_consumer_group_acked_total"))
            assert acked == 100

    run(body())


def test_window_holds_through_evictions(start_broker):
    broker = start_broker({"TINYBROKER_CONSUMER_CAPACITY": "32"})
    window = 16

    async def body():
        async with tinybroker.connect(broker.addr, window=window) as client:
            sub = await client.subscribe("win.>")
            most = 0
            for round_ in range(3):
                # Nobody reads: the broker's queue fills and it evicts.
                i = 0
                while sub.stats.evictions <= round_:
                    await client.publish_confirmed("win.a", str(i))
                    most = max(most, sub.pending)
                    i += 1
                    assert i < 5000, "no eviction"
                await until(lambda: sub.state == "WAITING", 10, "the backoff to end")
                most = max(most, sub.pending)
                assert sub.pending == window and not sub.is_open  # no room: not opened
                await sub.next(timeout=5)  # one taken: room for one
                await until(lambda: sub.is_open, 10, "opened with the room it has")
            assert most <= window, f"held {most} > window {window}"
            assert sub.stats.evictions == 3

    run(body())


def test_gap_is_a_range_on_one_instance(start_broker):
    broker = start_broker({"TINYBROKER_CONSUMER_CAPACITY": "32"})

    async def body():
        events = []
        async with tinybroker.connect(broker.addr, window=8) as client:
            sub = await client.subscribe("gap.>", on_event=events.append)
            while not sub.stats.evictions:
                await client.publish_confirmed("gap.a", b"x")
            ended = next(e for e in events if isinstance(e, tinybroker.Ended))
            held = [await sub.next(timeout=5) for _ in range(8)]
            await until(lambda: sub.is_open, 10, "open again")
            after = await client.publish_confirmed("gap.a", b"after")
            assert (await sub.next(timeout=5)).sequence == after.sequence
            gap = sub.last_gap
            assert gap.missed == (held[-1].sequence + 1, after.sequence - 1)
            assert gap.reason is None and gap.cause == "evicted"
            assert gap.dropped == ended.dropped > 0
            assert sum(isinstance(e, tinybroker.Gap) for e in events) == 1

    run(body())


def test_gap_is_unknown_across_a_restart(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("rs.>")
            before = await client.publish_confirmed("rs.a", b"1")
            assert (await sub.next(timeout=5)).sequence == before.sequence
            first_instance = client.instance
            broker.kill()
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
            broker.start()
            await until(lambda: sub.is_open, 10, "open again")
            # Sequences started again: 1 to 5 go elsewhere, so the next one
            # looks like a gap after the one before; it is not one.
            for _ in range(5):
                await client.publish_confirmed("elsewhere.a", b"")
            after = await client.publish_confirmed("rs.a", b"3")
            assert (await sub.next(timeout=5)).sequence == after.sequence
            assert after.sequence > before.sequence + 1
            gap = sub.last_gap
            assert gap.missed is None and gap.reason == "instance_changed"
            assert gap.cause == "connection_lost"
            assert client.instance is None or client.instance != first_instance

    run(body())


def test_back_within_half_a_second_of_a_restart(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("back.>")
            broker.kill()
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
            await asyncio.sleep(3.0)  # down long enough for a slow reconnect backoff to grow past 1 s
            broker.start()  # returns once the broker answers
            await asyncio.sleep(0.5)
            # A connection of its own (grpc shares a subchannel between
            # channels with the same arguments).
            async with tinybroker.connect(
                broker.addr, channel_options=[("grpc.primary_user_agent", "scenario-publisher")]
            ) as other:
                await other.publish_confirmed("back.a", b"in time")
            assert (await sub.next(timeout=5)).payload == b"in time"

    run(body())


def test_connection_events_once_per_connection(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            events = []
            client.on_connection_event(events.append)
            subs = [await client.subscribe(f"ce.{i}") for i in range(50)]
            assert [type(e) for e in events] == [tinybroker.Connected]
            broker.kill()
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
            broker.start()
            await until(lambda: all(s.is_open for s in subs), 15, "every subscription back")
            kinds = [type(e) for e in events]
            assert kinds == [tinybroker.Connected, tinybroker.Disconnected, tinybroker.Reconnected]
            assert events[1].reason
            assert events[2].address == f"http://{broker.addr}"
            assert events[2].instance_changed
            iterated = []

            async def watch():
                async for event in client.connection_events():
                    iterated.append(event)

            watcher = asyncio.ensure_future(watch())
            await asyncio.sleep(0)
        await asyncio.wait_for(watcher, 5)
        assert [type(e) for e in events][-1] is tinybroker.Closed
        assert [type(e) for e in iterated] == [tinybroker.Closed]

    run(body())


def test_stats_count_what_went_in_and_out(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("st.>")
            for i in range(10):
                await client.publish("st.a", b"12345")
            await client.flush(timeout=5)
            for _ in range(10):
                await sub.next(timeout=5)
            s = client.stats()
            assert (s.msgs_out, s.bytes_out, s.msgs_in, s.bytes_in) == (10, 50, 10, 50)
            assert (s.reconnects, s.pending_messages, s.pending_bytes) == (0, 0, 0)
            broker.kill()
            await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
            for _ in range(3):
                await client.publish("st.b", b"abc")
            s = client.stats()
            assert s.pending_messages == 3 and s.pending_bytes >= 3 * len("st.b" "abc")
            broker.start()
            assert (await client.flush(timeout=10)).accepted == 3
            for _ in range(3):
                await sub.next(timeout=5)
            s = client.stats()
            assert (s.msgs_out, s.bytes_out, s.msgs_in, s.bytes_in) == (13, 59, 13, 59)
            assert (s.reconnects, s.pending_messages, s.pending_bytes) == (1, 0, 0)

    run(body())


CHILD = textwrap.dedent(
    """
    import asyncio, sys, threading, warnings
    warnings.simplefilter("error")
    import tinybroker, tinybroker.sync

    async def main():
        client = await tinybroker.connect(sys.argv[1])
        sub = await client.subscribe("child.>")
        await client.publish("child.a", b"x")
        await client.close()
        return client, sub

    kept = asyncio.run(main())
    sync_client = tinybroker.sync.connect(sys.argv[1])
    sync_client.subscribe("child.>")
    sync_client.close()
    # No thread at all: not the facade's loop, not grpc's poller (daemon
    # threads included), though both clients are still referenced.
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print("ALIVE", alive, flush=True)
    """
)


def test_closed_means_closed(broker):
    async def body():
        client = await tinybroker.connect(broker.addr)
        sub = await client.subscribe("cl.>")
        publisher = client.publisher()
        await publisher.publish("elsewhere.a", b"open")
        waiting = asyncio.ensure_future(sub.next())
        await asyncio.sleep(0)
        result = await client.close()
        assert result.not_sent == 0
        with pytest.raises(tinybroker.ClientClosed):
            await asyncio.wait_for(waiting, 5)
        calls = [
            lambda: client.publish("cl.a", b"x"),
            lambda: client.flush(),
            lambda: client.publish_confirmed("cl.a", b"x"),
            lambda: client.subscribe("cl.>"),
            lambda: client.admin.info(),
            lambda: sub.next(),
            lambda: publisher.publish("cl.a", b"x"),
            lambda: publisher.close(),
        ]
        for call in calls:
            with pytest.raises(tinybroker.ClientClosed) as caught:
                await call()
            assert caught.value.code == grpc.StatusCode.CANCELLED and "closed" in caught.value.message
        with pytest.raises(tinybroker.ClientClosed):
            client.publisher()
        async for _ in sub:
            raise AssertionError("a closed subscription's iteration ends")

    run(body())

    # The blocking facade: its own error, no loop error, no coroutine warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client = tinybroker.sync.connect(broker.addr)
        sub = client.subscribe("cl.>")
        client.close()
        for call in (
            lambda: client.publish("cl.a", b"x"),
            lambda: client.flush(),
            lambda: client.publish_confirmed("cl.a", b"x"),
            lambda: client.subscribe("cl.>"),
            lambda: client.admin.info(),
            lambda: sub.next(timeout=1),
            lambda: client.publisher(),
        ):
            with pytest.raises(tinybroker.ClientClosed):
                call()
        gc.collect()

    # Nothing of a closed client keeps a process alive, even referenced.
    child = subprocess.run(
        [sys.executable, "-c", CHILD, broker.addr], capture_output=True, text=True, timeout=30,
        env=dict(os.environ, PYTHONWARNINGS="error"),
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "ALIVE []" in child.stdout, child.stdout


def test_one_next_at_a_time(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("one.>")
            first = asyncio.ensure_future(sub.next(timeout=10))
            await asyncio.sleep(0)
            with pytest.raises(tinybroker.UsageError):
                await asyncio.wait_for(sub.next(timeout=10), 1)
            await client.publish("one.a", b"for the first")
            assert (await asyncio.wait_for(first, 5)).payload == b"for the first"
        # The blocking facade refuses a second concurrent next() too.
        with tinybroker.sync.connect(broker.addr) as client:
            sync_sub = client.subscribe("one.>")
            loop = asyncio.get_running_loop()
            waiting = loop.run_in_executor(None, lambda: sync_sub.next(timeout=10))
            await until(lambda: sync_sub._busy.locked(), 5, "the first next() to wait")
            with pytest.raises(tinybroker.UsageError):
                sync_sub.next(timeout=1)
            client.publish("one.b", b"sync")
            assert (await asyncio.wait_for(waiting, 5)).payload == b"sync"

    run(body())


class _EndsAtOnce(broker_pb2_grpc.BrokerServicer):
    """A broker that accepts a session and ends it at once with status OK
    (as a replica shutting down does)."""

    async def Session(self, request_iterator, context):
        await context.send_initial_metadata(())


def test_status_ok_end_is_not_an_error(start_broker):
    a = start_broker(port=free_port())
    b = start_broker(port=free_port())

    async def body():
        async with tinybroker.connect([a.addr, b.addr]) as client:
            events = []
            client.on_connection_event(events.append)
            sub = await client.subscribe("ok.>")
            assert client.address == f"http://{a.addr}"
            a.stop()  # shuts down: ends the session with status OK
            await until(lambda: len(events) == 3 and sub.is_open, 15, "back on b")
            assert client.address == f"http://{b.addr}"
            assert [type(e) for e in events] == [tinybroker.Connected, tinybroker.Disconnected, tinybroker.Reconnected]
            assert events[1].reason == "closed by the broker"
            fresh = await client.subscribe("ok.>")
            await client.publish("ok.1", b"on b")
            assert (await client.flush(timeout=5)).accepted == 1
            for s in (sub, fresh):
                assert (await s.next(timeout=5)).payload == b"on b"

        # A session that ends OK as it starts: the next address, no error.
        server = grpc.aio.server()
        broker_pb2_grpc.add_BrokerServicer_to_server(_EndsAtOnce(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with tinybroker.connect([f"127.0.0.1:{port}", b.addr]) as client:
                sub = await client.subscribe("ok.>", timeout=10)
                assert client.address == f"http://{b.addr}"
                await client.publish("ok.2", b"served")
                assert (await sub.next(timeout=5)).payload == b"served"
        finally:
            await server.stop(None)

    run(body())


def test_publish_error_counts_what_the_broker_accepted(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            pub = client.publisher()
            with pytest.raises(tinybroker.PublishError) as caught:
                for topic in ("pe.1", "pe.2", "pe.3", "bad topic", "pe.4", "pe.5"):
                    await pub.publish(topic, b"x")
                await pub.end_stream()
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.accepted == 3
            assert re.search(r"\b3 earlier messages", caught.value.message)
            assert (await client.admin.info()).messages_published == 3

    run(body())


def test_cluster_subscriptions_survive_a_replica(tmp_path):
    nats = NatsServer(tmp_path)
    replicas = []
    try:
        for rid in ("a", "b"):
            env = {"TINYBROKER_NATS_URL": nats.url, "TINYBROKER_NATS_REPLICAS": "1", "TINYBROKER_REPLICA_ID": rid}
            replicas.append(Broker(env, port=free_port(), wait_serving=True))
        a, b = replicas

        async def body():
            events = []
            async with tinybroker.connect([a.addr, b.addr]) as client, tinybroker.connect(b.addr) as other:
                client.on_connection_event(events.append)
                subs = [await client.subscribe("cs.>") for _ in range(5)]
                await other.publish_confirmed("cs.1", b"before")
                for s in subs:
                    assert (await s.next(timeout=10)).payload == b"before"
                a.stop()  # the replica shuts down: its session ends OK
                await until(lambda: len(events) == 3 and all(s.is_open for s in subs), 30, "every subscription on b")
                assert client.address == f"http://{b.addr}"
                await other.publish_confirmed("cs.2", b"after")
                for s in subs:
                    assert (await s.next(timeout=10)).payload == b"after"
                    assert s.last_gap.missed is None
                    assert s.last_gap.reason in ("instance_changed", "sequence_scope")
                assert [type(e) for e in events] == [
                    tinybroker.Connected, tinybroker.Disconnected, tinybroker.Reconnected,
                ]
                fresh = await client.subscribe("cs.>")
                assert fresh.is_open

        run(body(), timeout=90)
    finally:
        for r in replicas:
            r.kill()
        nats.kill()
