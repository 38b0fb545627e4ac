import { BinaryReader, BinaryWriter } from "@bufbuild/protobuf/wire";
import { type CallOptions, type ChannelCredentials, Client, type ClientDuplexStream, type ClientOptions, type ClientReadableStream, type ClientUnaryCall, type ClientWritableStream, type handleBidiStreamingCall, type handleClientStreamingCall, type handleServerStreamingCall, type handleUnaryCall, type Metadata, type ServiceError, type UntypedServiceImplementation } from "@grpc/grpc-js";
import { Timestamp } from "../../google/protobuf/timestamp.js";
export declare const protobufPackage = "tinybroker.v1";
export declare const protobufFileName = "tinybroker/v1/broker.proto";
/**
 * tinybroker wire contract: the Broker service (publish, subscribe, ack).
 * See docs/contract.md for the semantics; names here are part of the contract.
 */
/** How a subscription shares messages with others. */
export declare enum DeliveryMode {
    /** DELIVERY_MODE_UNSPECIFIED - Same as DELIVERY_MODE_MULTI. */
    DELIVERY_MODE_UNSPECIFIED = 0,
    /** DELIVERY_MODE_MULTI - Broadcast: every matching subscription gets every message. */
    DELIVERY_MODE_MULTI = 1,
    /** DELIVERY_MODE_SINGLE - Consumer group: each message goes to one member of `consumer_group`. */
    DELIVERY_MODE_SINGLE = 2,
    UNRECOGNIZED = -1
}
/** When a consumer-group message counts as done. */
export declare enum AckMode {
    /** ACK_MODE_UNSPECIFIED - Same as ACK_MODE_AUTO. */
    ACK_MODE_UNSPECIFIED = 0,
    /** ACK_MODE_AUTO - Done once written to the member's stream (at most once). */
    ACK_MODE_AUTO = 1,
    /** ACK_MODE_MANUAL - In flight until acked; redelivered on deadline, nack or disconnect. */
    ACK_MODE_MANUAL = 2,
    UNRECOGNIZED = -1
}
export interface PublishRequest {
    /** Dot-separated topic without wildcards, e.g. `deploy.rollout`. */
    topic: string;
    payload: Buffer;
    headers: {
        [key: string]: string;
    };
}
export interface PublishRequest_HeadersEntry {
    key: string;
    value: string;
}
export interface PublishResponse {
    /** Broker-assigned sequence, strictly increasing over the broker's lifetime. */
    sequence: number;
    /** Broadcast subscriptions the message was queued for. */
    matchedSubscriptions: number;
    /** Consumer groups the message was routed to. */
    matchedGroups: number;
}
export interface PublishStreamResponse {
    /** Messages accepted on this stream. */
    accepted: number;
    /** Sequence of the first and last accepted message (0 when none). */
    firstSequence: number;
    lastSequence: number;
}
export interface OpenSubscriptionRequest {
    /** One or more patterns: `*` matches one token, a final `>` one or more. */
    topicPatterns: string[];
    mode: DeliveryMode;
    /** Blank: the broker generates one. */
    subscriptionId: string;
    /** Required with DELIVERY_MODE_SINGLE, forbidden otherwise. */
    consumerGroup: string;
    ackMode: AckMode;
    /** Consumer groups: most messages held at once (0: broker default). */
    maxInFlight: number;
    /** Manual ack: redeliver when not acked within this time (0: broker default). */
    ackDeadlineMs: number;
}
export interface Message {
    topic: string;
    payload: Buffer;
    headers: {
        [key: string]: string;
    };
    sequence: number;
    publishTime: Timestamp | undefined;
    subscriptionId: string;
    /** Set for consumer-group deliveries. */
    consumerGroup: string;
    /** 1 on first delivery, +1 on each redelivery. */
    deliveryAttempt: number;
}
export interface Message_HeadersEntry {
    key: string;
    value: string;
}
export interface AckRequest {
    subscriptionId: string;
    sequences: number[];
}
export interface AckResponse {
    /** Sequences that were in flight with this subscription and are now done. */
    acked: number;
    /** Sequences this subscription does not hold (already acked, redelivered elsewhere, never seen). */
    unknown: number;
}
export interface NackRequest {
    subscriptionId: string;
    sequences: number[];
}
export interface NackResponse {
    /** Sequences handed back to the group for redelivery. */
    requeued: number;
    unknown: number;
}
/** What a session's client sends: one request per message of the stream. */
export interface SessionRequest {
    request: {
        $case: "open";
        value: SessionOpen;
    } | {
        $case: "close";
        value: SessionClose;
    } | {
        $case: "credit";
        value: SessionCredit;
    } | {
        $case: "ack";
        value: SessionAck;
    } | {
        $case: "nack";
        value: SessionNack;
    } | {
        $case: "publish";
        value: SessionPublish;
    } | undefined;
}
/**
 * Opens a subscription under `handle` (non-zero, unique among the session's
 * open subscriptions).
 */
export interface SessionOpen {
    handle: number;
    /** Exactly what OpenSubscription takes, with the same validation. */
    subscription: OpenSubscriptionRequest | undefined;
    /**
     * 0: no credit limit. Otherwise the most deliveries sent to this handle
     * beyond what SessionCredit messages add.
     */
    credit: number;
}
/**
 * Ends the subscription of `handle`; an `ended` event with reason "closed"
 * follows.
 */
export interface SessionClose {
    handle: number;
}
/** Lets the broker send `messages` more deliveries to `handle`. */
export interface SessionCredit {
    handle: number;
    messages: number;
}
/** What Ack does, for the subscription of `handle`; no reply. */
export interface SessionAck {
    handle: number;
    sequences: number[];
}
/** What Nack does, for the subscription of `handle`; no reply. */
export interface SessionNack {
    handle: number;
    sequences: number[];
}
/**
 * Publishes `messages` in order, each validated, given its sequence and
 * routed exactly as Publish would; answered by one `published` event with
 * the same `id` (answers come in the order of the requests). At most
 * TINYBROKER_MAX_BATCH_MESSAGES messages; a larger batch is rejected whole.
 */
export interface SessionPublish {
    /** The client's own, echoed in the answer. */
    id: number;
    messages: PublishRequest[];
}
/** What the broker sends on a session. */
export interface SessionEvent {
    event: {
        $case: "opened";
        value: SessionOpened;
    } | {
        $case: "delivery";
        value: SessionDelivery;
    } | {
        $case: "ended";
        value: SessionEnded;
    } | {
        $case: "published";
        value: SessionPublished;
    } | //
    /**
     * Only on a session opened with the request metadata
     * `tinybroker-batch: 1`, which then gets no bare `delivery` events.
     */
    {
        $case: "deliveries";
        value: SessionDeliveries;
    } | undefined;
}
/** The answer to the `publish` with this `id`. */
export interface SessionPublished {
    id: number;
    /**
     * The sequence of the first accepted message; the others follow it,
     * consecutively, in request order (0 when none was accepted).
     */
    firstSequence: number;
    accepted: number;
    /** Each message not published, by its index in the batch, in index order. */
    rejected: PublishRejection[];
}
/** A message of a batch that was not published. */
export interface PublishRejection {
    /** Its index in `SessionPublish.messages`. */
    index: number;
    /** The gRPC status code Publish would have returned for it. */
    code: number;
    /** That status's message. */
    message: string;
}
/**
 * Every delivery that was ready for the session when the broker wrote, up to
 * a byte bound, each exactly a `delivery` event's; per handle in order.
 */
export interface SessionDeliveries {
    deliveries: SessionDelivery[];
}
/**
 * The subscription of `handle` is registered: every matching message
 * published from now on reaches it.
 */
export interface SessionOpened {
    handle: number;
    subscriptionId: string;
}
/**
 * One message for one or more of the session's subscriptions; no handle
 * appears twice.
 */
export interface SessionDelivery {
    handles: number[];
    /**
     * What OpenSubscription would have sent; `subscription_id` is empty when
     * the delivery names several handles.
     */
    message: Message | undefined;
}
/**
 * The subscription of `handle` ended; nothing more comes for it, and the
 * handle is free again.
 */
export interface SessionEnded {
    handle: number;
    /** evicted, closed, closed_by_admin, shutdown or rejected. */
    reason: string;
    /** Messages queued for it that were never delivered. */
    dropped: number;
    /** The sequence of the last message delivered to it (0 if none). */
    lastSequence: number;
    /**
     * For "rejected": the gRPC status code OpenSubscription would have
     * returned; 0 otherwise.
     */
    code: number;
    /** For "rejected": that status's message. */
    message: string;
}
export declare const PublishRequest: MessageFns<PublishRequest>;
export declare const PublishRequest_HeadersEntry: MessageFns<PublishRequest_HeadersEntry>;
export declare const PublishResponse: MessageFns<PublishResponse>;
export declare const PublishStreamResponse: MessageFns<PublishStreamResponse>;
export declare const OpenSubscriptionRequest: MessageFns<OpenSubscriptionRequest>;
export declare const Message: MessageFns<Message>;
export declare const Message_HeadersEntry: MessageFns<Message_HeadersEntry>;
export declare const AckRequest: MessageFns<AckRequest>;
export declare const AckResponse: MessageFns<AckResponse>;
export declare const NackRequest: MessageFns<NackRequest>;
export declare const NackResponse: MessageFns<NackResponse>;
export declare const SessionRequest: MessageFns<SessionRequest>;
export declare const SessionOpen: MessageFns<SessionOpen>;
export declare const SessionClose: MessageFns<SessionClose>;
export declare const SessionCredit: MessageFns<SessionCredit>;
export declare const SessionAck: MessageFns<SessionAck>;
export declare const SessionNack: MessageFns<SessionNack>;
export declare const SessionPublish: MessageFns<SessionPublish>;
export declare const SessionEvent: MessageFns<SessionEvent>;
export declare const SessionPublished: MessageFns<SessionPublished>;
export declare const PublishRejection: MessageFns<PublishRejection>;
export declare const SessionDeliveries: MessageFns<SessionDeliveries>;
export declare const SessionOpened: MessageFns<SessionOpened>;
export declare const SessionDelivery: MessageFns<SessionDelivery>;
export declare const SessionEnded: MessageFns<SessionEnded>;
/** Publish/subscribe over dot-separated topics with `*` and `>` patterns. */
export type BrokerService = typeof BrokerService;
export declare const BrokerService: {
    /** Routes one message to every matching subscription and consumer group. */
    readonly publish: {
        readonly path: "/tinybroker.v1.Broker/Publish";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: PublishRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => PublishRequest;
        readonly responseSerialize: (value: PublishResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => PublishResponse;
    };
    /**
     * The same for a long run of messages on one stream (high-rate publishers).
     * The single response is sent when the client half-closes the stream.
     */
    readonly publishStream: {
        readonly path: "/tinybroker.v1.Broker/PublishStream";
        readonly requestStream: true;
        readonly responseStream: false;
        readonly requestSerialize: (value: PublishRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => PublishRequest;
        readonly responseSerialize: (value: PublishStreamResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => PublishStreamResponse;
    };
    /**
     * Opens a subscription; messages stream until the client cancels, the broker
     * evicts it (slow consumer), an admin closes it, or the broker shuts down.
     * The subscription id is also sent in the initial metadata
     * `tinybroker-subscription-id`.
     */
    readonly openSubscription: {
        readonly path: "/tinybroker.v1.Broker/OpenSubscription";
        readonly requestStream: false;
        readonly responseStream: true;
        readonly requestSerialize: (value: OpenSubscriptionRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => OpenSubscriptionRequest;
        readonly responseSerialize: (value: Message) => Buffer;
        readonly responseDeserialize: (value: Buffer) => Message;
    };
    /** Consumer groups with manual ack: marks messages done. */
    readonly ack: {
        readonly path: "/tinybroker.v1.Broker/Ack";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: AckRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => AckRequest;
        readonly responseSerialize: (value: AckResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => AckResponse;
    };
    /** Consumer groups with manual ack: hands messages back for redelivery. */
    readonly nack: {
        readonly path: "/tinybroker.v1.Broker/Nack";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: NackRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => NackRequest;
        readonly responseSerialize: (value: NackResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => NackResponse;
    };
    /**
     * Many subscriptions on one stream: the client opens, closes, grants
     * credit to, acks and nacks subscriptions it names by handles of its own;
     * the broker answers with opened, delivery and ended events naming them.
     * Half-closing the stream closes every subscription and ends it with OK.
     */
    readonly session: {
        readonly path: "/tinybroker.v1.Broker/Session";
        readonly requestStream: true;
        readonly responseStream: true;
        readonly requestSerialize: (value: SessionRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => SessionRequest;
        readonly responseSerialize: (value: SessionEvent) => Buffer;
        readonly responseDeserialize: (value: Buffer) => SessionEvent;
    };
};
export interface BrokerServer extends UntypedServiceImplementation {
    /** Routes one message to every matching subscription and consumer group. */
    publish: handleUnaryCall<PublishRequest, PublishResponse>;
    /**
     * The same for a long run of messages on one stream (high-rate publishers).
     * The single response is sent when the client half-closes the stream.
     */
    publishStream: handleClientStreamingCall<PublishRequest, PublishStreamResponse>;
    /**
     * Opens a subscription; messages stream until the client cancels, the broker
     * evicts it (slow consumer), an admin closes it, or the broker shuts down.
     * The subscription id is also sent in the initial metadata
     * `tinybroker-subscription-id`.
     */
    openSubscription: handleServerStreamingCall<OpenSubscriptionRequest, Message>;
    /** Consumer groups with manual ack: marks messages done. */
    ack: handleUnaryCall<AckRequest, AckResponse>;
    /** Consumer groups with manual ack: hands messages back for redelivery. */
    nack: handleUnaryCall<NackRequest, NackResponse>;
    /**
     * Many subscriptions on one stream: the client opens, closes, grants
     * credit to, acks and nacks subscriptions it names by handles of its own;
     * the broker answers with opened, delivery and ended events naming them.
     * Half-closing the stream closes every subscription and ends it with OK.
     */
    session: handleBidiStreamingCall<SessionRequest, SessionEvent>;
}
export interface BrokerClient extends Client {
    /** Routes one message to every matching subscription and consumer group. */
    publish(request: PublishRequest, callback: (error: ServiceError | null, response: PublishResponse) => void): ClientUnaryCall;
    publish(request: PublishRequest, metadata: Metadata, callback: (error: ServiceError | null, response: PublishResponse) => void): ClientUnaryCall;
    publish(request: PublishRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: PublishResponse) => void): ClientUnaryCall;
    /**
     * The same for a long run of messages on one stream (high-rate publishers).
     * The single response is sent when the client half-closes the stream.
     */
    publishStream(callback: (error: ServiceError | null, response: PublishStreamResponse) => void): ClientWritableStream<PublishRequest>;
    publishStream(metadata: Metadata, callback: (error: ServiceError | null, response: PublishStreamResponse) => void): ClientWritableStream<PublishRequest>;
    publishStream(options: Partial<CallOptions>, callback: (error: ServiceError | null, response: PublishStreamResponse) => void): ClientWritableStream<PublishRequest>;
    publishStream(metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: PublishStreamResponse) => void): ClientWritableStream<PublishRequest>;
    /**
     * Opens a subscription; messages stream until the client cancels, the broker
     * evicts it (slow consumer), an admin closes it, or the broker shuts down.
     * The subscription id is also sent in the initial metadata
     * `tinybroker-subscription-id`.
     */
    openSubscription(request: OpenSubscriptionRequest, options?: Partial<CallOptions>): ClientReadableStream<Message>;
    openSubscription(request: OpenSubscriptionRequest, metadata?: Metadata, options?: Partial<CallOptions>): ClientReadableStream<Message>;
    /** Consumer groups with manual ack: marks messages done. */
    ack(request: AckRequest, callback: (error: ServiceError | null, response: AckResponse) => void): ClientUnaryCall;
    ack(request: AckRequest, metadata: Metadata, callback: (error: ServiceError | null, response: AckResponse) => void): ClientUnaryCall;
    ack(request: AckRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: AckResponse) => void): ClientUnaryCall;
    /** Consumer groups with manual ack: hands messages back for redelivery. */
    nack(request: NackRequest, callback: (error: ServiceError | null, response: NackResponse) => void): ClientUnaryCall;
    nack(request: NackRequest, metadata: Metadata, callback: (error: ServiceError | null, response: NackResponse) => void): ClientUnaryCall;
    nack(request: NackRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: NackResponse) => void): ClientUnaryCall;
    /**
     * Many subscriptions on one stream: the client opens, closes, grants
     * credit to, acks and nacks subscriptions it names by handles of its own;
     * the broker answers with opened, delivery and ended events naming them.
     * Half-closing the stream closes every subscription and ends it with OK.
     */
    session(): ClientDuplexStream<SessionRequest, SessionEvent>;
    session(options: Partial<CallOptions>): ClientDuplexStream<SessionRequest, SessionEvent>;
    session(metadata: Metadata, options?: Partial<CallOptions>): ClientDuplexStream<SessionRequest, SessionEvent>;
}
export declare const BrokerClient: {
    new (address: string, credentials: ChannelCredentials, options?: Partial<ClientOptions>): BrokerClient;
    service: typeof BrokerService;
    serviceName: string;
};
export interface MessageFns<T> {
    encode(message: T, writer?: BinaryWriter): BinaryWriter;
    decode(input: BinaryReader | Uint8Array, length?: number): T;
}
