import type { ChannelOptions } from "@grpc/grpc-js";
import { Admin, unary } from "./admin.js";
import type { CallOpts } from "./admin.js";
import { BATCH_BYTES, BATCH_MESSAGES, BUFFER_BYTES, CLOSE_TIMEOUT, REQUEST_SLACK, WINDOW } from "./constants.js";
import { Connection, parseTargets, targetString } from "./connection.js";
import { ClientClosed, Status, TimeoutError, TinybrokerError, UsageError } from "./errors.js";
import { AckMode as PbAckMode, DeliveryMode } from "./gen/tinybroker/v1/broker.js";
import type { GetBrokerInfoResponse } from "./gen/tinybroker/v1/admin.js";
import type { OpenSubscriptionRequest, PublishRequest, PublishResponse } from "./gen/tinybroker/v1/broker.js";
import { Publisher, asBytes } from "./publisher.js";
import type { Payload } from "./publisher.js";
import { Session, Subscription } from "./session.js";
import type { EventCallback, SessionState } from "./session.js";
import { inject, loadTracing } from "./tracing.js";
import type { AckMode, ClientStats, CloseResult, ConnectionEvent, FlushResult, PublishResult } from "./types.js";

/** Credit window per subscription when none is given (docs/clients.md `WINDOW`). */
export const DEFAULT_WINDOW = WINDOW;

/** Options of {@link connect}. */
export interface ConnectOptions {
  /**
   * `host:port`, `http://host:port`, `https://host:port` (TLS), or a list
   * (or comma-separated string) of them, tried in turn. Default:
   * `TINYBROKER_ADDR`, else `127.0.0.1:50051`. (`servers` is the same, as nats.js names it.)
   */
  addr?: string | readonly string[];
  /** The same as `addr`. */
  servers?: string | readonly string[];
  /** Bearer token (default `TINYBROKER_AUTH_TOKEN`). */
  token?: string;
  /** PEM file of the CA that signed the broker's certificate (`https://`; default the system's roots). */
  caFile?: string;
  /** The same CA as PEM text or bytes. */
  ca?: string | Buffer;
  /** Credit window per subscription (messages the broker may send it beyond what the application took; default {@link WINDOW}). */
  window?: number;
  /** Bytes of published messages buffered before `publish()` waits (default {@link BUFFER_BYTES}). */
  bufferBytes?: number;
  /** Re-subscribe after evictions, shutdowns and lost connections (default true; per subscription too). */
  resubscribe?: boolean;
  /** Milliseconds to wait for each address (default 5,000). */
  timeout?: number;
  /** Gives up connecting (rejects with CANCELLED). */
  signal?: AbortSignal;
  /** Extra grpc-js channel options. */
  channelOptions?: ChannelOptions;
  /**
   * With `@opentelemetry/api` installed, publish adds the active context's
   * `traceparent`/`tracestate` to the headers and `msg.traceContext` gives
   * back a delivered message's (default true; false turns this off).
   */
  tracing?: boolean;
}

/** Options of {@link Client.publish}. */
export interface PublishOptions {
  /** Headers (string to string). */
  headers?: Record<string, string>;
}

/** Options of {@link Client.publishConfirmed}: headers, a deadline, a signal. */
export interface PublishConfirmedOptions extends PublishOptions, CallOpts {}

/** Options of {@link Client.flush}. */
export interface FlushOptions {
  /** Milliseconds to wait (default: no limit); then it rejects with {@link TimeoutError} and loses nothing. */
  timeout?: number;
}

/** Options of {@link Client.subscribe}. */
export interface SubscribeOptions {
  /** An id of your own (blank: the broker makes one); kept when the client re-subscribes. */
  subscriptionId?: string;
  /** A consumer group: each message goes to one member. */
  group?: string;
  /** `"auto"` (default) or `"manual"` (groups only): then `msg.ack()` / `msg.nack()`. */
  ackMode?: AckMode;
  /** Group members: most messages held at once (0: the broker's default). */
  maxInFlight?: number;
  /** MANUAL: milliseconds before an unacked message is redelivered (0: the broker's default). */
  ackDeadline?: number;
  /** Credit window (default the client's). */
  window?: number;
  /** Open it again after an eviction, a shutdown or a lost connection (default the client's, true). */
  resubscribe?: boolean;
  /** Called with every {@link SubscriptionEvent} (ends, re-subscriptions, gaps). */
  onEvent?: EventCallback;
  /** Milliseconds to wait for a broker that registers it (default 10,000). */
  timeout?: number;
  /** Aborting it closes the subscription (and rejects subscribe() while it waits). */
  signal?: AbortSignal;
}

/** A callback for the client's {@link ConnectionEvent}s. */
export type ConnectionListener = (event: ConnectionEvent) => void;

/**
 * A connection to a broker: one HTTP/2 connection, one Session stream for
 * all its subscriptions and buffered publishes. Make one with
 * {@link connect}; share it across the process. Close it with
 * {@link Client.close}: after that every call rejects with
 * {@link ClientClosed}.
 */
export class Client {
  /** The Admin calls. */
  readonly admin: Admin;
  /** Default credit window of its subscriptions. */
  readonly window: number;
  /** Default of `resubscribe` for its subscriptions. */
  readonly resubscribe: boolean;
  private readonly bufferBytes: number;
  private readonly conn: Connection;
  private session: Session | undefined;
  private closed_ = false;
  private closing: Promise<CloseResult> | undefined;
  private readonly publishers = new Set<Publisher>();
  private readonly listeners = new Set<ConnectionListener>();
  private confirmedOut = 0;
  private confirmedBytesOut = 0;
  /** @internal */ _tracing = false;

  /** @internal Use {@link connect}. */
  constructor(opts: ConnectOptions) {
    const token = opts.token ?? (process.env.TINYBROKER_AUTH_TOKEN || undefined);
    this.conn = new Connection(parseTargets(opts.addr ?? opts.servers), {
      token,
      caFile: opts.caFile,
      ca: opts.ca,
      channelOptions: opts.channelOptions,
    });
    this.window = opts.window ?? DEFAULT_WINDOW;
    if (!(Number.isInteger(this.window) && this.window >= 1)) {
      throw new UsageError(`window must be an integer of at least 1, not ${opts.window}`, Status.INVALID_ARGUMENT);
    }
    this.bufferBytes = opts.bufferBytes ?? BUFFER_BYTES;
    if (!(this.bufferBytes >= 1)) {
      throw new UsageError(`bufferBytes must be at least 1, not ${opts.bufferBytes}`, Status.INVALID_ARGUMENT);
    }
    this.resubscribe = opts.resubscribe ?? true;
    this.admin = new Admin(
      () => this.conn,
      (e) => this.afterFailure(e),
      () => this.closed_,
    );
  }

  /** The address in use (`http://…` or `https://…`). */
  get address(): string {
    return targetString(this.conn.target);
  }
  /** The session's state: IDLE, STARTING, OPEN, WAITING or CLOSED (docs/clients.md). */
  get state(): SessionState {
    return this.closed_ ? "CLOSED" : (this.session?.state ?? "IDLE");
  }
  /** Sessions that opened after a `disconnected` (the connection was lost and found again). */
  get reconnects(): number {
    return this.session?.reconnects ?? 0;
  }
  /** How many times the client moved to the next address of its list. */
  get failovers(): number {
    return this.conn.failovers;
  }
  /** Whether {@link Client.close} was called. */
  get isClosed(): boolean {
    return this.closed_;
  }

  /** @internal */
  async _connect(timeout: number, signal?: AbortSignal, tracing = true): Promise<this> {
    this._tracing = tracing && (await loadTracing());
    await this.conn.connect(timeout, signal);
    // BATCH_MESSAGES is the broker's max_batch_messages when it says;
    // BATCH_BYTES stays below what one request may carry.
    let batchMessages = BATCH_MESSAGES;
    let batchBytes = BATCH_BYTES;
    try {
      const conn = this.conn;
      const info = await unary<object, GetBrokerInfoResponse>(
        conn.admin.getBrokerInfo,
        conn.admin,
        {},
        conn.metadata,
        { timeout: Math.min(timeout, 5000) },
      );
      if (info.limits?.maxBatchMessages) batchMessages = info.limits.maxBatchMessages;
      if (info.limits?.maxMessageBytes) {
        batchBytes = Math.min(batchBytes, info.limits.maxMessageBytes + REQUEST_SLACK);
      }
    } catch {
      // A broker that does not answer Admin (a token without admin rights, an older one): the defaults.
    }
    this.session = new Session(this.conn, this.bufferBytes, batchMessages, batchBytes, (e) => this.emit(e));
    return this;
  }

  private emit(event: ConnectionEvent): void {
    for (const listener of [...this.listeners]) {
      try {
        listener(event);
      } catch (e) {
        console.error("tinybroker: a connection listener failed", e);
      }
    }
  }

  /**
   * Calls `listener` with every {@link ConnectionEvent} (`connected`,
   * `disconnected`, `reconnected`, `closed`): once per change of the
   * connection, whatever the number of subscriptions.
   */
  on(event: "connection", listener: ConnectionListener): this {
    if (event !== "connection") throw new UsageError(`no event ${JSON.stringify(event)}: "connection"`);
    this.listeners.add(listener);
    return this;
  }

  /** Removes a listener added with {@link Client.on}. */
  off(event: "connection", listener: ConnectionListener): this {
    if (event === "connection") this.listeners.delete(listener);
    return this;
  }

  /**
   * The {@link ConnectionEvent}s from now on, as an async iterable:
   * `for await (const e of client.connectionEvents())`. It ends after
   * `closed`; leaving the loop stops listening.
   */
  connectionEvents(): AsyncIterable<ConnectionEvent> {
    const queue: ConnectionEvent[] = [];
    let wake: (() => void) | undefined;
    let done = this.closed_;
    const listener: ConnectionListener = (e) => {
      queue.push(e);
      if (e.type === "closed") {
        done = true;
        this.off("connection", listener);
      }
      wake?.();
    };
    if (!done) this.on("connection", listener);
    const stop = (): void => {
      done = true;
      queue.length = 0;
      this.off("connection", listener);
      wake?.();
    };
    return {
      [Symbol.asyncIterator]: () => ({
        next: async (): Promise<IteratorResult<ConnectionEvent>> => {
          while (queue.length === 0 && !done) await new Promise<void>((r) => (wake = r));
          wake = undefined;
          const e = queue.shift();
          return e === undefined ? { done: true, value: undefined } : { done: false, value: e };
        },
        return: async (): Promise<IteratorResult<ConnectionEvent>> => {
          stop();
          return { done: true, value: undefined };
        },
      }),
    };
  }

  /** The client's counters: messages and bytes in and out, reconnects, what is pending in the publish buffer. */
  stats(): ClientStats {
    const s = this.session;
    return {
      messagesIn: s?.messagesIn ?? 0,
      bytesIn: s?.bytesIn ?? 0,
      messagesOut: (s?.buffer.messagesOut ?? 0) + this.confirmedOut,
      bytesOut: (s?.buffer.bytesOut ?? 0) + this.confirmedBytesOut,
      reconnects: s?.reconnects ?? 0,
      pendingMessages: s?.buffer.pendingMessages ?? 0,
      pendingBytes: s?.buffer.pendingBytes ?? 0,
      droppedLate: s?.droppedLate ?? 0,
    };
  }

  /**
   * Flushes the publish buffer (for at most {@link CLOSE_TIMEOUT} ms),
   * ends every subscription (their loops end, waiting `next()` calls reject
   * with {@link ClientClosed}) and every {@link Publisher}, closes the
   * connection and emits `closed`. Resolves to the last flush's outcomes
   * and `notSent`: buffered messages never written. Nothing of the client
   * keeps the process alive after it. A second call returns the first's
   * result.
   */
  close(): Promise<CloseResult> {
    if (this.closing === undefined) this.closing = this.doClose();
    return this.closing;
  }

  private async doClose(): Promise<CloseResult> {
    this.closed_ = true;
    const session = this.session;
    let last: FlushResult | undefined;
    const started = Date.now();
    if (session !== undefined) {
      try {
        last = await session.buffer.flush(CLOSE_TIMEOUT);
      } catch {
        // Not answered within CLOSE_TIMEOUT: what is left is counted below, and the client closes anyway.
      }
    }
    const rest = session?.buffer.close() ?? { accepted: 0, rejected: [], unconfirmed: 0, unconfirmedIndexes: [], notSent: 0 };
    const left = Math.max(100, CLOSE_TIMEOUT - (Date.now() - started));
    await Promise.all([
      session?.close(Math.min(left, 2000)),
      ...[...this.publishers].map((p) => p._end(Math.min(left, 2000))),
    ]);
    this.conn.close();
    this.emit({ type: "closed" });
    this.listeners.clear();
    return {
      accepted: (last?.accepted ?? 0) + rest.accepted,
      rejected: [...(last?.rejected ?? []), ...rest.rejected],
      unconfirmed: (last?.unconfirmed ?? 0) + rest.unconfirmed,
      unconfirmedIndexes: [...(last?.unconfirmedIndexes ?? []), ...rest.unconfirmedIndexes],
      notSent: rest.notSent,
    };
  }

  private afterFailure(e: TinybrokerError): void {
    // A call found the broker gone: with a list, the next call goes on.
    if (e.code === Status.UNAVAILABLE && this.conn.targets.length > 1 && this.conn.down()) {
      if (this.session === undefined || this.session.state !== "OPEN") this.conn.failover();
    }
  }

  private sessionOrThrow(): Session {
    if (this.closed_ || this.session === undefined) throw new ClientClosed();
    return this.session;
  }

  private request(topic: string, payload: Payload | undefined, opts: PublishOptions | undefined): PublishRequest {
    if (typeof topic !== "string") throw new UsageError(`topic must be a string, not ${typeof topic}`, Status.INVALID_ARGUMENT);
    const headers = this._tracing ? inject(opts?.headers) : (opts?.headers ?? {});
    return { topic, payload: asBytes(payload), headers };
  }

  /**
   * Puts one message in the client's publish buffer and returns at once:
   * the returned promise is already resolved while the buffer holds less
   * than `bufferBytes`. When it holds more, the promise stays pending until
   * batches written to the broker make room (backpressure: await it). A
   * caller that does not await is bounded too: once the publishers waiting
   * for room hold another `bufferBytes`, `publish()` rejects at once with
   * RESOURCE_EXHAUSTED (nothing is dropped silently). Messages are sent as
   * `SessionPublish` batches, full ones at once and the rest on the next turn
   * of the event loop; {@link Client.flush} says what the broker did with
   * them. A string payload is sent as UTF-8. Rejects with
   * {@link ClientClosed} after close.
   */
  publish(topic: string, payload?: Payload, opts?: PublishOptions): Promise<void> {
    let session: Session;
    let request: PublishRequest;
    try {
      session = this.sessionOrThrow();
      request = this.request(topic, payload, opts);
    } catch (e) {
      return Promise.reject(e);
    }
    session.need();
    return session.buffer.publish(request);
  }

  /**
   * Resolves once every message published before the call has an outcome,
   * to what happened to the messages published since the previous flush:
   * `accepted`, `rejected` (index, topic, code, message each) and
   * `unconfirmed` (written to a session lost before it answered; never
   * written again). Rejects with {@link TimeoutError} after `timeout` ms,
   * losing nothing (the outcomes go to the next flush).
   */
  flush(opts: FlushOptions = {}): Promise<FlushResult> {
    let session: Session;
    try {
      session = this.sessionOrThrow();
    } catch (e) {
      return Promise.reject(e);
    }
    return session.buffer.flush(opts.timeout);
  }

  /**
   * Publishes one message with the unary `Publish` (not through the buffer:
   * it may overtake buffered messages) and resolves to its sequence and how
   * many subscriptions and groups it matched; rejects with the broker's code
   * and message.
   */
  async publishConfirmed(topic: string, payload?: Payload, opts?: PublishConfirmedOptions): Promise<PublishResult> {
    this.sessionOrThrow();
    const request = this.request(topic, payload, opts);
    const broker = this.conn.broker;
    const r = await unary<PublishRequest, PublishResponse>(
      broker.publish,
      broker,
      request,
      this.conn.metadata,
      opts,
      (e) => this.afterFailure(e),
    );
    this.confirmedOut += 1;
    this.confirmedBytesOut += request.payload.length;
    return { sequence: r.sequence, matchedSubscriptions: r.matchedSubscriptions, matchedGroups: r.matchedGroups };
  }

  /**
   * A {@link Publisher} over its own `PublishStream` (HTTP/2 flow control as
   * backpressure; the first bad message ends the stream). {@link Client.publish}
   * is the faster way; this one stays for code written against it. The
   * client's close ends it.
   */
  publisher(): Publisher {
    this.sessionOrThrow();
    const publisher = new Publisher(
      () => this.conn,
      this._tracing,
      (p) => this.publishers.delete(p),
    );
    this.publishers.add(publisher);
    return publisher;
  }

  /**
   * Opens a subscription on the client's session and resolves once the
   * broker has registered it. Rejects with {@link TinybrokerError} when the
   * broker refused it (INVALID_ARGUMENT for a bad pattern, ALREADY_EXISTS for
   * an id in use, UNAUTHENTICATED, ...) or no broker registered it within
   * `timeout`.
   */
  async subscribe(patterns: string | readonly string[], opts: SubscribeOptions = {}): Promise<Subscription> {
    const session = this.sessionOrThrow();
    const request: OpenSubscriptionRequest = {
      topicPatterns: typeof patterns === "string" ? [patterns] : [...patterns],
      mode: opts.group ? DeliveryMode.DELIVERY_MODE_SINGLE : DeliveryMode.DELIVERY_MODE_MULTI,
      subscriptionId: opts.subscriptionId ?? "",
      consumerGroup: opts.group ?? "",
      ackMode:
        opts.ackMode === undefined
          ? PbAckMode.ACK_MODE_UNSPECIFIED
          : opts.ackMode === "manual"
            ? PbAckMode.ACK_MODE_MANUAL
            : opts.ackMode === "auto"
              ? PbAckMode.ACK_MODE_AUTO
              : (() => {
                  throw new UsageError(
                    `ackMode must be "auto" or "manual", not ${JSON.stringify(opts.ackMode)}`,
                    Status.INVALID_ARGUMENT,
                  );
                })(),
      maxInFlight: opts.maxInFlight ?? 0,
      ackDeadlineMs: Math.round(opts.ackDeadline ?? 0),
    };
    const sub = new Subscription(session, request, {
      window: opts.window ?? this.window,
      resubscribe: opts.resubscribe ?? this.resubscribe,
      onEvent: opts.onEvent,
    });
    const signal = opts.signal;
    signal?.throwIfAborted();
    session.add(sub);
    const timeout = opts.timeout ?? 10_000;
    let timer: NodeJS.Timeout | undefined;
    let onAbort: (() => void) | undefined;
    try {
      await Promise.race([
        sub._opened,
        new Promise<void>((_, reject) => {
          timer = setTimeout(() => reject(new TimeoutError("timeout")), timeout);
          if (signal !== undefined) {
            onAbort = () => reject(signal.reason);
            signal.addEventListener("abort", onAbort, { once: true });
          }
        }),
      ]);
    } catch (e) {
      if (!(e instanceof TimeoutError) && e instanceof TinybrokerError) throw e;
      const cause = sub._lastCause;
      await sub.close();
      if (signal?.aborted) throw e;
      throw new TinybrokerError(
        cause?.code ?? Status.DEADLINE_EXCEEDED,
        `the subscription was not opened within ${timeout} ms` +
          (cause ? ` (last attempt: ${cause.codeName}: ${cause.details})` : ""),
      );
    } finally {
      clearTimeout(timer);
      if (onAbort !== undefined) signal!.removeEventListener("abort", onAbort);
    }
    if (signal !== undefined) {
      signal.addEventListener("abort", () => void sub.close(), { once: true });
    }
    return sub;
  }
}

/**
 * Connects to a broker: `const client = await connect("broker:50051")`.
 * Resolves once an address answers (each tried in turn for up to
 * `timeout` ms); rejects with TinybrokerError(UNAVAILABLE) when none does.
 *
 * @param addr an address, a list, or the options (then `addr` is in them);
 *   default `TINYBROKER_ADDR`, else `127.0.0.1:50051`.
 * @param opts token, CA, credit window, re-subscription, timeout, signal.
 */
export async function connect(
  addr?: string | readonly string[] | ConnectOptions,
  opts: ConnectOptions = {},
): Promise<Client> {
  if (addr !== undefined && typeof addr !== "string" && !Array.isArray(addr)) {
    opts = addr as ConnectOptions;
  } else if (addr !== undefined) {
    opts = { ...opts, addr: addr as string | readonly string[] };
  }
  const client = new Client(opts);
  return client._connect(opts.timeout ?? 5000, opts.signal, opts.tracing ?? true);
}
