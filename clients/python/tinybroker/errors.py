"""Errors the client raises: each carries the gRPC status code and a
non-empty message (the broker's own, else one naming what happened).

A status OK is never raised: a stream that ends OK without ``close()`` is
a lost session, which the client recovers from on its own."""

from __future__ import annotations

import asyncio
import re
from typing import Optional

import grpc

__all__ = [
    "TinybrokerError",
    "ClientClosed",
    "UsageError",
    "Timeout",
    "PublishError",
    "SubscriptionEnded",
]


class TinybrokerError(Exception):
    """A call the broker refused or the client could not do.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode``), e.g.
            ``INVALID_ARGUMENT`` for a bad topic, ``UNAUTHENTICATED`` for a
            missing or wrong token, ``UNAVAILABLE`` when no broker answers.
        message: what was wrong (the broker's message; never empty).
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        if not message:
            message = f"the call ended with {code.name} and no message"
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, what: str = "the call") -> "TinybrokerError":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        code = code or grpc.StatusCode.UNKNOWN
        return cls(code, details or f"{what} ended with {code.name} and no message")


class ClientClosed(TinybrokerError):
    """The client (or the subscription, or the publisher) was closed: every
    call after ``close()`` raises it, and waiting calls end with it."""

    def __init__(self, what: str = "the client is closed") -> None:
        super().__init__(grpc.StatusCode.CANCELLED, what)


class UsageError(TinybrokerError):
    """The application used the client in a way it does not allow (a second
    concurrent ``next()`` on one subscription, a bad argument)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


_TIMEOUT_BASES = (TimeoutError,) if asyncio.TimeoutError is TimeoutError else (TimeoutError, asyncio.TimeoutError)


class Timeout(TinybrokerError, *_TIMEOUT_BASES):  # type: ignore[misc]
    """A bounded wait (``flush(timeout)``, ``next(timeout)``, ``subscribe``)
    ran out. Also a ``TimeoutError``. Nothing is lost by it."""

    def __init__(self, message: str) -> None:
        TinybrokerError.__init__(self, grpc.StatusCode.DEADLINE_EXCEEDED, message)


_ACCEPTED = re.compile(r"(\d+) (?:earlier )?messages of this stream were accepted")


class PublishError(TinybrokerError):
    """A publish the broker refused: ``publish_confirmed`` (``accepted`` 0),
    or a :class:`~tinybroker.Publisher`'s stream, which the first bad message
    ends (the messages before it stay published).

    Attributes:
        accepted: how many messages of the stream the broker accepted, as
            the broker said (None when its message does not say).
    """

    def __init__(self, code: grpc.StatusCode, message: str, accepted: Optional[int] = 0) -> None:
        super().__init__(code, message)
        self.accepted = accepted

    @classmethod
    def from_stream_error(cls, code: grpc.StatusCode, details: str) -> "PublishError":
        """The error that ended a ``PublishStream``, with the count the
        broker's message gives."""
        m = _ACCEPTED.search(details or "")
        return cls(code, details, int(m.group(1)) if m else None)


def _code_from_int(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


class SubscriptionEnded(TinybrokerError):
    """A subscription ended for good and will not be opened again.

    Raised from ``next()`` and iteration, once what the subscription held is
    taken, when the broker ended it and the client does not open it again:
    an admin closed it (``closed_by_admin``), re-subscription is off and it
    was ``evicted`` or the broker shut down (``shutdown``), or a re-open was
    ``rejected`` with a code that is not retried.

    Attributes:
        reason: ``evicted``, ``closed_by_admin``, ``shutdown`` or ``rejected``.
        dropped: messages queued for it that were never delivered.
        last_sequence: sequence of the last message delivered to it (0: none).
        code: the gRPC status code (``OK`` except for ``rejected``; the
            exception's own ``code`` is then ``CANCELLED``).
        message: the broker's message, else the reason.
        subscription_id: the id it had.
    """

    def __init__(
        self,
        reason: str,
        *,
        dropped: int = 0,
        last_sequence: int = 0,
        code: grpc.StatusCode = grpc.StatusCode.OK,
        message: str = "",
        subscription_id: Optional[str] = None,
    ) -> None:
        text = (
            f"subscription {subscription_id or '?'} ended: {reason}"
            f" (dropped {dropped}, last sequence {last_sequence}"
            + (f", {code.name}: {message}" if message else "")
            + ")"
        )
        super().__init__(grpc.StatusCode.CANCELLED if code == grpc.StatusCode.OK else code, text)
        self.reason = reason
        self.dropped = dropped
        self.last_sequence = last_sequence
        self.broker_code = code
        self.subscription_id = subscription_id
