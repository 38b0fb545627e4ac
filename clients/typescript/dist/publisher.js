import { ClientClosed, PublishError } from "./errors.js";
import { inject } from "./tracing.js";
/** @internal */
export function asBytes(payload) {
    if (payload === undefined)
        return Buffer.alloc(0);
    if (typeof payload === "string")
        return Buffer.from(payload, "utf8");
    return Buffer.isBuffer(payload) ? payload : Buffer.from(payload.buffer, payload.byteOffset, payload.byteLength);
}
/**
 * Publishes a long run of messages on one `PublishStream` of its own.
 * (`client.publish()` with `client.flush()` is the faster way, on the
 * client's session; this stays for code written against it.)
 *
 * `await pub.publish(...)` resolves once the message is handed to the
 * stream, and waits (for 'drain') while the stream's HTTP/2 flow-control
 * window is full, i.e. the broker is behind: nothing is buffered without
 * bound as long as each publish is awaited. {@link Publisher.end} ends the
 * stream and resolves to what the broker accepted on it (a later publish
 * starts a new one); {@link Publisher.close} does the same and ends the
 * publisher, as the client's close does. The first bad message ends the
 * stream: that publish (or the next, or end) rejects with a
 * {@link PublishError} carrying the gRPC code, the broker's message and
 * `accepted`, the count the broker says it accepted before it.
 */
export class Publisher {
    conn;
    tracing;
    onClosed;
    /** Messages written on all of this publisher's streams. */
    published = 0;
    stream;
    closed = false;
    /** @internal */
    constructor(conn, tracing, onClosed) {
        this.conn = conn;
        this.tracing = tracing;
        this.onClosed = onClosed;
    }
    start() {
        const conn = this.conn();
        const s = {};
        s.error = undefined;
        s.response = undefined;
        s.wakeDrain = undefined;
        s.done = new Promise((resolve) => {
            s.call = conn.broker.publishStream(conn.metadata, (err, response) => {
                if (err)
                    s.error = new PublishError(err.code, err.details || err.message || `the stream ended with code ${err.code}`);
                else
                    s.response = response;
                s.wakeDrain?.();
                resolve();
            });
        });
        this.stream = s;
        return s;
    }
    /**
     * Writes one message on the stream; resolves at once unless the stream is
     * full, then once it has room. Rejects with {@link PublishError} when the
     * stream has ended with an error.
     */
    publish(topic, payload, opts) {
        if (this.closed)
            return Promise.reject(new ClientClosed("the publisher"));
        let s = this.stream;
        if (s !== undefined && s.error !== undefined) {
            this.stream = undefined;
            return Promise.reject(s.error);
        }
        if (s === undefined)
            s = this.start();
        const headers = this.tracing ? inject(opts?.headers) : (opts?.headers ?? {});
        const request = { topic, payload: asBytes(payload), headers };
        const room = s.call.write(request);
        this.published += 1;
        if (room)
            return Promise.resolve();
        return this.drain(s);
    }
    drain(s) {
        return new Promise((resolve, reject) => {
            const done = () => {
                s.call.off("drain", done);
                s.wakeDrain = undefined;
                if (s.error !== undefined) {
                    if (this.stream === s)
                        this.stream = undefined;
                    reject(s.error);
                }
                else
                    resolve();
            };
            s.wakeDrain = done;
            s.call.once("drain", done);
        });
    }
    /**
     * Ends the current stream and resolves to the broker's counts for it
     * (zeros when nothing was published since the last end); a later publish
     * starts a new stream.
     */
    async end() {
        const s = this.stream;
        this.stream = undefined;
        if (s === undefined)
            return { accepted: 0, firstSequence: 0, lastSequence: 0 };
        s.call.end();
        await s.done;
        if (s.error !== undefined)
            throw s.error;
        const r = s.response;
        return { accepted: r.accepted, firstSequence: r.firstSequence, lastSequence: r.lastSequence };
    }
    /** Ends the stream ({@link Publisher.end}) and the publisher: later publishes reject with {@link ClientClosed}. */
    async close() {
        this.closed = true;
        this.onClosed(this);
        return this.end();
    }
    /** Cancels the current stream without waiting (what was written may or may not be published) and ends the publisher. */
    abort() {
        this.closed = true;
        this.onClosed(this);
        this.stream?.call.cancel();
        this.stream = undefined;
    }
    /** @internal The client closes: the stream is ended, and cancelled if the broker has not answered within `timeout` ms. */
    async _end(timeout) {
        this.closed = true;
        const s = this.stream;
        if (s === undefined)
            return;
        let timer;
        await Promise.race([this.end().catch(() => undefined), new Promise((r) => (timer = setTimeout(r, timeout)))]);
        clearTimeout(timer);
        s.call.cancel();
    }
}
