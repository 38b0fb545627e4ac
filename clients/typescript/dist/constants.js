// The numbers of docs/clients.md "The constants", exported under its names.
/** Credit of one subscription (deliveries beyond what the application took); configurable with `window`. */
export const WINDOW = 256;
/** Credit is given back in one `SessionCredit` once the application took this many since the last one: `max(1, window / 4)`. */
export function topUp(window) {
    return Math.max(1, Math.floor(window / 4));
}
/** `topUp(WINDOW)`. */
export const TOP_UP = topUp(WINDOW);
/** Milliseconds before the first attempt to start a session again after one was lost or could not start. */
export const CONNECT_DELAY_FIRST = 100;
/** The longest wait (ms) between two attempts to start a session. */
export const CONNECT_DELAY_CAP = 250;
/** Milliseconds before opening again a subscription the broker ended (evicted, shutdown) or refused with a retryable code. */
export const RESUBSCRIBE_DELAY_FIRST = 100;
/** The longest such wait (ms); the delay doubles at each end in a row. */
export const RESUBSCRIBE_DELAY_CAP = 5000;
/** Each delay is multiplied by a uniform factor in [1 - JITTER, 1 + JITTER]. */
export const JITTER = 0.2;
/** Bytes of published messages the client buffers before `publish()` waits; configurable with `bufferBytes`. */
export const BUFFER_BYTES = 8 * 1024 * 1024;
/** Messages in one `SessionPublish` when the broker does not say (GetBrokerInfo `limits.maxBatchMessages`). */
export const BATCH_MESSAGES = 1024;
/** Encoded bytes of one `SessionPublish` (never over the broker's `max_message_bytes` plus the slack docs/clients.md states). */
export const BATCH_BYTES = 512 * 1024;
/** @internal What a request may carry beyond the broker's `max_message_bytes`, less a 1 KiB margin (the bound of `BATCH_BYTES`). */
export const REQUEST_SLACK = 64 * 1024 - 1024;
/** `SessionPublish` requests written and not yet answered. */
export const BATCHES_IN_FLIGHT = 4;
/** Milliseconds the broker has to accept a session. */
export const START_TIMEOUT = 10_000;
/** Milliseconds `close()` waits for the buffer to be answered before it closes anyway. */
export const CLOSE_TIMEOUT = 5000;
/** @internal `ms` times a uniform factor in [1 - JITTER, 1 + JITTER], rounded. */
export function jitter(ms) {
    return Math.round(ms * (1 - JITTER + Math.random() * 2 * JITTER));
}
/** @internal A delay that starts at `first`, doubles at each `next()` up to `cap`, and starts again after `reset()`. */
export class Backoff {
    first;
    cap;
    current;
    constructor(first, cap) {
        this.first = first;
        this.cap = cap;
        this.current = first;
    }
    /** The next delay (ms, jittered); the one after it is twice as long, up to the cap. */
    next() {
        const delay = jitter(this.current);
        this.current = Math.min(this.current * 2, this.cap);
        return delay;
    }
    reset() {
        this.current = this.first;
    }
}
