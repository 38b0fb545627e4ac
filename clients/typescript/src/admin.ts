import type { Metadata, ServiceError, ClientUnaryCall, CallOptions } from "@grpc/grpc-js";
import type { Connection } from "./connection.js";
import { ClientClosed, Status, TinybrokerError } from "./errors.js";
import type { BrokerLimits } from "./gen/tinybroker/v1/admin.js";
import type { Duration } from "./gen/google/protobuf/duration.js";
import type { Timestamp } from "./gen/google/protobuf/timestamp.js";

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

function time(ts: Timestamp | undefined): Date | undefined {
  if (ts === undefined || (ts.seconds === 0 && ts.nanos === 0)) return undefined;
  return new Date(ts.seconds * 1000 + Math.floor(ts.nanos / 1e6));
}

function seconds(d: Duration | undefined): number | undefined {
  return d === undefined ? undefined : d.seconds + d.nanos / 1e9;
}

type Unary<Req, Res> = (
  request: Req,
  metadata: Metadata,
  options: Partial<CallOptions>,
  callback: (error: ServiceError | null, response: Res) => void,
) => ClientUnaryCall;

/** @internal Runs one unary call with a deadline and an AbortSignal. */
export function unary<Req, Res>(
  method: Unary<Req, Res>,
  self: object,
  request: Req,
  metadata: Metadata,
  opts: CallOpts | undefined,
  onError?: (e: TinybrokerError) => void,
): Promise<Res> {
  const signal = opts?.signal;
  if (signal?.aborted) return Promise.reject(new TinybrokerError(Status.CANCELLED, "aborted"));
  return new Promise<Res>((resolve, reject) => {
    const deadline = Date.now() + (opts?.timeout ?? 10_000);
    let onAbort: (() => void) | undefined;
    const call = method.call(self, request, metadata, { deadline }, (err, response) => {
      if (onAbort !== undefined) signal!.removeEventListener("abort", onAbort);
      if (err) {
        const e = TinybrokerError.from(err);
        onError?.(e);
        reject(e);
      } else resolve(response);
    });
    if (signal !== undefined) {
      onAbort = () => call.cancel();
      signal.addEventListener("abort", onAbort, { once: true });
    }
  });
}

/**
 * `client.admin`: the broker's Admin service (needs the token when the
 * broker has one). Each method rejects with a {@link TinybrokerError}
 * carrying the gRPC code on failure, and with {@link ClientClosed} once the
 * client is closed.
 */
export class Admin {
  /** @internal */
  constructor(
    private readonly conn: () => Connection,
    private readonly onError: (e: TinybrokerError) => void,
    private readonly isClosed: () => boolean,
  ) {}

  private call<Req, Res>(name: string, request: Req, opts?: CallOpts): Promise<Res> {
    if (this.isClosed()) return Promise.reject(new ClientClosed());
    const conn = this.conn();
    const admin = conn.admin as unknown as Record<string, Unary<Req, Res>>;
    return unary(admin[name]!, conn.admin, request, conn.metadata, opts, this.onError);
  }

  /** Every open subscription (of the whole cluster in cluster mode). */
  async subscriptions(opts?: CallOpts): Promise<SubscriptionInfo[]> {
    const r = await this.call<object, import("./gen/tinybroker/v1/admin.js").ListSubscriptionsResponse>(
      "listSubscriptions",
      {},
      opts,
    );
    return r.subscriptions.map((s) => ({
      subscriptionId: s.subscriptionId,
      mode: s.mode === 2 ? "single" : "multi",
      consumerGroup: s.consumerGroup,
      topicPatterns: s.topicPatterns,
      queueDepth: s.queueDepth,
      capacity: s.capacity,
      delivered: s.delivered,
      openedAt: time(s.openedAt),
      peerAddress: s.peerAddress,
      ackMode: s.ackMode === 2 ? "manual" : "auto",
      replicaId: s.replicaId,
      unacked: s.unacked,
      oldestUnackedAge: seconds(s.oldestUnackedAge),
    }));
  }

  /** Every consumer group, including memberless ones holding a backlog. */
  async groups(opts?: CallOpts): Promise<GroupInfo[]> {
    const r = await this.call<object, import("./gen/tinybroker/v1/admin.js").ListConsumerGroupsResponse>(
      "listConsumerGroups",
      {},
      opts,
    );
    return r.groups.map((g) => ({
      name: g.name,
      topicPatterns: g.topicPatterns,
      members: g.members,
      backlog: g.backlog,
      inFlight: g.inFlight,
      redeliveries: g.redeliveries,
      deadLettered: g.deadLettered,
      dropped: g.dropped,
      oldestUnackedAge: seconds(g.oldestUnackedAge),
    }));
  }

  /** The most recent evictions (slow consumers), newest first. */
  async evictions(opts?: CallOpts): Promise<EvictionInfo[]> {
    const r = await this.call<object, import("./gen/tinybroker/v1/admin.js").ListEvictionsResponse>(
      "listEvictions",
      {},
      opts,
    );
    return r.evictions.map((e) => ({
      subscriptionId: e.subscriptionId,
      evictedAt: time(e.evictedAt),
      topicPatterns: e.topicPatterns,
      queueDepth: e.queueDepth,
      lastDeliveredSequence: e.lastDeliveredSequence,
      peerAddress: e.peerAddress,
      replicaId: e.replicaId,
    }));
  }

  /** Version, uptime, effective limits and counters. */
  async info(opts?: CallOpts): Promise<BrokerInfo> {
    const r = await this.call<object, import("./gen/tinybroker/v1/admin.js").GetBrokerInfoResponse>(
      "getBrokerInfo",
      {},
      opts,
    );
    return {
      version: r.version,
      uptime: seconds(r.uptime) ?? 0,
      startedAt: time(r.startedAt),
      limits: r.limits!,
      subscriptions: r.subscriptions,
      consumerGroups: r.consumerGroups,
      lastSequence: r.lastSequence,
      authEnabled: r.authEnabled,
      tlsEnabled: r.tlsEnabled,
      clusterMode: r.clusterMode,
      replicaId: r.replicaId,
      natsServer: r.natsServer,
      messagesPublished: r.messagesPublished,
      messagesDelivered: r.messagesDelivered,
    };
  }

  /** Closes one subscription by id (NOT_FOUND if none); its client hears `closed_by_admin` and does not re-subscribe. */
  async closeSubscription(subscriptionId: string, opts?: CallOpts): Promise<void> {
    await this.call("closeSubscription", { subscriptionId }, opts);
  }
}
