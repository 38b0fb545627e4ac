"""Errors the client raises: each carries the gRPC status code and the
broker's own message."""

from __future__ import annotations

from typing import Optional

import grpc

__all__ = ["TinybrokerError", "PublishError", "SubscriptionEnded"]


class TinybrokerError(Exception):
    """A call the broker refused or could not take.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode``), e.g.
            ``INVALID_ARGUMENT`` for a bad topic, ``UNAUTHENTICATED`` for a
            missing or wrong token, ``UNAVAILABLE`` when no broker answers.
        message: the broker's message (it names the bad value).
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "TinybrokerError":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


class PublishError(TinybrokerError):
    """A publisher's stream ended with an error (the first bad message ends
    it; the messages before it stay published).

    Attributes:
        accepted: messages this client wrote on the stream before the error
            (the broker's message says how many it accepted).
    """

    def __init__(self, code: grpc.StatusCode, message: str, accepted: int = 0) -> None:
        super().__init__(code, message)
        self.accepted = accepted


def _code_from_int(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


class SubscriptionEnded(TinybrokerError):
    """A subscription ended for good and will not be opened again.

    Raised from iterating a subscription when the broker ended it and the
    client does not re-subscribe: an admin closed it (``closed_by_admin``),
    or re-subscription is turned off and it was ``evicted``, the broker
    shut down (``shutdown``) or the connection was lost
    (``connection_lost``), or a re-open was ``rejected``.

    Attributes:
        reason: ``evicted``, ``closed_by_admin``, ``shutdown``, ``rejected``
            or ``connection_lost``.
        dropped: messages queued for it that were never delivered.
        last_sequence: sequence of the last message delivered to it (0: none).
        code: the gRPC status code (``OK`` except for ``rejected`` and
            ``connection_lost``).
        message: the broker's message, if any.
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
        text = message or reason
        super().__init__(code, text)
        self.args = (
            f"subscription {subscription_id or '?'} ended: {reason}"
            f" (dropped {dropped}, last sequence {last_sequence}"
            + (f", {code.name}: {message}" if message else "")
            + ")",
        )
        self.reason = reason
        self.dropped = dropped
        self.last_sequence = last_sequence
        self.message = message
        self.subscription_id = subscription_id
