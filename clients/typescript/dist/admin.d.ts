import type { BrokerLimits } from "./gen/tinybroker/v1/admin.js";
/** Options of every Admin call. */
export interface CallOpts {
    /** Milliseconds before the call fails with DEADLINE_EXCEEDED (default 10,000). */
    timeout?: number;
    /** Cancels the call (it rejects with CANCELLED). */
    signal?: AbortSignal;
}
/** One open subscription, as Admin/ListSubscriptions lists it. */
export interface SubscriptionInfo {
    /** Its id. */ subscriptionId: string;
    /** `"multi"` (broadcast) or `"single"` (consumer group). */ mode: "multi" | "single";
    /** Its group, or `""`. */ consumerGroup: string;
    /** Its patterns. */ topicPatterns: string[];
    /** Messages waiting in its queue (a group member: held by it). */ queueDepth: number;
    /** Queue slots (a group member: max_in_flight). */ capacity: number;
    /** Messages delivered to it. */ delivered: number;
    /** When it was opened. */ openedAt: Date | undefined;
    /** The client's address. */ peerAddress: string;
    /** `"auto"` or `"manual"`. */ ackMode: "auto" | "manual";
    /** The replica serving it (cluster mode). */ replicaId: string;
    /** A MANUAL member's messages delivered and not acked yet (0 for any other). */ unacked: number;
    /** Seconds since the oldest of them was handed to it; undefined when none. */ oldestUnackedAge: number | undefined;
}
/** One consumer group, as Admin/ListConsumerGroups lists it. */
export interface GroupInfo {
    /** Its name. */ name: string;
    /** Its patterns. */ topicPatterns: string[];
    /** Members on every replica. */ members: number;
    /** Messages waiting for a member with room. */ backlog: number;
    /** Delivered and not yet acked. */ inFlight: number;
    /** Redeliveries so far. */ redeliveries: number;
    /** Messages sent to `_dlq.<group>`. */ deadLettered: number;
    /** Messages dropped from its backlog. */ dropped: number;
    /** Seconds since the oldest unacked message was delivered; undefined when none. */ oldestUnackedAge: number | undefined;
}
/** One eviction, as Admin/ListEvictions lists it (newest first). */
export interface EvictionInfo {
    /** The evicted subscription's id. */ subscriptionId: string;
    /** When. */ evictedAt: Date | undefined;
    /** Its patterns. */ topicPatterns: string[];
    /** Its queue depth at eviction. */ queueDepth: number;
    /** Sequence of the last message handed to it (0: none). */ lastDeliveredSequence: number;
    /** The client's address. */ peerAddress: string;
    /** The replica that served it (cluster mode). */ replicaId: string;
}
/** Admin/GetBrokerInfo: version, uptime, effective limits, counters. */
export interface BrokerInfo {
    /** Broker version. */ version: string;
    /** Seconds since start. */ uptime: number;
    /** When it started. */ startedAt: Date | undefined;
    /** Effective limits (capacities, max message size, ...). */ limits: BrokerLimits;
    /** Open subscriptions. */ subscriptions: number;
    /** Consumer groups. */ consumerGroups: number;
    /** Last sequence assigned. */ lastSequence: number;
    /** Whether a token is required. */ authEnabled: boolean;
    /** Whether it serves TLS. */ tlsEnabled: boolean;
    /** Cluster mode (several replicas over NATS). */ clusterMode: boolean;
    /** This replica's id. */ replicaId: string;
    /** The NATS server it is connected to (cluster mode). */ natsServer: string;
    /** Messages published through it since it started. */ messagesPublished: number;
    /** Messages it delivered since it started. */ messagesDelivered: number;
}
/**
 * `client.admin`: the broker's Admin service (needs the token when the
 * broker has one). Each method rejects with a {@link TinybrokerError}
 * carrying the gRPC code on failure, and with {@link ClientClosed} once the
 * client is closed.
 */
export declare class Admin {
    private readonly conn;
    private readonly onError;
    private readonly isClosed;
    private call;
    /** Every open subscription (of the whole cluster in cluster mode). */
    subscriptions(opts?: CallOpts): Promise<SubscriptionInfo[]>;
    /** Every consumer group, including memberless ones holding a backlog. */
    groups(opts?: CallOpts): Promise<GroupInfo[]>;
    /** The most recent evictions (slow consumers), newest first. */
    evictions(opts?: CallOpts): Promise<EvictionInfo[]>;
    /** Version, uptime, effective limits and counters. */
    info(opts?: CallOpts): Promise<BrokerInfo>;
    /** Closes one subscription by id (NOT_FOUND if none); its client hears `closed_by_admin` and does not re-subscribe. */
    closeSubscription(subscriptionId: string, opts?: CallOpts): Promise<void>;
}
