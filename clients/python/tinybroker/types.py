"""The values the client hands the application: messages, publish results,
subscription events. None of them exposes the generated protobuf types
(each keeps the raw one in ``raw`` for what is not mapped)."""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple

from . import _tracing

__all__ = [
    "AckMode",
    "Message",
    "PublishResult",
    "PublishStreamResult",
    "Rejection",
    "FlushResult",
    "ConnectionEvent",
    "Connected",
    "Disconnected",
    "Reconnected",
    "Closed",
    "ClientStats",
    "SubscriptionEvent",
    "Opened",
    "Ended",
    "Resubscribing",
    "Resubscribed",
    "Gap",
    "SubscriptionStats",
]


class AckMode(str, enum.Enum):
    """When a consumer-group message counts as done."""

    AUTO = "auto"
    """Done once written to the member's stream (at most once)."""
    MANUAL = "manual"
    """In flight until ``ack()``; redelivered on deadline, ``nack()`` or disconnect."""


@dataclass(frozen=True)
class PublishResult:
    """What the broker answered to one publish."""

    sequence: int
    """Broker-assigned sequence, strictly increasing over the broker's lifetime."""
    matched_subscriptions: int
    """Broadcast subscriptions the message was queued for."""
    matched_groups: int
    """Consumer groups the message was routed to."""


@dataclass(frozen=True)
class PublishStreamResult:
    """What one ``PublishStream`` of a :class:`~tinybroker.Publisher` carried."""

    accepted: int
    first_sequence: int
    last_sequence: int


class _Settles(Protocol):
    """What a :class:`Message` uses of the subscription it came on (a
    ``session.Subscription``; session.py imports this module, not the other
    way round)."""

    subscription_id: Optional[str]

    def _settle(self, message: "Message", nack: bool) -> bool: ...


class Message:
    """One delivered message.

    Attributes (read-only): ``topic``, ``payload`` (bytes), ``headers``
    (dict), ``sequence``, ``publish_time`` (aware ``datetime``),
    ``subscription_id``, ``consumer_group`` and ``delivery_attempt`` (1 on
    first delivery). ``raw`` is the protobuf ``Message``.

    In a MANUAL consumer group call ``await msg.ack()`` when done or
    ``await msg.nack()`` to hand it back for redelivery; both travel
    in-band on the client's session, coalesced per subscription. In AUTO mode and for broadcast
    subscriptions they do nothing.
    """

    __slots__ = ("raw", "_sub", "_handle", "_headers")

    def __init__(self, raw: Any, sub: "_Settles", handle: int) -> None:
        self.raw = raw
        self._sub = sub
        self._handle = handle  # of the open it came on: ack() checks it
        self._headers: Optional[Dict[str, str]] = None

    @property
    def topic(self) -> str:
        return self.raw.topic

    @property
    def payload(self) -> bytes:
        return self.raw.payload

    @property
    def data(self) -> bytes:
        """The payload (the name nats-py uses)."""
        return self.raw.payload

    @property
    def headers(self) -> Dict[str, str]:
        if self._headers is None:
            self._headers = dict(self.raw.headers)
        return self._headers

    @property
    def sequence(self) -> int:
        return self.raw.sequence

    @property
    def publish_time(self) -> datetime.datetime:
        ts = self.raw.publish_time
        return datetime.datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=datetime.timezone.utc)

    @property
    def subscription_id(self) -> str:
        return self.raw.subscription_id or self._sub.subscription_id or ""

    @property
    def consumer_group(self) -> str:
        return self.raw.consumer_group

    @property
    def delivery_attempt(self) -> int:
        return self.raw.delivery_attempt

    @property
    def trace_context(self) -> Optional[Any]:
        """The OpenTelemetry ``Context`` from the ``traceparent`` /
        ``tracestate`` headers (None without the OpenTelemetry API): pass it
        as ``context=`` when starting the consumer's span."""
        return _tracing.extract(self.headers)

    async def ack(self) -> bool:
        """Acknowledges this MANUAL-group message in-band (no reply): the
        sequence joins the subscription's pending acks, which go out as one
        ``SessionAck`` on the next turn of the event loop.

        Returns False when nothing will be sent: not a MANUAL group, or the
        message came before the subscription was opened again (on an earlier
        session: the broker redelivers it anyway), or it is closed."""
        return self._sub._settle(self, nack=False)

    async def nack(self) -> bool:
        """Hands this MANUAL-group message back for immediate redelivery to
        another member (or this one). Returns False as :meth:`ack` does."""
        return self._sub._settle(self, nack=True)

    def __repr__(self) -> str:
        return (
            f"Message(topic={self.topic!r}, sequence={self.sequence}, "
            f"payload={self.payload[:64]!r}{'...' if len(self.payload) > 64 else ''})"
        )


@dataclass(frozen=True)
class SubscriptionEvent:
    """Base of what happens to a subscription besides its messages."""

    subscription_id: Optional[str]


@dataclass(frozen=True)
class Opened(SubscriptionEvent):
    """The broker registered the subscription (first open)."""


@dataclass(frozen=True)
class Ended(SubscriptionEvent):
    """The broker ended the subscription.

    ``reason`` is the broker's: ``evicted``, ``closed_by_admin``,
    ``shutdown`` or ``rejected`` (a re-open refused). A lost session is not
    an end (the connection events report it). ``resubscribing`` says
    whether the client opens it again."""

    reason: str
    dropped: int
    last_sequence: int
    code: Any  # grpc.StatusCode
    message: str
    resubscribing: bool


@dataclass(frozen=True)
class Resubscribing(SubscriptionEvent):
    """The subscription is opened again in ``delay`` seconds; ``cause``
    says why the last attempt failed, if one did."""

    delay: float
    cause: Optional[str] = None


@dataclass(frozen=True)
class Resubscribed(SubscriptionEvent):
    """Open again after an end (``subscription_id`` is the new id; the same
    one when the application named it). Re-opens after a lost session emit
    no event of their own; ``stats.resubscribes`` counts every re-open."""


@dataclass(frozen=True)
class Gap(SubscriptionEvent):
    """Reported with the first message after the subscription is open again
    (after an end or a lost session), when messages may have been missed.

    ``missed`` is the range of sequences (first, last, inclusive) that were
    not delivered to it, known only when the deliveries before and after
    came from the same broker instance with one sequence counter
    (``tinybroker-sequence-scope: instance``); otherwise it is None and
    ``reason`` says why: ``instance_changed`` (the broker restarted, or the
    client is on another replica), ``sequence_scope`` (cluster mode: each
    replica counts apart) or ``nothing_before`` (nothing was delivered
    before). ``dropped`` is what the broker's ``ended`` said it dropped (0
    after a lost session). ``cause`` is why it was away: ``evicted``,
    ``shutdown``, ``rejected`` or ``connection_lost``."""

    missed: Optional[Tuple[int, int]]
    reason: Optional[str]
    dropped: int
    cause: str
    last_before: int
    """Sequence of the last message delivered before (0: none)."""
    first_after: int
    """Sequence of this first message after."""


@dataclass
class SubscriptionStats:
    """Counters of one subscription (read them at any time)."""

    received: int = 0
    """Messages handed to the application."""
    ends: int = 0
    """Times its stream ended (evictions, shutdowns, lost connections, ...)."""
    evictions: int = 0
    resubscribes: int = 0
    """Times it was opened again."""
    gaps: int = 0
    """Gap events reported (each a :class:`Gap`)."""
    dropped: int = 0
    """Sum of ``dropped`` over its ends."""
    by_reason: Dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Rejection:
    """A buffered message the broker did not publish, as its
    ``PublishRejection`` said."""

    index: int
    """The message's index: its place among the client's ``publish()`` calls, from 0."""
    topic: str
    code: Any  # grpc.StatusCode
    message: str


@dataclass(frozen=True)
class FlushResult:
    """What happened to the messages published since the previous
    ``flush()`` (each message is reported by exactly one flush)."""

    accepted: int = 0
    """Messages the broker published."""
    rejected: List[Rejection] = field(default_factory=list)
    """Each message it refused, with its index, topic, code and message."""
    unconfirmed: int = 0
    """Messages written to a session lost before it answered: they may or
    may not have been published; they are not written again."""
    unconfirmed_ranges: List[Tuple[int, int]] = field(default_factory=list)
    """Their indexes, as (first, last) inclusive ranges."""
    not_sent: int = 0
    """``close()`` only: messages still in the buffer, never written."""


@dataclass(frozen=True)
class ConnectionEvent:
    """Base of the client's connection events (one per connection change,
    whatever the number of subscriptions)."""


@dataclass(frozen=True)
class Connected(ConnectionEvent):
    """The client's first session is open."""

    address: str
    instance: Optional[str]
    """The broker's ``tinybroker-instance`` (None: the broker sent none)."""


@dataclass(frozen=True)
class Disconnected(ConnectionEvent):
    """An open session was lost; the client starts one again on its own."""

    reason: str
    """The gRPC code and message, or ``"closed by the broker"`` for an OK end."""


@dataclass(frozen=True)
class Reconnected(ConnectionEvent):
    """A session is open again after a :class:`Disconnected`."""

    address: str
    instance: Optional[str]
    instance_changed: bool
    """Whether the broker's instance differs from the one before (a restart,
    another replica, or a broker that names none)."""


@dataclass(frozen=True)
class Closed(ConnectionEvent):
    """``close()`` finished."""


@dataclass(frozen=True)
class ClientStats:
    """The client's counters (``client.stats()``; payload bytes)."""

    msgs_in: int
    bytes_in: int
    msgs_out: int
    """Messages written to a session, and those of ``publish_confirmed``."""
    bytes_out: int
    reconnects: int
    """Sessions opened after a lost one."""
    pending_messages: int
    """Messages in the publish buffer (not yet written)."""
    pending_bytes: int
    """Their encoded bytes (what ``buffer_bytes`` bounds)."""
    dropped_late: int
    """Deliveries for a handle the client no longer has."""
