// The client's one Session stream and its subscriptions.
//
// One loop (Session.run) owns the stream: it starts it, opens every waiting
// subscription on it, reads its events and hands each delivery to the
// subscriptions its handles name. When the stream fails it tells every
// subscription, waits a jittered backoff, moves to the next address of a
// list, and starts a new session on which the subscriptions that
// re-subscribe are opened again.
//
// A Subscription is opened with a credit window (256 by default) and gives
// credit back as the application takes messages, so the broker never sends
// it more than its window beyond what the application has taken, and one
// the application stops reading stalls (and is evicted) alone.
import type { ClientDuplexStream, ServiceError } from "@grpc/grpc-js";
import type { Connection } from "./connection.js";
import { targetString } from "./connection.js";
import { Status, SubscriptionEnded, TinybrokerError } from "./errors.js";
import type {
  Message as PbMessage,
  OpenSubscriptionRequest,
  SessionEnded,
  SessionEvent,
  SessionRequest,
} from "./gen/tinybroker/v1/broker.js";
import { AckMode as PbAckMode } from "./gen/tinybroker/v1/broker.js";
import { Message } from "./types.js";
import type { EndedEvent, GapEvent, SubscriptionEvent, SubscriptionStats } from "./types.js";

/** How long (ms) the broker has to accept a session (it answers at once). */
const START_TIMEOUT = 10_000;

const enum State {
  Waiting = 0, // not on the current session (none yet, or lost)
  Opening = 1, // `open` sent, `opened` not yet received
  Open = 2,
  Done = 3, // ended for good
}

const RETRYABLE = new Set<number>([
  Status.UNAVAILABLE,
  Status.UNKNOWN,
  Status.CANCELLED,
  Status.ABORTED,
  Status.DEADLINE_EXCEEDED,
  Status.INTERNAL,
]);

/** @internal Exponential backoff with jitter: 100 ms doubling to `cap` ms, each delay 0-25 % longer at random. */
export class Backoff {
  private next_: number;
  constructor(
    private readonly first = 100,
    private readonly cap = 2000,
  ) {
    this.next_ = first;
  }
  reset(): void {
    this.next_ = this.first;
  }
  next(): number {
    const delay = this.next_ * (1 + Math.random() * 0.25);
    this.next_ = Math.min(this.next_ * 2, this.cap);
    return Math.round(delay);
  }
}

class StartFailed extends Error {
  constructor(readonly error: TinybrokerError) {
    super(error.message);
  }
}

/** An open was refused UNAVAILABLE (a replica that lost NATS, a broker shutting down) while the client knows other addresses. */
class ReplicaUnavailable extends Error {
  constructor(readonly error: TinybrokerError) {
    super(error.message);
  }
}

/** @internal The one Session stream of a client, and its subscriptions by handle. */
export class Session {
  readonly subs = new Map<number, Subscription>();
  private lastHandle = 0;
  private call: ClientDuplexStream<SessionRequest, SessionEvent> | undefined;
  /** The stream is accepted: requests can be written. */
  live = false;
  private running: Promise<void> | undefined;
  private wake: (() => void) | undefined;
  private sleeping: { timer: NodeJS.Timeout; resolve: () => void } | undefined;
  closed = false;
  private readonly backoff = new Backoff();
  /** Sessions started after the first (the connection was lost and found again). */
  reconnects = 0;
  private started = 0;

  constructor(private readonly conn: Connection) {}

  // === the application's side ===

  /** Opens `sub` under a new handle, now or on the next session. */
  open(sub: Subscription): void {
    const handle = this.nextHandle();
    sub._handle = handle;
    sub._state = State.Waiting;
    this.subs.set(handle, sub);
    if (this.live) {
      this.sendOpen(sub);
    } else {
      if (this.running === undefined) this.running = this.run();
      this.wake?.();
    }
  }

  send(request: SessionRequest): void {
    if (this.live && this.call !== undefined) this.call.write(request);
  }

  forget(sub: Subscription): void {
    if (this.subs.get(sub._handle) === sub) this.subs.delete(sub._handle);
  }

  /** Half-closes the session (the broker ends every subscription "closed" and then the stream) and ends the loop. */
  async close(timeout = 2000): Promise<void> {
    this.closed = true;
    for (const sub of this.subs.values()) sub._closing = true;
    this.wake?.();
    if (this.sleeping) {
      clearTimeout(this.sleeping.timer);
      this.sleeping.resolve();
    }
    const call = this.call;
    if (this.live && call !== undefined && this.running !== undefined) {
      call.end();
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([
        this.running.catch(() => undefined),
        new Promise<void>((r) => (timer = setTimeout(r, timeout))),
      ]);
      clearTimeout(timer);
    }
    if (this.call !== undefined) this.call.cancel();
    await this.running?.catch(() => undefined);
    for (const sub of [...this.subs.values()]) sub._finish(undefined);
    this.subs.clear();
  }

  // === the loop ===

  private nextHandle(): number {
    for (;;) {
      this.lastHandle = (this.lastHandle % 0xffffffff) + 1;
      if (!this.subs.has(this.lastHandle)) return this.lastHandle;
    }
  }

  private sendOpen(sub: Subscription): void {
    sub._generation += 1;
    sub._state = State.Opening;
    sub._taken = 0;
    // What it still holds from before counts against its window: the client
    // never holds more than the window (credit 0 would mean no limit).
    const credit = Math.max(1, sub.window - sub.pending);
    this.call!.write({
      request: { $case: "open", value: { handle: sub._handle, subscription: sub._request, credit } },
    });
  }

  private sleep(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.sleeping = undefined;
        resolve();
      }, ms);
      this.sleeping = { timer, resolve };
    });
  }

  private async run(): Promise<void> {
    while (!this.closed) {
      let waiting = false;
      for (const s of this.subs.values()) if (s._state === State.Waiting) waiting = true;
      if (!waiting) {
        await new Promise<void>((r) => (this.wake = r));
        this.wake = undefined;
        continue;
      }
      let failure: TinybrokerError;
      let starting = false;
      let moving = false;
      try {
        await this.serve();
        if (this.closed) return;
        failure = new TinybrokerError(Status.UNAVAILABLE, "the broker ended the session");
      } catch (e) {
        if (e instanceof StartFailed) {
          failure = e.error;
          starting = true;
        } else if (e instanceof ReplicaUnavailable) {
          failure = e.error;
          moving = true;
        } else {
          failure = TinybrokerError.from(e);
        }
      } finally {
        this.live = false;
        const call = this.call;
        this.call = undefined;
        call?.cancel();
      }
      if (this.closed) return;
      if (moving) this.conn.failover();
      if (this.subs.size === 0) continue; // every subscription had ended before (a shutdown)
      this.lost(failure, starting);
      if (this.subs.size === 0) continue;
      const delay = this.backoff.next();
      for (const sub of [...this.subs.values()]) {
        sub._emit({
          type: "resubscribing",
          subscriptionId: sub.subscriptionId,
          delay,
          cause: starting ? failure.message : undefined,
        });
      }
      await this.sleep(delay);
      if (
        !moving &&
        RETRYABLE.has(failure.code) &&
        (this.conn.down() || starting || this.conn.targets.length > 1)
      ) {
        this.conn.failover();
      }
    }
  }

  private serve(): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const conn = this.conn;
      const call = conn.broker.session(conn.metadata);
      this.call = call;
      let accepted = false;
      let settled = false;
      const fail = (e: Error): void => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        reject(e);
      };
      const timer = setTimeout(() => {
        fail(
          new StartFailed(
            new TinybrokerError(
              Status.DEADLINE_EXCEEDED,
              `${targetString(conn.target)} did not accept a session within ${START_TIMEOUT / 1000} s`,
            ),
          ),
        );
      }, START_TIMEOUT);
      call.on("metadata", () => {
        if (settled || accepted) return;
        clearTimeout(timer);
        accepted = true;
        this.live = true;
        this.started += 1;
        if (this.started > 1) this.reconnects += 1;
        for (const sub of this.subs.values()) if (sub._state === State.Waiting) this.sendOpen(sub);
      });
      const subs = this.subs;
      call.on("data", (event: SessionEvent) => {
        if (settled) return;
        const e = event.event;
        if (e === undefined) return;
        switch (e.$case) {
          case "delivery": {
            const message = e.value.message;
            if (message === undefined) return;
            for (const handle of e.value.handles) subs.get(handle)?._deliver(message, handle);
            return;
          }
          case "opened": {
            const sub = subs.get(e.value.handle);
            if (sub !== undefined) {
              this.backoff.reset();
              sub._onOpened(e.value.subscriptionId);
            }
            return;
          }
          case "ended": {
            const ended = e.value;
            const sub = subs.get(ended.handle);
            if (sub !== undefined) {
              subs.delete(ended.handle);
              sub._onEnded(ended);
            }
            if (ended.reason === "rejected" && ended.code === Status.UNAVAILABLE && conn.targets.length > 1) {
              // This replica cannot serve now: try the next address.
              fail(
                new ReplicaUnavailable(
                  new TinybrokerError(Status.UNAVAILABLE, `${targetString(conn.target)}: ${ended.message}`),
                ),
              );
            }
            return;
          }
        }
      });
      call.on("error", (err: ServiceError) => {
        const error = TinybrokerError.from(err);
        if (!accepted) {
          fail(new StartFailed(new TinybrokerError(error.code, `${targetString(conn.target)}: ${error.details}`)));
        } else {
          fail(error);
        }
      });
      call.on("status", (s: { code: number }) => {
        if (s.code === Status.OK && !settled) {
          settled = true;
          clearTimeout(timer);
          resolve();
        }
      });
    });
  }

  private lost(failure: TinybrokerError, starting: boolean): void {
    for (const [handle, sub] of [...this.subs]) {
      if (!sub._onLost(failure, starting)) this.subs.delete(handle);
    }
  }
}

/** Options of {@link Subscription.next}. */
export interface NextOptions {
  /** Milliseconds to wait: then it rejects with a TinybrokerError(DEADLINE_EXCEEDED). */
  timeout?: number;
  /** Stops waiting (rejects with the signal's reason). */
  signal?: AbortSignal;
}

/** A callback for a subscription's events. */
export type EventCallback = (event: SubscriptionEvent) => void;

const CLOSED = Symbol("closed");

/**
 * A subscription on its client's session: an `AsyncIterable` of
 * {@link Message}s (`for await (const msg of sub) { ... }`).
 *
 * The broker sends it at most `window` messages beyond what the iteration
 * has taken. When the broker ends it (eviction, shutdown) or the connection
 * is lost, the client opens it again after a jittered backoff (unless
 * `resubscribe: false`), with the same id when the application named one,
 * and reports each step as a {@link SubscriptionEvent} (to `onEvent`, in
 * {@link Subscription.events}, counted in {@link Subscription.stats}), with
 * a `gap` event when messages arrive again. Iteration stops after
 * {@link Subscription.close}; it throws {@link SubscriptionEnded} when the
 * subscription ended for good otherwise (an admin closed it, or it ended and
 * does not re-subscribe). Leaving a `for await` loop does not close it.
 */
export class Subscription implements AsyncIterable<Message> {
  /** Credit window: deliveries the broker may send beyond what was taken. */
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
  /** @internal */ _handle = 0;
  /** @internal */ _state: State = State.Waiting;
  /** @internal */ _generation = 0;
  /** @internal */ _taken = 0;
  /** @internal */ _closing = false;
  /** @internal */ _lastCause: TinybrokerError | undefined;
  /** @internal */ readonly _opened: Promise<void>;

  private readonly session: Session;
  private readonly batch: number;
  private readonly onEvent: EventCallback | undefined;
  private buffer: Message[] = [];
  private head = 0;
  private waiter: (() => void) | undefined;
  private lastSequence = 0;
  private resuming: EndedEvent | undefined;
  private final: SubscriptionEnded | TinybrokerError | typeof CLOSED | undefined;
  private openedOnce = false;
  private resolveOpened!: () => void;
  private rejectOpened!: (e: Error) => void;
  private openSettled = false;
  private closedWaiter: (() => void) | undefined;
  private retry: NodeJS.Timeout | undefined;
  private readonly backoff = new Backoff();
  private readonly manual: boolean;

  /** @internal */
  constructor(
    session: Session,
    request: OpenSubscriptionRequest,
    opts: { window: number; resubscribe: boolean; onEvent?: EventCallback | undefined },
  ) {
    if (!(opts.window >= 1)) throw new RangeError("window must be at least 1");
    this.session = session;
    this._request = request;
    this.window = opts.window;
    this.batch = Math.max(1, Math.floor(opts.window / 4));
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
  /** Open on the broker right now (not between an end and a re-open). */
  get isOpen(): boolean {
    return this._state === State.Open;
  }
  /** Ended for good: iteration stops or throws once the buffer is empty. */
  get done(): boolean {
    return this._state === State.Done;
  }
  /** Messages received and not yet taken (never more than the window). */
  get pending(): number {
    return this.buffer.length - this.head;
  }

  /** Iterates its messages: `for await (const msg of sub)`. */
  [Symbol.asyncIterator](): AsyncIterator<Message> {
    return {
      next: async (): Promise<IteratorResult<Message>> => {
        const m = await this.take();
        return m === undefined ? { done: true, value: undefined } : { done: false, value: m };
      },
      // Leaving the loop does not close the subscription.
      return: async (): Promise<IteratorResult<Message>> => ({ done: true, value: undefined }),
    };
  }

  /**
   * The next message. Rejects with TinybrokerError(DEADLINE_EXCEEDED) after
   * `timeout` ms, with {@link SubscriptionEnded} when it ended for good, and
   * with TinybrokerError(CANCELLED) after {@link Subscription.close}.
   */
  async next(opts: NextOptions = {}): Promise<Message> {
    const m = await this.take(opts.timeout, opts.signal);
    if (m === undefined) throw new TinybrokerError(Status.CANCELLED, "the subscription is closed");
    return m;
  }

  private take(timeout?: number, signal?: AbortSignal): Promise<Message | undefined> | Message | undefined {
    if (this.head < this.buffer.length) return this.shift();
    return this.wait(timeout, signal);
  }

  private async wait(timeout?: number, signal?: AbortSignal): Promise<Message | undefined> {
    for (;;) {
      if (this.head < this.buffer.length) return this.shift();
      const final = this.final;
      if (final !== undefined) {
        if (final === CLOSED) return undefined;
        throw final;
      }
      if (this.waiter !== undefined) throw new Error("only one next() at a time on a subscription");
      signal?.throwIfAborted();
      let timer: NodeJS.Timeout | undefined;
      let onAbort: (() => void) | undefined;
      try {
        await new Promise<void>((resolve, reject) => {
          this.waiter = resolve;
          if (timeout !== undefined) {
            timer = setTimeout(
              () =>
                reject(
                  new TinybrokerError(
                    Status.DEADLINE_EXCEEDED,
                    `no message on ${this.subscriptionId ?? "the subscription"} within ${timeout} ms`,
                  ),
                ),
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
    this.head += 1;
    if (this.head === this.buffer.length) {
      this.buffer = [];
      this.head = 0;
    } else if (this.head >= 1024 && this.head * 2 >= this.buffer.length) {
      this.buffer = this.buffer.slice(this.head);
      this.head = 0;
    }
    this.stats.received += 1;
    if (this._state === State.Opening || this._state === State.Open) {
      this._taken += 1;
      if (this._taken >= this.batch) {
        this.session.send({ request: { $case: "credit", value: { handle: this._handle, messages: this._taken } } });
        this._taken = 0;
      }
    }
    return message;
  }

  /**
   * Closes the subscription and waits (up to `timeout` ms) until the broker
   * has ended it (acks sent before have then been applied). Messages not yet
   * taken are dropped (a MANUAL group's go to another member). Iteration then
   * stops.
   */
  async close(timeout = 5000): Promise<void> {
    if (this._state === State.Done) return;
    this._closing = true;
    clearTimeout(this.retry);
    this.retry = undefined;
    this.buffer = [];
    this.head = 0;
    if ((this._state === State.Opening || this._state === State.Open) && this.session.live) {
      let timer: NodeJS.Timeout | undefined;
      const closed = new Promise<void>((r) => {
        this.closedWaiter = r;
        timer = setTimeout(r, timeout);
      });
      this.session.send({ request: { $case: "close", value: { handle: this._handle } } });
      await closed;
      clearTimeout(timer);
    }
    this.session.forget(this);
    this._finish(undefined);
  }

  /** The same as {@link Subscription.close} (the name nats.js uses). */
  unsubscribe(): Promise<void> {
    return this.close();
  }

  // --- what the session calls ---

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

  /** @internal */
  _deliver(raw: PbMessage, handle: number): void {
    if (this.resuming !== undefined) {
      const ended = this.resuming;
      this.resuming = undefined;
      const gap: GapEvent = {
        type: "gap",
        subscriptionId: this.subscriptionId,
        lastBefore: this.lastSequence,
        firstAfter: raw.sequence,
        dropped: ended.dropped,
        reason: ended.reason,
      };
      this.lastGap = gap;
      this.stats.gaps += 1;
      this._emit(gap);
    }
    this.lastSequence = raw.sequence;
    this.buffer.push(new Message(raw, this, handle, this._generation));
    const waiter = this.waiter;
    if (waiter !== undefined) {
      this.waiter = undefined;
      waiter();
    }
  }

  /** @internal */
  _onOpened(subscriptionId: string): void {
    this._state = State.Open;
    this.subscriptionId = subscriptionId;
    this._lastCause = undefined;
    if (!this.openedOnce) {
      this.openedOnce = true;
      this.settleOpened();
      this._emit({ type: "opened", subscriptionId });
    } else {
      this.backoff.reset();
      this.stats.resubscribes += 1;
      this._emit({ type: "resubscribed", subscriptionId });
    }
    if (this._closing) this.session.send({ request: { $case: "close", value: { handle: this._handle } } });
  }

  private countEnd(ended: EndedEvent): void {
    this.stats.ends += 1;
    this.stats.dropped += ended.dropped;
    this.stats.byReason[ended.reason] = (this.stats.byReason[ended.reason] ?? 0) + 1;
    if (ended.reason === "evicted") this.stats.evictions += 1;
  }

  /** @internal */
  _onEnded(ended: SessionEnded): void {
    this._state = State.Waiting;
    const reason = ended.reason;
    if (this._closing || reason === "closed") {
      this._finish(undefined);
      return;
    }
    const code = ended.code;
    if (reason === "rejected") {
      const error = new TinybrokerError(code, ended.message);
      this._lastCause = error;
      if (!this.openedOnce) {
        // A broker that cannot serve now (UNAVAILABLE): subscribe() waits,
        // until its timeout, for one that can.
        if (this.resubscribe && code === Status.UNAVAILABLE) {
          this.scheduleRetry(error.message);
          return;
        }
        this._finish(undefined, error);
        return;
      }
      if (this.resubscribe && (RETRYABLE.has(code) || code === Status.ALREADY_EXISTS)) {
        this.scheduleRetry(error.message);
        return;
      }
      this._finish(
        new SubscriptionEnded(reason, {
          code,
          message: ended.message,
          subscriptionId: this.subscriptionId,
          lastSequence: this.lastSequence,
        }),
      );
      return;
    }
    const again = this.resubscribe && reason !== "closed_by_admin";
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
      this.resuming = event;
      this.scheduleRetry(undefined);
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

  /** @internal The session failed; true to stay and be opened on the next one. */
  _onLost(failure: TinybrokerError, starting: boolean): boolean {
    const was = this._state;
    this._state = State.Waiting;
    if (this._closing) {
      this._finish(undefined);
      return false;
    }
    this._lastCause = failure;
    const retry = this.resubscribe && RETRYABLE.has(failure.code);
    if (!this.openedOnce) {
      // subscribe() waits (until its timeout) for a broker that answers.
      if (RETRYABLE.has(failure.code)) return true;
      this._finish(undefined, failure);
      return false;
    }
    if (!starting && was !== State.Waiting) {
      const event: EndedEvent = {
        type: "ended",
        subscriptionId: this.subscriptionId,
        reason: "connection_lost",
        dropped: 0,
        lastSequence: this.lastSequence,
        code: failure.code,
        message: failure.details,
        resubscribing: retry,
      };
      this.countEnd(event);
      this._emit(event);
      if (retry) this.resuming = event;
    }
    if (retry) return true;
    this._finish(
      new SubscriptionEnded("connection_lost", {
        lastSequence: this.lastSequence,
        code: failure.code,
        message: failure.details,
        subscriptionId: this.subscriptionId,
      }),
    );
    return false;
  }

  private scheduleRetry(cause: string | undefined): void {
    const delay = this.backoff.next();
    this._emit({ type: "resubscribing", subscriptionId: this.subscriptionId, delay, cause });
    this.retry = setTimeout(() => {
      this.retry = undefined;
      if (!this._closing && this._state !== State.Done && !this.session.closed) this.session.open(this);
    }, delay);
  }

  /** @internal */
  settle(message: Message, nack: boolean): boolean {
    if (
      this._state !== State.Open ||
      !this.manual ||
      message._generation !== this._generation ||
      message._handle !== this._handle
    ) {
      return false;
    }
    const value = { handle: this._handle, sequences: [message.sequence] };
    this.session.send(nack ? { request: { $case: "nack", value } } : { request: { $case: "ack", value } });
    return true;
  }

  private settleOpened(error?: Error): void {
    if (this.openSettled) return;
    this.openSettled = true;
    if (error === undefined) this.resolveOpened();
    else this.rejectOpened(error);
  }

  /** @internal */
  _finish(final: SubscriptionEnded | TinybrokerError | undefined, openError?: Error): void {
    this._state = State.Done;
    clearTimeout(this.retry);
    this.retry = undefined;
    if (this.final === undefined) this.final = final ?? CLOSED;
    if (!this.openSettled) {
      this.settleOpened(openError ?? final ?? new TinybrokerError(Status.CANCELLED, "closed before it opened"));
    }
    const closed = this.closedWaiter;
    this.closedWaiter = undefined;
    closed?.();
    const waiter = this.waiter;
    this.waiter = undefined;
    waiter?.();
  }
}
