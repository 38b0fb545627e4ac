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

Every object is safe to use from any thread. The hot calls pay no round trip
to the loop's thread each: ``publish()`` appends to the client's shared
buffer through a lock-protected inbox the loop drains in one hop,
``next()`` takes from the subscription's buffer directly (waking only when
it is empty) and counts credit back every ``TOP_UP`` messages, and
``ack()``/``nack()`` join the inbox. The other calls block until the loop
has done them. After :meth:`Client.close` every call raises
:class:`~tinybroker.ClientClosed`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable, Coroutine, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from . import client as _client
from ._pb import broker_pb2 as pb
from .admin import BrokerInfo, EvictionInfo, GroupInfo, SubscriptionInfo
from .constants import BUFFER_BYTES, CLOSE_TIMEOUT, WINDOW
from .errors import ClientClosed, Timeout, UsageError
from .publisher import Publisher as _AsyncPublisher
from .publisher import _as_bytes
from .session import SUB_OPEN, SUB_OPENING, SUB_WAITING, EventCallback, ThreadInbox
from .session import Subscription as _AsyncSubscription
from .types import AckMode, ClientStats, ConnectionEvent, FlushResult, PublishResult, PublishStreamResult
from .types import Message as _AsyncMessage

__all__ = ["connect", "Client", "Subscription", "Publisher", "Message", "Admin"]

T = TypeVar("T")


class _Loop:
    """An event loop running in a daemon thread, and the inbox to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.inbox = ThreadInbox(self.loop)
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="tinybroker-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: Optional[float] = None) -> T:
        """Runs the coroutine ``make()`` returns on the loop and waits for it
        (the coroutine is made only when it will run: no warning of one
        never awaited)."""
        if self.closed:
            raise ClientClosed()
        if threading.current_thread() is self.thread:
            raise UsageError("tinybroker.sync called from its own loop (use the asyncio client there)")
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Timeout(f"no result within {timeout:g} s") from None
        except concurrent.futures.CancelledError:
            raise ClientClosed() from None

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.closed:
            raise ClientClosed()
        self.inbox.post(fn, *args)

    def stop(self) -> None:
        self.closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class Message(_AsyncMessage):
    """A delivered message (the attributes of :class:`tinybroker.Message`),
    with blocking-free :meth:`ack` and :meth:`nack`."""

    __slots__ = ()

    def ack(self) -> bool:  # type: ignore[override]
        """Acknowledges this MANUAL-group message in-band (coalesced with the
        subscription's other acks; no reply). False as
        :meth:`tinybroker.Message.ack` says."""
        return self._post_settle(False)

    def nack(self) -> bool:  # type: ignore[override]
        """Hands this MANUAL-group message back for redelivery."""
        return self._post_settle(True)

    def _post_settle(self, nack: bool) -> bool:
        sub = self._sub
        if (
            sub._request.ack_mode != pb.ACK_MODE_MANUAL
            or self._handle != sub._handle
            or sub._state not in (SUB_OPENING, SUB_OPEN)
        ):
            return False
        sub._sync_loop.post(sub._settle, self, nack)  # type: ignore[attr-defined]
        return True


class Subscription:
    """A subscription: ``for msg in sub:`` blocks for each message. Its
    ``stats``, ``events``, ``last_gap``, ``state`` and ``subscription_id``
    are those of the asyncio :class:`tinybroker.Subscription`."""

    def __init__(self, loop: _Loop, sub: _AsyncSubscription) -> None:
        self._loop = loop
        self._sub = sub
        sub._sync_loop = loop  # type: ignore[attr-defined]
        self._busy = threading.Lock()
        self._event = threading.Event()
        self._untold = 0

    def __getattr__(self, name: str) -> Any:
        # stats, events, last_gap, subscription_id, is_open, done, pending, ...
        return getattr(self._sub, name)

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        try:
            return self.next()
        except ClientClosed:
            raise StopIteration from None

    def next(self, timeout: Optional[float] = None) -> Message:
        """The next message, taken from the subscription's buffer in this
        thread. One caller at a time (a second raises
        :class:`~tinybroker.UsageError`).

        Raises:
            Timeout: nothing within ``timeout`` seconds (also a ``TimeoutError``).
            ClientClosed: the subscription or the client is closed.
            SubscriptionEnded: it ended for good.
        """
        if not self._busy.acquire(blocking=False):
            raise UsageError("another next() is already waiting on this subscription")
        try:
            return self._next(timeout)
        finally:
            self._busy.release()

    def _next(self, timeout: Optional[float]) -> Message:
        sub = self._sub
        buffer = sub._buffer
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Counted as held outside the buffer before it leaves it, so the
            # loop never sees the window with room it does not have.
            sub._outside += 1  # only this thread (under _busy) writes it
            try:
                message = buffer.popleft()
            except IndexError:
                sub._outside -= 1
            else:
                self._taken()
                return message  # type: ignore[return-value]
            if sub._final is not None and not buffer:
                raise sub._final
            if self._loop.closed:
                raise ClientClosed()
            self._tell()  # credit owed, before sleeping
            event = self._event
            event.clear()
            sub._thread_waiter = event
            try:
                if buffer or sub._final is not None:
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0 or not event.wait(remaining):
                    raise Timeout(f"no message within {timeout:g} s")
            finally:
                sub._thread_waiter = None

    def _taken(self) -> None:
        # Taken out of the buffer in this thread: the loop still counts it as
        # held (``_outside``) until told, every TOP_UP messages.
        sub = self._sub
        self._untold += 1
        if self._untold >= sub._top_up or sub._state is SUB_WAITING:
            self._tell()

    def _tell(self) -> None:
        n = self._untold
        if n and not self._loop.closed:
            self._untold = 0
            self._loop.post(self._told, n)

    def _told(self, n: int) -> None:
        sub = self._sub
        sub._told += n
        sub._count_taken(n)

    def close(self) -> None:
        """Closes the subscription (see :meth:`tinybroker.Subscription.close`)."""
        self._loop.run(self._sub.close)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._loop.closed:
            self.close()


class Publisher:
    """The blocking face of :class:`tinybroker.Publisher`."""

    def __init__(self, loop: _Loop, pub: _AsyncPublisher) -> None:
        self._loop = loop
        self._pub = pub

    def publish(self, topic: str, payload: Union[bytes, str] = b"", headers: Optional[Mapping[str, str]] = None) -> None:
        """Writes one message on the stream (blocks while it is full)."""
        self._loop.run(lambda: self._pub.publish(topic, payload, headers))

    def end_stream(self) -> PublishStreamResult:
        return self._loop.run(self._pub.end_stream)

    def close(self) -> PublishStreamResult:
        return self._loop.run(self._pub.close)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._loop.closed:
            self._loop.run(lambda: self._pub.__aexit__(exc_type, *exc))


class Admin:
    """The blocking face of :class:`tinybroker.admin.Admin`."""

    def __init__(self, loop: _Loop, admin: Any) -> None:
        self._loop = loop
        self._admin = admin

    def subscriptions(self) -> List[SubscriptionInfo]:
        return self._loop.run(self._admin.subscriptions)

    def groups(self) -> List[GroupInfo]:
        return self._loop.run(self._admin.groups)

    def evictions(self) -> List[EvictionInfo]:
        return self._loop.run(self._admin.evictions)

    def info(self) -> BrokerInfo:
        return self._loop.run(self._admin.info)

    def close_subscription(self, subscription_id: str) -> None:
        self._loop.run(lambda: self._admin.close_subscription(subscription_id))

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
        session = client._session
        assert session is not None
        self._session = session
        # Publishes posted and not yet appended on the loop, in bytes.
        self._posted_bytes = 0
        self._room = threading.Condition()
        session.on_room(self._on_room)

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def reconnects(self) -> int:
        return self._client.reconnects

    def publish(self, topic: str, payload: Union[bytes, str] = b"", headers: Optional[Mapping[str, str]] = None) -> None:
        """Appends one message to the client's buffer (shared with every
        thread publishing on this client) and returns at once; blocks only
        while the buffer is full. See :meth:`tinybroker.Client.publish`."""
        if self._loop.closed:
            raise ClientClosed()
        data = _as_bytes(payload)
        headers = self._client._headers(headers)
        size = len(topic) + len(data)
        session = self._session
        with self._room:
            while session.pending_bytes + self._posted_bytes >= session.buffer_bytes:
                if self._loop.closed:
                    raise ClientClosed()
                self._room.wait(0.1)
            self._posted_bytes += size
        self._loop.post(self._append, topic, data, headers, size)

    def _append(self, topic: str, data: bytes, headers: Optional[Mapping[str, str]], size: int) -> None:
        with self._room:
            self._posted_bytes -= size
        if not self._client._closed:
            self._session.append(topic, data, headers)

    def _on_room(self) -> None:
        with self._room:
            self._room.notify_all()

    def flush(self, timeout: Optional[float] = None) -> FlushResult:
        """See :meth:`tinybroker.Client.flush` (it covers every publish this
        thread made before it)."""
        return self._loop.run(lambda: self._client.flush(timeout))

    def publish_confirmed(
        self, topic: str, payload: Union[bytes, str] = b"", headers: Optional[Mapping[str, str]] = None,
        *, timeout: Optional[float] = 10.0,
    ) -> PublishResult:
        """See :meth:`tinybroker.Client.publish_confirmed`."""
        return self._loop.run(lambda: self._client.publish_confirmed(topic, payload, headers, timeout=timeout))

    def publisher(self) -> Publisher:
        """See :meth:`tinybroker.Client.publisher`."""
        if self._loop.closed:
            raise ClientClosed()
        return Publisher(self._loop, self._client.publisher())

    def on_connection_event(self, callback: Callable[[ConnectionEvent], None]) -> Callable[[], None]:
        """See :meth:`tinybroker.Client.on_connection_event`; ``callback``
        runs on the client's background thread."""
        if self._loop.closed:
            raise ClientClosed()
        return self._client.on_connection_event(callback)

    def stats(self) -> ClientStats:
        """See :meth:`tinybroker.Client.stats`."""
        return self._client.stats()

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
            lambda: self._client.subscribe(
                patterns, subscription_id=subscription_id, group=group, ack_mode=ack_mode,
                max_in_flight=max_in_flight, ack_deadline=ack_deadline, window=window,
                resubscribe=resubscribe, on_event=on_event, timeout=timeout,
            )
        )
        return Subscription(self._loop, sub)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> FlushResult:
        """Flushes, closes every subscription and the connection, and ends
        the thread (see :meth:`tinybroker.Client.close`)."""
        if self._loop.closed:
            return self._client._close_result or FlushResult()
        try:
            # What this thread posted goes in before the close's flush.
            return self._loop.run(lambda: self._client.close(timeout), timeout=timeout + 10)
        finally:
            self._loop.stop()
            with self._room:
                self._room.notify_all()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    addr: Union[str, Sequence[str], None] = None,
    *,
    token: Optional[str] = None,
    ca_file: Optional[str] = None,
    window: int = WINDOW,
    buffer_bytes: int = BUFFER_BYTES,
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
            addr, token=token, ca_file=ca_file, window=window, buffer_bytes=buffer_bytes,
            resubscribe=resubscribe, tracing=tracing, channel_options=channel_options,
        )
        try:
            return await client.connect(connect_timeout)
        except BaseException:
            await client.close()
            raise

    try:
        client = loop.run(make)
    except BaseException:
        loop.stop()
        raise
    return Client(loop, client)
