import asyncio
import os

# grpc's fork handlers break a subprocess forked while its threads run (on
# Python 3.9, whose subprocess forks rather than vforks).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import sys
import pathlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from broker import Broker  # noqa: E402


@pytest.fixture
def start_broker():
    """start_broker(env=..., port=...) -> Broker; every one is killed after the test."""
    started = []

    def start(env=None, port=0, wait_serving=False):
        broker = Broker(env, port, wait_serving)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.kill()


@pytest.fixture
def broker(start_broker):
    return start_broker()


def run(coro, timeout=45):
    """Runs one test body on a fresh loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(condition, timeout, what, interval=0.01):
    """Awaits until condition() is true (no fixed sleeps); returns its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
