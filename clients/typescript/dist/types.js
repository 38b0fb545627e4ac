import { extract } from "./tracing.js";
const decoder = new TextDecoder();
/**
 * One delivered message. In a MANUAL consumer group call {@link Message.ack}
 * when done or {@link Message.nack} to hand it back for redelivery; both go
 * in-band on the client's session, with no reply.
 */
export class Message {
    /** @internal */ raw;
    /** @internal */ _sub;
    /** @internal The handle it came under (handles are never reused: an old one means an earlier open). */
    _handle;
    /** @internal */
    constructor(raw, sub, handle) {
        this.raw = raw;
        this._sub = sub;
        this._handle = handle;
    }
    /** The topic it was published to. */
    get topic() {
        return this.raw.topic;
    }
    /** The topic (the name nats.js uses). */
    get subject() {
        return this.raw.topic;
    }
    /** The payload bytes. */
    get payload() {
        return this.raw.payload;
    }
    /** The payload bytes (the name nats.js uses). */
    get data() {
        return this.raw.payload;
    }
    /** Headers the publisher set (and `traceparent` when the broker traces). */
    get headers() {
        return this.raw.headers;
    }
    /** Broker-assigned sequence (names the message in acks). */
    get sequence() {
        return this.raw.sequence;
    }
    /** When the broker accepted the publish. */
    get publishTime() {
        const ts = this.raw.publishTime;
        return ts ? new Date(ts.seconds * 1000 + Math.floor(ts.nanos / 1e6)) : new Date(0);
    }
    /** The id of the subscription it was delivered to. */
    get subscriptionId() {
        return this.raw.subscriptionId || this._sub.subscriptionId || "";
    }
    /** The consumer group, for group deliveries (else `""`). */
    get consumerGroup() {
        return this.raw.consumerGroup;
    }
    /** 1 on first delivery, growing with each redelivery. */
    get deliveryAttempt() {
        return this.raw.deliveryAttempt;
    }
    /**
     * The OpenTelemetry `Context` its `traceparent`/`tracestate` headers carry
     * (undefined without `@opentelemetry/api`): pass it to
     * `tracer.startActiveSpan(name, {}, msg.traceContext, fn)` to continue the trace.
     */
    get traceContext() {
        return extract(this.raw.headers);
    }
    /** The payload decoded as UTF-8. */
    string() {
        return decoder.decode(this.raw.payload);
    }
    /** The payload parsed as JSON. */
    json() {
        return JSON.parse(this.string());
    }
    /**
     * Acknowledges this MANUAL-group message. It is not sent at once: every
     * ack of the subscription made before the client's next turn of the event
     * loop goes in one `SessionAck`. Returns false when it will not be sent:
     * not a MANUAL group, or the message came on an earlier open of the
     * subscription (an earlier session: the broker redelivers it anyway) or
     * the subscription is closed.
     */
    ack() {
        return this._sub.settle(this, false);
    }
    /** Hands this MANUAL-group message back for immediate redelivery to another member (or this one). Returns false as {@link Message.ack} does. */
    nack() {
        return this._sub.settle(this, true);
    }
}
