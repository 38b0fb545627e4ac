"""A publisher over one ``PublishStream`` of its own: counts at the end of
the stream, the first bad message ends it. (Buffered ``client.publish()``
on the session is the usual way; this one is for a run of messages whose
sequences are wanted as one range.)"""

from __future__ import annotations

import asyncio
from typing import Mapping, Optional, Union

import grpc
import grpc.aio

from . import _tracing
from ._client_core import ClientCore
from ._pb import broker_pb2 as pb
from .errors import ClientClosed, PublishError
from .types import PublishStreamResult


def _as_bytes(payload: Union[bytes, bytearray, memoryview, str]) -> bytes:
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload) if not isinstance(payload, bytes) else payload


class Publisher:
    """Publishes a run of messages on one ``PublishStream``.

    ``await pub.publish(...)`` returns once the message is written to the
    stream; it waits while the stream's HTTP/2 flow-control window is full
    (the broker is behind), so nothing is buffered without bound.
    :meth:`end_stream` ends the current stream and returns what it carried
    (a later publish starts a new one); :meth:`close` does the same and ends
    the publisher. The first bad message ends the stream: that publish (or
    a later one, or ``end_stream``/``close``) raises
    :class:`~tinybroker.PublishError` with the gRPC code, the broker's
    message and ``accepted``, the count the broker gives in it. After the
    client's ``close()`` every call raises :class:`~tinybroker.ClientClosed`.
    Use it as ``async with client.publisher() as pub:``.
    """

    def __init__(self, client: ClientCore, tracing: bool) -> None:
        self._client = client
        self._tracing = tracing and _tracing.AVAILABLE
        self._call: Optional[grpc.aio.StreamUnaryCall] = None
        # Made on first use, on the client's loop (Python 3.9 binds a lock to
        # the loop current when it is made).
        self._lock_: Optional[asyncio.Lock] = None
        self._closed = False
        #: Messages written on all of this publisher's streams.
        self.published = 0

    @property
    def _lock(self) -> asyncio.Lock:
        if self._lock_ is None:
            self._lock_ = asyncio.Lock()
        return self._lock_

    def _check_open(self) -> None:
        if self._client._closed:
            raise ClientClosed()
        if self._closed:
            raise ClientClosed("the publisher is closed")

    async def publish(
        self,
        topic: str,
        payload: Union[bytes, str] = b"",
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Writes one message on the stream (waits while it is full)."""
        self._check_open()
        if self._tracing:
            headers = dict(headers or {})
            _tracing.inject(headers)
        request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload), headers=headers)
        async with self._lock:
            self._check_open()
            call = self._call
            if call is None:
                conn = self._client._conn
                call = self._call = conn.broker.PublishStream(metadata=conn.metadata)
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                raise await self._failed(call, e) from None
            self.published += 1

    async def _failed(self, call: grpc.aio.StreamUnaryCall, error: Exception) -> Exception:
        # A write fails once the broker has ended the stream; its status (the
        # code and message naming the bad message and the count accepted) is
        # the call's, not the failed write's ("Internal error from Core").
        self._call = None
        self._check_open()
        try:
            await call
        except grpc.aio.AioRpcError as e:
            return PublishError.from_stream_error(e.code(), e.details() or "")
        except asyncio.CancelledError:
            raise ClientClosed("the publisher is closed") from None
        if isinstance(error, grpc.aio.AioRpcError):  # pragma: no cover - the call ended OK
            return PublishError.from_stream_error(error.code(), error.details() or "")
        return PublishError(grpc.StatusCode.UNKNOWN, f"the stream failed: {error!r}", None)  # pragma: no cover

    async def end_stream(self) -> PublishStreamResult:
        """Ends the current stream and returns its counts (zeros when
        nothing was published since the last one)."""
        self._check_open()
        async with self._lock:
            call, self._call = self._call, None
            if call is None:
                return PublishStreamResult(0, 0, 0)
            try:
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                raise await self._failed(call, e) from None
            try:
                response = await call
            except grpc.aio.AioRpcError as e:
                raise PublishError.from_stream_error(e.code(), e.details() or "") from None
            except asyncio.CancelledError:
                self._check_open()
                raise
            return PublishStreamResult(response.accepted, response.first_sequence, response.last_sequence)

    async def close(self) -> PublishStreamResult:
        """Ends the stream (see :meth:`end_stream`) and the publisher."""
        try:
            return await self.end_stream()
        finally:
            self._closed = True

    def _abort(self) -> None:
        """The client is closing: the stream is cancelled."""
        self._closed = True
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def __aenter__(self) -> "Publisher":
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and not self._closed and not self._client._closed:
            await self.close()
        else:
            self._abort()
