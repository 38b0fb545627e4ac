"""The blocking facade, for scripts, Celery or Django workers and notebooks.

It drives the same asyncio client on an event loop of its own, in a
background thread (one core, two faces)::

    import tinybroker.sync

    with tinybroker.sync.connect("127.0.0.1:50051") as client:
        sub = client.subscribe("jobs.>", group="workers", ack_mode="manual")
        client.publish("jobs.run", b"work")
        for msg in sub:
            print(msg.payload)
            msg.ack()
            break

Every object is safe to use from any thread; each call blocks until the
loop has done it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from . import client as _client
from .admin import BrokerInfo, EvictionInfo, GroupInfo, SubscriptionInfo
from .publisher import Publisher as _AsyncPublisher
from .session import EventCallback, Subscription as _AsyncSubscription
from .types import AckMode, Message as _AsyncMessage, PublishResult, PublishStreamResult

__all__ = ["connect", "Client", "Subscription", "Publisher", "Message", "Admin"]

T = TypeVar("T")


class _Loop:
    """An event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tinybroker-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Awaitable[T], timeout: Optional[float] = None) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("tinybroker.sync called from its own loop (use the asyncio client there)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class Message(_AsyncMessage):
    """A delivered message (the attributes of :class:`tinybroker.Message`),
    with blocking :meth:`ack` and :meth:`nack`."""

    __slots__ = ()

    def ack(self) -> bool:  # type: ignore[override]
        """Acknowledges this MANUAL-group message in-band (no reply)."""
        return self._sub._sync_loop.run(_AsyncMessage.ack(self))  # type: ignore[attr-defined]

    def nack(self) -> bool:  # type: ignore[override]
        """Hands this MANUAL-group message back for redelivery."""
        return self._sub._sync_loop.run(_AsyncMessage.nack(self))  # type: ignore[attr-defined]


class Subscription:
    """A subscription: ``for msg in sub:`` blocks for each message. Its
    ``stats``, ``events``, ``last_gap`` and ``subscription_id`` are those of
    the asyncio :class:`tinybroker.Subscription`."""

    def __init__(self, loop: _Loop, sub: _AsyncSubscription) -> None:
        self._loop = loop
        self._sub = sub
        sub._sync_loop = loop  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        # stats, events, last_gap, subscription_id, is_open, done, pending, ...
        return getattr(self._sub, name)

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        try:
            return self._loop.run(self._sub.__anext__())  # type: ignore[return-value]
        except StopAsyncIteration:
            raise StopIteration from None

    def next(self, timeout: Optional[float] = None) -> Message:
        """The next message; ``TimeoutError`` after ``timeout`` seconds,
        ``StopIteration`` after :meth:`close`."""
        try:
            return self._loop.run(self._sub.next(timeout))  # type: ignore[return-value]
        except StopAsyncIteration:
            raise StopIteration from None
        except asyncio.TimeoutError:
            raise TimeoutError(f"no message within {timeout} s") from None

    def close(self) -> None:
        """Closes the subscription (see :meth:`tinybroker.Subscription.close`)."""
        self._loop.run(self._sub.close())

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Publisher:
    """The blocking face of :class:`tinybroker.Publisher`."""

    def __init__(self, loop: _Loop, pub: _AsyncPublisher) -> None:
        self._loop = loop
        self._pub = pub

    def publish(self, topic: str, payload: Union[bytes, str] = b"", headers: Optional[Mapping[str, str]] = None) -> None:
        """Writes one message on the stream (blocks while it is full)."""
        self._loop.run(self._pub.publish(topic, payload, headers))

    def flush(self) -> PublishStreamResult:
        return self._loop.run(self._pub.flush())

    def close(self) -> PublishStreamResult:
        return self._loop.run(self._pub.close())

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._loop.run(self._pub.__aexit__(exc_type, *exc))


class Admin:
    """The blocking face of :class:`tinybroker.admin.Admin`."""

    def __init__(self, loop: _Loop, admin: Any) -> None:
        self._loop = loop
        self._admin = admin

    def subscriptions(self) -> List[SubscriptionInfo]:
        return self._loop.run(self._admin.subscriptions())

    def groups(self) -> List[GroupInfo]:
        return self._loop.run(self._admin.groups())

    def evictions(self) -> List[EvictionInfo]:
        return self._loop.run(self._admin.evictions())

    def info(self) -> BrokerInfo:
        return self._loop.run(self._admin.info())

    def close_subscription(self, subscription_id: str) -> None:
        self._loop.run(self._admin.close_subscription(subscription_id))

    close = close_subscription


class _SyncAsyncClient(_client.Client):
    def _message_class(self) -> type:
        return Message


class Client:
    """The blocking client. Make one with :func:`connect`; it is safe to
    share between threads. Close it with :meth:`close` or ``with``."""

    def __init__(self, loop: _Loop, client: _client.Client) -> None:
        self._loop = loop
        self._client = client
        self.admin = Admin(loop, client.admin)

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def reconnects(self) -> int:
        return self._client.reconnects

    def publish(
        self, topic: str, payload: Union[bytes, str] = b"", headers: Optional[Mapping[str, str]] = None,
        *, timeout: Optional[float] = 10.0,
    ) -> PublishResult:
        """See :meth:`tinybroker.Client.publish`."""
        return self._loop.run(self._client.publish(topic, payload, headers, timeout=timeout))

    def publisher(self) -> Publisher:
        """See :meth:`tinybroker.Client.publisher`."""
        return Publisher(self._loop, self._client.publisher())

    def subscribe(
        self,
        patterns: Union[str, Sequence[str]],
        *,
        subscription_id: Optional[str] = None,
        group: Optional[str] = None,
        ack_mode: Union[AckMode, str, None] = None,
        max_in_flight: int = 0,
        ack_deadline: Optional[float] = None,
        window: Optional[int] = None,
        resubscribe: Optional[bool] = None,
        on_event: Optional[EventCallback] = None,
        timeout: float = 10.0,
    ) -> Subscription:
        """See :meth:`tinybroker.Client.subscribe`; ``on_event`` is called
        on the client's background thread."""
        sub = self._loop.run(
            self._client.subscribe(
                patterns, subscription_id=subscription_id, group=group, ack_mode=ack_mode,
                max_in_flight=max_in_flight, ack_deadline=ack_deadline, window=window,
                resubscribe=resubscribe, on_event=on_event, timeout=timeout,
            )
        )
        return Subscription(self._loop, sub)

    def close(self) -> None:
        """Closes every subscription and the connection, and ends the thread."""
        if self._loop.loop.is_closed():
            return
        try:
            self._loop.run(self._client.close(), timeout=10)
        finally:
            self._loop.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    addr: Union[str, Sequence[str], None] = None,
    *,
    token: Optional[str] = None,
    ca_file: Optional[str] = None,
    window: int = _client.DEFAULT_WINDOW,
    resubscribe: bool = True,
    tracing: bool = True,
    connect_timeout: float = 5.0,
    channel_options: Optional[Sequence[Tuple[str, Any]]] = None,
) -> Client:
    """Connects (blocking); the arguments are those of
    :func:`tinybroker.connect`."""
    loop = _Loop()

    async def make() -> _client.Client:
        client = _SyncAsyncClient(
            addr, token=token, ca_file=ca_file, window=window, resubscribe=resubscribe, tracing=tracing,
            channel_options=channel_options,
        )
        try:
            return await client.connect(connect_timeout)
        except BaseException:
            await client.close()
            raise

    try:
        client = loop.run(make())
    except BaseException:
        loop.stop()
        raise
    return Client(loop, client)
