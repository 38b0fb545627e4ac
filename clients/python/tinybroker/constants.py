"""The numbers of docs/clients.md "The constants", one name each.

Times are in seconds, sizes in bytes."""

from __future__ import annotations

__all__ = [
    "WINDOW",
    "TOP_UP",
    "top_up",
    "CONNECT_DELAY_FIRST",
    "CONNECT_DELAY_CAP",
    "RESUBSCRIBE_DELAY_FIRST",
    "RESUBSCRIBE_DELAY_CAP",
    "JITTER",
    "BUFFER_BYTES",
    "BATCH_MESSAGES",
    "BATCH_BYTES",
    "REQUEST_SLACK",
    "BATCHES_IN_FLIGHT",
    "START_TIMEOUT",
    "CLOSE_TIMEOUT",
]

#: Credit of one subscription (deliveries beyond what the application took);
#: the client holds at most this many for it. Configurable (``window=``).
WINDOW = 256


def top_up(window: int) -> int:
    """Deliveries taken before one ``SessionCredit`` gives them back."""
    return max(1, window // 4)


#: ``top_up(WINDOW)``.
TOP_UP = top_up(WINDOW)

#: Wait before starting a session again after one was lost or failed to start.
CONNECT_DELAY_FIRST = 0.1
#: Longest wait between two attempts to start a session.
CONNECT_DELAY_CAP = 0.25
#: Wait before opening again a subscription the broker ended (evicted, shutdown)
#: or refused with a retryable code; doubles at each end in a row.
RESUBSCRIBE_DELAY_FIRST = 0.1
#: Longest such wait.
RESUBSCRIBE_DELAY_CAP = 5.0
#: Each delay is multiplied by a uniform factor in this range.
JITTER = (0.8, 1.2)
#: The publish buffer: encoded bytes published and not yet written to a
#: session. Configurable (``buffer_bytes=``).
BUFFER_BYTES = 8 * 1024 * 1024
#: Messages in one ``SessionPublish`` when the broker does not say its
#: ``max_batch_messages`` (GetBrokerInfo ``limits``).
BATCH_MESSAGES = 1024
#: Encoded bytes of one ``SessionPublish`` (a larger message is a batch of its
#: own); never over the broker's ``max_message_bytes`` + ``REQUEST_SLACK``.
BATCH_BYTES = 512 * 1024
#: What a request may carry beyond ``max_message_bytes``, less the 1 KiB margin.
REQUEST_SLACK = 64 * 1024 - 1024
#: ``SessionPublish`` requests written and not yet answered.
BATCHES_IN_FLIGHT = 4
#: How long the broker has to accept a session.
START_TIMEOUT = 10.0
#: How long ``close()`` waits for the buffer to be answered.
CLOSE_TIMEOUT = 5.0
