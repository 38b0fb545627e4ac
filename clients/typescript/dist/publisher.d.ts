import type { PublishStreamResult } from "./types.js";
/** A payload: bytes, or a string sent as UTF-8. */
export type Payload = Uint8Array | string;
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
export declare class Publisher {
    private readonly conn;
    private readonly tracing;
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
    /** Ends the current stream and resolves to its counts (zeros when nothing was published since the last flush). */
    flush(): Promise<PublishStreamResult>;
    /** Flushes and ends the publisher. */
    close(): Promise<PublishStreamResult>;
    /** Cancels the current stream without waiting (what was written may or may not be published) and ends the publisher. */
    abort(): void;
}
