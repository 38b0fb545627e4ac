"""The asyncio client: :func:`connect` and :class:`Client`."""

from __future__ import annotations

import asyncio
import datetime
import os
import weakref
from typing import Any, AsyncIterator, Callable, Generator, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from . import _tracing
from ._connection import Connection, parse_targets
from ._pb import admin_pb2 as apb
from ._pb import broker_pb2 as pb
from .admin import Admin
from .constants import BATCH_MESSAGES, BUFFER_BYTES, CLOSE_TIMEOUT, WINDOW
from .errors import ClientClosed, PublishError, Timeout, TinybrokerError, UsageError
from .publisher import Publisher, _as_bytes
from .session import ConnectionCallback, EventCallback, Session, Subscription
from .types import AckMode, ClientStats, Closed, ConnectionEvent, FlushResult, Message, PublishResult

#: Credit window per subscription when none is given (``WINDOW``).
DEFAULT_WINDOW = WINDOW

Address = Union[str, Sequence[str], None]


class Client:
    """A connection to a broker: one HTTP/2 connection and, once anything
    needs it, one Session stream that carries every subscription, ack,
    credit and buffered publish of the client. Make one with
    :func:`connect`; share it between the tasks of its event loop. Close it
    with :meth:`close` or ``async with``.

    Attributes:
        admin: the Admin calls (:class:`~tinybroker.admin.Admin`).
    """

    def __init__(
        self,
        addr: Address = None,
        *,
        token: Optional[str] = None,
        ca_file: Optional[str] = None,
        window: int = WINDOW,
        buffer_bytes: int = BUFFER_BYTES,
        resubscribe: bool = True,
        tracing: bool = True,
        channel_options: Optional[Sequence[Tuple[str, Any]]] = None,
    ) -> None:
        if window < 1:
            raise UsageError(f"window must be at least 1, not {window}")
        if buffer_bytes < 1:
            raise UsageError(f"buffer_bytes must be at least 1, not {buffer_bytes}")
        if token is None:
            token = os.environ.get("TINYBROKER_AUTH_TOKEN") or None
        self._conn = Connection(parse_targets(addr), token=token, ca_file=ca_file, options=channel_options)
        self.window = window
        self.buffer_bytes = buffer_bytes
        self.resubscribe = resubscribe
        self._tracing = tracing and _tracing.AVAILABLE
        self._session: Optional[Session] = None
        self._closed = False
        self._close_result: Optional[FlushResult] = None
        self._publishers: "weakref.WeakSet[Publisher]" = weakref.WeakSet()
        self.admin = Admin(self)

    @property
    def address(self) -> str:
        """The address in use (``http://`` or ``https://``)."""
        return str(self._conn.target)

    @property
    def reconnects(self) -> int:
        """Sessions opened again after a lost one."""
        return self._session.reconnects if self._session is not None else 0

    @property
    def failovers(self) -> int:
        """How many times the client moved to the next address of its list."""
        return self._conn.failovers

    @property
    def session_state(self) -> str:
        """``IDLE``, ``STARTING``, ``OPEN``, ``WAITING`` or ``CLOSED``."""
        if self._closed:
            return "CLOSED"
        return self._session.state if self._session is not None else "IDLE"

    @property
    def instance(self) -> Optional[str]:
        """The broker's ``tinybroker-instance`` on the current session."""
        return self._session.instance if self._session is not None else None

    async def connect(self, timeout: float = 5.0) -> "Client":
        """Connects to the first address that answers (each tried in turn
        for up to ``timeout`` seconds) and reads the broker's batch limits;
        TinybrokerError(UNAVAILABLE) if none answers."""
        self._check_open()
        await self._conn.connect(timeout)
        batch_messages, max_message_bytes = BATCH_MESSAGES, None
        try:
            info = await self._conn.admin.GetBrokerInfo(
                apb.GetBrokerInfoRequest(), metadata=self._conn.metadata, timeout=timeout
            )
            batch_messages = info.limits.max_batch_messages or BATCH_MESSAGES
            max_message_bytes = info.limits.max_message_bytes or None
        except grpc.aio.AioRpcError:
            pass  # an older broker, or Admin refused: the defaults
        self._session = Session(
            self._conn, buffer_bytes=self.buffer_bytes, batch_messages=batch_messages,
            max_message_bytes=max_message_bytes,
        )
        return self

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> FlushResult:
        """Flushes (for at most ``timeout`` seconds), ends every subscription
        and publisher, closes the connection and emits ``Closed``. Returns
        the last flush's outcomes, with ``not_sent``: messages never written.
        Every later call raises :class:`~tinybroker.ClientClosed`."""
        if self._closed:
            return self._close_result or FlushResult()
        self._closed = True
        session = self._session
        result = FlushResult()
        if session is not None:
            try:
                await session.flush(timeout)
            except Timeout:
                pass
            outcomes = session.take_outcomes()
            not_sent = session.not_sent()
            await session.close(2.0)
            # What was written and is still unanswered is unconfirmed.
            late = session.take_outcomes()
            result = FlushResult(
                outcomes.accepted + late.accepted, outcomes.rejected + late.rejected,
                outcomes.unconfirmed + late.unconfirmed, outcomes.unconfirmed_ranges + late.unconfirmed_ranges,
                not_sent,
            )
        for publisher in list(self._publishers):
            publisher._abort()
        await self._conn.close()
        self._close_result = result
        if session is not None:
            session.emit(Closed())
        return result

    async def __aenter__(self) -> "Client":
        if self._session is None and not self._closed:
            await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed()

    async def _after_failure(self, error: grpc.aio.AioRpcError) -> None:
        # A call found the broker gone: with a list, the next call goes on.
        if error.code() == grpc.StatusCode.UNAVAILABLE and len(self._conn.targets) > 1 and self._conn.down():
            if self._session is None or self._session.state != "OPEN":
                await self._conn.failover()

    def _session_or_raise(self) -> Session:
        self._check_open()
        if self._session is None:
            raise UsageError("the client is not connected: await client.connect() first")
        return self._session

    def _headers(self, headers: Optional[Mapping[str, str]]) -> Optional[Mapping[str, str]]:
        if self._tracing:
            headers = dict(headers or {})
            _tracing.inject(headers)
        return headers

    # === publishing ===

    async def publish(
        self,
        topic: str,
        payload: Union[bytes, str] = b"",
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Appends one message to the client's buffer and returns at once;
        it goes out in a ``SessionPublish`` batch on the client's session
        (when the batch is full, or on the next turn of the event loop).
        Waits only while the buffer holds ``buffer_bytes`` or more
        (backpressure). :meth:`flush` reports what the broker did with it.
        A ``str`` payload is sent as UTF-8; with the OpenTelemetry API
        present the current span's ``traceparent``/``tracestate`` are added.

        Raises:
            ClientClosed: the client is closed.
        """
        session = self._session
        if session is None or self._closed:
            session = self._session_or_raise()
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        if self._tracing:
            headers = self._headers(headers)
        if session.pending_bytes >= session.buffer_bytes:
            await session.wait_room()
        session.append(topic, payload, headers)  # type: ignore[arg-type]

    async def flush(self, timeout: Optional[float] = None) -> FlushResult:
        """Waits until every message published before the call has an
        outcome and returns what happened to those published since the
        previous flush: ``accepted``, ``rejected`` (index, topic, code,
        message) and ``unconfirmed`` (written to a session lost before it
        answered: never written again).

        Raises:
            Timeout: not all had an outcome within ``timeout`` seconds
                (nothing is lost: the next flush reports them).
            ClientClosed: the client is closed.
        """
        return await self._session_or_raise().flush(timeout)

    async def publish_confirmed(
        self,
        topic: str,
        payload: Union[bytes, str] = b"",
        headers: Optional[Mapping[str, str]] = None,
        *,
        timeout: Optional[float] = 10.0,
    ) -> PublishResult:
        """Publishes one message with the unary ``Publish`` (not through the
        buffer, so it may overtake buffered messages) and returns its
        sequence and how many subscriptions and groups it matched.

        Raises:
            PublishError: the broker refused it (its code and message).
            TinybrokerError: no broker answered.
            ClientClosed: the client is closed.
        """
        self._session_or_raise()
        request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload), headers=self._headers(headers))
        try:
            r = await self._conn.broker.Publish(request, metadata=self._conn.metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            await self._after_failure(e)
            error = TinybrokerError.from_rpc_error(e, "Publish")
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise error from None
            raise PublishError(error.code, error.message, accepted=0) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            raise ClientClosed() from None
        session = self._session
        if session is not None:
            session.msgs_out += 1
            session.bytes_out += len(request.payload)
        return PublishResult(r.sequence, r.matched_subscriptions, r.matched_groups)

    def publisher(self) -> Publisher:
        """A :class:`~tinybroker.Publisher` over ``PublishStream`` (one stream
        of its own, counts at its end)."""
        self._session_or_raise()
        publisher = Publisher(self, self._tracing)
        self._publishers.add(publisher)
        return publisher

    # === connection events and counters ===

    def on_connection_event(self, callback: ConnectionCallback) -> Callable[[], None]:
        """Calls ``callback`` (on the client's loop) with each
        :class:`~tinybroker.ConnectionEvent`: ``Connected``,
        ``Disconnected``, ``Reconnected``, ``Closed``, once per connection
        change. Returns a function that stops it."""
        return self._session_or_raise().add_callback(callback)

    async def connection_events(self) -> AsyncIterator[ConnectionEvent]:
        """The connection events from now on, as an async iterator that ends
        after ``Closed``."""
        session = self._session_or_raise()
        queue: "asyncio.Queue[ConnectionEvent]" = asyncio.Queue()
        remove = session.add_callback(queue.put_nowait)
        try:
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, Closed):
                    return
        finally:
            remove()

    def stats(self) -> ClientStats:
        """The counters: messages and payload bytes in and out, reconnects,
        what is pending in the publish buffer, late deliveries dropped."""
        if self._session is None:
            return ClientStats(0, 0, 0, 0, 0, 0, 0, 0)
        return self._session.stats()

    # === subscribing ===

    async def subscribe(
        self,
        patterns: Union[str, Sequence[str]],
        *,
        subscription_id: Optional[str] = None,
        group: Optional[str] = None,
        ack_mode: Union[AckMode, str, None] = None,
        max_in_flight: int = 0,
        ack_deadline: Union[float, datetime.timedelta, None] = None,
        window: Optional[int] = None,
        resubscribe: Optional[bool] = None,
        on_event: Optional[EventCallback] = None,
        timeout: float = 10.0,
    ) -> Subscription:
        """Opens a subscription on the client's session and returns once the
        broker has registered it.

        Args:
            patterns: one pattern or several (``deploy.*``, ``deploy.>``).
            subscription_id: an id of your own (blank: the broker makes one);
                kept when the client re-subscribes.
            group: a consumer group: each message goes to one member.
            ack_mode: ``"auto"`` (default) or ``"manual"`` (groups only):
                then ``await msg.ack()`` / ``await msg.nack()``.
            max_in_flight: group members: most messages held at once
                (0: the broker's default).
            ack_deadline: MANUAL: seconds (or a timedelta) before an unacked
                message is redelivered (None: the broker's default).
            window: credit window (default the client's, ``WINDOW``).
            resubscribe: open it again after an eviction or a shutdown
                (default the client's, True). A lost session is not an end:
                the subscription is always opened on the next one.
            on_event: called with every
                :class:`~tinybroker.SubscriptionEvent` (ends, re-subscriptions,
                gaps), on the client's loop.
            timeout: seconds to wait for a broker that answers.

        Raises:
            TinybrokerError: the broker refused it (INVALID_ARGUMENT for a bad
                pattern, ALREADY_EXISTS for an id in use, ...).
            Timeout: it was not opened within ``timeout`` seconds.
            ClientClosed: the client is closed.
        """
        session = self._session_or_raise()
        request = self._request(patterns, subscription_id, group, ack_mode, max_in_flight, ack_deadline)
        sub = Subscription(
            session,
            request,
            window=window or self.window,
            resubscribe=self.resubscribe if resubscribe is None else resubscribe,
            on_event=on_event,
            message_class=self._message_class(),
        )
        session.add(sub)
        try:
            await asyncio.wait_for(asyncio.shield(sub._opened), timeout)
        except asyncio.TimeoutError:
            cause = sub._last_cause
            await sub.close()
            raise Timeout(
                f"the subscription was not opened within {timeout:g} s"
                + (f" (last attempt: {cause.code.name}: {cause.message})" if cause else "")
            ) from None
        return sub

    def _message_class(self) -> type:
        return Message

    @staticmethod
    def _request(
        patterns: Union[str, Sequence[str]],
        subscription_id: Optional[str],
        group: Optional[str],
        ack_mode: Union[AckMode, str, None],
        max_in_flight: int,
        ack_deadline: Union[float, datetime.timedelta, None],
    ) -> pb.OpenSubscriptionRequest:
        if isinstance(patterns, str):
            patterns = [patterns]
        try:
            mode = AckMode(ack_mode) if ack_mode is not None else None
        except ValueError:
            raise UsageError(f"ack_mode must be 'auto' or 'manual', not {ack_mode!r}") from None
        if isinstance(ack_deadline, datetime.timedelta):
            ack_deadline = ack_deadline.total_seconds()
        return pb.OpenSubscriptionRequest(
            topic_patterns=list(patterns),
            mode=pb.DELIVERY_MODE_SINGLE if group else pb.DELIVERY_MODE_MULTI,
            subscription_id=subscription_id or "",
            consumer_group=group or "",
            ack_mode={None: pb.ACK_MODE_UNSPECIFIED, AckMode.AUTO: pb.ACK_MODE_AUTO, AckMode.MANUAL: pb.ACK_MODE_MANUAL}[
                mode
            ],
            max_in_flight=max_in_flight,
            ack_deadline_ms=int(ack_deadline * 1000) if ack_deadline else 0,
        )


class _Connect:
    """What :func:`connect` returns: await it, or use it with ``async with``."""

    def __init__(self, client: Client, timeout: float) -> None:
        self._client = client
        self._timeout = timeout

    def __await__(self) -> Generator[Any, None, Client]:
        return self._client.connect(self._timeout).__await__()

    async def __aenter__(self) -> Client:
        return await self._client.connect(self._timeout)

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()


def connect(
    addr: Address = None,
    *,
    token: Optional[str] = None,
    ca_file: Optional[str] = None,
    window: int = WINDOW,
    buffer_bytes: int = BUFFER_BYTES,
    resubscribe: bool = True,
    tracing: bool = True,
    connect_timeout: float = 5.0,
    channel_options: Optional[Sequence[Tuple[str, Any]]] = None,
) -> _Connect:
    """Connects to a broker: ``client = await tinybroker.connect(...)`` or
    ``async with tinybroker.connect(...) as client:``.

    Args:
        addr: ``host:port``, ``http://host:port``, ``https://host:port``
            (TLS), or a list (or comma-separated string) of them tried in
            turn. Default: ``TINYBROKER_ADDR``, else ``127.0.0.1:50051``.
        token: bearer token (default ``TINYBROKER_AUTH_TOKEN``).
        ca_file: PEM file of the CA that signed the broker's certificate
            (``https://``; default the system's roots).
        window: credit window per subscription (deliveries the broker may
            send it beyond what the application took; ``WINDOW``).
        buffer_bytes: bound of the publish buffer (``BUFFER_BYTES``).
        resubscribe: re-subscribe after evictions and shutdowns (per
            subscription too).
        tracing: inject and extract W3C trace context when the OpenTelemetry
            API is installed.
        connect_timeout: seconds to wait for each address.
        channel_options: extra grpc channel options.

    Raises:
        TinybrokerError: UNAVAILABLE when no address answers.
    """
    client = Client(
        addr, token=token, ca_file=ca_file, window=window, buffer_bytes=buffer_bytes, resubscribe=resubscribe,
        tracing=tracing, channel_options=channel_options,
    )
    return _Connect(client, connect_timeout)


