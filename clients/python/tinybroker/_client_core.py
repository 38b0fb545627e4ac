"""What admin.py and publisher.py use of the client that made them, as a
protocol: they depend on this module, not on client.py (which imports
them), so that the package's modules depend one way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import grpc.aio

if TYPE_CHECKING:  # pragma: no cover
    from ._connection import Connection

__all__ = ["ClientCore"]


class ClientCore(Protocol):
    """The part of :class:`~tinybroker.Client` an ``Admin`` or a
    ``Publisher`` calls: its connection, whether it is closed, and what to do
    after a failed call."""

    _conn: "Connection"
    _closed: bool

    def _check_open(self) -> None: ...

    async def _after_failure(self, error: grpc.aio.AioRpcError) -> None: ...
