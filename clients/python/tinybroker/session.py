"""The client's one ``Session`` stream: its subscriptions, its publish
buffer and its connection events (docs/clients.md, which this module
follows state by state).

One task (:meth:`Session._run`) owns the stream: it starts it (``STARTING``),
and once the broker's response headers are in (``OPEN``) opens every
subscription that is to be open, writes the publish buffer from its oldest
message, and reads the events. When the stream ends or fails for any reason
but :meth:`Session.close` (``WAITING``), the subscriptions go back to
``WAITING``, the batches written without an answer become unconfirmed, and
after a jittered delay (with an address list, on the next address) a new
session starts. Everything runs on the client's event loop, so no lock is
needed; the blocking facade reaches it through :class:`ThreadInbox`.

Requests out are coalesced: acks and nacks of a subscription, and the
publish batch being filled, go out on the next turn of the event loop
(:meth:`Session._pump`), as one request each.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Mapping, Optional, Set, Tuple

import grpc
import grpc.aio

from ._pb import broker_pb2 as pb
from .constants import (
    BATCH_BYTES,
    BATCH_MESSAGES,
    BATCHES_IN_FLIGHT,
    BUFFER_BYTES,
    CONNECT_DELAY_CAP,
    CONNECT_DELAY_FIRST,
    JITTER,
    REQUEST_SLACK,
    RESUBSCRIBE_DELAY_CAP,
    RESUBSCRIBE_DELAY_FIRST,
    START_TIMEOUT,
    top_up,
)
from .errors import ClientClosed, SubscriptionEnded, Timeout, TinybrokerError, UsageError, _code_from_int
from .types import (
    ClientStats,
    Connected,
    ConnectionEvent,
    Disconnected,
    Ended,
    FlushResult,
    Gap,
    Message,
    Opened,
    Reconnected,
    Rejection,
    Resubscribed,
    Resubscribing,
    SubscriptionEvent,
    SubscriptionStats,
)

if TYPE_CHECKING:  # pragma: no cover
    from ._connection import Connection

log = logging.getLogger("tinybroker")

# The session's states (docs/clients.md "The session's states").
IDLE = "IDLE"
STARTING = "STARTING"
OPEN = "OPEN"
WAITING = "WAITING"
CLOSED = "CLOSED"

# A subscription's states (docs/clients.md "A subscription's states").
SUB_WAITING = "WAITING"
SUB_OPENING = "OPENING"
SUB_OPEN = "OPEN"
SUB_BACKOFF = "BACKOFF"
SUB_DONE = "DONE"

_OK = grpc.StatusCode.OK
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
# A session that fails to start with one of these will not start by trying
# again: a subscription waiting for its first open gets the error.
_FINAL_START_CODES = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
_BATCH_METADATA = ("tinybroker-batch", "1")


class Backoff:
    """A delay that starts at ``first``, doubles up to ``cap``, each one
    multiplied by a uniform factor in ``JITTER``."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self.first

    def next_delay(self) -> float:
        delay = self._next * random.uniform(*JITTER)
        self._next = min(self._next * 2, self.cap)
        return delay


class _Requests:
    """The session's outgoing requests: an async iterator grpc consumes;
    ``put`` never blocks (what it carries is bounded elsewhere: the window,
    the batches in flight)."""

    __slots__ = ("_items", "_waiter", "_closed")

    def __init__(self) -> None:
        self._items: Deque[pb.SessionRequest] = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._closed = False

    def put(self, request: pb.SessionRequest) -> None:
        self._items.append(request)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Half-closes the stream once what was put is sent."""
        self._closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> "_Requests":
        return self

    async def __anext__(self) -> pb.SessionRequest:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        return self._items.popleft()


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# The varints of the lengths most messages have, made once.
_VARINTS = [_encode_varint(i) for i in range(4096)]


def _varint(n: int) -> bytes:
    return _VARINTS[n] if n < 4096 else _encode_varint(n)


def encode_message(topic: str, payload: bytes, headers: Optional[Mapping[str, str]]) -> Tuple[bytes, int]:
    """One ``PublishRequest`` as an element of ``SessionPublish.messages``
    (field 2), in wire bytes, and its size."""
    if headers:
        body = pb.PublishRequest(topic=topic, payload=payload, headers=headers).SerializeToString()
    else:
        t = topic.encode()
        lt, lp = len(t), len(payload)
        varints = _VARINTS
        if lt < 4096 and lp < 3072:
            body = b"\n" + varints[lt] + t + b"\x12" + varints[lp] + payload
            n = len(body)
            part = b"\x12" + varints[n] + body
            return part, len(part)
        body = b"\n" + _varint(lt) + t + b"\x12" + _varint(lp) + payload
    part = b"\x12" + _varint(len(body)) + body
    return part, len(part)


class _Batch:
    """One ``SessionPublish`` being filled, waiting, or written: its
    messages as wire bytes (one join when written) and their topics (to name
    a rejected one)."""

    __slots__ = ("parts", "topics", "first", "count", "nbytes", "payload_bytes", "oversize")

    def __init__(self, first: int) -> None:
        self.parts: List[bytes] = []
        self.topics: List[str] = []
        self.first = first  # index of its first message
        self.count = 0
        self.nbytes = 0
        self.payload_bytes = 0
        self.oversize = False

    def request(self, batch_id: int) -> bytes:
        """The ``SessionRequest`` (``publish``, field 6) in wire bytes."""
        body = b"\x08" + _varint(batch_id) + b"".join(self.parts)
        return b"2" + _varint(len(body)) + body


class _StartFailed(Exception):
    def __init__(self, error: TinybrokerError) -> None:
        self.error = error


class _MoveOn(Exception):
    """The broker refused an open UNAVAILABLE and the client knows other
    addresses: the session goes to the next one."""

    def __init__(self, error: TinybrokerError) -> None:
        self.error = error


class ThreadInbox:
    """Calls posted from other threads, run on the loop in one hop: the
    first post since the last run schedules it, later ones join it (the
    blocking facade's publishes, acks and credit pay no round trip each)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: List[Tuple[Callable[..., Any], tuple]] = []
        self._scheduled = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for fn, args in items:
            try:
                fn(*args)
            except Exception:  # pragma: no cover - reported where it matters
                log.exception("tinybroker: a call posted from a thread failed")


ConnectionCallback = Callable[[ConnectionEvent], None]


class Session:
    """The one Session stream of a client, its subscriptions by handle, its
    publish buffer and its connection events."""

    def __init__(
        self,
        connection: "Connection",
        *,
        buffer_bytes: int = BUFFER_BYTES,
        batch_messages: int = BATCH_MESSAGES,
        max_message_bytes: Optional[int] = None,
    ) -> None:
        self._conn = connection
        self._loop = asyncio.get_running_loop()
        self.state = IDLE
        self._task: Optional[asyncio.Task] = None
        self._requests: Optional[_Requests] = None
        self._call: Optional[grpc.aio.StreamStreamCall] = None
        self._backoff = Backoff(CONNECT_DELAY_FIRST, CONNECT_DELAY_CAP)
        self._closed = False
        #: The broker's tinybroker-instance and -sequence-scope of the session
        #: (None when it sent none).
        self.instance: Optional[str] = None
        self.scope: Optional[str] = None
        # What a delivery's sequence space is compared by: the instance, or a
        # new object per session when the broker names none.
        self._instance_key: object = None
        self._was_connected = False
        self._disconnected = False
        self._move_on: Optional[TinybrokerError] = None
        # Subscriptions: all that are not DONE, and those open by handle.
        self._subs: Dict["Subscription", None] = {}
        self._handles: Dict[int, "Subscription"] = {}
        self._last_handle = 0
        self._dirty: Set["Subscription"] = set()
        self._pump_scheduled = False
        # The publish buffer.
        self.buffer_bytes = buffer_bytes
        self.batch_messages = max(1, batch_messages)
        self.batch_bytes = BATCH_BYTES
        # The largest request the broker reads (no bound known: none).
        self._request_limit = 1 << 62
        if max_message_bytes:
            self._request_limit = max_message_bytes + REQUEST_SLACK
            self.batch_bytes = min(BATCH_BYTES, self._request_limit)
        self._filling: Optional[_Batch] = None
        self._sealed: Deque[_Batch] = collections.deque()
        self._in_flight: Deque[Tuple[int, _Batch]] = collections.deque()
        self._batch_id = 0
        self._next_index = 0
        self._settled = 0  # every index below it has an outcome
        self._written = 0  # messages written (or refused here), from index 0
        self.pending_bytes = 0
        self._room_waiters: Deque[asyncio.Future] = collections.deque()
        self._flush_waiters: List[Tuple[int, asyncio.Future]] = []
        self._room_callbacks: List[Callable[[], None]] = []
        self._accepted = 0
        self._rejected: List[Rejection] = []
        self._unconfirmed = 0
        self._unconfirmed_ranges: List[Tuple[int, int]] = []
        # Connection events and counters.
        self._callbacks: List[ConnectionCallback] = []
        self.msgs_in = 0
        self.bytes_in = 0
        self.msgs_out = 0
        self.bytes_out = 0
        self.reconnects = 0
        self.dropped_late = 0

    # === subscriptions ===

    def add(self, sub: "Subscription") -> None:
        """A new subscription: opened now if the session is open, else on
        the next session (which this starts)."""
        self._subs[sub] = None
        self._need()
        self.try_open(sub)

    def try_open(self, sub: "Subscription") -> None:
        """Opens ``sub`` (WAITING) if the session is open and its window has
        room; else it stays WAITING."""
        if self.state != OPEN or sub._state != SUB_WAITING:
            return
        held = sub._held()
        if held >= sub.window:
            return  # opened once the application takes one
        self._last_handle += 1
        handle = self._last_handle
        sub._opening(handle)
        self._handles[handle] = sub
        assert self._requests is not None
        self._requests.put(
            pb.SessionRequest(
                open=pb.SessionOpen(handle=handle, subscription=sub._request, credit=sub.window - held)
            )
        )

    def send(self, request: pb.SessionRequest) -> None:
        """Writes a request now, if the session is open."""
        if self._requests is not None and self.state == OPEN:
            self._requests.put(request)

    def close_handle(self, sub: "Subscription") -> bool:
        """Sends ``close`` for ``sub``'s handle (after its pending acks);
        False when it is not on the current session."""
        if self.state != OPEN or self._handles.get(sub._handle) is not sub:
            return False
        self._pump()
        self.send(pb.SessionRequest(close=pb.SessionClose(handle=sub._handle)))
        return True

    def forget(self, sub: "Subscription") -> None:
        self._subs.pop(sub, None)
        if self._handles.get(sub._handle) is sub:
            del self._handles[sub._handle]
        self._dirty.discard(sub)

    def mark_dirty(self, sub: "Subscription") -> None:
        """``sub`` has acks or nacks to send on the next turn of the loop."""
        self._dirty.add(sub)
        self._schedule_pump()

    # === the publish buffer ===

    def append(self, topic: str, payload: bytes, headers: Optional[Mapping[str, str]]) -> int:
        """Appends one message to the buffer (never waits: the callers bound
        the buffer) and returns its index."""
        part, size = encode_message(topic, payload, headers)
        batch = self._filling
        if batch is None:
            batch = self._filling = _Batch(self._next_index)
        elif batch.nbytes + size > self.batch_bytes:
            self._sealed.append(batch)
            batch = self._filling = _Batch(self._next_index)
        parts = batch.parts
        parts.append(part)
        batch.topics.append(topic)
        nbytes = batch.nbytes = batch.nbytes + size
        batch.payload_bytes += len(payload)
        if size > self._request_limit:
            batch.oversize = True
        index = self._next_index
        self._next_index = index + 1
        self.pending_bytes += size
        if len(parts) >= self.batch_messages or nbytes >= self.batch_bytes:
            self._seal()
            self._write_batches()
        elif not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)
        if self._task is None:
            self._need()
        return index

    async def wait_room(self) -> None:
        """Waits while the buffer holds ``buffer_bytes`` or more."""
        while self.pending_bytes >= self.buffer_bytes:
            if self._closed:
                raise ClientClosed()
            waiter = self._loop.create_future()
            self._room_waiters.append(waiter)
            await waiter
        if self._closed:
            raise ClientClosed()

    def on_room(self, callback: Callable[[], None]) -> None:
        """``callback`` is called (on the loop) whenever the buffer drops
        below ``buffer_bytes`` (the blocking facade's publishers wait on it)."""
        self._room_callbacks.append(callback)

    def _seal(self) -> None:
        batch = self._filling
        if batch is not None:
            self._filling = None
            self._sealed.append(batch)

    def _write_batches(self) -> None:
        if self.state != OPEN or self._requests is None:
            return
        sealed, in_flight = self._sealed, self._in_flight
        wrote = False
        while sealed and len(in_flight) < BATCHES_IN_FLIGHT:
            batch = sealed[0]
            if batch.oversize:
                if in_flight:
                    break  # its outcome comes after theirs
                sealed.popleft()
                self._unbuffer(batch)
                self._reject_oversize(batch)
                continue
            sealed.popleft()
            self._batch_id += 1
            self._requests.put(batch.request(self._batch_id))  # type: ignore[arg-type]
            in_flight.append((self._batch_id, batch))
            self._unbuffer(batch)
            self.msgs_out += batch.count
            self.bytes_out += batch.payload_bytes
            wrote = True
        if wrote and self.pending_bytes < self.buffer_bytes:
            self._wake_room()

    @property
    def pending_messages(self) -> int:
        """Messages in the buffer, not yet written."""
        return self._next_index - self._written

    def _unbuffer(self, batch: _Batch) -> None:
        batch.count = len(batch.parts)
        self._written = batch.first + batch.count
        self.pending_bytes -= batch.nbytes

    def _wake_room(self) -> None:
        waiters = self._room_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        for callback in self._room_callbacks:
            callback()

    def _reject_oversize(self, batch: _Batch) -> None:
        # The request could not be read by the broker (it would end the
        # session): each message is refused here, as the broker would.
        for i, part in enumerate(batch.parts):
            size = len(part)
            if size > self._request_limit:
                self._rejected.append(
                    Rejection(
                        batch.first + i, batch.topics[i], grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"message of {size} bytes exceeds max_message_bytes "
                        f"({self._request_limit - REQUEST_SLACK})",
                    )
                )
            else:  # pragma: no cover - a large message is a batch of its own
                self._unconfirmed_range(batch.first + i, 1)
        self._settle_to(batch.first + batch.count)

    def _on_published(self, published: pb.SessionPublished) -> None:
        if not self._in_flight or self._in_flight[0][0] != published.id:
            log.warning("tinybroker: an answer to publish %d, which is not the oldest written", published.id)
            return
        _, batch = self._in_flight.popleft()
        self._accepted += published.accepted
        topics = batch.topics
        for r in published.rejected:
            topic = topics[r.index] if r.index < len(topics) else ""
            code = _code_from_int(r.code)
            self._rejected.append(
                Rejection(batch.first + r.index, topic, code, r.message or f"rejected with {code.name}")
            )
        self._settle_to(batch.first + batch.count)
        self._write_batches()

    def _unconfirmed_range(self, first: int, count: int) -> None:
        self._unconfirmed += count
        ranges = self._unconfirmed_ranges
        if ranges and ranges[-1][1] + 1 == first:
            ranges[-1] = (ranges[-1][0], first + count - 1)
        else:
            ranges.append((first, first + count - 1))

    def _settle_to(self, index: int) -> None:
        self._settled = index
        if self._flush_waiters:
            keep = []
            for target, waiter in self._flush_waiters:
                if target <= index:
                    if not waiter.done():
                        waiter.set_result(None)
                else:
                    keep.append((target, waiter))
            self._flush_waiters = keep

    def take_outcomes(self) -> FlushResult:
        """The outcomes gathered since the last call, handed over once."""
        result = FlushResult(self._accepted, self._rejected, self._unconfirmed, self._unconfirmed_ranges)
        self._accepted, self._rejected, self._unconfirmed, self._unconfirmed_ranges = 0, [], 0, []
        return result

    async def flush(self, timeout: Optional[float]) -> FlushResult:
        """Waits until every message published so far has an outcome and
        returns the outcomes since the previous flush."""
        if self._closed:
            raise ClientClosed()
        target = self._next_index
        if self._settled < target:
            self._seal()
            self._write_batches()
            waiter = self._loop.create_future()
            entry = (target, waiter)
            self._flush_waiters.append(entry)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except asyncio.TimeoutError:
                raise Timeout(
                    f"flush: {target - self._settled} messages without an outcome after {timeout:g} s"
                    " (they are reported by the next flush)"
                ) from None
            finally:
                if entry in self._flush_waiters:
                    self._flush_waiters.remove(entry)
        return self.take_outcomes()

    # === the pump: coalesced requests, once per turn of the loop ===

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        self._seal()
        self._write_batches()
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        requests = self._requests if self.state == OPEN else None
        for sub in dirty:
            acks, nacks = sub._acks, sub._nacks
            sub._acks, sub._nacks = [], []
            if requests is None or self._handles.get(sub._handle) is not sub:
                continue
            if acks:
                requests.put(pb.SessionRequest(ack=pb.SessionAck(handle=sub._handle, sequences=acks)))
            if nacks:
                requests.put(pb.SessionRequest(nack=pb.SessionNack(handle=sub._handle, sequences=nacks)))

    # === connection events and counters ===

    def add_callback(self, callback: ConnectionCallback) -> Callable[[], None]:
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove

    def emit(self, event: ConnectionEvent) -> None:
        log.debug("tinybroker: %s", event)
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception:  # pragma: no cover - the application's bug
                log.exception("tinybroker connection event callback failed")

    def stats(self) -> ClientStats:
        return ClientStats(
            self.msgs_in, self.bytes_in, self.msgs_out, self.bytes_out, self.reconnects,
            self.pending_messages, self.pending_bytes, self.dropped_late,
        )

    # === the task ===

    def _need(self) -> None:
        """Something needs a session: IDLE -> STARTING."""
        if self._task is None and not self._closed:
            self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        conn = self._conn
        while not self._closed:
            self.state = STARTING
            starting = True
            try:
                await self._serve()
                failure = TinybrokerError(_UNAVAILABLE, f"{conn.target}: closed by the broker")
                reason = "closed by the broker"
                starting = False
            except _StartFailed as e:
                failure, reason = e.error, str(e.error)
            except _MoveOn as e:
                failure, reason, starting = e.error, str(e.error), False
            except grpc.aio.AioRpcError as e:
                failure = TinybrokerError.from_rpc_error(e, "the session")
                reason, starting = str(failure), False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # pragma: no cover - a bug, not the broker
                log.exception("tinybroker session failed")
                failure = TinybrokerError(grpc.StatusCode.INTERNAL, f"the session failed: {e!r}")
                reason, starting = str(failure), False
            finally:
                self._end_call()
            if self._closed:
                return
            self._lost(failure, reason, starting)
            self.state = WAITING
            await asyncio.sleep(self._backoff.next_delay())
            if len(conn.targets) > 1 and not self._closed:
                await conn.failover()

    def _end_call(self) -> None:
        if self._requests is not None:
            self._requests.close()  # ends grpc's task that reads it
        self._requests = None
        call, self._call = self._call, None
        if call is not None and not call.done():
            call.cancel()

    async def _serve(self) -> None:
        conn = self._conn
        requests = _Requests()
        metadata = tuple(conn.metadata or ()) + (_BATCH_METADATA,)
        # One address: the call waits for the channel, whose own reconnect
        # backoff (CONNECT_DELAY_FIRST to _CAP) finds a broker that is back;
        # with a list a broker that does not answer is passed over.
        call = conn.session(requests, metadata=metadata, wait_for_ready=len(conn.targets) == 1)
        self._call = call
        try:
            headers = await asyncio.wait_for(call.initial_metadata(), START_TIMEOUT)
        except asyncio.TimeoutError:
            raise _StartFailed(
                TinybrokerError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{conn.target} did not accept a session within {START_TIMEOUT:g} s",
                )
            ) from None
        except grpc.aio.AioRpcError as e:
            raise _StartFailed(TinybrokerError.from_rpc_error(e, f"the session on {conn.target}")) from None
        if call.done():
            code = await call.code()
            details = await call.details()
            if code == _OK:
                raise _StartFailed(TinybrokerError(_UNAVAILABLE, f"{conn.target} ended the session as it started"))
            raise _StartFailed(TinybrokerError(code, details or f"{conn.target}: {code.name}"))
        self._opened(requests, headers)
        handles = self._handles
        read = call.read
        eof = grpc.aio.EOF
        while True:
            event = await read()
            if event is eof:
                return
            kind = event.WhichOneof("event")
            if kind == "deliveries":
                deliveries = event.deliveries.deliveries
                self.msgs_in += len(deliveries)
                nbytes = 0
                for delivery in deliveries:
                    message = delivery.message
                    nbytes += len(message.payload)
                    for handle in delivery.handles:
                        sub = handles.get(handle)
                        if sub is None:
                            self.dropped_late += 1
                        else:
                            sub._deliver(message, handle)
                self.bytes_in += nbytes
            elif kind == "published":
                self._on_published(event.published)
            elif kind == "delivery":
                delivery = event.delivery
                message = delivery.message
                self.msgs_in += 1
                self.bytes_in += len(message.payload)
                for handle in delivery.handles:
                    sub = handles.get(handle)
                    if sub is None:
                        self.dropped_late += 1
                    else:
                        sub._deliver(message, handle)
            elif kind == "opened":
                sub = handles.get(event.opened.handle)
                if sub is not None:
                    sub._on_opened(event.opened.subscription_id)
            elif kind == "ended":
                ended = event.ended
                sub = handles.pop(ended.handle, None)
                if sub is not None:
                    sub._on_ended(ended)
                if self._move_on is not None:
                    error, self._move_on = self._move_on, None
                    raise _MoveOn(error)

    def _opened(self, requests: _Requests, headers: Any) -> None:
        """STARTING -> OPEN: opens the subscriptions, then writes the buffer."""
        conn = self._conn
        instance = scope = None
        for key, value in headers or ():
            if key == "tinybroker-instance":
                instance = value
            elif key == "tinybroker-sequence-scope":
                scope = value
        previous = self._instance_key
        self.instance, self.scope = instance, scope
        self._instance_key = instance if instance is not None else object()
        self._requests = requests
        self._batch_id = 0
        self.state = OPEN
        self._backoff.reset()
        if not self._was_connected:
            self._was_connected = True
            self.emit(Connected(str(conn.target), instance))
        elif self._disconnected:
            self._disconnected = False
            self.reconnects += 1
            self.emit(Reconnected(str(conn.target), instance, self._instance_key != previous))
        for sub in list(self._subs):
            self.try_open(sub)
        self._seal()
        self._write_batches()

    def _lost(self, failure: TinybrokerError, reason: str, starting: bool) -> None:
        """The session ended (OPEN or STARTING -> WAITING)."""
        was_open = self.state == OPEN
        self.state = WAITING
        if was_open:
            self._disconnected = True
            self.emit(Disconnected(reason))
        self._unconfirm_in_flight()
        handles, self._handles = self._handles, {}
        self._dirty.clear()
        for sub in handles.values():
            sub._on_lost()
        final = starting and failure.code in _FINAL_START_CODES
        for sub in list(self._subs):
            sub._last_cause = failure
            if final and not sub._opened_once:
                sub._finish(None, failure)
                self._subs.pop(sub, None)

    def _unconfirm_in_flight(self) -> None:
        """Batches written to a session that is gone, without an answer:
        unconfirmed, never written again."""
        if self._in_flight:
            for _, batch in self._in_flight:
                self._unconfirmed_range(batch.first, batch.count)
            last = self._in_flight[-1][1]
            self._in_flight.clear()
            self._settle_to(last.first + last.count)

    def request_move_on(self, error: TinybrokerError) -> None:
        """Ends the session after the current event, to go to the next address."""
        if len(self._conn.targets) > 1:
            self._move_on = error

    async def close(self, timeout: float) -> None:
        """Ends every subscription (``close`` for each, then the half-close)
        and the task; every waiting call ends with :class:`ClientClosed`."""
        self._closed = True
        for sub in list(self._subs):
            sub._closing = True
            if sub._retry is not None:
                sub._retry.cancel()
                sub._retry = None
        task = self._task
        if self.state == OPEN and self._requests is not None and task is not None:
            self._pump()
            for handle in list(self._handles):
                self._requests.put(pb.SessionRequest(close=pb.SessionClose(handle=handle)))
            self._requests.close()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except (asyncio.TimeoutError, Exception):
                pass
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
        self._end_call()
        self._unconfirm_in_flight()
        self.state = CLOSED
        for sub in list(self._subs):
            sub._finish(ClientClosed())
        self._subs.clear()
        self._handles.clear()
        closed = ClientClosed()
        for waiter in self._room_waiters:
            if not waiter.done():
                waiter.set_exception(closed)
                waiter.exception()
        self._room_waiters.clear()
        for _, waiter in self._flush_waiters:
            if not waiter.done():
                waiter.set_exception(closed)
                waiter.exception()
        self._flush_waiters = []
        for callback in self._room_callbacks:
            callback()

    def not_sent(self) -> int:
        """Messages in the buffer, never written (``close()`` reports them)."""
        return self.pending_messages


EventCallback = Callable[[SubscriptionEvent], None]


class Subscription:
    """A subscription on its client's session: an async iterator of
    :class:`~tinybroker.Message`.

    ::

        async for msg in sub:
            ...

    The broker sends it at most ``window`` deliveries beyond what the
    application took, and the client never holds more than ``window`` for
    it. When the broker ends it (eviction, shutdown) the client opens it
    again after a jittered backoff (unless ``resubscribe=False``), with the
    same id when the application named one; a lost session is not an end:
    it is opened again on the next session. Each step is a
    :class:`~tinybroker.SubscriptionEvent` (to ``on_event``, in
    :attr:`events`, counted in :attr:`stats`), with a
    :class:`~tinybroker.Gap` when messages may have been missed. Iteration
    stops after :meth:`close` (``next()`` raises
    :class:`~tinybroker.ClientClosed`); both raise
    :class:`~tinybroker.SubscriptionEnded` when it ended for good otherwise.
    """

    def __init__(
        self,
        session: Session,
        request: pb.OpenSubscriptionRequest,
        *,
        window: int,
        resubscribe: bool,
        on_event: Optional[EventCallback],
        message_class: type = Message,
    ) -> None:
        if window < 1:
            raise UsageError(f"window must be at least 1, not {window}")
        self._session = session
        self._request = request
        #: Credit window: deliveries the broker may send beyond what was taken.
        self.window = window
        self._top_up = top_up(window)
        self.resubscribe = resubscribe
        self._on_event = on_event
        self._message_class = message_class
        #: The id the broker gave it (the one the application named, if any).
        self.subscription_id: Optional[str] = request.subscription_id or None
        self._stats = SubscriptionStats()
        #: The last 100 events, oldest first.
        self.events: Deque[SubscriptionEvent] = collections.deque(maxlen=100)
        #: The last Gap reported, if any.
        self.last_gap: Optional[Gap] = None
        self._handle = 0
        self._state = SUB_WAITING
        self._buffer: Deque[Message] = collections.deque()
        # Messages the blocking facade took out of the buffer (counted by its
        # thread) and those it has counted back (by the loop): the client
        # holds the difference too. One writer each, so no lock.
        self._outside = 0
        self._told = 0
        self._waiter: Optional[asyncio.Future] = None
        self._nexting = False  # a next() is running
        self._thread_waiter: Optional[threading.Event] = None
        self._taken = 0  # since the last credit given back
        self._received = 0  # taken by the application, in all
        self._received_at_open = 0
        self._acks: List[int] = []
        self._nacks: List[int] = []
        # The last delivery, and the sequence space (instance) it came from:
        # that of the open it came on, noted when the subscription leaves it.
        self._last_raw: Optional[pb.Message] = None
        self._raw_at_open: Optional[pb.Message] = None
        self._open_instance: object = None
        self._last_instance: object = None
        self._away: Optional[Tuple[str, int]] = None  # (cause, dropped) until the next delivery
        self._final: Optional[BaseException] = None
        self._opened_once = False
        self._after_end = False
        self._opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = False
        self._closed_future: Optional[asyncio.Future] = None
        self._retry: Optional[asyncio.TimerHandle] = None
        self._backoff = Backoff(RESUBSCRIBE_DELAY_FIRST, RESUBSCRIBE_DELAY_CAP)
        self._last_cause: Optional[TinybrokerError] = None

    # --- what the application sees ---

    @property
    def stats(self) -> SubscriptionStats:
        """Counters: received, ends, evictions, resubscribes, gaps, dropped."""
        self._stats.received = self._received
        return self._stats

    @property
    def _last_sequence(self) -> int:
        return self._last_raw.sequence if self._last_raw is not None else 0

    @property
    def patterns(self) -> List[str]:
        return list(self._request.topic_patterns)

    @property
    def group(self) -> Optional[str]:
        return self._request.consumer_group or None

    @property
    def state(self) -> str:
        """``WAITING``, ``OPENING``, ``OPEN``, ``BACKOFF`` or ``DONE``."""
        return self._state

    @property
    def is_open(self) -> bool:
        """Open on the broker right now."""
        return self._state == SUB_OPEN

    @property
    def done(self) -> bool:
        """Ended for good: iteration stops or raises once the buffer is empty."""
        return self._state == SUB_DONE

    @property
    def pending(self) -> int:
        """Deliveries held and not yet taken (never more than the window)."""
        return self._held()

    @property
    def messages(self) -> "Subscription":
        """The subscription itself (``async for msg in sub.messages``, as in nats-py)."""
        return self

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> Message:
        if self._buffer and not self._nexting:
            return self._take()
        try:
            return await self._next(None)
        except ClientClosed:
            raise StopAsyncIteration from None

    async def next(self, timeout: Optional[float] = None) -> Message:
        """The next message. One caller at a time: a second ``next()`` while
        one waits raises :class:`~tinybroker.UsageError`.

        Raises:
            Timeout: nothing within ``timeout`` seconds (also a ``TimeoutError``).
            ClientClosed: the subscription or its client is closed.
            SubscriptionEnded: it ended for good, and what it held was taken.
        """
        if self._buffer and not self._nexting:
            return self._take()
        return await self._next(timeout)

    next_msg = next

    async def _next(self, timeout: Optional[float]) -> Message:
        if self._nexting or self._thread_waiter is not None:
            raise UsageError("another next() is already waiting on this subscription")
        buffer = self._buffer
        if buffer:
            return self._take()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._nexting = True
        try:
            while True:
                if self._final is not None:
                    raise self._final
                waiter = self._waiter = loop.create_future()
                if deadline is None:
                    await waiter
                else:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise Timeout(f"no message within {timeout:g} s")
                    try:
                        await asyncio.wait_for(waiter, remaining)
                    except asyncio.TimeoutError:
                        raise Timeout(f"no message within {timeout:g} s") from None
                if buffer:
                    return self._take()
        finally:
            self._waiter = None
            self._nexting = False

    def _take(self) -> Message:
        message = self._buffer.popleft()
        self._received += 1
        taken = self._taken = self._taken + 1
        if taken >= self._top_up or self._state is SUB_WAITING:
            self._after_take()
        return message

    def _count_taken(self, n: int) -> None:
        """The blocking facade counts back ``n`` it took from the buffer."""
        self._received += n
        self._taken += n
        self._after_take()

    def _after_take(self) -> None:
        state = self._state
        if state is SUB_OPEN or state is SUB_OPENING:
            if self._taken >= self._top_up:
                self._session.send(
                    pb.SessionRequest(credit=pb.SessionCredit(handle=self._handle, messages=self._taken))
                )
                self._taken = 0
        elif state is SUB_WAITING:
            self._session.try_open(self)

    def _held(self) -> int:
        return len(self._buffer) + self._outside - self._told

    async def close(self, timeout: float = 5.0) -> None:
        """Closes the subscription and waits until the broker has ended it
        (acks made before are sent first). Messages not yet taken are
        dropped (a MANUAL group's go to another member). Iteration then
        stops; a waiting ``next()`` raises :class:`~tinybroker.ClientClosed`."""
        if self._state == SUB_DONE:
            return
        self._closing = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._buffer.clear()
        if self._state in (SUB_OPENING, SUB_OPEN) and self._session.close_handle(self):
            self._closed_future = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._closed_future), timeout)
            except asyncio.TimeoutError:
                pass
        self._session.forget(self)
        self._finish(ClientClosed("the subscription is closed"))

    unsubscribe = close

    async def __aenter__(self) -> "Subscription":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Subscription {self.subscription_id} {self.patterns} {self._state}>"

    # --- what the session calls ---

    def _emit(self, event: SubscriptionEvent) -> None:
        self.events.append(event)
        log.debug("tinybroker: %s", event)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:  # pragma: no cover - the application's bug
                log.exception("tinybroker on_event callback failed")

    def _opening(self, handle: int) -> None:
        self._handle = handle
        self._state = SUB_OPENING
        self._taken = 0
        self._received_at_open = self._received
        self._raw_at_open = self._last_raw
        self._open_instance = self._session._instance_key
        self._acks, self._nacks = [], []

    def _deliver(self, raw: pb.Message, handle: int) -> None:
        if self._away is not None:
            self._report_gap(raw.sequence)
        self._last_raw = raw
        self._buffer.append(self._message_class(raw, self, handle))
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        else:
            thread_waiter = self._thread_waiter  # read once: the thread may clear it
            if thread_waiter is not None:
                thread_waiter.set()

    def _leaving(self) -> None:
        """Out of OPENING/OPEN: what came on that open came from its instance."""
        if self._last_raw is not self._raw_at_open:
            self._last_instance = self._open_instance

    def _report_gap(self, first: int) -> None:
        """docs/clients.md "Gaps": the first delivery after being away."""
        (cause, dropped), self._away = self._away, None  # type: ignore[misc]
        session = self._session
        last = self._last_sequence
        missed: Optional[Tuple[int, int]] = None
        reason: Optional[str] = None
        if self._last_raw is None:
            reason = "nothing_before"
        elif self._last_instance is not session._instance_key:
            reason = "instance_changed"
        elif session.scope != "instance":
            reason = "sequence_scope"
        elif first == last + 1:
            return
        elif first > last + 1:
            missed = (last + 1, first - 1)
        else:  # sequences went back: not the space they were in
            reason = "instance_changed"
        gap = Gap(self.subscription_id, missed, reason, dropped, cause, last, first)
        self.last_gap = gap
        self._stats.gaps += 1
        self._emit(gap)

    def _on_opened(self, subscription_id: str) -> None:
        self._state = SUB_OPEN
        self.subscription_id = subscription_id
        self._last_cause = None
        if not self._opened_once:
            self._opened_once = True
            if not self._opened.done():
                self._opened.set_result(None)
            self._emit(Opened(subscription_id))
        else:
            self._stats.resubscribes += 1
            if self._after_end:
                self._after_end = False
                self._emit(Resubscribed(subscription_id))

    def _count_end(self, ended: Ended) -> None:
        self._stats.ends += 1
        self._stats.dropped += ended.dropped
        self._stats.by_reason[ended.reason] = self._stats.by_reason.get(ended.reason, 0) + 1
        if ended.reason == "evicted":
            self._stats.evictions += 1

    def _on_ended(self, ended: pb.SessionEnded) -> None:
        reason = ended.reason
        if self._closing or reason == "closed":
            self._finish(ClientClosed("the subscription is closed"))
            self._session.forget(self)
            return
        self._leaving()
        self._state = SUB_WAITING
        code = _code_from_int(ended.code)
        if reason == "rejected":
            error = TinybrokerError(code, ended.message or f"the broker refused the subscription ({code.name})")
            self._last_cause = error
            # UNAVAILABLE: a broker that cannot serve now (shutting down, a
            # replica cut off from NATS); ALREADY_EXISTS on a re-open: the
            # broker has not yet seen the old stream of a named id go.
            retry = self.resubscribe and (
                code == _UNAVAILABLE or (self._opened_once and code == grpc.StatusCode.ALREADY_EXISTS)
            )
            if retry:
                if code == _UNAVAILABLE:
                    self._session.request_move_on(TinybrokerError(code, f"{self._session._conn.target}: {error.message}"))
                if self._away is None and self._opened_once:
                    self._away = ("rejected", 0)
                self._backoff_then_reopen(str(error))
                return
            self._session.forget(self)
            if not self._opened_once:
                self._finish(None, error)
                return
            event = Ended(self.subscription_id, reason, 0, self._last_sequence, code, error.message, False)
            self._count_end(event)
            self._emit(event)
            self._finish(
                SubscriptionEnded(
                    reason, code=code, message=error.message, subscription_id=self.subscription_id,
                    last_sequence=self._last_sequence,
                )
            )
            return
        again = self.resubscribe and reason != "closed_by_admin"
        last = max(ended.last_sequence, self._last_sequence)
        event = Ended(self.subscription_id, reason, ended.dropped, last, code, ended.message, again)
        self._count_end(event)
        self._emit(event)
        if again:
            self._away = (reason, ended.dropped)
            self._after_end = True
            self._backoff_then_reopen(None)
        else:
            self._session.forget(self)
            self._finish(
                SubscriptionEnded(
                    reason, dropped=ended.dropped, last_sequence=last, code=code,
                    message=ended.message, subscription_id=self.subscription_id,
                )
            )

    def _on_lost(self) -> None:
        """The session was lost: WAITING, to be opened on the next one."""
        if self._state in (SUB_OPENING, SUB_OPEN):
            self._leaving()
            self._state = SUB_WAITING
            if self._opened_once and self._away is None:
                self._away = ("connection_lost", 0)

    def _backoff_then_reopen(self, cause: Optional[str]) -> None:
        if self._received > self._received_at_open:
            self._backoff.reset()  # the application took one since the last open
        self._state = SUB_BACKOFF
        delay = self._backoff.next_delay()
        self._emit(Resubscribing(self.subscription_id, delay, cause))
        self._retry = asyncio.get_running_loop().call_later(delay, self._reopen)

    def _reopen(self) -> None:
        self._retry = None
        if not self._closing and self._state == SUB_BACKOFF:
            self._state = SUB_WAITING
            self._session.try_open(self)

    def _settle(self, message: Message, nack: bool) -> bool:
        if (
            self._request.ack_mode != pb.ACK_MODE_MANUAL
            or message._handle != self._handle
            or self._state not in (SUB_OPENING, SUB_OPEN)
        ):
            return False
        (self._nacks if nack else self._acks).append(message.raw.sequence)
        self._session.mark_dirty(self)
        return True

    def _finish(self, final: Optional[BaseException], open_error: Optional[BaseException] = None) -> None:
        self._state = SUB_DONE
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if isinstance(final, ClientClosed):
            self._buffer.clear()
        if self._final is None:
            self._final = final if final is not None else ClientClosed("the subscription is closed")
        if not self._opened.done():
            self._opened.set_exception(open_error or final or ClientClosed("closed before it opened"))
            # Nobody may wait for it (a timed-out subscribe): do not warn.
            self._opened.exception()
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(None)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        thread_waiter = self._thread_waiter
        if thread_waiter is not None:
            thread_waiter.set()
