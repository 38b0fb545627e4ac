"""Publish and subscribe through one client: the round trip, the publisher
stream and typed errors."""

import asyncio

import grpc
import pytest

import tinybroker
from conftest import run


def test_round_trip_delivers_payload_headers_and_sequence(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe(["greet.*", "other.>"])
            assert sub.subscription_id
            result = await client.publish_confirmed("greet.world", b"hello", headers={"k": "v"})
            assert result.sequence > 0 and result.matched_subscriptions == 1
            msg = await sub.next(timeout=5)
            assert (msg.topic, msg.payload, msg.headers["k"]) == ("greet.world", b"hello", "v")
            assert msg.sequence == result.sequence
            assert msg.subscription_id == sub.subscription_id
            assert msg.publish_time.year >= 2024
            # A str payload goes as UTF-8; iteration is the subscription itself.
            await client.publish_confirmed("other.a.b", "text")
            async for msg in sub:
                assert msg.payload == b"text"
                break

    run(body())


def test_publisher_streams_with_counts_and_first_error_typed(broker):
    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("load.>")
            async with client.publisher() as pub:
                for i in range(500):
                    await pub.publish(f"load.{i % 5}", str(i))
                result = await pub.end_stream()
                assert result.accepted == 500
                assert result.last_sequence - result.first_sequence == 499
                got = [int((await sub.next(timeout=5)).payload) for _ in range(500)]
                assert got == list(range(500))
                # A bad topic ends the stream; the error is typed.
                with pytest.raises(tinybroker.PublishError) as caught:
                    await pub.publish("ok.topic", b"1")
                    await pub.publish("bad topic", b"2")
                    await pub.end_stream()
                assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "bad topic" in caught.value.message
            with pytest.raises(tinybroker.PublishError) as caught:
                await client.publish_confirmed("bad..topic", b"")
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(tinybroker.TinybrokerError) as caught:
                await client.subscribe("bad pattern")
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            # A bad argument is the client's usage error, before any call.
            with pytest.raises(tinybroker.UsageError):
                await client.subscribe("a.>", ack_mode="sometimes")
            with pytest.raises(tinybroker.UsageError):
                await client.subscribe("a.>", window=-1)

    run(body())


def test_address_list_is_tried_in_turn_and_env_defaults_apply(broker, monkeypatch):
    async def body():
        dead = "127.0.0.1:1"
        async with tinybroker.connect([dead, f"http://{broker.addr}"], connect_timeout=3) as client:
            assert client.address == f"http://{broker.addr}"
            await client.publish_confirmed("x.y", b"")
        monkeypatch.setenv("TINYBROKER_ADDR", broker.addr)
        async with tinybroker.connect() as client:
            assert client.address == f"http://{broker.addr}"
        with pytest.raises(tinybroker.TinybrokerError) as caught:
            await tinybroker.connect(dead, connect_timeout=2)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE

    run(body())
