"""The asyncio client: :func:`connect` and :class:`Client`."""

from __future__ import annotations

import asyncio
import datetime
import os
from typing import Any, Generator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from . import _tracing
from ._connection import Connection, parse_targets
from ._pb import broker_pb2 as pb
from .admin import Admin
from .errors import TinybrokerError
from .publisher import Publisher, _as_bytes
from .session import EventCallback, Session, Subscription
from .types import AckMode, Message, PublishResult

#: Credit window per subscription when none is given.
DEFAULT_WINDOW = 256

Address = Union[str, Sequence[str], None]


class Client:
    """A connection to a broker (one HTTP/2 connection, one Session stream
    for all its subscriptions). Make one with :func:`connect`; share it
    between the tasks of its event loop. Close it with :meth:`close` or
    ``async with``.

    Attributes:
        admin: the Admin calls (:class:`~tinybroker.admin.Admin`).
    """

    def __init__(
        self,
        addr: Address = None,
        *,
        token: Optional[str] = None,
        ca_file: Optional[str] = None,
        window: int = DEFAULT_WINDOW,
        resubscribe: bool = True,
        tracing: bool = True,
        channel_options: Optional[Sequence[Tuple[str, Any]]] = None,
    ) -> None:
        if token is None:
            token = os.environ.get("TINYBROKER_AUTH_TOKEN") or None
        self._conn = Connection(parse_targets(addr), token=token, ca_file=ca_file, options=channel_options)
        self.window = window
        self.resubscribe = resubscribe
        self._tracing = tracing and _tracing.AVAILABLE
        self._session: Optional[Session] = None
        self._closed = False
        self.admin = Admin(self)

    @property
    def address(self) -> str:
        """The address in use (``http://`` or ``https://``)."""
        return str(self._conn.target)

    @property
    def reconnects(self) -> int:
        """How many times the session was started again after a loss."""
        return self._session.reconnects if self._session is not None else 0

    @property
    def failovers(self) -> int:
        """How many times the client moved to the next address of its list."""
        return self._conn.failovers

    async def connect(self, timeout: float = 5.0) -> "Client":
        """Connects to the first address that answers (each tried in turn
        for up to ``timeout`` seconds); TinybrokerError(UNAVAILABLE) if none."""
        await self._conn.connect(timeout)
        self._session = Session(self._conn)
        return self

    async def close(self) -> None:
        """Closes every subscription (their iteration stops) and the connection."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            await self._session.close()
        await self._conn.close()

    async def __aenter__(self) -> "Client":
        if self._session is None and not self._closed:
            await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _after_failure(self, error: grpc.aio.AioRpcError) -> None:
        # A call found the broker gone: with a list, the next call goes on.
        if error.code() == grpc.StatusCode.UNAVAILABLE and len(self._conn.targets) > 1 and self._conn.down():
            if self._session is None or self._session._requests is None:
                await self._conn.failover()

    def _session_or_raise(self) -> Session:
        if self._closed or self._session is None:
            raise TinybrokerError(grpc.StatusCode.FAILED_PRECONDITION, "the client is not connected")
        return self._session

    async def publish(
        self,
        topic: str,
        payload: Union[bytes, str] = b"",
        headers: Optional[Mapping[str, str]] = None,
        *,
        timeout: Optional[float] = 10.0,
    ) -> PublishResult:
        """Publishes one message and returns its sequence and how many
        subscriptions and groups it matched. A ``str`` payload is sent as
        UTF-8. With the OpenTelemetry API present, the current span's
        ``traceparent``/``tracestate`` are added to the headers."""
        if self._tracing:
            headers = dict(headers or {})
            _tracing.inject(headers)
        request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload), headers=headers)
        try:
            r = await self._conn.broker.Publish(request, metadata=self._conn.metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            await self._after_failure(e)
            raise TinybrokerError.from_rpc_error(e) from None
        return PublishResult(r.sequence, r.matched_subscriptions, r.matched_groups)

    def publisher(self) -> Publisher:
        """A :class:`~tinybroker.Publisher` for high rates over ``PublishStream``."""
        return Publisher(self, self._tracing)

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
            window: credit window (default the client's, 256).
            resubscribe: open it again after an eviction, a shutdown or a
                lost connection (default the client's, True).
            on_event: called with every
                :class:`~tinybroker.SubscriptionEvent` (ends, re-subscriptions,
                gaps), on the client's loop.
            timeout: seconds to wait for a broker that answers.

        Raises:
            TinybrokerError: the broker refused it (INVALID_ARGUMENT for a bad
                pattern, ALREADY_EXISTS for an id in use, ...), or no broker
                answered within ``timeout``.
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
        session.open(sub)
        try:
            await asyncio.wait_for(asyncio.shield(sub._opened), timeout)
        except asyncio.TimeoutError:
            cause = sub._last_cause
            await sub.close()
            raise TinybrokerError(
                cause.code if cause else grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the subscription was not opened within {timeout:g} s"
                + (f" (last attempt: {cause.code.name}: {cause.message})" if cause else ""),
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
        mode = AckMode(ack_mode) if ack_mode is not None else None
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
    window: int = DEFAULT_WINDOW,
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
        window: credit window per subscription (messages the broker may
            send it beyond what the application took).
        resubscribe: re-subscribe after evictions, shutdowns and lost
            connections (per subscription too).
        tracing: inject and extract W3C trace context when the OpenTelemetry
            API is installed.
        connect_timeout: seconds to wait for each address.
        channel_options: extra grpc channel options.

    Raises:
        TinybrokerError: UNAVAILABLE when no address answers.
    """
    client = Client(
        addr, token=token, ca_file=ca_file, window=window, resubscribe=resubscribe, tracing=tracing,
        channel_options=channel_options,
    )
    return _Connect(client, connect_timeout)


