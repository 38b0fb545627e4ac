/**
 * The Node.js client of tinybroker.
 *
 * ```ts
 * import { connect } from "@tinybroker/client";
 * const client = await connect("127.0.0.1:50051");
 * const sub = await client.subscribe("greetings.*");
 * await client.publish("greetings.world", "hello");
 * for await (const msg of sub) { console.log(msg.topic, msg.string()); break; }
 * await client.close();
 * ```
 *
 * Every subscription of a client rides on one `Session` stream, with a
 * credit window per subscription, in-band acks, and re-subscription (with
 * the gap reported) after an eviction, a shutdown or a lost connection.
 *
 * @packageDocumentation
 */
export { connect, Client, DEFAULT_WINDOW } from "./client.js";
export type { ConnectOptions, PublishOptions, SubscribeOptions } from "./client.js";
export { Subscription } from "./session.js";
export type { NextOptions, EventCallback } from "./session.js";
export { Publisher } from "./publisher.js";
export type { Payload } from "./publisher.js";
export { Admin } from "./admin.js";
export type { CallOpts, SubscriptionInfo, GroupInfo, EvictionInfo, BrokerInfo } from "./admin.js";
export type { BrokerLimits } from "./gen/tinybroker/v1/admin.js";
export { Message } from "./types.js";
export type { AckMode, PublishResult, PublishStreamResult, SubscriptionEvent, OpenedEvent, EndedEvent, ResubscribingEvent, ResubscribedEvent, GapEvent, SubscriptionStats, } from "./types.js";
export { TinybrokerError, PublishError, SubscriptionEnded, Status } from "./errors.js";
