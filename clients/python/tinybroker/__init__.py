"""tinybroker: the Python client of the tinybroker pub/sub broker.

asyncio first::

    import asyncio, tinybroker

    async def main():
        async with tinybroker.connect("127.0.0.1:50051") as client:
            sub = await client.subscribe("greetings.*")
            await client.publish("greetings.world", b"hello")
            msg = await sub.next(timeout=5)
            print(msg.topic, msg.payload)

    asyncio.run(main())

Blocking scripts use :mod:`tinybroker.sync`, the same client driven on a
loop of its own. Every subscription of a client rides on one ``Session``
stream, with a credit window per subscription, in-band acks, and
re-subscription (with the gap reported) after an eviction, a shutdown or a
lost connection.
"""

from .admin import BrokerInfo, EvictionInfo, GroupInfo, SubscriptionInfo
from .client import DEFAULT_WINDOW, Client, connect
from .errors import PublishError, SubscriptionEnded, TinybrokerError
from .publisher import Publisher
from .session import Subscription
from .types import (
    AckMode,
    Ended,
    Gap,
    Message,
    Opened,
    PublishResult,
    PublishStreamResult,
    Resubscribed,
    Resubscribing,
    SubscriptionEvent,
    SubscriptionStats,
)

__version__ = "0.1.0"

__all__ = [
    "connect",
    "Client",
    "Subscription",
    "Publisher",
    "Message",
    "AckMode",
    "PublishResult",
    "PublishStreamResult",
    "SubscriptionEvent",
    "Opened",
    "Ended",
    "Resubscribing",
    "Resubscribed",
    "Gap",
    "SubscriptionStats",
    "TinybrokerError",
    "PublishError",
    "SubscriptionEnded",
    "SubscriptionInfo",
    "GroupInfo",
    "EvictionInfo",
    "BrokerInfo",
    "DEFAULT_WINDOW",
]
