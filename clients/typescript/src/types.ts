import type { Message as PbMessage } from "./gen/tinybroker/v1/broker.js";
import { extract } from "./tracing.js";

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

/** @internal What a Message needs from its subscription. */
export interface Settler {
  settle(message: Message, nack: boolean): boolean;
  readonly subscriptionId: string | undefined;
}

const decoder = new TextDecoder();

/**
 * One delivered message. In a MANUAL consumer group call {@link Message.ack}
 * when done or {@link Message.nack} to hand it back for redelivery; both go
 * in-band on the client's session, with no reply.
 */
export class Message {
  /** @internal */ readonly raw: PbMessage;
  /** @internal */ readonly _sub: Settler;
  /** @internal */ readonly _handle: number;
  /** @internal */ readonly _generation: number;

  /** @internal */
  constructor(raw: PbMessage, sub: Settler, handle: number, generation: number) {
    this.raw = raw;
    this._sub = sub;
    this._handle = handle;
    this._generation = generation;
  }

  /** The topic it was published to. */
  get topic(): string {
    return this.raw.topic;
  }
  /** The topic (the name nats.js uses). */
  get subject(): string {
    return this.raw.topic;
  }
  /** The payload bytes. */
  get payload(): Uint8Array {
    return this.raw.payload;
  }
  /** The payload bytes (the name nats.js uses). */
  get data(): Uint8Array {
    return this.raw.payload;
  }
  /** Headers the publisher set (and `traceparent` when the broker traces). */
  get headers(): Readonly<Record<string, string>> {
    return this.raw.headers;
  }
  /** Broker-assigned sequence (names the message in acks). */
  get sequence(): number {
    return this.raw.sequence;
  }
  /** When the broker accepted the publish. */
  get publishTime(): Date {
    const ts = this.raw.publishTime;
    return ts ? new Date(ts.seconds * 1000 + Math.floor(ts.nanos / 1e6)) : new Date(0);
  }
  /** The id of the subscription it was delivered to. */
  get subscriptionId(): string {
    return this.raw.subscriptionId || this._sub.subscriptionId || "";
  }
  /** The consumer group, for group deliveries (else `""`). */
  get consumerGroup(): string {
    return this.raw.consumerGroup;
  }
  /** 1 on first delivery, growing with each redelivery. */
  get deliveryAttempt(): number {
    return this.raw.deliveryAttempt;
  }
  /**
   * The OpenTelemetry `Context` its `traceparent`/`tracestate` headers carry
   * (undefined without `@opentelemetry/api`): pass it to
   * `tracer.startActiveSpan(name, {}, msg.traceContext, fn)` to continue the trace.
   */
  get traceContext(): unknown {
    return extract(this.raw.headers);
  }
  /** The payload decoded as UTF-8. */
  string(): string {
    return decoder.decode(this.raw.payload);
  }
  /** The payload parsed as JSON. */
  json<T = unknown>(): T {
    return JSON.parse(this.string()) as T;
  }
  /**
   * Acknowledges this MANUAL-group message (in-band, no reply). Returns
   * false when nothing was sent: not a MANUAL group, or the subscription was
   * re-opened since (the broker redelivers the message anyway) or closed.
   */
  ack(): boolean {
    return this._sub.settle(this, false);
  }
  /** Hands this MANUAL-group message back for immediate redelivery to another member (or this one). Returns false as {@link Message.ack} does. */
  nack(): boolean {
    return this._sub.settle(this, true);
  }
}

/** The broker registered the subscription (its first open). */
export interface OpenedEvent {
  /** Discriminant. */ readonly type: "opened";
  /** The id the broker gave it (yours when you named one). */ readonly subscriptionId: string;
}

/**
 * The subscription's stream ended. `reason` is the broker's (`evicted`,
 * `closed_by_admin`, `shutdown`) or `connection_lost` when the session
 * failed; `resubscribing` says whether the client opens it again.
 */
export interface EndedEvent {
  /** Discriminant. */ readonly type: "ended";
  /** Its id. */ readonly subscriptionId: string | undefined;
  /** Why it ended. */ readonly reason: string;
  /** Messages queued for it that were never delivered. */ readonly dropped: number;
  /** Sequence of the last message delivered to it (0: none). */ readonly lastSequence: number;
  /** gRPC status code (0 except for `connection_lost`). */ readonly code: number;
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

/**
 * The first message after a re-subscription: messages published with
 * sequences between `lastBefore` and `firstAfter` (exclusive) while the
 * subscription was away were not delivered to it. `lastBefore` is 0 when it
 * had received nothing before; `dropped` is what the broker said it dropped
 * when it ended the old stream.
 */
export interface GapEvent {
  /** Discriminant. */ readonly type: "gap";
  /** Its id. */ readonly subscriptionId: string | undefined;
  /** Sequence of the last message before the gap (0: none). */ readonly lastBefore: number;
  /** Sequence of the first message after it. */ readonly firstAfter: number;
  /** What the broker dropped when it ended the old stream. */ readonly dropped: number;
  /** Why the old stream ended. */ readonly reason: string;
}

/** What happens to a subscription besides its messages (see `type`). */
export type SubscriptionEvent = OpenedEvent | EndedEvent | ResubscribingEvent | ResubscribedEvent | GapEvent;

/** Counters of one subscription (read them at any time). */
export interface SubscriptionStats {
  /** Messages handed to the application. */ received: number;
  /** Times its stream ended (evictions, shutdowns, lost connections, ...). */ ends: number;
  /** Times it was evicted. */ evictions: number;
  /** Times it was opened again. */ resubscribes: number;
  /** Re-subscriptions after which a message arrived (each a {@link GapEvent}). */ gaps: number;
  /** Sum of `dropped` over its ends. */ dropped: number;
  /** Ends by reason. */ byReason: Record<string, number>;
}
