"""tinybroker: the Python client of the tinybroker pub/sub broker.

asyncio first::

    import asyncio, tinybroker

    async def main():
        async with tinybroker.connect("127.0.0.1:50051") as client:
            sub = await client.subscribe("greetings.*")
            await client.publish("greetings.world", b"hello")  # buffered
            print(await client.flush())  # FlushResult(accepted=1, ...)
            msg = await sub.next(timeout=5)
            print(msg.topic, msg.payload)

    asyncio.run(main())

Blocking scripts use :mod:`tinybroker.sync`, the same client driven on a
loop of its own. Every subscription of a client rides on one ``Session``
stream, with a credit window per subscription, coalesced in-band acks,
buffered publishes sent in batches, and re-subscription (with the gap
reported) after an eviction, a shutdown or a lost connection
(docs/clients.md is the behaviour, constant by constant).
"""

from . import constants
from .admin import BrokerInfo, EvictionInfo, GroupInfo, SubscriptionInfo
from .client import DEFAULT_WINDOW, Client, connect
from .constants import (
    BATCH_BYTES,
    BATCH_MESSAGES,
    BATCHES_IN_FLIGHT,
    BUFFER_BYTES,
    CLOSE_TIMEOUT,
    CONNECT_DELAY_CAP,
    CONNECT_DELAY_FIRST,
    JITTER,
    RESUBSCRIBE_DELAY_CAP,
    RESUBSCRIBE_DELAY_FIRST,
    START_TIMEOUT,
    TOP_UP,
    WINDOW,
)
from .errors import ClientClosed, PublishError, SubscriptionEnded, Timeout, TinybrokerError, UsageError
from .publisher import Publisher
from .session import Subscription
from .types import (
    AckMode,
    ClientStats,
    Closed,
    Connected,
    ConnectionEvent,
    Disconnected,
    Ended,
    FlushResult,
    Gap,
    Message,
    Opened,
    PublishResult,
    PublishStreamResult,
    Reconnected,
    Rejection,
    Resubscribed,
    Resubscribing,
    SubscriptionEvent,
    SubscriptionStats,
)

__version__ = "0.2.0"

__all__ = [
    "connect",
    "Client",
    "Subscription",
    "Publisher",
    "Message",
    "AckMode",
    "PublishResult",
    "PublishStreamResult",
    "FlushResult",
    "Rejection",
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
    "TinybrokerError",
    "ClientClosed",
    "UsageError",
    "Timeout",
    "PublishError",
    "SubscriptionEnded",
    "SubscriptionInfo",
    "GroupInfo",
    "EvictionInfo",
    "BrokerInfo",
    "constants",
    "DEFAULT_WINDOW",
    "WINDOW",
    "TOP_UP",
    "CONNECT_DELAY_FIRST",
    "CONNECT_DELAY_CAP",
    "RESUBSCRIBE_DELAY_FIRST",
    "RESUBSCRIBE_DELAY_CAP",
    "JITTER",
    "BUFFER_BYTES",
    "BATCH_MESSAGES",
    "BATCH_BYTES",
    "BATCHES_IN_FLIGHT",
    "START_TIMEOUT",
    "CLOSE_TIMEOUT",
]
