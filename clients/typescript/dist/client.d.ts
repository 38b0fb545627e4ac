import type { ChannelOptions } from "@grpc/grpc-js";
import { Admin } from "./admin.js";
import type { CallOpts } from "./admin.js";
import { Publisher } from "./publisher.js";
import type { Payload } from "./publisher.js";
import { Subscription } from "./session.js";
import type { EventCallback } from "./session.js";
import type { AckMode, PublishResult } from "./types.js";
/** Credit window per subscription when none is given. */
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
    /** Credit window per subscription (messages the broker may send it beyond what the application took; default 256). */
    window?: number;
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
export interface PublishOptions extends CallOpts {
    /** Headers (string to string). */
    headers?: Record<string, string>;
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
    /** Credit window (default the client's, 256). */
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
/**
 * A connection to a broker: one HTTP/2 connection, one Session stream for
 * all its subscriptions. Make one with {@link connect}; share it across the
 * process. Close it with {@link Client.close}.
 */
export declare class Client {
    /** The Admin calls. */
    readonly admin: Admin;
    /** Default credit window of its subscriptions. */
    readonly window: number;
    /** Default of `resubscribe` for its subscriptions. */
    readonly resubscribe: boolean;
    private readonly conn;
    private session;
    private closed_;
    /** The address in use (`http://…` or `https://…`). */
    get address(): string;
    /** How many times the session was started again after a loss. */
    get reconnects(): number;
    /** How many times the client moved to the next address of its list. */
    get failovers(): number;
    /** Whether {@link Client.close} was called. */
    get isClosed(): boolean;
    /** Closes every subscription (their iteration ends) and the connection. */
    close(): Promise<void>;
    private afterFailure;
    private sessionOrThrow;
    /**
     * Publishes one message and resolves to its sequence and how many
     * subscriptions and groups it matched. A string payload is sent as UTF-8.
     */
    publish(topic: string, payload?: Payload, opts?: PublishOptions): Promise<PublishResult>;
    /** A {@link Publisher} for high rates over one `PublishStream`, with backpressure. */
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
