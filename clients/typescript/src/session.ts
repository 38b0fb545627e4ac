// The client's one Session stream, its state machine, and its
// subscriptions (docs/clients.md "One client, one connection, one session"
// and "Subscriptions").
//
// The Session is driven by the stream's events and by timers, never by a
// loop: IDLE until something needs it, STARTING while the call waits for
// its response headers, OPEN once they came (every subscription that is to
// be open is opened, then the publish buffer is written), WAITING for a
// jittered delay after a loss (then the next address of a list is tried),
// CLOSED after close().
import type { ClientDuplexStream, Metadata, ServiceError, StatusObject } from "@grpc/grpc-js";
import { PublishBuffer } from "./buffer.js";
import {
  Backoff,
  CONNECT_DELAY_CAP,
  CONNECT_DELAY_FIRST,
  RESUBSCRIBE_DELAY_CAP,
  RESUBSCRIBE_DELAY_FIRST,
  START_TIMEOUT,
  topUp,
} from "./constants.js";
import type { Connection } from "./connection.js";
import { targetString } from "./connection.js";
import { ClientClosed, Status, SubscriptionEnded, TimeoutError, TinybrokerError, UsageError } from "./errors.js";
import type {
  Message as PbMessage,
  OpenSubscriptionRequest,
  PublishRequest,
  SessionDelivery,
  SessionEnded,
  SessionEvent,
  SessionRequest,
} from "./gen/tinybroker/v1/broker.js";
import { AckMode as PbAckMode } from "./gen/tinybroker/v1/broker.js";
import { SessionRequest as SessionRequestCodec } from "./gen/tinybroker/v1/broker.js";
import { Message } from "./types.js";
import { decodeEvent, encodePublish } from "./wire.js";
import type { ConnectionEvent, EndedEvent, GapEvent, SubscriptionEvent, SubscriptionStats } from "./types.js";

/** The states of the client's session (docs/clients.md "The session's states"). */
export type SessionState = "IDLE" | "STARTING" | "OPEN" | "WAITING" | "CLOSED";

/** The states of a subscription (docs/clients.md "A subscription's states"). */
export type SubscriptionState = "WAITING" | "OPENING" | "OPEN" | "BACKOFF" | "DONE";

/** Codes of a failed session start after which a first open is still awaited (another attempt may succeed). */
const RETRYABLE = new Set<number>([
  Status.UNAVAILABLE,
  Status.DEADLINE_EXCEEDED,
  Status.CANCELLED,
  Status.UNKNOWN,
  Status.INTERNAL,
  Status.ABORTED,
  Status.RESOURCE_EXHAUSTED,
]);

/** The Session call: requests as the generated codec encodes them, or a batch encoded by hand. */
type Call = ClientDuplexStream<SessionRequest | Buffer, SessionEvent>;
const SESSION_PATH = "/tinybroker.v1.Broker/Session";
function serialize(request: SessionRequest | Buffer): Buffer {
  if (Buffer.isBuffer(request)) return request;
  const bytes = SessionRequestCodec.encode(request).finish();
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}
function deserialize(bytes: Buffer): SessionEvent {
  return decodeEvent(bytes);
}

/** The session's response headers that say which sequence space its deliveries come from. */
const INSTANCE_HEADER = "tinybroker-instance";
const SCOPE_HEADER = "tinybroker-sequence-scope";

/** Where a delivery's sequence comes from: the session's instance and scope. */
interface Origin {
  readonly instance: string;
  readonly scope: string | undefined;
}

/** @internal The one Session stream of a client and its subscriptions. */
export class Session {
  state: SessionState = "IDLE";
  /** Every subscription that is not DONE. */
  private readonly subs = new Set<Subscription>();
  /** The subscriptions opened (OPENING or OPEN) on the current session, by handle. */
  private readonly byHandle = new Map<number, Subscription>();
  /** Handles are never reused while the client lives. */
  private lastHandle = 0;
  private call: Call | undefined;
  private timer: NodeJS.Timeout | undefined;
  private readonly delay = new Backoff(CONNECT_DELAY_FIRST, CONNECT_DELAY_CAP);
  /** The current session's instance and scope (once OPEN). */
  origin: Origin | undefined;
  private previousInstance: string | undefined;
  private unnamedInstances = 0;
  private everOpen = false;
  private disconnected = false;
  /** Subscriptions with acks or nacks to send before the next turn of the event loop. */
  private readonly acking = new Set<Subscription>();
  private ackTimer: NodeJS.Immediate | undefined;
  /** The end of the current call, while close() waits for it. */
  private ended: (() => void) | undefined;

  readonly buffer: PublishBuffer;
  reconnects = 0;
  messagesIn = 0;
  bytesIn = 0;
  droppedLate = 0;

  constructor(
    private readonly conn: Connection,
    bufferBytes: number,
    batchMessages: number,
    batchBytes: number,
    private readonly emit: (event: ConnectionEvent) => void,
  ) {
    this.buffer = new PublishBuffer(
      {
        writable: () => this.state === "OPEN",
        writePublish: (id: number, messages: PublishRequest[]) => {
          if (this.state === "OPEN" && this.call !== undefined) this.call.write(encodePublish(id, messages));
        },
      },
      bufferBytes,
      batchMessages,
      batchBytes,
    );
  }

  // === what the client and the subscriptions call ===

  /** IDLE → STARTING: something needs the session. */
  need(): void {
    if (this.state === "IDLE") this.start();
  }

  /** Adds a subscription (WAITING) and opens it now when the session is OPEN. */
  add(sub: Subscription): void {
    this.subs.add(sub);
    this.need();
    this.openIfRoom(sub);
  }

  /** Opens `sub` when it is WAITING, the session is OPEN and it has room in its window. */
  openIfRoom(sub: Subscription): void {
    if (this.state !== "OPEN" || sub._state !== "WAITING" || sub.pending >= sub.window) return;
    const handle = ++this.lastHandle;
    sub._handle = handle;
    sub._state = "OPENING";
    sub._taken = 0;
    this.byHandle.set(handle, sub);
    // What it still holds counts against its window: never more than the window held.
    const credit = sub.window - sub.pending;
    this.write({ request: { $case: "open", value: { handle, subscription: sub._request, credit } } });
  }

  /** Forgets a subscription that is DONE. */
  forget(sub: Subscription): void {
    this.subs.delete(sub);
    if (this.byHandle.get(sub._handle) === sub) this.byHandle.delete(sub._handle);
    this.acking.delete(sub);
  }

  /** Writes a request when the session is OPEN (else it is not sent: it belonged to a lost session). */
  write(request: SessionRequest): void {
    if (this.state === "OPEN" && this.call !== undefined) this.call.write(request);
  }

  /** Sends `sub`'s pending acks and nacks with every other's before the next turn of the event loop. */
  ackLater(sub: Subscription): void {
    this.acking.add(sub);
    if (this.ackTimer === undefined) {
      this.ackTimer = setImmediate(() => {
        this.ackTimer = undefined;
        this.sendAcks();
      });
    }
  }

  /** One SessionAck and one SessionNack per handle with all it has pending. */
  private sendAcks(): void {
    for (const sub of this.acking) {
      const { acks, nacks } = sub._takeSettles();
      if (this.byHandle.get(sub._handle) !== sub) continue;
      const handle = sub._handle;
      if (acks.length > 0) this.write({ request: { $case: "ack", value: { handle, sequences: acks } } });
      if (nacks.length > 0) this.write({ request: { $case: "nack", value: { handle, sequences: nacks } } });
    }
    this.acking.clear();
  }

  /**
   * CLOSED: ends every subscription (SessionClose each, then half-closes),
   * waits up to `timeout` ms for the broker's end, then cancels the call.
   */
  async close(timeout: number): Promise<void> {
    if (this.state === "CLOSED") return;
    clearTimeout(this.timer);
    this.timer = undefined;
    if (this.ackTimer !== undefined) {
      clearImmediate(this.ackTimer);
      this.ackTimer = undefined;
      this.sendAcks();
    }
    const call = this.call;
    if (this.state === "OPEN" && call !== undefined) {
      for (const [handle, sub] of this.byHandle) {
        sub._closing = true;
        this.write({ request: { $case: "close", value: { handle } } });
      }
      let timer: NodeJS.Timeout | undefined;
      await new Promise<void>((resolve) => {
        this.ended = resolve;
        timer = setTimeout(resolve, timeout);
        call.end();
      });
      clearTimeout(timer);
      this.ended = undefined;
    }
    this.state = "CLOSED";
    this.call = undefined;
    call?.cancel();
    this.byHandle.clear();
    for (const sub of [...this.subs]) sub._finish(new ClientClosed());
    this.subs.clear();
  }

  // === the stream ===

  private start(): void {
    this.state = "STARTING";
    const conn = this.conn;
    const metadata: Metadata = conn.metadata.clone();
    metadata.set("tinybroker-batch", "1");
    const call: Call = conn.broker.makeBidiStreamRequest(SESSION_PATH, serialize, deserialize, metadata);
    this.call = call;
    this.timer = setTimeout(() => {
      this.lost(
        call,
        Status.DEADLINE_EXCEEDED,
        `${targetString(conn.target)} did not accept a session within ${START_TIMEOUT / 1000} s`,
      );
    }, START_TIMEOUT);
    call.on("metadata", (headers: Metadata) => this.opened(call, headers));
    call.on("data", (event: SessionEvent) => {
      if (this.call === call) this.onEvent(event);
    });
    call.on("error", (err: ServiceError) => {
      const e = TinybrokerError.from(err);
      this.lost(call, e.code, `${targetString(conn.target)}: ${e.details}`);
    });
    call.on("status", (status: StatusObject) => {
      if (status.code === Status.OK) this.lost(call, Status.OK, "closed by the broker");
    });
  }

  /** STARTING → OPEN: the response headers came. */
  private opened(call: Call, headers: Metadata): void {
    if (this.call !== call || this.state !== "STARTING") return;
    clearTimeout(this.timer);
    this.timer = undefined;
    const named = headers.get(INSTANCE_HEADER)[0];
    const scope = headers.get(SCOPE_HEADER)[0];
    // A broker that does not say is a new instance at every session.
    const instance = named !== undefined && named !== "" ? String(named) : `unnamed-${++this.unnamedInstances}`;
    this.origin = { instance, scope: scope === undefined ? undefined : String(scope) };
    this.state = "OPEN";
    this.delay.reset();
    const address = targetString(this.conn.target);
    if (!this.everOpen) {
      this.everOpen = true;
      this.emit({ type: "connected", address, instance });
    } else if (this.disconnected) {
      this.disconnected = false;
      this.reconnects += 1;
      this.emit({ type: "reconnected", address, instance, instanceChanged: instance !== this.previousInstance });
    }
    this.previousInstance = instance;
    for (const sub of this.subs) this.openIfRoom(sub);
    this.buffer.onOpen();
  }

  private onEvent(event: SessionEvent): void {
    const e = event.event;
    if (e === undefined) return;
    switch (e.$case) {
      case "deliveries":
        for (const d of e.value.deliveries) this.deliver(d);
        return;
      case "delivery":
        this.deliver(e.value);
        return;
      case "published":
        this.buffer.onPublished(e.value);
        return;
      case "opened":
        this.byHandle.get(e.value.handle)?._onOpened(e.value.subscriptionId);
        return;
      case "ended": {
        const ended = e.value;
        const sub = this.byHandle.get(ended.handle);
        if (sub === undefined) return;
        this.byHandle.delete(ended.handle);
        sub._onEnded(ended);
        if (ended.reason === "rejected" && ended.code === Status.UNAVAILABLE && this.conn.targets.length > 1) {
          // This replica cannot serve now: the session moves to the next address.
          const call = this.call;
          if (call !== undefined) {
            this.lost(call, Status.UNAVAILABLE, `${targetString(this.conn.target)}: ${ended.message}`);
          }
        }
        return;
      }
    }
  }

  private deliver(d: SessionDelivery): void {
    const message = d.message;
    if (message === undefined) return;
    this.messagesIn += 1;
    this.bytesIn += message.payload.length;
    const origin = this.origin!;
    for (const handle of d.handles) {
      const sub = this.byHandle.get(handle);
      if (sub === undefined) this.droppedLate += 1;
      else sub._deliver(message, handle, origin);
    }
  }

  /** The call failed or ended (status OK included) without close(): WAITING, then STARTING again. */
  private lost(call: Call, code: number, reason: string): void {
    if (this.call !== call) return;
    this.call = undefined;
    if (this.ended !== undefined) {
      this.ended(); // close() was waiting for this end
      return;
    }
    call.cancel();
    if (this.state === "CLOSED") return;
    clearTimeout(this.timer);
    const wasOpen = this.state === "OPEN";
    this.state = "WAITING";
    if (wasOpen) {
      this.disconnected = true;
      this.emit({ type: "disconnected", reason, code });
    }
    const opened = [...this.byHandle.values()];
    this.byHandle.clear();
    for (const sub of opened) sub._onLost(code, reason);
    if (!wasOpen) {
      // The session could not start: a subscription never opened learns why
      // (and subscribe() fails at once when retrying cannot help, e.g. a bad token).
      for (const sub of [...this.subs]) sub._onStartFailed(code, reason);
    }
    this.buffer.onLost();
    this.conn.failover(); // with a list, the next address (no-op with one)
    this.timer = setTimeout(() => {
      this.timer = undefined;
      if (this.state === "WAITING") this.start();
    }, this.delay.next());
  }
}

/** Options of {@link Subscription.next}. */
export interface NextOptions {
  /** Milliseconds to wait: then it rejects with a {@link TimeoutError} (DEADLINE_EXCEEDED). */
  timeout?: number;
  /** Stops waiting (rejects with the signal's reason). */
  signal?: AbortSignal;
}

/** A callback for a subscription's events. */
export type EventCallback = (event: SubscriptionEvent) => void;

/** How the subscription was last ended or lost, until its next delivery reports the gap. */
interface Resuming {
  readonly cause: string;
  readonly dropped: number | undefined;
}

/**
 * A subscription on its client's session: an `AsyncIterable` of
 * {@link Message}s (`for await (const msg of sub) { ... }`).
 *
 * The broker sends it at most `window` messages beyond what the application
 * has taken, and the client holds at most `window` for it. When the broker
 * ends it (eviction, shutdown) the client opens it again after a jittered
 * backoff (unless `resubscribe: false`); when the session is lost it is
 * opened again on the next session. Each step is a
 * {@link SubscriptionEvent} (to `onEvent`, in {@link Subscription.events},
 * counted in {@link Subscription.stats}), with a `gap` event when the first
 * message after does not follow the last one before. Iteration stops after
 * {@link Subscription.close} or the client's close; it throws
 * {@link SubscriptionEnded} when the subscription ended for good otherwise.
 * Leaving a `for await` loop does not close it.
 */
export class Subscription implements AsyncIterable<Message> {
  /** Credit window: deliveries the broker may send beyond what was taken, and the most the client holds. */
  readonly window: number;
  /** Whether it is opened again after an eviction, a shutdown or a lost connection. */
  readonly resubscribe: boolean;
  /** The id the broker gave it (the one the application named, if any). */
  subscriptionId: string | undefined;
  /** Counters: received, ends, evictions, resubscribes, gaps, dropped. */
  readonly stats: SubscriptionStats = {
    received: 0,
    ends: 0,
    evictions: 0,
    resubscribes: 0,
    gaps: 0,
    dropped: 0,
    byReason: {},
  };
  /** The last 100 events, oldest first. */
  readonly events: SubscriptionEvent[] = [];
  /** The last gap reported, if any. */
  lastGap: GapEvent | undefined;

  /** @internal */ readonly _request: OpenSubscriptionRequest;
  /** @internal The handle of its latest open (0: never opened). */ _handle = 0;
  /** @internal */ _state: SubscriptionState = "WAITING";
  /** @internal Messages taken since the last credit top-up of this open. */ _taken = 0;
  /** @internal */ _closing = false;
  /** @internal Why the last attempt to open it failed, if one did. */ _lastCause: TinybrokerError | undefined;
  /** @internal */ readonly _opened: Promise<void>;

  private readonly session: Session;
  private readonly topUp: number;
  private readonly onEvent: EventCallback | undefined;
  private buffer: Message[] = [];
  private head = 0;
  private waiter: (() => void) | undefined;
  private lastSequence = 0;
  private lastOrigin: Origin | undefined;
  private resuming: Resuming | undefined;
  private final: Error | undefined;
  private openedOnce = false;
  private resolveOpened!: () => void;
  private rejectOpened!: (e: Error) => void;
  private openSettled = false;
  private closedWaiter: (() => void) | undefined;
  private retry: NodeJS.Timeout | undefined;
  private readonly backoff = new Backoff(RESUBSCRIBE_DELAY_FIRST, RESUBSCRIBE_DELAY_CAP);
  private takenSinceOpen = false;
  private readonly manual: boolean;
  private acks: number[] = [];
  private nacks: number[] = [];

  /** @internal */
  constructor(
    session: Session,
    request: OpenSubscriptionRequest,
    opts: { window: number; resubscribe: boolean; onEvent?: EventCallback | undefined },
  ) {
    if (!(Number.isInteger(opts.window) && opts.window >= 1)) {
      throw new UsageError(`window must be an integer of at least 1, not ${opts.window}`, Status.INVALID_ARGUMENT);
    }
    this.session = session;
    this._request = request;
    this.window = opts.window;
    this.topUp = topUp(opts.window);
    this.resubscribe = opts.resubscribe;
    this.onEvent = opts.onEvent;
    this.subscriptionId = request.subscriptionId || undefined;
    this.manual = request.ackMode === PbAckMode.ACK_MODE_MANUAL;
    this._opened = new Promise<void>((resolve, reject) => {
      this.resolveOpened = resolve;
      this.rejectOpened = reject;
    });
    this._opened.catch(() => undefined); // nobody may wait for it (a timed-out subscribe)
  }

  // --- what the application sees ---

  /** Its topic patterns. */
  get patterns(): string[] {
    return [...this._request.topicPatterns];
  }
  /** Its consumer group, if any. */
  get group(): string | undefined {
    return this._request.consumerGroup || undefined;
  }
  /** Its state: WAITING, OPENING, OPEN, BACKOFF or DONE (docs/clients.md). */
  get state(): SubscriptionState {
    return this._state;
  }
  /** Open on the broker right now. */
  get isOpen(): boolean {
    return this._state === "OPEN";
  }
  /** Ended for good: iteration stops or throws once the messages held are taken. */
  get done(): boolean {
    return this._state === "DONE";
  }
  /** Messages received and not yet taken (never more than the window). */
  get pending(): number {
    return this.buffer.length - this.head;
  }

  /** Iterates its messages: `for await (const msg of sub)`. */
  [Symbol.asyncIterator](): AsyncIterator<Message> {
    const result = (m: Message | undefined): IteratorResult<Message> =>
      m === undefined ? { done: true, value: undefined } : { done: false, value: m };
    return {
      // A message already held is handed over without waiting a turn.
      next: (): Promise<IteratorResult<Message>> => {
        try {
          const m = this.take();
          return m instanceof Promise ? m.then(result) : Promise.resolve(result(m));
        } catch (e) {
          return Promise.reject(e);
        }
      },
      // Leaving the loop does not close the subscription.
      return: async (): Promise<IteratorResult<Message>> => ({ done: true, value: undefined }),
    };
  }

  /**
   * The next message. One at a time: a second call while one waits rejects
   * at once with {@link UsageError} (the first keeps waiting). Rejects with
   * {@link TimeoutError} after `timeout` ms, with {@link SubscriptionEnded}
   * when it ended for good, and with {@link ClientClosed} after
   * {@link Subscription.close} or the client's close.
   */
  async next(opts: NextOptions = {}): Promise<Message> {
    const m = await this.take(opts.timeout, opts.signal);
    if (m === undefined) throw this.final ?? new ClientClosed("the subscription");
    return m;
  }

  /** A message, or undefined at the end of the iteration (closed). */
  private take(timeout?: number, signal?: AbortSignal): Promise<Message | undefined> | Message | undefined {
    if (this.head < this.buffer.length && this.waiter === undefined) return this.shift();
    return this.wait(timeout, signal);
  }

  private async wait(timeout?: number, signal?: AbortSignal): Promise<Message | undefined> {
    if (this.waiter !== undefined) throw new UsageError("only one next() at a time on a subscription");
    for (;;) {
      if (this.head < this.buffer.length) return this.shift();
      const final = this.final;
      if (final !== undefined) {
        if (final instanceof ClientClosed) return undefined;
        throw final;
      }
      signal?.throwIfAborted();
      let timer: NodeJS.Timeout | undefined;
      let onAbort: (() => void) | undefined;
      try {
        await new Promise<void>((resolve, reject) => {
          this.waiter = resolve;
          if (timeout !== undefined) {
            timer = setTimeout(
              () => reject(new TimeoutError(`no message on ${this.subscriptionId ?? "the subscription"} within ${timeout} ms`)),
              timeout,
            );
          }
          if (signal !== undefined) {
            onAbort = () => reject(signal.reason);
            signal.addEventListener("abort", onAbort, { once: true });
          }
        });
      } finally {
        this.waiter = undefined;
        clearTimeout(timer);
        if (onAbort !== undefined) signal!.removeEventListener("abort", onAbort);
      }
    }
  }

  private shift(): Message {
    const message = this.buffer[this.head]!;
    this.buffer[this.head] = undefined as unknown as Message;
    this.head += 1;
    if (this.head === this.buffer.length) {
      this.buffer = [];
      this.head = 0;
    } else if (this.head >= 1024 && this.head * 2 >= this.buffer.length) {
      this.buffer = this.buffer.slice(this.head);
      this.head = 0;
    }
    this.stats.received += 1;
    if (!this.takenSinceOpen && this._state === "OPEN") {
      // Taken after its last open: the resubscribe delay starts again from the first.
      this.takenSinceOpen = true;
      this.backoff.reset();
    }
    if (this._state === "OPENING" || this._state === "OPEN") {
      this._taken += 1;
      if (this._taken >= this.topUp) {
        this.session.write({ request: { $case: "credit", value: { handle: this._handle, messages: this._taken } } });
        this._taken = 0;
      }
    } else if (this._state === "WAITING") {
      this.session.openIfRoom(this); // it may have been waiting for room in its window
    }
    return message;
  }

  /**
   * Closes the subscription and waits (up to `timeout` ms) until the broker
   * has ended it (acks made before are sent first). Messages not yet taken
   * are dropped (a MANUAL group's go to another member). Iteration then
   * stops; a waiting `next()` rejects with {@link ClientClosed}.
   */
  async close(timeout = 5000): Promise<void> {
    if (this._state === "DONE") return;
    this._closing = true;
    clearTimeout(this.retry);
    this.retry = undefined;
    this.buffer = [];
    this.head = 0;
    if (this._state === "OPEN" && this.session.state === "OPEN") {
      let timer: NodeJS.Timeout | undefined;
      const closed = new Promise<void>((r) => {
        this.closedWaiter = r;
        timer = setTimeout(r, timeout);
      });
      this.session.write({ request: { $case: "close", value: { handle: this._handle } } });
      await closed;
      clearTimeout(timer);
    } else if (this._state === "OPENING") {
      // Its `opened` sends the close; the end comes after it.
      let timer: NodeJS.Timeout | undefined;
      await new Promise<void>((r) => {
        this.closedWaiter = r;
        timer = setTimeout(r, timeout);
      });
      clearTimeout(timer);
    }
    this._finish(new ClientClosed("the subscription"));
  }

  /** The same as {@link Subscription.close} (the name nats.js uses). */
  unsubscribe(): Promise<void> {
    return this.close();
  }

  // --- what the session and messages call ---

  /** @internal */
  _emit(event: SubscriptionEvent): void {
    this.events.push(event);
    if (this.events.length > 100) this.events.shift();
    if (this.onEvent !== undefined) {
      try {
        this.onEvent(event);
      } catch (e) {
        console.error("tinybroker: onEvent callback failed", e);
      }
    }
  }

  /** @internal A delivery for its current handle. */
  _deliver(raw: PbMessage, handle: number, origin: Origin): void {
    if (this.resuming !== undefined) this.reportGap(this.resuming, raw.sequence, origin);
    this.lastSequence = raw.sequence;
    this.lastOrigin = origin;
    this.buffer.push(new Message(raw, this, handle));
    const waiter = this.waiter;
    if (waiter !== undefined) {
      this.waiter = undefined;
      waiter();
    }
  }

  /** The first delivery after it was open again: one gap event, unless it follows the last one (docs/clients.md "Gaps"). */
  private reportGap(resuming: Resuming, first: number, origin: Origin): void {
    this.resuming = undefined;
    const last = this.lastSequence;
    let missed: GapEvent["missed"];
    let reason: GapEvent["reason"];
    if (last === 0 || this.lastOrigin === undefined) reason = "nothing_before";
    else if (origin.instance !== this.lastOrigin.instance) reason = "instance_changed";
    else if (origin.scope !== "instance" || this.lastOrigin.scope !== "instance") reason = "sequence_scope";
    else if (first > last + 1) missed = { first: last + 1, last: first - 1 };
    else return; // the next sequence (or a redelivery): nothing missed
    const gap: GapEvent = {
      type: "gap",
      subscriptionId: this.subscriptionId,
      missed,
      reason,
      dropped: resuming.dropped,
      cause: resuming.cause,
      lastBefore: last,
      firstAfter: first,
    };
    this.lastGap = gap;
    this.stats.gaps += 1;
    this._emit(gap);
  }

  /** @internal */
  _onOpened(subscriptionId: string): void {
    this._state = "OPEN";
    this.takenSinceOpen = false;
    this.subscriptionId = subscriptionId;
    this._lastCause = undefined;
    if (!this.openedOnce) {
      this.openedOnce = true;
      this.settleOpened();
      this._emit({ type: "opened", subscriptionId });
    } else {
      this.stats.resubscribes += 1;
      this._emit({ type: "resubscribed", subscriptionId });
    }
    if (this._closing) this.session.write({ request: { $case: "close", value: { handle: this._handle } } });
  }

  private countEnd(event: EndedEvent): void {
    this.stats.ends += 1;
    this.stats.dropped += event.dropped;
    this.stats.byReason[event.reason] = (this.stats.byReason[event.reason] ?? 0) + 1;
    if (event.reason === "evicted") this.stats.evictions += 1;
  }

  /** @internal The broker ended its current handle (docs/clients.md "Ends"). */
  _onEnded(ended: SessionEnded): void {
    this._state = "WAITING";
    this.acks = [];
    this.nacks = [];
    const reason = ended.reason;
    if (this._closing || reason === "closed") {
      this._finish(new ClientClosed("the subscription"));
      return;
    }
    const code = ended.code;
    if (reason === "rejected") {
      const error = new TinybrokerError(code, ended.message || `the broker refused the subscription (${code})`);
      this._lastCause = error;
      if (!this.openedOnce) {
        // A broker that cannot serve now (shutting down, a replica cut off
        // from NATS; with an address list the session moves on): subscribe()
        // waits (until its timeout) for one that can, as docs/clients.md says.
        if (code === Status.UNAVAILABLE) return this.backOff(error.message, undefined);
        return this._finish(error, error);
      }
      // A re-open: UNAVAILABLE is retried; so is ALREADY_EXISTS (the broker
      // may not have ended the subscription of the lost session yet).
      if (this.resubscribe && (code === Status.UNAVAILABLE || code === Status.ALREADY_EXISTS)) {
        return this.backOff(error.message, undefined);
      }
    }
    const again = this.resubscribe && (reason === "evicted" || reason === "shutdown");
    const last = Math.max(ended.lastSequence, this.lastSequence);
    const event: EndedEvent = {
      type: "ended",
      subscriptionId: this.subscriptionId,
      reason,
      dropped: ended.dropped,
      lastSequence: last,
      code,
      message: ended.message,
      resubscribing: again,
    };
    this.countEnd(event);
    this._emit(event);
    if (again) {
      this.resuming = { cause: reason, dropped: ended.dropped };
      this.backOff(undefined, this.resuming);
    } else {
      this._finish(
        new SubscriptionEnded(reason, {
          dropped: ended.dropped,
          lastSequence: last,
          code,
          message: ended.message,
          subscriptionId: this.subscriptionId,
        }),
      );
    }
  }

  /** BACKOFF, then WAITING after the resubscribe delay. */
  private backOff(cause: string | undefined, resuming: Resuming | undefined): void {
    this._state = "BACKOFF";
    if (resuming !== undefined) this.resuming = resuming;
    const delay = this.backoff.next();
    this._emit({ type: "resubscribing", subscriptionId: this.subscriptionId, delay, cause });
    this.retry = setTimeout(() => {
      this.retry = undefined;
      if (this._state !== "BACKOFF") return;
      this._state = "WAITING";
      this.session.openIfRoom(this);
    }, delay);
  }

  /** @internal Its session was lost: WAITING, to be opened on the next session (or DONE without re-subscription). */
  _onLost(code: number, reason: string): void {
    this._state = "WAITING";
    this.acks = [];
    this.nacks = [];
    if (this._closing) return this._finish(new ClientClosed("the subscription"));
    this._lastCause = new TinybrokerError(code || Status.UNAVAILABLE, reason);
    if (!this.openedOnce) return; // subscribe() waits (until its timeout) for a session
    if (!this.resubscribe) {
      const event: EndedEvent = {
        type: "ended",
        subscriptionId: this.subscriptionId,
        reason: "connection_lost",
        dropped: 0,
        lastSequence: this.lastSequence,
        code: code || Status.UNAVAILABLE,
        message: reason,
        resubscribing: false,
      };
      this.countEnd(event);
      this._emit(event);
      this._finish(
        new SubscriptionEnded("connection_lost", {
          lastSequence: this.lastSequence,
          code: event.code,
          message: reason,
          subscriptionId: this.subscriptionId,
        }),
      );
      return;
    }
    if (this.resuming === undefined) this.resuming = { cause: "connection_lost", dropped: undefined };
  }

  /** @internal The session could not start: a subscription never opened fails when the code says retrying cannot help. */
  _onStartFailed(code: number, reason: string): void {
    if (this.openedOnce || this._state === "DONE") return;
    const error = new TinybrokerError(code || Status.UNAVAILABLE, reason);
    this._lastCause = error;
    if (!RETRYABLE.has(error.code)) this._finish(error, error);
  }

  /** @internal Queues an ack or nack of `message` for the next SessionAck/SessionNack; false when it will not be sent. */
  settle(message: Message, nack: boolean): boolean {
    if (!this.manual || message._handle !== this._handle || this._state !== "OPEN") return false;
    (nack ? this.nacks : this.acks).push(message.sequence);
    this.session.ackLater(this);
    return true;
  }

  /** @internal The acks and nacks to send now. */
  _takeSettles(): { acks: number[]; nacks: number[] } {
    const taken = { acks: this.acks, nacks: this.nacks };
    this.acks = [];
    this.nacks = [];
    return taken;
  }

  private settleOpened(error?: Error): void {
    if (this.openSettled) return;
    this.openSettled = true;
    if (error === undefined) this.resolveOpened();
    else this.rejectOpened(error);
  }

  /** @internal DONE: `final` is what a waiting or later next() gets once the messages held are taken. */
  _finish(final: Error, openError?: Error): void {
    this._state = "DONE";
    clearTimeout(this.retry);
    this.retry = undefined;
    if (this.final === undefined) this.final = final;
    this.session.forget(this);
    if (!this.openSettled) this.settleOpened(openError ?? final);
    const closed = this.closedWaiter;
    this.closedWaiter = undefined;
    closed?.();
    const waiter = this.waiter;
    this.waiter = undefined;
    waiter?.();
  }
}
