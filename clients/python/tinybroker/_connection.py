"""Addresses, TLS, the token and the one gRPC channel (one HTTP/2
connection) a client uses; with several addresses, the next one is tried
when the current one stops answering."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from ._pb import admin_pb2_grpc, broker_pb2, broker_pb2_grpc
from .errors import TinybrokerError

DEFAULT_ADDR = "127.0.0.1:50051"

# grpc's own reconnect backoff starts at 1 s and grows to 120 s; a broker
# that comes back is to be found at once (docs/clients.md: CONNECT_DELAY_FIRST,
# at most CONNECT_DELAY_CAP).
CHANNEL_OPTIONS: List[Tuple[str, object]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.http2.max_pings_without_data", 0),
]


def _serialize(request: object) -> bytes:
    if type(request) is bytes:
        return request  # type: ignore[return-value]
    return request.SerializeToString()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Target:
    """One broker address: ``host:port`` and whether it speaks TLS."""

    address: str
    tls: bool

    def __str__(self) -> str:
        return ("https://" if self.tls else "http://") + self.address


def parse_targets(addr: Union[str, Sequence[str], None]) -> List[Target]:
    """``host:port``, ``http://host:port``, ``https://host:port``, a
    comma-separated string of them, or a list; None reads
    ``TINYBROKER_ADDR`` (default ``127.0.0.1:50051``)."""
    if addr is None:
        addr = os.environ.get("TINYBROKER_ADDR") or DEFAULT_ADDR
    items = addr.split(",") if isinstance(addr, str) else list(addr)
    targets = []
    for item in items:
        item = item.strip().rstrip("/")
        if not item:
            continue
        tls = False
        if item.startswith("https://"):
            tls, item = True, item[len("https://") :]
        elif item.startswith("http://"):
            item = item[len("http://") :]
        elif "://" in item:
            raise ValueError(f"broker address {item!r}: the scheme must be http:// or https://")
        if ":" not in item.rsplit("]", 1)[-1]:
            item += ":443" if tls else ":50051"
        targets.append(Target(item, tls))
    if not targets:
        raise ValueError(f"no broker address in {addr!r}")
    return targets


class Connection:
    """The current channel and its stubs. Only the client's own loop uses it."""

    def __init__(
        self,
        targets: List[Target],
        *,
        token: Optional[str],
        ca_file: Optional[str],
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        self.targets = targets
        self.index = 0
        self.metadata: Optional[Tuple[Tuple[str, str], ...]] = (
            (("authorization", f"Bearer {token}"),) if token else None
        )
        self._root_certificates: Optional[bytes] = None
        if ca_file is not None:
            with open(ca_file, "rb") as f:
                self._root_certificates = f.read()
        self._options = list(CHANNEL_OPTIONS) + list(options or [])
        self.channel: Optional[grpc.aio.Channel] = None
        self.broker: broker_pb2_grpc.BrokerStub
        self.admin: admin_pb2_grpc.AdminStub
        self.session: grpc.aio.StreamStreamMultiCallable
        self.failovers = 0

    @property
    def target(self) -> Target:
        return self.targets[self.index]

    def _open(self) -> None:
        target = self.target
        if target.tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            self.channel = grpc.aio.secure_channel(target.address, credentials, options=self._options)
        else:
            self.channel = grpc.aio.insecure_channel(target.address, options=self._options)
        self.broker = broker_pb2_grpc.BrokerStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        # Broker/Session, taking requests already in wire bytes too (the
        # publish batches, encoded as they fill).
        self.session = self.channel.stream_stream(
            "/tinybroker.v1.Broker/Session",
            request_serializer=_serialize,
            response_deserializer=broker_pb2.SessionEvent.FromString,
        )

    async def connect(self, timeout: float) -> None:
        """Tries each address in turn until one completes its handshake
        within ``timeout`` seconds; TinybrokerError(UNAVAILABLE) otherwise."""
        failures = []
        for i in range(len(self.targets)):
            self.index = i
            self._open()
            assert self.channel is not None
            outcome = await _ready(self.channel, timeout)
            if outcome is None:
                return
            failures.append(f"{self.target}: {outcome}")
            await self.channel.close()
        self.channel = None
        hint = ""
        if any(t.tls for t in self.targets):
            hint = " (for https://, check the CA file and that the broker serves TLS)"
        raise TinybrokerError(grpc.StatusCode.UNAVAILABLE, "cannot connect: " + "; ".join(failures) + hint)

    def down(self) -> bool:
        """Whether the channel has failed to reach its broker."""
        return self.channel is None or self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def failover(self) -> None:
        """Moves to the next address of a list (no-op with one address)."""
        if len(self.targets) < 2:
            return
        old = self.channel
        self.index = (self.index + 1) % len(self.targets)
        self.failovers += 1
        self._open()
        if old is not None:
            await old.close()

    async def close(self) -> None:
        """Closes the channel and lets go of it and its stubs: grpc's poller
        thread stops once no channel is left (a closed client that is still
        referenced holds none)."""
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        self.broker = self.admin = self.session = None  # type: ignore[assignment]


async def _ready(channel: grpc.aio.Channel, timeout: float) -> Optional[str]:
    """None once the channel is READY; why not, when it fails or times out
    (a refused connection fails at once rather than after ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return "connection failed"
        remaining = deadline - loop.time()
        if remaining <= 0:
            return f"no connection within {timeout:g} s"
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
        except asyncio.TimeoutError:
            return f"no connection within {timeout:g} s"
        state = channel.get_state(try_to_connect=True)
    return None
