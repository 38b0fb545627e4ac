import { BinaryReader, BinaryWriter } from "@bufbuild/protobuf/wire";
import { type CallOptions, type ChannelCredentials, Client, type ClientOptions, type ClientUnaryCall, type handleUnaryCall, type Metadata, type ServiceError, type UntypedServiceImplementation } from "@grpc/grpc-js";
import { Duration } from "../../google/protobuf/duration.js";
import { Timestamp } from "../../google/protobuf/timestamp.js";
import { AckMode, DeliveryMode } from "./broker.js";
export declare const protobufPackage = "tinybroker.v1";
export declare const protobufFileName = "tinybroker/v1/admin.proto";
/** tinybroker wire contract: the Admin service (inspection and control for operators). */
export interface ListSubscriptionsRequest {
}
export interface SubscriptionInfo {
    subscriptionId: string;
    mode: DeliveryMode;
    consumerGroup: string;
    topicPatterns: string[];
    /** Messages waiting in this subscription's queue (consumer groups: held by the member). */
    queueDepth: number;
    /** Queue slots (consumer groups: max_in_flight). */
    capacity: number;
    delivered: number;
    openedAt: Timestamp | undefined;
    peerAddress: string;
    ackMode: AckMode;
    /** The replica serving it (cluster mode; the replica id, TINYBROKER_REPLICA_ID). */
    replicaId: string;
    /**
     * A MANUAL group member's messages delivered to it and not acked or nacked
     * yet (0 for every other subscription): a hung member among healthy ones
     * holds many, for long (tinybroker_subscription_unacked).
     */
    unacked: number;
    /**
     * How long ago the oldest message it holds unacked was handed to it (unset
     * when it holds none), as ConsumerGroupInfo.oldest_unacked_age.
     */
    oldestUnackedAge: Duration | undefined;
}
export interface ListSubscriptionsResponse {
    subscriptions: SubscriptionInfo[];
}
export interface ListConsumerGroupsRequest {
}
export interface ConsumerGroupInfo {
    name: string;
    topicPatterns: string[];
    members: number;
    backlog: number;
    inFlight: number;
    redeliveries: number;
    deadLettered: number;
    dropped: number;
    /**
     * Age of the oldest delivered, unacked message of a manual-ack group (unset
     * when none; tinybroker_consumer_group_oldest_unacked_age_seconds).
     */
    oldestUnackedAge: Duration | undefined;
}
export interface ListConsumerGroupsResponse {
    groups: ConsumerGroupInfo[];
}
export interface CloseSubscriptionRequest {
    subscriptionId: string;
}
export interface CloseSubscriptionResponse {
}
export interface ListEvictionsRequest {
}
export interface EvictionInfo {
    subscriptionId: string;
    evictedAt: Timestamp | undefined;
    topicPatterns: string[];
    queueDepth: number;
    /** Sequence of the last message handed to the subscriber's stream (0: none). */
    lastDeliveredSequence: number;
    peerAddress: string;
    /** The replica that served it (cluster mode). */
    replicaId: string;
}
export interface ListEvictionsResponse {
    evictions: EvictionInfo[];
}
export interface GetBrokerInfoRequest {
}
export interface BrokerLimits {
    consumerCapacity: number;
    groupCapacity: number;
    defaultMaxInFlight: number;
    defaultAckDeadlineMs: number;
    maxDeliveryAttempts: number;
    groupIdleTtlSeconds: number;
    maxMessageBytes: number;
    maxSubscriptions: number;
    shutdownGraceSeconds: number;
    maxPatternsPerSubscription: number;
    maxTopicBytes: number;
    maxHeaders: number;
    /**
     * Byte limits: one broadcast subscription's queue, one group's backlog,
     * and the whole broker (0: none).
     */
    consumerMaxBytes: number;
    groupMaxBytes: number;
    maxMemoryBytes: number;
    maxConnections: number;
    handshakeTimeoutSeconds: number;
    /** Subscriptions one Session stream may hold. */
    maxSubscriptionsPerSession: number;
    /** Messages one SessionPublish may carry (TINYBROKER_MAX_BATCH_MESSAGES). */
    maxBatchMessages: number;
}
export interface GetBrokerInfoResponse {
    version: string;
    uptime: Duration | undefined;
    startedAt: Timestamp | undefined;
    limits: BrokerLimits | undefined;
    subscriptions: number;
    consumerGroups: number;
    lastSequence: number;
    authEnabled: boolean;
    tlsEnabled: boolean;
    /** Cluster mode (TINYBROKER_NATS_URL set): several replicas over NATS. */
    clusterMode: boolean;
    /** This replica's id (TINYBROKER_REPLICA_ID; the host name by default). */
    replicaId: string;
    /**
     * The NATS server this replica is connected to (cluster mode; empty while
     * disconnected).
     */
    natsServer: string;
    /**
     * Messages published through this replica since it started: the value of
     * tinybroker_messages_published_total.
     */
    messagesPublished: number;
    /**
     * Messages this replica wrote to its subscribers' streams since it started
     * (broadcast and consumer groups): the sum of
     * tinybroker_messages_delivered_total over its modes.
     */
    messagesDelivered: number;
}
export declare const ListSubscriptionsRequest: MessageFns<ListSubscriptionsRequest>;
export declare const SubscriptionInfo: MessageFns<SubscriptionInfo>;
export declare const ListSubscriptionsResponse: MessageFns<ListSubscriptionsResponse>;
export declare const ListConsumerGroupsRequest: MessageFns<ListConsumerGroupsRequest>;
export declare const ConsumerGroupInfo: MessageFns<ConsumerGroupInfo>;
export declare const ListConsumerGroupsResponse: MessageFns<ListConsumerGroupsResponse>;
export declare const CloseSubscriptionRequest: MessageFns<CloseSubscriptionRequest>;
export declare const CloseSubscriptionResponse: MessageFns<CloseSubscriptionResponse>;
export declare const ListEvictionsRequest: MessageFns<ListEvictionsRequest>;
export declare const EvictionInfo: MessageFns<EvictionInfo>;
export declare const ListEvictionsResponse: MessageFns<ListEvictionsResponse>;
export declare const GetBrokerInfoRequest: MessageFns<GetBrokerInfoRequest>;
export declare const BrokerLimits: MessageFns<BrokerLimits>;
export declare const GetBrokerInfoResponse: MessageFns<GetBrokerInfoResponse>;
/** Read-mostly view of the broker for operators. */
export type AdminService = typeof AdminService;
export declare const AdminService: {
    /** Every open subscription. */
    readonly listSubscriptions: {
        readonly path: "/tinybroker.v1.Admin/ListSubscriptions";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: ListSubscriptionsRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => ListSubscriptionsRequest;
        readonly responseSerialize: (value: ListSubscriptionsResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => ListSubscriptionsResponse;
    };
    /** Every consumer group, including memberless groups still holding a backlog. */
    readonly listConsumerGroups: {
        readonly path: "/tinybroker.v1.Admin/ListConsumerGroups";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: ListConsumerGroupsRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => ListConsumerGroupsRequest;
        readonly responseSerialize: (value: ListConsumerGroupsResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => ListConsumerGroupsResponse;
    };
    /** Closes one subscription by id; its stream ends with status OK. */
    readonly closeSubscription: {
        readonly path: "/tinybroker.v1.Admin/CloseSubscription";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: CloseSubscriptionRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => CloseSubscriptionRequest;
        readonly responseSerialize: (value: CloseSubscriptionResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => CloseSubscriptionResponse;
    };
    /** The most recent evictions (slow consumers), newest first. */
    readonly listEvictions: {
        readonly path: "/tinybroker.v1.Admin/ListEvictions";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: ListEvictionsRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => ListEvictionsRequest;
        readonly responseSerialize: (value: ListEvictionsResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => ListEvictionsResponse;
    };
    /** Version, uptime and effective limits. */
    readonly getBrokerInfo: {
        readonly path: "/tinybroker.v1.Admin/GetBrokerInfo";
        readonly requestStream: false;
        readonly responseStream: false;
        readonly requestSerialize: (value: GetBrokerInfoRequest) => Buffer;
        readonly requestDeserialize: (value: Buffer) => GetBrokerInfoRequest;
        readonly responseSerialize: (value: GetBrokerInfoResponse) => Buffer;
        readonly responseDeserialize: (value: Buffer) => GetBrokerInfoResponse;
    };
};
export interface AdminServer extends UntypedServiceImplementation {
    /** Every open subscription. */
    listSubscriptions: handleUnaryCall<ListSubscriptionsRequest, ListSubscriptionsResponse>;
    /** Every consumer group, including memberless groups still holding a backlog. */
    listConsumerGroups: handleUnaryCall<ListConsumerGroupsRequest, ListConsumerGroupsResponse>;
    /** Closes one subscription by id; its stream ends with status OK. */
    closeSubscription: handleUnaryCall<CloseSubscriptionRequest, CloseSubscriptionResponse>;
    /** The most recent evictions (slow consumers), newest first. */
    listEvictions: handleUnaryCall<ListEvictionsRequest, ListEvictionsResponse>;
    /** Version, uptime and effective limits. */
    getBrokerInfo: handleUnaryCall<GetBrokerInfoRequest, GetBrokerInfoResponse>;
}
export interface AdminClient extends Client {
    /** Every open subscription. */
    listSubscriptions(request: ListSubscriptionsRequest, callback: (error: ServiceError | null, response: ListSubscriptionsResponse) => void): ClientUnaryCall;
    listSubscriptions(request: ListSubscriptionsRequest, metadata: Metadata, callback: (error: ServiceError | null, response: ListSubscriptionsResponse) => void): ClientUnaryCall;
    listSubscriptions(request: ListSubscriptionsRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: ListSubscriptionsResponse) => void): ClientUnaryCall;
    /** Every consumer group, including memberless groups still holding a backlog. */
    listConsumerGroups(request: ListConsumerGroupsRequest, callback: (error: ServiceError | null, response: ListConsumerGroupsResponse) => void): ClientUnaryCall;
    listConsumerGroups(request: ListConsumerGroupsRequest, metadata: Metadata, callback: (error: ServiceError | null, response: ListConsumerGroupsResponse) => void): ClientUnaryCall;
    listConsumerGroups(request: ListConsumerGroupsRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: ListConsumerGroupsResponse) => void): ClientUnaryCall;
    /** Closes one subscription by id; its stream ends with status OK. */
    closeSubscription(request: CloseSubscriptionRequest, callback: (error: ServiceError | null, response: CloseSubscriptionResponse) => void): ClientUnaryCall;
    closeSubscription(request: CloseSubscriptionRequest, metadata: Metadata, callback: (error: ServiceError | null, response: CloseSubscriptionResponse) => void): ClientUnaryCall;
    closeSubscription(request: CloseSubscriptionRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: CloseSubscriptionResponse) => void): ClientUnaryCall;
    /** The most recent evictions (slow consumers), newest first. */
    listEvictions(request: ListEvictionsRequest, callback: (error: ServiceError | null, response: ListEvictionsResponse) => void): ClientUnaryCall;
    listEvictions(request: ListEvictionsRequest, metadata: Metadata, callback: (error: ServiceError | null, response: ListEvictionsResponse) => void): ClientUnaryCall;
    listEvictions(request: ListEvictionsRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: ListEvictionsResponse) => void): ClientUnaryCall;
    /** Version, uptime and effective limits. */
    getBrokerInfo(request: GetBrokerInfoRequest, callback: (error: ServiceError | null, response: GetBrokerInfoResponse) => void): ClientUnaryCall;
    getBrokerInfo(request: GetBrokerInfoRequest, metadata: Metadata, callback: (error: ServiceError | null, response: GetBrokerInfoResponse) => void): ClientUnaryCall;
    getBrokerInfo(request: GetBrokerInfoRequest, metadata: Metadata, options: Partial<CallOptions>, callback: (error: ServiceError | null, response: GetBrokerInfoResponse) => void): ClientUnaryCall;
}
export declare const AdminClient: {
    new (address: string, credentials: ChannelCredentials, options?: Partial<ClientOptions>): AdminClient;
    service: typeof AdminService;
    serviceName: string;
};
export interface MessageFns<T> {
    encode(message: T, writer?: BinaryWriter): BinaryWriter;
    decode(input: BinaryReader | Uint8Array, length?: number): T;
}
