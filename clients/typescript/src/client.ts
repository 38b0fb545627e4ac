import type { ChannelOptions } from "@grpc/grpc-js";
import { Admin, unary } from "./admin.js";
import type { CallOpts } from "./admin.js";
import { Connection, parseTargets, targetString } from "./connection.js";
import { Status, TinybrokerError } from "./errors.js";
import { AckMode as PbAckMode, DeliveryMode } from "./gen/tinybroker/v1/broker.js";
import type { OpenSubscriptionRequest, PublishRequest, PublishResponse } from "./gen/tinybroker/v1/broker.js";
import { Publisher, asBytes } from "./publisher.js";
import type { Payload } from "./publisher.js";
import { Session, Subscription } from "./session.js";
import { inject, loadTracing } from "./tracing.js";
import type { EventCallback } from "./session.js";
import type { AckMode, PublishResult } from "./types.js";

/** Credit window per subscription when none is given. */
export const DEFAULT_WINDOW = 256;

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
  /** Credit window per subscription (messages the broker may send it beyond what the application took; default 256). */
  window?: number;
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
export interface PublishOptions extends CallOpts {
  /** Headers (string to string). */
  headers?: Record<string, string>;
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
  /** Credit window (default the client's, 256). */
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

/**
 * A connection to a broker: one HTTP/2 connection, one Session stream for
 * all its subscriptions. Make one with {@link connect}; share it across the
 * process. Close it with {@link Client.close}.
 */
export class Client {
  /** The Admin calls. */
  readonly admin: Admin;
  /** Default credit window of its subscriptions. */
  readonly window: number;
  /** Default of `resubscribe` for its subscriptions. */
  readonly resubscribe: boolean;
  private readonly conn: Connection;
  private session: Session | undefined;
  private closed_ = false;
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
    this.resubscribe = opts.resubscribe ?? true;
    this.admin = new Admin(() => this.conn, (e) => this.afterFailure(e));
  }

  /** The address in use (`http://…` or `https://…`). */
  get address(): string {
    return targetString(this.conn.target);
  }
  /** How many times the session was started again after a loss. */
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
    this.session = new Session(this.conn);
    return this;
  }

  /** Closes every subscription (their iteration ends) and the connection. */
  async close(): Promise<void> {
    if (this.closed_) return;
    this.closed_ = true;
    await this.session?.close();
    this.conn.close();
  }

  private afterFailure(e: TinybrokerError): void {
    // A call found the broker gone: with a list, the next call goes on.
    if (e.code === Status.UNAVAILABLE && this.conn.targets.length > 1 && this.conn.down()) {
      if (this.session === undefined || !this.session.live) this.conn.failover();
    }
  }

  private sessionOrThrow(): Session {
    if (this.closed_ || this.session === undefined) {
      throw new TinybrokerError(Status.FAILED_PRECONDITION, "the client is closed");
    }
    return this.session;
  }

  /**
   * Publishes one message and resolves to its sequence and how many
   * subscriptions and groups it matched. A string payload is sent as UTF-8.
   */
  async publish(topic: string, payload?: Payload, opts?: PublishOptions): Promise<PublishResult> {
    this.sessionOrThrow();
    const headers = this._tracing ? inject(opts?.headers) : (opts?.headers ?? {});
    const request: PublishRequest = { topic, payload: asBytes(payload), headers };
    const broker = this.conn.broker;
    const r = await unary<PublishRequest, PublishResponse>(
      broker.publish,
      broker,
      request,
      this.conn.metadata,
      opts,
      (e) => this.afterFailure(e),
    );
    return { sequence: r.sequence, matchedSubscriptions: r.matchedSubscriptions, matchedGroups: r.matchedGroups };
  }

  /** A {@link Publisher} for high rates over one `PublishStream`, with backpressure. */
  publisher(): Publisher {
    this.sessionOrThrow();
    return new Publisher(() => this.conn, this._tracing);
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
                  throw new TypeError(`ackMode must be "auto" or "manual", not ${JSON.stringify(opts.ackMode)}`);
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
    session.open(sub);
    const timeout = opts.timeout ?? 10_000;
    let timer: NodeJS.Timeout | undefined;
    let onAbort: (() => void) | undefined;
    try {
      await Promise.race([
        sub._opened,
        new Promise<void>((_, reject) => {
          timer = setTimeout(() => reject(new Error("timeout")), timeout);
          if (signal !== undefined) {
            onAbort = () => reject(signal.reason);
            signal.addEventListener("abort", onAbort, { once: true });
          }
        }),
      ]);
    } catch (e) {
      if (e instanceof TinybrokerError) throw e;
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
