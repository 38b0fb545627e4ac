import type { PublishStreamResult } from "./types.js";
/** A payload: bytes, or a string sent as UTF-8. */
export type Payload = Uint8Array | string;
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
export declare class Publisher {
    private readonly conn;
    private readonly tracing;
    private readonly onClosed;
    /** Messages written on all of this publisher's streams. */
    published: number;
    private stream;
    private closed;
    private start;
    /**
     * Writes one message on the stream; resolves at once unless the stream is
     * full, then once it has room. Rejects with {@link PublishError} when the
     * stream has ended with an error.
     */
    publish(topic: string, payload?: Payload, opts?: {
        headers?: Record<string, string>;
    }): Promise<void>;
    private drain;
    /**
     * Ends the current stream and resolves to the broker's counts for it
     * (zeros when nothing was published since the last end); a later publish
     * starts a new stream.
     */
    end(): Promise<PublishStreamResult>;
    /** Ends the stream ({@link Publisher.end}) and the publisher: later publishes reject with {@link ClientClosed}. */
    close(): Promise<PublishStreamResult>;
    /** Cancels the current stream without waiting (what was written may or may not be published) and ends the publisher. */
    abort(): void;
}
