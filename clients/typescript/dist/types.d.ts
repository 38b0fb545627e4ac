/** When a consumer-group message counts as done: `"auto"` once written to the member's stream (at most once), `"manual"` once acked. */
export type AckMode = "auto" | "manual";
/** What the broker answered to one publish. */
export interface PublishResult {
    /** Broker-assigned sequence, strictly increasing over the broker's lifetime. */
    readonly sequence: number;
    /** Broadcast subscriptions the message was queued for. */
    readonly matchedSubscriptions: number;
    /** Consumer groups the message was routed to. */
    readonly matchedGroups: number;
}
/** What one `PublishStream` of a {@link Publisher} carried. */
export interface PublishStreamResult {
    /** Messages the broker accepted on the stream. */
    readonly accepted: number;
    /** Sequence of the first accepted message (0: none). */
    readonly firstSequence: number;
    /** Sequence of the last accepted message (0: none). */
    readonly lastSequence: number;
}
/**
 * One delivered message. In a MANUAL consumer group call {@link Message.ack}
 * when done or {@link Message.nack} to hand it back for redelivery; both go
 * in-band on the client's session, with no reply.
 */
export declare class Message {
    /** The topic it was published to. */
    get topic(): string;
    /** The topic (the name nats.js uses). */
    get subject(): string;
    /** The payload bytes. */
    get payload(): Uint8Array;
    /** The payload bytes (the name nats.js uses). */
    get data(): Uint8Array;
    /** Headers the publisher set (and `traceparent` when the broker traces). */
    get headers(): Readonly<Record<string, string>>;
    /** Broker-assigned sequence (names the message in acks). */
    get sequence(): number;
    /** When the broker accepted the publish. */
    get publishTime(): Date;
    /** The id of the subscription it was delivered to. */
    get subscriptionId(): string;
    /** The consumer group, for group deliveries (else `""`). */
    get consumerGroup(): string;
    /** 1 on first delivery, growing with each redelivery. */
    get deliveryAttempt(): number;
    /**
     * The OpenTelemetry `Context` its `traceparent`/`tracestate` headers carry
     * (undefined without `@opentelemetry/api`): pass it to
     * `tracer.startActiveSpan(name, {}, msg.traceContext, fn)` to continue the trace.
     */
    get traceContext(): unknown;
    /** The payload decoded as UTF-8. */
    string(): string;
    /** The payload parsed as JSON. */
    json<T = unknown>(): T;
    /**
     * Acknowledges this MANUAL-group message. It is not sent at once: every
     * ack of the subscription made before the client's next turn of the event
     * loop goes in one `SessionAck`. Returns false when it will not be sent:
     * not a MANUAL group, or the message came on an earlier open of the
     * subscription (an earlier session: the broker redelivers it anyway) or
     * the subscription is closed.
     */
    ack(): boolean;
    /** Hands this MANUAL-group message back for immediate redelivery to another member (or this one). Returns false as {@link Message.ack} does. */
    nack(): boolean;
}
/** The broker registered the subscription (its first open). */
export interface OpenedEvent {
    /** Discriminant. */ readonly type: "opened";
    /** The id the broker gave it (yours when you named one). */ readonly subscriptionId: string;
}
/**
 * The broker ended the subscription: `reason` is the broker's (`evicted`,
 * `shutdown`, `closed_by_admin`, or `rejected` for a re-open it refused);
 * `resubscribing` says whether the client opens it again. A lost session is
 * not an end: the subscription is opened again on the next session and the
 * client's `connection` events say so (except with `resubscribe: false`,
 * when it ends with `reason: "connection_lost"`).
 */
export interface EndedEvent {
    /** Discriminant. */ readonly type: "ended";
    /** Its id. */ readonly subscriptionId: string | undefined;
    /** Why it ended. */ readonly reason: string;
    /** Messages queued for it that were never delivered. */ readonly dropped: number;
    /** Sequence of the last message delivered to it (0: none). */ readonly lastSequence: number;
    /** gRPC status code (0 except for `rejected` and `connection_lost`). */ readonly code: number;
    /** The broker's or the transport's message. */ readonly message: string;
    /** Whether the client opens it again. */ readonly resubscribing: boolean;
}
/** The subscription is opened again in `delay` ms; `cause` says why the last attempt failed, if one did. */
export interface ResubscribingEvent {
    /** Discriminant. */ readonly type: "resubscribing";
    /** Its id. */ readonly subscriptionId: string | undefined;
    /** Milliseconds until the attempt. */ readonly delay: number;
    /** Why the previous attempt failed, if one did. */ readonly cause: string | undefined;
}
/** Open again (`subscriptionId` is the new id; the same one when the application named it). */
export interface ResubscribedEvent {
    /** Discriminant. */ readonly type: "resubscribed";
    /** Its id now. */ readonly subscriptionId: string;
}
/** Why a {@link GapEvent} cannot say which sequences were missed. */
export type GapUnknownReason = "instance_changed" | "sequence_scope" | "nothing_before";
/**
 * The first message after the subscription was open again (after an end or
 * a lost session) does not follow the last one before. `missed` is the
 * exact range of sequences not delivered to it, only when both messages
 * came from the same broker instance whose sequences are one counter
 * (`tinybroker-sequence-scope: instance`); otherwise it is undefined and
 * `reason` says why (docs/clients.md "Gaps"). No event is reported when the
 * first message is the next sequence.
 */
export interface GapEvent {
    /** Discriminant. */ readonly type: "gap";
    /** Its id. */ readonly subscriptionId: string | undefined;
    /** The sequences missed, inclusive; undefined when unknown. */
    readonly missed: {
        readonly first: number;
        readonly last: number;
    } | undefined;
    /** Why `missed` is unknown (undefined when it is known). */ readonly reason: GapUnknownReason | undefined;
    /** What the broker said it dropped when it ended the subscription (undefined after a lost session). */
    readonly dropped: number | undefined;
    /** What ended it before: the broker's `ended` reason, or `connection_lost`. */ readonly cause: string;
    /** Sequence of the last message before (0: none). */ readonly lastBefore: number;
    /** Sequence of the first message after. */ readonly firstAfter: number;
}
/** What happens to a subscription besides its messages (see `type`). */
export type SubscriptionEvent = OpenedEvent | EndedEvent | ResubscribingEvent | ResubscribedEvent | GapEvent;
/** Counters of one subscription (read them at any time). */
export interface SubscriptionStats {
    /** Messages handed to the application. */ received: number;
    /** Times the broker ended it (evictions, shutdowns, ...); lost sessions are not ends. */ ends: number;
    /** Times it was evicted. */ evictions: number;
    /** Times it was opened again (after an end or a lost session). */ resubscribes: number;
    /** Gap events reported. */ gaps: number;
    /** Sum of `dropped` over its ends. */ dropped: number;
    /** Ends by reason. */ byReason: Record<string, number>;
}
/**
 * What happened to the client's connection, once per change whatever the
 * number of subscriptions (docs/clients.md "Connection events"):
 * `connected` (the first session opened), `disconnected` (an open session
 * was lost), `reconnected` (a session opened after a `disconnected`),
 * `closed` ({@link Client.close} finished).
 */
export type ConnectionEvent = {
    readonly type: "connected";
    readonly address: string;
    readonly instance: string;
} | {
    readonly type: "disconnected";
    readonly reason: string;
    readonly code: number;
} | {
    readonly type: "reconnected";
    readonly address: string;
    readonly instance: string;
    readonly instanceChanged: boolean;
} | {
    readonly type: "closed";
};
/** One buffered message the broker refused, as its `PublishRejection` said. */
export interface PublishRejected {
    /** The message's index (counted from 0 over the client's `publish()` calls). */ readonly index: number;
    /** Its topic. */ readonly topic: string;
    /** The gRPC status code `Publish` would have returned (a {@link Status}). */ readonly code: number;
    /** The broker's message. */ readonly message: string;
}
/** A run of message indexes, inclusive. */
export interface IndexRange {
    /** First index. */ readonly first: number;
    /** Last index. */ readonly last: number;
}
/**
 * What happened to the messages published since the previous
 * `flush()`: each message's outcome is in exactly one flush result.
 */
export interface FlushResult {
    /** Messages the broker accepted. */ readonly accepted: number;
    /** Messages it refused, each with its index, topic, code and message. */ readonly rejected: readonly PublishRejected[];
    /**
     * Messages written to a session that was lost before it answered: they
     * may or may not have been published, and are never written again.
     */
    readonly unconfirmed: number;
    /** Their indexes. */ readonly unconfirmedIndexes: readonly IndexRange[];
}
/** What `close()` reports: the last flush, and what was never written. */
export interface CloseResult extends FlushResult {
    /** Buffered messages not written to any session by the time the client closed. */ readonly notSent: number;
}
/** The client's counters (`client.stats()`). */
export interface ClientStats {
    /** Deliveries received on the session (a delivery naming several subscriptions counts once). */ messagesIn: number;
    /** Their payload bytes. */ bytesIn: number;
    /** Messages written to the broker (buffered publishes and `publishConfirmed`). */ messagesOut: number;
    /** Their payload bytes. */ bytesOut: number;
    /** Sessions that opened after a `disconnected`. */ reconnects: number;
    /** Messages in the publish buffer, not yet written (including publishers waiting for room). */ pendingMessages: number;
    /** Their encoded bytes. */ pendingBytes: number;
    /** Deliveries dropped because their handle was no longer the client's (late events of a closed or re-opened subscription). */ droppedLate: number;
}
