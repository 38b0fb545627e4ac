"""The client's one ``Session`` stream and its subscriptions.

One task (:meth:`Session._run`) owns the stream: it starts it, opens every
waiting subscription on it, reads its events and hands each delivery to the
subscriptions its handles name. When the stream fails it tells every
subscription, waits a jittered backoff, moves to the next address of a list,
and starts a new session on which the subscriptions that re-subscribe are
opened again. Everything runs on the client's event loop, so no lock is
needed.

A :class:`Subscription` is opened with a credit window (256 by default) and
gives credit back as the application takes messages, so the broker never
sends it more than its window beyond what the application has taken, and
one the application stops reading stalls (and is evicted) alone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Optional

import grpc
import grpc.aio

from ._pb import broker_pb2 as pb
from .errors import SubscriptionEnded, TinybrokerError, _code_from_int
from .types import (
    Ended,
    Gap,
    Message,
    Opened,
    Resubscribed,
    Resubscribing,
    SubscriptionEvent,
    SubscriptionStats,
)

if TYPE_CHECKING:  # pragma: no cover
    from ._connection import Connection

log = logging.getLogger("tinybroker")

#: How long the broker has to accept a session (it answers at once).
START_TIMEOUT = 10.0

# Subscription states.
_WAITING = 0  # not on the current session (none yet, or lost)
_OPENING = 1  # `open` sent, `opened` not yet received
_OPEN = 2
_DONE = 3  # ended for good

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
}


class Backoff:
    """Exponential backoff with jitter: 100 ms doubling to ``cap`` seconds,
    each delay 0-25 % longer at random."""

    def __init__(self, first: float = 0.1, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self.first

    def next_delay(self) -> float:
        delay = self._next * (1 + random.random() * 0.25)
        self._next = min(self._next * 2, self.cap)
        return delay


class _Requests:
    """The session's outgoing requests: an async iterator grpc consumes;
    ``put`` never blocks (requests are small: opens, credit, acks)."""

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


class _StartFailed(Exception):
    def __init__(self, error: TinybrokerError) -> None:
        self.error = error


class _ReplicaUnavailable(Exception):
    """An open was refused UNAVAILABLE (a replica that lost NATS, a broker
    shutting down) while the client knows other addresses."""

    def __init__(self, error: TinybrokerError) -> None:
        self.error = error


class Session:
    """The one Session stream of a client, and its subscriptions by handle."""

    def __init__(self, connection: "Connection") -> None:
        self._conn = connection
        self._subs: Dict[int, "Subscription"] = {}
        self._last_handle = 0
        self._requests: Optional[_Requests] = None
        self._call: Optional[grpc.aio.StreamStreamCall] = None
        self._task: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self._closed = False
        self._backoff = Backoff()
        #: Sessions started after the first (the connection was lost and
        #: found again).
        self.reconnects = 0
        self._started = 0

    # === the application's side ===

    def open(self, sub: "Subscription") -> None:
        """Opens ``sub`` under a new handle, now or on the next session."""
        handle = self._next_handle()
        sub._handle = handle
        sub._state = _WAITING
        self._subs[handle] = sub
        if self._requests is not None:
            self._send_open(sub)
        else:
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._run())
            self._wake.set()

    def send(self, request: pb.SessionRequest) -> None:
        if self._requests is not None:
            self._requests.put(request)

    def forget(self, sub: "Subscription") -> None:
        if self._subs.get(sub._handle) is sub:
            del self._subs[sub._handle]

    async def close(self, timeout: float = 2.0) -> None:
        """Half-closes the session (the broker ends every subscription
        "closed" and then the stream) and ends the task."""
        self._closed = True
        for sub in list(self._subs.values()):
            sub._closing = True
        if self._requests is not None and self._call is not None and self._task is not None:
            self._requests.close()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, Exception):
                pass
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
        for sub in list(self._subs.values()):
            sub._finish(None)
        self._subs.clear()

    # === the task ===

    def _next_handle(self) -> int:
        while True:
            self._last_handle = self._last_handle % 0xFFFFFFFF + 1
            if self._last_handle not in self._subs:
                return self._last_handle

    def _send_open(self, sub: "Subscription") -> None:
        sub._generation += 1
        sub._state = _OPENING
        sub._taken = 0
        # What it still holds from before counts against its window: the
        # client never holds more than the window (credit 0 would mean none).
        credit = max(1, sub.window - len(sub._buffer))
        assert self._requests is not None
        self._requests.put(
            pb.SessionRequest(open=pb.SessionOpen(handle=sub._handle, subscription=sub._request, credit=credit))
        )

    async def _run(self) -> None:
        while not self._closed:
            if not any(s._state == _WAITING for s in self._subs.values()):
                self._wake.clear()
                await self._wake.wait()
                continue
            starting = moving = False
            try:
                await self._serve()
                if self._closed:
                    return
                failure = TinybrokerError(grpc.StatusCode.UNAVAILABLE, "the broker ended the session")
            except _StartFailed as e:
                failure, starting = e.error, True
            except _ReplicaUnavailable as e:
                failure, moving = e.error, True
            except grpc.aio.AioRpcError as e:
                failure = TinybrokerError.from_rpc_error(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # pragma: no cover - a bug, not the broker
                log.exception("tinybroker session failed")
                failure = TinybrokerError(grpc.StatusCode.INTERNAL, repr(e))
            finally:
                if self._requests is not None:
                    self._requests.close()  # ends grpc's task that reads it
                self._requests = None
                call, self._call = self._call, None
                if call is not None and not call.done():
                    call.cancel()
            if self._closed:
                return
            if moving:
                await self._conn.failover()
            if not self._subs:
                continue  # every subscription had ended before (a shutdown)
            self._lost(failure, starting)
            if not self._subs:
                continue
            delay = self._backoff.next_delay()
            for sub in list(self._subs.values()):
                sub._emit(Resubscribing(sub.subscription_id, delay, str(failure) if starting else None))
            await asyncio.sleep(delay)
            if not moving and failure.code in _RETRYABLE and (
                self._conn.down() or starting or len(self._conn.targets) > 1
            ):
                await self._conn.failover()

    async def _serve(self) -> None:
        requests = _Requests()
        call = self._conn.broker.Session(requests, metadata=self._conn.metadata)
        self._call = call
        try:
            await asyncio.wait_for(call.initial_metadata(), START_TIMEOUT)
        except asyncio.TimeoutError:
            raise _StartFailed(
                TinybrokerError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self._conn.target} did not accept a session within {START_TIMEOUT:g} s",
                )
            )
        except grpc.aio.AioRpcError as e:
            requests.close()
            raise _StartFailed(TinybrokerError.from_rpc_error(e))
        if call.done():
            requests.close()
            code = await call.code()
            details = await call.details()
            raise _StartFailed(TinybrokerError(code, f"{self._conn.target}: {details}"))
        self._requests = requests
        self._started += 1
        if self._started > 1:
            self.reconnects += 1
        for sub in list(self._subs.values()):
            if sub._state == _WAITING:
                self._send_open(sub)
        subs = self._subs
        read = call.read
        eof = grpc.aio.EOF
        while True:
            event = await read()
            if event is eof:
                return
            kind = event.WhichOneof("event")
            if kind == "delivery":
                delivery = event.delivery
                message = delivery.message
                for handle in delivery.handles:
                    sub = subs.get(handle)
                    if sub is not None:
                        sub._deliver(message, handle)
            elif kind == "opened":
                opened = event.opened
                sub = subs.get(opened.handle)
                if sub is not None:
                    self._backoff.reset()
                    sub._on_opened(opened.subscription_id)
            elif kind == "ended":
                ended = event.ended
                sub = subs.pop(ended.handle, None)
                if sub is not None:
                    sub._on_ended(ended)
                if ended.reason == "rejected" and ended.code == _UNAVAILABLE and len(self._conn.targets) > 1:
                    # This replica cannot serve now: try the next address.
                    raise _ReplicaUnavailable(
                        TinybrokerError(grpc.StatusCode.UNAVAILABLE, f"{self._conn.target}: {ended.message}")
                    )

    def _lost(self, failure: TinybrokerError, starting: bool) -> None:
        for handle, sub in list(self._subs.items()):
            if not sub._on_lost(failure, starting):
                self._subs.pop(handle, None)


EventCallback = Callable[[SubscriptionEvent], None]

_CLOSED = object()


class Subscription:
    """A subscription on its client's session: an async iterator of
    :class:`~tinybroker.Message`.

    ::

        async for msg in sub:
            ...

    The broker sends it at most ``window`` messages beyond what the
    iteration has taken. When the broker ends it (eviction, shutdown) or
    the connection is lost, the client opens it again after a jittered
    backoff (unless ``resubscribe=False``), with the same id when the
    application named one, and reports each step as a
    :class:`~tinybroker.SubscriptionEvent` (to ``on_event``, in
    :attr:`events`, and counted in :attr:`stats`), with a
    :class:`~tinybroker.Gap` when messages arrive again. Iteration stops
    after :meth:`close`; it raises :class:`~tinybroker.SubscriptionEnded`
    when the subscription ended for good otherwise (an admin closed it, or
    it ended and does not re-subscribe).
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
            raise ValueError("window must be at least 1")
        self._session = session
        self._request = request
        #: Credit window: deliveries the broker may send beyond what was taken.
        self.window = window
        self._batch = max(1, window // 4)
        self.resubscribe = resubscribe
        self._on_event = on_event
        self._message_class = message_class
        #: The id the broker gave it (the one the application named, if any).
        self.subscription_id: Optional[str] = request.subscription_id or None
        #: Counters: received, ends, evictions, resubscribes, gaps, dropped.
        self.stats = SubscriptionStats()
        #: The last 100 events, oldest first.
        self.events: Deque[SubscriptionEvent] = collections.deque(maxlen=100)
        #: The last Gap reported, if any.
        self.last_gap: Optional[Gap] = None
        self._handle = 0
        self._state = _WAITING
        self._generation = 0
        self._buffer: Deque[Message] = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._taken = 0
        self._last_sequence = 0
        self._resuming: Optional[Ended] = None
        self._final: object = None
        self._opened_once = False
        self._opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = False
        self._closed_future: Optional[asyncio.Future] = None
        self._retry: Optional[asyncio.TimerHandle] = None
        self._backoff = Backoff()
        self._last_cause: Optional[TinybrokerError] = None

    # --- what the application sees ---

    @property
    def patterns(self) -> List[str]:
        return list(self._request.topic_patterns)

    @property
    def group(self) -> Optional[str]:
        return self._request.consumer_group or None

    @property
    def is_open(self) -> bool:
        """Open on the broker right now (not between an end and a re-open)."""
        return self._state == _OPEN

    @property
    def done(self) -> bool:
        """Ended for good: iteration stops or raises once the buffer is empty."""
        return self._state == _DONE

    @property
    def pending(self) -> int:
        """Messages received and not yet taken (never more than the window)."""
        return len(self._buffer)

    @property
    def messages(self) -> "Subscription":
        """The subscription itself (``async for msg in sub.messages``, as
        in nats-py)."""
        return self

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> Message:
        buffer = self._buffer
        while not buffer:
            final = self._final
            if final is not None:
                if final is _CLOSED:
                    raise StopAsyncIteration
                raise final  # type: ignore[misc]
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        message = buffer.popleft()
        self.stats.received += 1
        if _WAITING < self._state < _DONE:
            self._taken += 1
            if self._taken >= self._batch:
                self._session.send(
                    pb.SessionRequest(credit=pb.SessionCredit(handle=self._handle, messages=self._taken))
                )
                self._taken = 0
        return message

    async def next(self, timeout: Optional[float] = None) -> Message:
        """The next message; ``asyncio.TimeoutError`` after ``timeout``
        seconds, ``StopAsyncIteration`` after :meth:`close`."""
        if timeout is None:
            return await self.__anext__()
        return await asyncio.wait_for(self.__anext__(), timeout)

    next_msg = next

    async def close(self, timeout: float = 5.0) -> None:
        """Closes the subscription and waits until the broker has ended it
        (acks sent before have then been applied). Messages not yet taken
        are dropped (a MANUAL group's go to another member). Iteration then
        stops."""
        if self._state == _DONE:
            return
        self._closing = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._buffer.clear()
        if self._state in (_OPENING, _OPEN) and self._session._requests is not None:
            self._closed_future = asyncio.get_running_loop().create_future()
            self._session.send(pb.SessionRequest(close=pb.SessionClose(handle=self._handle)))
            try:
                await asyncio.wait_for(asyncio.shield(self._closed_future), timeout)
            except asyncio.TimeoutError:
                pass
        self._session.forget(self)
        self._finish(None)

    unsubscribe = close

    async def __aenter__(self) -> "Subscription":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = ["waiting", "opening", "open", "done"][self._state]
        return f"<Subscription {self.subscription_id} {self.patterns} {state}>"

    # --- what the session calls ---

    def _emit(self, event: SubscriptionEvent) -> None:
        self.events.append(event)
        log.debug("tinybroker: %s", event)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:  # pragma: no cover - the application's bug
                log.exception("tinybroker on_event callback failed")

    def _deliver(self, raw: pb.Message, handle: int) -> None:
        if self._resuming is not None:
            ended, self._resuming = self._resuming, None
            gap = Gap(
                self.subscription_id,
                last_before=self._last_sequence,
                first_after=raw.sequence,
                dropped=ended.dropped,
                reason=ended.reason,
            )
            self.last_gap = gap
            self.stats.gaps += 1
            self._emit(gap)
        self._last_sequence = raw.sequence
        self._buffer.append(self._message_class(raw, self, handle, self._generation))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_opened(self, subscription_id: str) -> None:
        self._state = _OPEN
        self.subscription_id = subscription_id
        self._last_cause = None
        if not self._opened_once:
            self._opened_once = True
            if not self._opened.done():
                self._opened.set_result(None)
            self._emit(Opened(subscription_id))
        else:
            self._backoff.reset()
            self.stats.resubscribes += 1
            self._emit(Resubscribed(subscription_id))
        if self._closing:
            self._session.send(pb.SessionRequest(close=pb.SessionClose(handle=self._handle)))

    def _count_end(self, ended: Ended) -> None:
        self.stats.ends += 1
        self.stats.dropped += ended.dropped
        self.stats.by_reason[ended.reason] = self.stats.by_reason.get(ended.reason, 0) + 1
        if ended.reason == "evicted":
            self.stats.evictions += 1

    def _on_ended(self, ended: pb.SessionEnded) -> None:
        self._state = _WAITING
        reason = ended.reason
        if self._closing or reason == "closed":
            self._finish(None)
            return
        code = _code_from_int(ended.code)
        if reason == "rejected":
            error = TinybrokerError(code, ended.message)
            self._last_cause = error
            if not self._opened_once:
                # A broker that cannot serve now (UNAVAILABLE): subscribe()
                # waits, until its timeout, for one that can.
                if self.resubscribe and code == grpc.StatusCode.UNAVAILABLE:
                    self._schedule_retry(str(error))
                    return
                self._finish(None, error)
                return
            if self.resubscribe and (code in _RETRYABLE or code == grpc.StatusCode.ALREADY_EXISTS):
                self._schedule_retry(str(error))
                return
            self._finish(
                SubscriptionEnded(
                    reason, code=code, message=ended.message, subscription_id=self.subscription_id,
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
            self._resuming = event
            self._schedule_retry(None)
        else:
            self._finish(
                SubscriptionEnded(
                    reason,
                    dropped=ended.dropped,
                    last_sequence=last,
                    code=code,
                    message=ended.message,
                    subscription_id=self.subscription_id,
                )
            )

    def _on_lost(self, failure: TinybrokerError, starting: bool) -> bool:
        """The session failed; True to stay and be opened on the next one."""
        was = self._state
        self._state = _WAITING
        if self._closing:
            self._finish(None)
            return False
        self._last_cause = failure
        retry = self.resubscribe and failure.code in _RETRYABLE
        if not self._opened_once:
            # subscribe() waits (until its timeout) for a broker that answers.
            if failure.code in _RETRYABLE:
                return True
            self._finish(None, failure)
            return False
        if not starting and was != _WAITING:
            event = Ended(
                self.subscription_id, "connection_lost", 0, self._last_sequence, failure.code,
                failure.message, retry,
            )
            self._count_end(event)
            self._emit(event)
            if retry:
                self._resuming = event
        if retry:
            return True
        self._finish(
            SubscriptionEnded(
                "connection_lost",
                last_sequence=self._last_sequence,
                code=failure.code,
                message=failure.message,
                subscription_id=self.subscription_id,
            )
        )
        return False

    def _schedule_retry(self, cause: Optional[str]) -> None:
        delay = self._backoff.next_delay()
        self._emit(Resubscribing(self.subscription_id, delay, cause))
        self._retry = asyncio.get_running_loop().call_later(delay, self._reopen)

    def _reopen(self) -> None:
        self._retry = None
        if not self._closing and self._state != _DONE and not self._session._closed:
            self._session.open(self)

    def _settle(self, message: Message, nack: bool) -> bool:
        if (
            self._state != _OPEN
            or self._request.ack_mode != pb.ACK_MODE_MANUAL
            or message._generation != self._generation
            or message._handle != self._handle
        ):
            return False
        sequences = [message.raw.sequence]
        if nack:
            request = pb.SessionRequest(nack=pb.SessionNack(handle=self._handle, sequences=sequences))
        else:
            request = pb.SessionRequest(ack=pb.SessionAck(handle=self._handle, sequences=sequences))
        self._session.send(request)
        return True

    def _finish(self, final: Optional[BaseException], open_error: Optional[BaseException] = None) -> None:
        self._state = _DONE
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._final is None:
            self._final = final if final is not None else _CLOSED
        if not self._opened.done():
            self._opened.set_exception(
                open_error or final or TinybrokerError(grpc.StatusCode.CANCELLED, "closed before it opened")
            )
            # Nobody may wait for it (a timed-out subscribe): do not warn.
            self._opened.exception()
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(None)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
