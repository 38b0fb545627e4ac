import { Admin, unary } from "./admin.js";
import { Connection, parseTargets, targetString } from "./connection.js";
import { Status, TinybrokerError } from "./errors.js";
import { AckMode as PbAckMode, DeliveryMode } from "./gen/tinybroker/v1/broker.js";
import { Publisher, asBytes } from "./publisher.js";
import { Session, Subscription } from "./session.js";
import { inject, loadTracing } from "./tracing.js";
/** Credit window per subscription when none is given. */
export const DEFAULT_WINDOW = 256;
/**
 * A connection to a broker: one HTTP/2 connection, one Session stream for
 * all its subscriptions. Make one with {@link connect}; share it across the
 * process. Close it with {@link Client.close}.
 */
export class Client {
    /** The Admin calls. */
    admin;
    /** Default credit window of its subscriptions. */
    window;
    /** Default of `resubscribe` for its subscriptions. */
    resubscribe;
    conn;
    session;
    closed_ = false;
    /** @internal */ _tracing = false;
    /** @internal Use {@link connect}. */
    constructor(opts) {
        const token = opts.token ?? (process.env.TINYBROKER_AUTH_TOKEN || undefined);
        this.conn = new Connection(parseTargets(opts.addr ?? opts.servers), {
            token,
            caFile: opts.caFile,
            ca: opts.ca,
            channelOptions: opts.channelOptions,
        });
        this.window = opts.window ?? DEFAULT_WINDOW;
        this.resubscribe = opts.resubscribe ?? true;
        this.admin = new Admin(() => this.conn, (e) => this.afterFailure(e));
    }
    /** The address in use (`http://…` or `https://…`). */
    get address() {
        return targetString(this.conn.target);
    }
    /** How many times the session was started again after a loss. */
    get reconnects() {
        return this.session?.reconnects ?? 0;
    }
    /** How many times the client moved to the next address of its list. */
    get failovers() {
        return this.conn.failovers;
    }
    /** Whether {@link Client.close} was called. */
    get isClosed() {
        return this.closed_;
    }
    /** @internal */
    async _connect(timeout, signal, tracing = true) {
        this._tracing = tracing && (await loadTracing());
        await this.conn.connect(timeout, signal);
        this.session = new Session(this.conn);
        return this;
    }
    /** Closes every subscription (their iteration ends) and the connection. */
    async close() {
        if (this.closed_)
            return;
        this.closed_ = true;
        await this.session?.close();
        this.conn.close();
    }
    afterFailure(e) {
        // A call found the broker gone: with a list, the next call goes on.
        if (e.code === Status.UNAVAILABLE && this.conn.targets.length > 1 && this.conn.down()) {
            if (this.session === undefined || !this.session.live)
                this.conn.failover();
        }
    }
    sessionOrThrow() {
        if (this.closed_ || this.session === undefined) {
            throw new TinybrokerError(Status.FAILED_PRECONDITION, "the client is closed");
        }
        return this.session;
    }
    /**
     * Publishes one message and resolves to its sequence and how many
     * subscriptions and groups it matched. A string payload is sent as UTF-8.
     */
    async publish(topic, payload, opts) {
        this.sessionOrThrow();
        const headers = this._tracing ? inject(opts?.headers) : (opts?.headers ?? {});
        const request = { topic, payload: asBytes(payload), headers };
        const broker = this.conn.broker;
        const r = await unary(broker.publish, broker, request, this.conn.metadata, opts, (e) => this.afterFailure(e));
        return { sequence: r.sequence, matchedSubscriptions: r.matchedSubscriptions, matchedGroups: r.matchedGroups };
    }
    /** A {@link Publisher} for high rates over one `PublishStream`, with backpressure. */
    publisher() {
        this.sessionOrThrow();
        return new Publisher(() => this.conn, this._tracing);
    }
    /**
     * Opens a subscription on the client's session and resolves once the
     * broker has registered it. Rejects with {@link TinybrokerError} when the
     * broker refused it (INVALID_ARGUMENT for a bad pattern, ALREADY_EXISTS for
     * an id in use, UNAUTHENTICATED, ...) or no broker registered it within
     * `timeout`.
     */
    async subscribe(patterns, opts = {}) {
        const session = this.sessionOrThrow();
        const request = {
            topicPatterns: typeof patterns === "string" ? [patterns] : [...patterns],
            mode: opts.group ? DeliveryMode.DELIVERY_MODE_SINGLE : DeliveryMode.DELIVERY_MODE_MULTI,
            subscriptionId: opts.subscriptionId ?? "",
            consumerGroup: opts.group ?? "",
            ackMode: opts.ackMode === undefined
                ? PbAckMode.ACK_MODE_UNSPECIFIED
                : opts.ackMode === "manual"
                    ? PbAckMode.ACK_MODE_MANUAL
                    : opts.ackMode === "auto"
                        ? PbAckMode.ACK_MODE_AUTO
                        : (() => {
                            throw new TypeError(`ackMode must be "auto" or "manual", not ${JSON.stringify(opts.ackMode)}`);
                        })(),
            maxInFlight: opts.maxInFlight ?? 0,
            ackDeadlineMs: Math.round(opts.ackDeadline ?? 0),
        };
        const sub = new Subscription(session, request, {
            window: opts.window ?? this.window,
            resubscribe: opts.resubscribe ?? this.resubscribe,
            onEvent: opts.onEvent,
        });
        const signal = opts.signal;
        signal?.throwIfAborted();
        session.open(sub);
        const timeout = opts.timeout ?? 10_000;
        let timer;
        let onAbort;
        try {
            await Promise.race([
                sub._opened,
                new Promise((_, reject) => {
                    timer = setTimeout(() => reject(new Error("timeout")), timeout);
                    if (signal !== undefined) {
                        onAbort = () => reject(signal.reason);
                        signal.addEventListener("abort", onAbort, { once: true });
                    }
                }),
            ]);
        }
        catch (e) {
            if (e instanceof TinybrokerError)
                throw e;
            const cause = sub._lastCause;
            await sub.close();
            if (signal?.aborted)
                throw e;
            throw new TinybrokerError(cause?.code ?? Status.DEADLINE_EXCEEDED, `the subscription was not opened within ${timeout} ms` +
                (cause ? ` (last attempt: ${cause.codeName}: ${cause.details})` : ""));
        }
        finally {
            clearTimeout(timer);
            if (onAbort !== undefined)
                signal.removeEventListener("abort", onAbort);
        }
        if (signal !== undefined) {
            signal.addEventListener("abort", () => void sub.close(), { once: true });
        }
        return sub;
    }
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
export async function connect(addr, opts = {}) {
    if (addr !== undefined && typeof addr !== "string" && !Array.isArray(addr)) {
        opts = addr;
    }
    else if (addr !== undefined) {
        opts = { ...opts, addr: addr };
    }
    const client = new Client(opts);
    return client._connect(opts.timeout ?? 5000, opts.signal, opts.tracing ?? true);
}
