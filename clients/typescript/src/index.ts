/**
 * The Node.js client of tinybroker.
 *
 * ```ts
 * import { connect } from "@tinybroker/client";
 * const client = await connect("127.0.0.1:50051");
 * const sub = await client.subscribe("greetings.*");
 * await client.publish("greetings.world", "hello"); // buffered: returns at once
 * console.log(await client.flush()); // { accepted: 1, rejected: [], unconfirmed: 0, ... }
 * for await (const msg of sub) { console.log(msg.topic, msg.string()); break; }
 * await client.close();
 * ```
 *
 * Every subscription and buffered publish of a client rides on one
 * `Session` stream, with a credit window per subscription, batched
 * deliveries and publishes, coalesced acks, and re-subscription (with the
 * gap reported) after an eviction, a shutdown or a lost connection, as
 * docs/clients.md specifies.
 *
 * @packageDocumentation
 */
export { connect, Client, DEFAULT_WINDOW } from "./client.js";
export type {
  ConnectOptions,
  ConnectionListener,
  FlushOptions,
  PublishOptions,
  PublishConfirmedOptions,
  SubscribeOptions,
} from "./client.js";
export {
  WINDOW,
  TOP_UP,
  topUp,
  CONNECT_DELAY_FIRST,
  CONNECT_DELAY_CAP,
  RESUBSCRIBE_DELAY_FIRST,
  RESUBSCRIBE_DELAY_CAP,
  JITTER,
  BUFFER_BYTES,
  BATCH_MESSAGES,
  BATCH_BYTES,
  BATCHES_IN_FLIGHT,
  START_TIMEOUT,
  CLOSE_TIMEOUT,
} from "./constants.js";
export { Subscription } from "./session.js";
export type { NextOptions, EventCallback, SessionState, SubscriptionState } from "./session.js";
export { Publisher } from "./publisher.js";
export type { Payload } from "./publisher.js";
export { Admin } from "./admin.js";
export type { CallOpts, SubscriptionInfo, GroupInfo, EvictionInfo, BrokerInfo } from "./admin.js";
export type { BrokerLimits } from "./gen/tinybroker/v1/admin.js";
export { Message } from "./types.js";
export type {
  AckMode,
  PublishResult,
  PublishStreamResult,
  SubscriptionEvent,
  OpenedEvent,
  EndedEvent,
  ResubscribingEvent,
  ResubscribedEvent,
  GapEvent,
  GapUnknownReason,
  SubscriptionStats,
  ConnectionEvent,
  FlushResult,
  CloseResult,
  PublishRejected,
  IndexRange,
  ClientStats,
} from "./types.js";
export {
  TinybrokerError,
  ClientClosed,
  UsageError,
  TimeoutError,
  PublishError,
  SubscriptionEnded,
  Status,
} from "./errors.js";
