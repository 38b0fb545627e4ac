"""The publish buffer at close(): what was never written, and what was
written without an answer, are counted in close()'s result."""

import signal

import tinybroker
from broker import free_port
from conftest import run, until
from test_scenarios import stopped


def test_close_counts_what_was_never_written(start_broker):
    broker = start_broker(port=free_port())

    async def body():
        client = await tinybroker.connect(broker.addr)
        await client.publish("cl.a", b"first")
        assert (await client.flush(timeout=5)).accepted == 1
        broker.kill()
        await until(lambda: client.session_state != "OPEN", 10, "the session to be lost")
        for i in range(5):
            await client.publish("cl.a", str(i))
        result = await client.close(timeout=0.3)
        assert (result.not_sent, result.accepted, result.unconfirmed) == (5, 0, 0)
        assert client.session_state == "CLOSED"

    run(body())


def test_close_counts_what_was_written_without_an_answer(start_broker):
    broker = start_broker()

    async def body():
        client = await tinybroker.connect(broker.addr)
        await client.publish("cl.a", b"first")
        assert (await client.flush(timeout=5)).accepted == 1
        broker.proc.send_signal(signal.SIGSTOP)
        await until(lambda: stopped(broker.proc.pid), 5, "the broker to stop")
        try:
            for i in range(5):
                await client.publish("cl.a", str(i))
            await until(lambda: client.stats().msgs_out == 6, 5, "the batch to be written")
            result = await client.close(timeout=0.3)
        finally:
            broker.kill()
        assert (result.not_sent, result.unconfirmed, result.unconfirmed_ranges) == (0, 5, [(1, 5)])

    run(body())
