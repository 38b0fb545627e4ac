import { Admin, unary } from "./admin.js";
import { BATCH_BYTES, BATCH_MESSAGES, BUFFER_BYTES, CLOSE_TIMEOUT, REQUEST_SLACK, WINDOW } from "./constants.js";
import { Connection, parseTargets, targetString } from "./connection.js";
import { ClientClosed, Status, TimeoutError, TinybrokerError, UsageError } from "./errors.js";
import { AckMode as PbAckMode, DeliveryMode } from "./gen/tinybroker/v1/broker.js";
import { Publisher, asBytes } from "./publisher.js";
import { Session, Subscription } from "./session.js";
import { inject, loadTracing } from "./tracing.js";
/** Credit window per subscription when none is given (docs/clients.md `WINDOW`). */
export const DEFAULT_WINDOW = WINDOW;
/**
 * A connection to a broker: one HTTP/2 connection, one Session stream for
 * all its subscriptions and buffered publishes. Make one with
 * {@link connect}; share it across the process. Close it with
 * {@link Client.close}: after that every call rejects with
 * {@link ClientClosed}.
 */
export class Client {
    /** The Admin calls. */
    admin;
    /** Default credit window of its subscriptions. */
    window;
    /** Default of `resubscribe` for its subscriptions. */
    resubscribe;
    bufferBytes;
    conn;
    session;
    closed_ = false;
    closing;
    publishers = new Set();
    listeners = new Set();
    confirmedOut = 0;
    confirmedBytesOut = 0;
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
        if (!(Number.isInteger(this.window) && this.window >= 1)) {
            throw new UsageError(`window must be an integer of at least 1, not ${opts.window}`, Status.INVALID_ARGUMENT);
        }
        this.bufferBytes = opts.bufferBytes ?? BUFFER_BYTES;
        if (!(this.bufferBytes >= 1)) {
            throw new UsageError(`bufferBytes must be at least 1, not ${opts.bufferBytes}`, Status.INVALID_ARGUMENT);
        }
        this.resubscribe = opts.resubscribe ?? true;
        this.admin = new Admin(() => this.conn, (e) => this.afterFailure(e), () => this.closed_);
    }
    /** The address in use (`http://…` or `https://…`). */
    get address() {
        return targetString(this.conn.target);
    }
    /** The session's state: IDLE, STARTING, OPEN, WAITING or CLOSED (docs/clients.md). */
    get state() {
        return this.closed_ ? "CLOSED" : (this.session?.state ?? "IDLE");
    }
    /** Sessions that opened after a `disconnected` (the connection was lost and found again). */
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
        // BATCH_MESSAGES is the broker's max_batch_messages when it says;
        // BATCH_BYTES stays below what one request may carry.
        let batchMessages = BATCH_MESSAGES;
        let batchBytes = BATCH_BYTES;
        try {
            const conn = this.conn;
            const info = await unary(conn.admin.getBrokerInfo, conn.admin, {}, conn.metadata, { timeout: Math.min(timeout, 5000) });
            if (info.limits?.maxBatchMessages)
                batchMessages = info.limits.maxBatchMessages;
            if (info.limits?.maxMessageBytes) {
                batchBytes = Math.min(batchBytes, info.limits.maxMessageBytes + REQUEST_SLACK);
            }
        }
        catch {
            // A broker that does not answer Admin (a token without admin rights, an older one): the defaults.
        }
        this.session = new Session(this.conn, this.bufferBytes, batchMessages, batchBytes, (e) => this.emit(e));
        return this;
    }
    emit(event) {
        for (const listener of [...this.listeners]) {
            try {
                listener(event);
            }
            catch (e) {
                console.error("tinybroker: a connection listener failed", e);
            }
        }
    }
    /**
     * Calls `listener` with every {@link ConnectionEvent} (`connected`,
     * `disconnected`, `reconnected`, `closed`): once per change of the
     * connection, whatever the number of subscriptions.
     */
    on(event, listener) {
        if (event !== "connection")
            throw new UsageError(`no event ${JSON.stringify(event)}: "connection"`);
        this.listeners.add(listener);
        return this;
    }
    /** Removes a listener added with {@link Client.on}. */
    off(event, listener) {
        if (event === "connection")
            this.listeners.delete(listener);
        return this;
    }
    /**
     * The {@link ConnectionEvent}s from now on, as an async iterable:
     * `for await (const e of client.connectionEvents())`. It ends after
     * `closed`; leaving the loop stops listening.
     */
    connectionEvents() {
        const queue = [];
        let wake;
        let done = this.closed_;
        const listener = (e) => {
            queue.push(e);
            if (e.type === "closed") {
                done = true;
                this.off("connection", listener);
            }
            wake?.();
        };
        if (!done)
            this.on("connection", listener);
        const stop = () => {
            done = true;
            queue.length = 0;
            this.off("connection", listener);
            wake?.();
        };
        return {
            [Symbol.asyncIterator]: () => ({
                next: async () => {
                    while (queue.length === 0 && !done)
                        await new Promise((r) => (wake = r));
                    wake = undefined;
                    const e = queue.shift();
                    return e === undefined ? { done: true, value: undefined } : { done: false, value: e };
                },
                return: async () => {
                    stop();
                    return { done: true, value: undefined };
                },
            }),
        };
    }
    /** The client's counters: messages and bytes in and out, reconnects, what is pending in the publish buffer. */
    stats() {
        const s = this.session;
        return {
            messagesIn: s?.messagesIn ?? 0,
            bytesIn: s?.bytesIn ?? 0,
            messagesOut: (s?.buffer.messagesOut ?? 0) + this.confirmedOut,
            bytesOut: (s?.buffer.bytesOut ?? 0) + this.confirmedBytesOut,
            reconnects: s?.reconnects ?? 0,
            pendingMessages: s?.buffer.pendingMessages ?? 0,
            pendingBytes: s?.buffer.pendingBytes ?? 0,
            droppedLate: s?.droppedLate ?? 0,
        };
    }
    /**
     * Flushes the publish buffer (for at most {@link CLOSE_TIMEOUT} ms),
     * ends every subscription (their loops end, waiting `next()` calls reject
     * with {@link ClientClosed}) and every {@link Publisher}, closes the
     * connection and emits `closed`. Resolves to the last flush's outcomes
     * and `notSent`: buffered messages never written. Nothing of the client
     * keeps the process alive after it. A second call returns the first's
     * result.
     */
    close() {
        if (this.closing === undefined)
            this.closing = this.doClose();
        return this.closing;
    }
    async doClose() {
        this.closed_ = true;
        const session = this.session;
        let last;
        const started = Date.now();
        if (session !== undefined) {
            try {
                last = await session.buffer.flush(CLOSE_TIMEOUT);
            }
            catch {
                // Not answered within CLOSE_TIMEOUT: what is left is counted below, and the client closes anyway.
            }
        }
        const rest = session?.buffer.close() ?? { accepted: 0, rejected: [], unconfirmed: 0, unconfirmedIndexes: [], notSent: 0 };
        const left = Math.max(100, CLOSE_TIMEOUT - (Date.now() - started));
        await Promise.all([
            session?.close(Math.min(left, 2000)),
            ...[...this.publishers].map((p) => p._end(Math.min(left, 2000))),
        ]);
        this.conn.close();
        this.emit({ type: "closed" });
        this.listeners.clear();
        return {
            accepted: (last?.accepted ?? 0) + rest.accepted,
            rejected: [...(last?.rejected ?? []), ...rest.rejected],
            unconfirmed: (last?.unconfirmed ?? 0) + rest.unconfirmed,
            unconfirmedIndexes: [...(last?.unconfirmedIndexes ?? []), ...rest.unconfirmedIndexes],
            notSent: rest.notSent,
        };
    }
    afterFailure(e) {
        // A call found the broker gone: with a list, the next call goes on.
        if (e.code === Status.UNAVAILABLE && this.conn.targets.length > 1 && this.conn.down()) {
            if (this.session === undefined || this.session.state !== "OPEN")
                this.conn.failover();
        }
    }
    sessionOrThrow() {
        if (this.closed_ || this.session === undefined)
            throw new ClientClosed();
        return this.session;
    }
    request(topic, payload, opts) {
        if (typeof topic !== "string")
            throw new UsageError(`topic must be a string, not ${typeof topic}`, Status.INVALID_ARGUMENT);
        const headers = this._tracing ? inject(opts?.headers) : (opts?.headers ?? {});
        return { topic, payload: asBytes(payload), headers };
    }
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
    publish(topic, payload, opts) {
        let session;
        let request;
        try {
            session = this.sessionOrThrow();
            request = this.request(topic, payload, opts);
        }
        catch (e) {
            return Promise.reject(e);
        }
        session.need();
        return session.buffer.publish(request);
    }
    /**
     * Resolves once every message published before the call has an outcome,
     * to what happened to the messages published since the previous flush:
     * `accepted`, `rejected` (index, topic, code, message each) and
     * `unconfirmed` (written to a session lost before it answered; never
     * written again). Rejects with {@link TimeoutError} after `timeout` ms,
     * losing nothing (the outcomes go to the next flush).
     */
    flush(opts = {}) {
        let session;
        try {
            session = this.sessionOrThrow();
        }
        catch (e) {
            return Promise.reject(e);
        }
        return session.buffer.flush(opts.timeout);
    }
    /**
     * Publishes one message with the unary `Publish` (not through the buffer:
     * it may overtake buffered messages) and resolves to its sequence and how
     * many subscriptions and groups it matched; rejects with the broker's code
     * and message.
     */
    async publishConfirmed(topic, payload, opts) {
        this.sessionOrThrow();
        const request = this.request(topic, payload, opts);
        const broker = this.conn.broker;
        const r = await unary(broker.publish, broker, request, this.conn.metadata, opts, (e) => this.afterFailure(e));
        this.confirmedOut += 1;
        this.confirmedBytesOut += request.payload.length;
        return { sequence: r.sequence, matchedSubscriptions: r.matchedSubscriptions, matchedGroups: r.matchedGroups };
    }
    /**
     * A {@link Publisher} over its own `PublishStream` (HTTP/2 flow control as
     * backpressure; the first bad message ends the stream). {@link Client.publish}
     * is the faster way; this one stays for code written against it. The
     * client's close ends it.
     */
    publisher() {
        this.sessionOrThrow();
        const publisher = new Publisher(() => this.conn, this._tracing, (p) => this.publishers.delete(p));
        this.publishers.add(publisher);
        return publisher;
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
                            throw new UsageError(`ackMode must be "auto" or "manual", not ${JSON.stringify(opts.ackMode)}`, Status.INVALID_ARGUMENT);
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
        session.add(sub);
        const timeout = opts.timeout ?? 10_000;
        let timer;
        let onAbort;
        try {
            await Promise.race([
                sub._opened,
                new Promise((_, reject) => {
                    timer = setTimeout(() => reject(new TimeoutError("timeout")), timeout);
                    if (signal !== undefined) {
                        onAbort = () => reject(signal.reason);
                        signal.addEventListener("abort", onAbort, { once: true });
                    }
                }),
            ]);
        }
        catch (e) {
            if (!(e instanceof TimeoutError) && e instanceof TinybrokerError)
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
