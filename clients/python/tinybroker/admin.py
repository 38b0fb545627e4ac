"""The Admin service: subscriptions, groups, evictions, broker info, close."""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass
from typing import Any, List, Optional

import grpc.aio

from ._client_core import ClientCore
from ._pb import admin_pb2 as apb
from .errors import ClientClosed, TinybrokerError

__all__ = ["Admin", "SubscriptionInfo", "GroupInfo", "EvictionInfo", "BrokerInfo"]


def _time(ts: Any) -> Optional[datetime.datetime]:
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return datetime.datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=datetime.timezone.utc)


def _seconds(d: Any) -> float:
    return d.seconds + d.nanos / 1e9


_MODES = {0: "multi", 1: "multi", 2: "single"}
_ACK = {0: "auto", 1: "auto", 2: "manual"}


@dataclass(frozen=True)
class SubscriptionInfo:
    """One open subscription, as Admin/ListSubscriptions lists it."""

    subscription_id: str
    mode: str  # "multi" (broadcast) or "single" (consumer group)
    consumer_group: str
    topic_patterns: List[str]
    queue_depth: int
    capacity: int
    delivered: int
    opened_at: Optional[datetime.datetime]
    peer_address: str
    ack_mode: str
    replica_id: str
    #: A manual-ack member's messages delivered and not acked yet (0 for any
    #: other subscription): a hung member holds many.
    unacked: int
    #: Seconds since the oldest of them was handed to it; None when none.
    oldest_unacked_age: Optional[float]
    raw: Any


@dataclass(frozen=True)
class GroupInfo:
    """One consumer group, as Admin/ListConsumerGroups lists it."""

    name: str
    topic_patterns: List[str]
    members: int
    backlog: int
    in_flight: int
    redeliveries: int
    dead_lettered: int
    dropped: int
    oldest_unacked_age: Optional[float]  # seconds
    raw: Any


@dataclass(frozen=True)
class EvictionInfo:
    """One eviction, as Admin/ListEvictions lists it (newest first)."""

    subscription_id: str
    evicted_at: Optional[datetime.datetime]
    topic_patterns: List[str]
    queue_depth: int
    last_delivered_sequence: int
    peer_address: str
    replica_id: str
    raw: Any


@dataclass(frozen=True)
class BrokerInfo:
    """Admin/GetBrokerInfo: version, uptime, limits (``raw.limits``), counters."""

    version: str
    uptime: float  # seconds
    started_at: Optional[datetime.datetime]
    subscriptions: int
    consumer_groups: int
    last_sequence: int
    auth_enabled: bool
    tls_enabled: bool
    cluster_mode: bool
    replica_id: str
    nats_server: str
    messages_published: int
    messages_delivered: int
    limits: Any
    raw: Any


class Admin:
    """``client.admin``: the broker's Admin service (needs the token when
    the broker has one). Each method raises
    :class:`~tinybroker.TinybrokerError` with the gRPC code on failure."""

    def __init__(self, client: ClientCore) -> None:
        self._client = client

    async def _call(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        self._client._check_open()
        conn = self._client._conn
        try:
            return await getattr(conn.admin, method)(request, metadata=conn.metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            await self._client._after_failure(e)
            raise TinybrokerError.from_rpc_error(e, method) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            raise ClientClosed() from None

    async def subscriptions(self, timeout: Optional[float] = 10.0) -> List[SubscriptionInfo]:
        """Every open subscription (of the whole cluster in cluster mode)."""
        response = await self._call("ListSubscriptions", apb.ListSubscriptionsRequest(), timeout)
        return [
            SubscriptionInfo(
                s.subscription_id, _MODES.get(s.mode, str(s.mode)), s.consumer_group, list(s.topic_patterns),
                s.queue_depth, s.capacity, s.delivered, _time(s.opened_at), s.peer_address,
                _ACK.get(s.ack_mode, str(s.ack_mode)), s.replica_id, s.unacked,
                _seconds(s.oldest_unacked_age) if s.HasField("oldest_unacked_age") else None, s,
            )
            for s in response.subscriptions
        ]

    async def groups(self, timeout: Optional[float] = 10.0) -> List[GroupInfo]:
        """Every consumer group, including memberless ones holding a backlog."""
        response = await self._call("ListConsumerGroups", apb.ListConsumerGroupsRequest(), timeout)
        return [
            GroupInfo(
                g.name, list(g.topic_patterns), g.members, g.backlog, g.in_flight, g.redeliveries,
                g.dead_lettered, g.dropped,
                _seconds(g.oldest_unacked_age) if g.HasField("oldest_unacked_age") else None, g,
            )
            for g in response.groups
        ]

    async def evictions(self, timeout: Optional[float] = 10.0) -> List[EvictionInfo]:
        """The most recent evictions (slow consumers), newest first."""
        response = await self._call("ListEvictions", apb.ListEvictionsRequest(), timeout)
        return [
            EvictionInfo(
                e.subscription_id, _time(e.evicted_at), list(e.topic_patterns), e.queue_depth,
                e.last_delivered_sequence, e.peer_address, e.replica_id, e,
            )
            for e in response.evictions
        ]

    async def info(self, timeout: Optional[float] = 10.0) -> BrokerInfo:
        """Version, uptime, effective limits and counters."""
        r = await self._call("GetBrokerInfo", apb.GetBrokerInfoRequest(), timeout)
        return BrokerInfo(
            r.version, _seconds(r.uptime), _time(r.started_at), r.subscriptions, r.consumer_groups,
            r.last_sequence, r.auth_enabled, r.tls_enabled, r.cluster_mode, r.replica_id, r.nats_server,
            r.messages_published, r.messages_delivered, r.limits, r,
        )

    async def close_subscription(self, subscription_id: str, timeout: Optional[float] = 10.0) -> None:
        """Closes one subscription by id (NOT_FOUND if none); its client
        hears ``closed_by_admin`` and does not re-subscribe."""
        await self._call("CloseSubscription", apb.CloseSubscriptionRequest(subscription_id=subscription_id), timeout)

    close = close_subscription
