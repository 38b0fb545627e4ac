/** Credit of one subscription (deliveries beyond what the application took); configurable with `window`. */
export declare const WINDOW = 256;
/** Credit is given back in one `SessionCredit` once the application took this many since the last one: `max(1, window / 4)`. */
export declare function topUp(window: number): number;
/** `topUp(WINDOW)`. */
export declare const TOP_UP: number;
/** Milliseconds before the first attempt to start a session again after one was lost or could not start. */
export declare const CONNECT_DELAY_FIRST = 100;
/** The longest wait (ms) between two attempts to start a session. */
export declare const CONNECT_DELAY_CAP = 250;
/** Milliseconds before opening again a subscription the broker ended (evicted, shutdown) or refused with a retryable code. */
export declare const RESUBSCRIBE_DELAY_FIRST = 100;
/** The longest such wait (ms); the delay doubles at each end in a row. */
export declare const RESUBSCRIBE_DELAY_CAP = 5000;
/** Each delay is multiplied by a uniform factor in [1 - JITTER, 1 + JITTER]. */
export declare const JITTER = 0.2;
/** Bytes of published messages the client buffers before `publish()` waits; configurable with `bufferBytes`. */
export declare const BUFFER_BYTES: number;
/** Messages in one `SessionPublish` when the broker does not say (GetBrokerInfo `limits.maxBatchMessages`). */
export declare const BATCH_MESSAGES = 1024;
/** Encoded bytes of one `SessionPublish` (never over the broker's `max_message_bytes` plus the slack docs/clients.md states). */
export declare const BATCH_BYTES: number;
/** `SessionPublish` requests written and not yet answered. */
export declare const BATCHES_IN_FLIGHT = 4;
/** Milliseconds the broker has to accept a session. */
export declare const START_TIMEOUT = 10000;
/** Milliseconds `close()` waits for the buffer to be answered before it closes anyway. */
export declare const CLOSE_TIMEOUT = 5000;
