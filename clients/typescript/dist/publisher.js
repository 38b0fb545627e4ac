import { PublishError, Status, TinybrokerError } from "./errors.js";
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
 * Publishes a long run of messages on one `PublishStream`.
 *
 * `await pub.publish(...)` resolves once the message is handed to the
 * stream, and waits (for 'drain') while the stream's HTTP/2 flow-control
 * window is full, i.e. the broker is behind: nothing is buffered without
 * bound as long as each publish is awaited. {@link Publisher.flush} ends the
 * stream and resolves to what it carried (a later publish starts a new one);
 * {@link Publisher.close} does the same and ends the publisher. The first bad
 * message ends the stream: that publish (or the next, or flush) rejects with
 * a {@link PublishError} carrying the gRPC code, the broker's message and how
 * many messages were written before it.
 */
export class Publisher {
    conn;
    tracing;
    /** Messages written on all of this publisher's streams. */
    published = 0;
    stream;
    closed = false;
    /** @internal */
    constructor(conn, tracing = false) {
        this.conn = conn;
        this.tracing = tracing;
    }
    start() {
        const conn = this.conn();
        const s = {};
        s.written = 0;
        s.error = undefined;
        s.response = undefined;
        s.wakeDrain = undefined;
        s.done = new Promise((resolve) => {
            s.call = conn.broker.publishStream(conn.metadata, (err, response) => {
                if (err)
                    s.error = new PublishError(err.code, err.details ?? err.message, s.written);
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
        if (this.closed) {
            return Promise.reject(new TinybrokerError(Status.FAILED_PRECONDITION, "the publisher is closed"));
        }
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
        s.written += 1;
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
    /** Ends the current stream and resolves to its counts (zeros when nothing was published since the last flush). */
    async flush() {
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
    /** Flushes and ends the publisher. */
    async close() {
        const result = await this.flush();
        this.closed = true;
        return result;
    }
    /** Cancels the current stream without waiting (what was written may or may not be published) and ends the publisher. */
    abort() {
        this.closed = true;
        this.stream?.call.cancel();
        this.stream = undefined;
    }
}
