"""The values the client hands the application: messages, publish results,
subscription events. None of them exposes the generated protobuf types
(each keeps the raw one in ``raw`` for what is not mapped)."""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

from . import _tracing

if TYPE_CHECKING:  # pragma: no cover
    from .session import Subscription

__all__ = [
    "AckMode",
    "Message",
    "PublishResult",
    "PublishStreamResult",
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


class Message:
    """One delivered message.

    Attributes (read-only): ``topic``, ``payload`` (bytes), ``headers``
    (dict), ``sequence``, ``publish_time`` (aware ``datetime``),
    ``subscription_id``, ``consumer_group`` and ``delivery_attempt`` (1 on
    first delivery). ``raw`` is the protobuf ``Message``.

    In a MANUAL consumer group call ``await msg.ack()`` when done or
    ``await msg.nack()`` to hand it back for redelivery; both travel
    in-band on the client's session. In AUTO mode and for broadcast
    subscriptions they do nothing.
    """

    __slots__ = ("raw", "_sub", "_handle", "_generation", "_headers")

    def __init__(self, raw: Any, sub: "Subscription", handle: int, generation: int) -> None:
        self.raw = raw
        self._sub = sub
        self._handle = handle
        self._generation = generation
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
        """Acknowledges this MANUAL-group message in-band (no reply).

        Returns False when nothing was sent: not a MANUAL group, or the
        subscription was re-opened since (the broker redelivers the message
        anyway) or is closed."""
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
    """The subscription's stream ended.

    ``reason`` is the broker's (``evicted``, ``closed_by_admin``,
    ``shutdown``, ``rejected``) or ``connection_lost`` when the session
    failed. ``resubscribing`` says whether the client opens it again."""

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
    """Open again (``subscription_id`` is the new id; the same one when the
    application named it)."""


@dataclass(frozen=True)
class Gap(SubscriptionEvent):
    """The first message after a re-subscription: messages published with
    sequences between ``last_before`` and ``first_after`` (exclusive) while
    the subscription was away were not delivered to it. ``last_before`` is 0
    when it had received nothing before. ``dropped`` is what the broker said
    it dropped when it ended the old stream."""

    last_before: int
    first_after: int
    dropped: int
    reason: str


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
    """Re-subscriptions after which a message arrived (each a :class:`Gap`)."""
    dropped: int = 0
    """Sum of ``dropped`` over its ends."""
    by_reason: Dict[str, int] = field(default_factory=dict)
