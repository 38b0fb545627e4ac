import type { ChannelOptions } from "@grpc/grpc-js";
import { Admin } from "./admin.js";
import type { CallOpts } from "./admin.js";
import { Publisher } from "./publisher.js";
import type { Payload } from "./publisher.js";
import { Subscription } from "./session.js";
import type { EventCallback, SessionState } from "./session.js";
import type { AckMode, ClientStats, CloseResult, ConnectionEvent, FlushResult, PublishResult } from "./types.js";
/** Credit window per subscription when none is given (docs/clients.md `WINDOW`). */
export declare const DEFAULT_WINDOW = 256;
/** Options of {@link connect}. */
export interface ConnectOptions {
    /**
     * `host:port`, `http://host:port`, `https://host:port` (TLS), or a list
     * (or comma-separated string) of them, tried in turn. Default:
     * `TINYBROKER_ADDR`, else `127.0.0.1:50051`. (`servers` is the same, as nats.js names it.)
     */
    addr?: string | readonly string[];
    /** The same as `addr`. */
    servers?: string | readonly string[];
    /** Bearer token (default `TINYBROKER_AUTH_TOKEN`). */
    token?: string;
    /** PEM file of the CA that signed the broker's certificate (`https://`; default the system's roots). */
    caFile?: string;
    /** The same CA as PEM text or bytes. */
    ca?: string | Buffer;
    /** Credit window per subscription (messages the broker may send it beyond what the application took; default {@link WINDOW}). */
    window?: number;
    /** Bytes of published messages buffered before `publish()` waits (default {@link BUFFER_BYTES}). */
    bufferBytes?: number;
    /** Re-subscribe after evictions, shutdowns and lost connections (default true; per subscription too). */
    resubscribe?: boolean;
    /** Milliseconds to wait for each address (default 5,000). */
    timeout?: number;
    /** Gives up connecting (rejects with CANCELLED). */
    signal?: AbortSignal;
    /** Extra grpc-js channel options. */
    channelOptions?: ChannelOptions;
    /**
     * With `@opentelemetry/api` installed, publish adds the active context's
     * `traceparent`/`tracestate` to the headers and `msg.traceContext` gives
     * back a delivered message's (default true; false turns this off).
     */
    tracing?: boolean;
}
/** Options of {@link Client.publish}. */
export interface PublishOptions {
    /** Headers (string to string). */
    headers?: Record<string, string>;
}
/** Options of {@link Client.publishConfirmed}: headers, a deadline, a signal. */
export interface PublishConfirmedOptions extends PublishOptions, CallOpts {
}
/** Options of {@link Client.flush}. */
export interface FlushOptions {
    /** Milliseconds to wait (default: no limit); then it rejects with {@link TimeoutError} and loses nothing. */
    timeout?: number;
}
/** Options of {@link Client.subscribe}. */
export interface SubscribeOptions {
    /** An id of your own (blank: the broker makes one); kept when the client re-subscribes. */
    subscriptionId?: string;
    /** A consumer group: each message goes to one member. */
    group?: string;
    /** `"auto"` (default) or `"manual"` (groups only): then `msg.ack()` / `msg.nack()`. */
    ackMode?: AckMode;
    /** Group members: most messages held at once (0: the broker's default). */
    maxInFlight?: number;
    /** MANUAL: milliseconds before an unacked message is redelivered (0: the broker's default). */
    ackDeadline?: number;
    /** Credit window (default the client's). */
    window?: number;
    /** Open it again after an eviction, a shutdown or a lost connection (default the client's, true). */
    resubscribe?: boolean;
    /** Called with every {@link SubscriptionEvent} (ends, re-subscriptions, gaps). */
    onEvent?: EventCallback;
    /** Milliseconds to wait for a broker that registers it (default 10,000). */
    timeout?: number;
    /** Aborting it closes the subscription (and rejects subscribe() while it waits). */
    signal?: AbortSignal;
}
/** A callback for the client's {@link ConnectionEvent}s. */
export type ConnectionListener = (event: ConnectionEvent) => void;
/**
 * A connection to a broker: one HTTP/2 connection, one Session stream for
 * all its subscriptions and buffered publishes. Make one with
 * {@link connect}; share it across the process. Close it with
 * {@link Client.close}: after that every call rejects with
 * {@link ClientClosed}.
 */
export declare class Client {
    /** The Admin calls. */
    readonly admin: Admin;
    /** Default credit window of its subscriptions. */
    readonly window: number;
    /** Default of `resubscribe` for its subscriptions. */
    readonly resubscribe: boolean;
    private readonly bufferBytes;
    private readonly conn;
    private session;
    private closed_;
    private closing;
    private readonly publishers;
    private readonly listeners;
    private confirmedOut;
    private confirmedBytesOut;
    /** The address in use (`http://…` or `https://…`). */
    get address(): string;
    /** The session's state: IDLE, STARTING, OPEN, WAITING or CLOSED (docs/clients.md). */
    get state(): SessionState;
    /** Sessions that opened after a `disconnected` (the connection was lost and found again). */
    get reconnects(): number;
    /** How many times the client moved to the next address of its list. */
    get failovers(): number;
    /** Whether {@link Client.close} was called. */
    get isClosed(): boolean;
    private emit;
    /**
     * Calls `listener` with every {@link ConnectionEvent} (`connected`,
     * `disconnected`, `reconnected`, `closed`): once per change of the
     * connection, whatever the number of subscriptions.
     */
    on(event: "connection", listener: ConnectionListener): this;
    /** Removes a listener added with {@link Client.on}. */
    off(event: "connection", listener: ConnectionListener): this;
    /**
     * The {@link ConnectionEvent}s from now on, as an async iterable:
     * `for await (const e of client.connectionEvents())`. It ends after
     * `closed`; leaving the loop stops listening.
     */
    connectionEvents(): AsyncIterable<ConnectionEvent>;
    /** The client's counters: messages and bytes in and out, reconnects, what is pending in the publish buffer. */
    stats(): ClientStats;
    /**
     * Flushes the publish buffer (for at most {@link CLOSE_TIMEOUT} ms),
     * ends every subscription (their loops end, waiting `next()` calls reject
     * with {@link ClientClosed}) and every {@link Publisher}, closes the
     * connection and emits `closed`. Resolves to the last flush's outcomes
     * and `notSent`: buffered messages never written. Nothing of the client
     * keeps the process alive after it. A second call returns the first's
     * result.
     */
    close(): Promise<CloseResult>;
    private doClose;
    private afterFailure;
    private sessionOrThrow;
    private request;
    /**
     * Puts one message in the client's publish buffer and returns at once:
     * the returned promise is already resolved while the buffer holds less
     * than `bufferBytes`. When it holds more, the promise stays pending until
     * batches written to the broker make room (backpressure: await it). A
     * caller that does not await is bounded too: once the publishers waiting
     * for room hold another `bufferBytes`, `publish()` rejects at once with
     * RESOURCE_EXHAUSTED (nothing is dropped silently). Messages are sent as
     * `SessionPublish` batches, full ones at once and the rest on the next turn
     * of the event loop; {@link Client.flush} says what the broker did with
     * them. A string payload is sent as UTF-8. Rejects with
     * {@link ClientClosed} after close.
     */
    publish(topic: string, payload?: Payload, opts?: PublishOptions): Promise<void>;
    /**
     * Resolves once every message published before the call has an outcome,
     * to what happened to the messages published since the previous flush:
     * `accepted`, `rejected` (index, topic, code, message each) and
     * `unconfirmed` (written to a session lost before it answered; never
     * written again). Rejects with {@link TimeoutError} after `timeout` ms,
     * losing nothing (the outcomes go to the next flush).
     */
    flush(opts?: FlushOptions): Promise<FlushResult>;
    /**
     * Publishes one message with the unary `Publish` (not through the buffer:
     * it may overtake buffered messages) and resolves to its sequence and how
     * many subscriptions and groups it matched; rejects with the broker's code
     * and message.
     */
    publishConfirmed(topic: string, payload?: Payload, opts?: PublishConfirmedOptions): Promise<PublishResult>;
    /**
     * A {@link Publisher} over its own `PublishStream` (HTTP/2 flow control as
     * backpressure; the first bad message ends the stream). {@link Client.publish}
     * is the faster way; this one stays for code written against it. The
     * client's close ends it.
     */
    publisher(): Publisher;
    /**
     * Opens a subscription on the client's session and resolves once the
     * broker has registered it. Rejects with {@link TinybrokerError} when the
     * broker refused it (INVALID_ARGUMENT for a bad pattern, ALREADY_EXISTS for
     * an id in use, UNAUTHENTICATED, ...) or no broker registered it within
     * `timeout`.
     */
    subscribe(patterns: string | readonly string[], opts?: SubscribeOptions): Promise<Subscription>;
}
/**
 * Connects to a broker: `const client = await connect("broker:50051")`.
 * Resolves once an address answers (each tried in turn for up to
 * `timeout` ms); rejects with TinybrokerError(UNAVAILABLE) when none does.
 *
 * @param addr an address, a list, or the options (then `addr` is in them);
 *   default `TINYBROKER_ADDR`, else `127.0.0.1:50051`.
 * @param opts token, CA, credit window, re-subscription, timeout, signal.
 */
export declare function connect(addr?: string | readonly string[] | ConnectOptions, opts?: ConnectOptions): Promise<Client>;
