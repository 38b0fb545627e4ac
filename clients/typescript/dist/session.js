import { targetString } from "./connection.js";
import { Status, SubscriptionEnded, TinybrokerError } from "./errors.js";
import { AckMode as PbAckMode } from "./gen/tinybroker/v1/broker.js";
import { Message } from "./types.js";
/** How long (ms) the broker has to accept a session (it answers at once). */
const START_TIMEOUT = 10_000;
const RETRYABLE = new Set([
    Status.UNAVAILABLE,
    Status.UNKNOWN,
    Status.CANCELLED,
    Status.ABORTED,
    Status.DEADLINE_EXCEEDED,
    Status.INTERNAL,
]);
/** @internal Exponential backoff with jitter: 100 ms doubling to `cap` ms, each delay 0-25 % longer at random. */
export class Backoff {
    first;
    cap;
    next_;
    constructor(first = 100, cap = 2000) {
        this.first = first;
        this.cap = cap;
        this.next_ = first;
    }
    reset() {
        this.next_ = this.first;
    }
    next() {
        const delay = this.next_ * (1 + Math.random() * 0.25);
        this.next_ = Math.min(this.next_ * 2, this.cap);
        return Math.round(delay);
    }
}
class StartFailed extends Error {
    error;
    constructor(error) {
        super(error.message);
        this.error = error;
    }
}
/** An open was refused UNAVAILABLE (a replica that lost NATS, a broker shutting down) while the client knows other addresses. */
class ReplicaUnavailable extends Error {
    error;
    constructor(error) {
        super(error.message);
        this.error = error;
    }
}
/** @internal The one Session stream of a client, and its subscriptions by handle. */
export class Session {
    conn;
    subs = new Map();
    lastHandle = 0;
    call;
    /** The stream is accepted: requests can be written. */
    live = false;
    running;
    wake;
    sleeping;
    closed = false;
    backoff = new Backoff();
    /** Sessions started after the first (the connection was lost and found again). */
    reconnects = 0;
    started = 0;
    constructor(conn) {
        this.conn = conn;
    }
    // === the application's side ===
    /** Opens `sub` under a new handle, now or on the next session. */
    open(sub) {
        const handle = this.nextHandle();
        sub._handle = handle;
        sub._state = 0 /* State.Waiting */;
        this.subs.set(handle, sub);
        if (this.live) {
            this.sendOpen(sub);
        }
        else {
            if (this.running === undefined)
                this.running = this.run();
            this.wake?.();
        }
    }
    send(request) {
        if (this.live && this.call !== undefined)
            this.call.write(request);
    }
    forget(sub) {
        if (this.subs.get(sub._handle) === sub)
            this.subs.delete(sub._handle);
    }
    /** Half-closes the session (the broker ends every subscription "closed" and then the stream) and ends the loop. */
    async close(timeout = 2000) {
        this.closed = true;
        for (const sub of this.subs.values())
            sub._closing = true;
        this.wake?.();
        if (this.sleeping) {
            clearTimeout(this.sleeping.timer);
            this.sleeping.resolve();
        }
        const call = this.call;
        if (this.live && call !== undefined && this.running !== undefined) {
            call.end();
            let timer;
            await Promise.race([
                this.running.catch(() => undefined),
                new Promise((r) => (timer = setTimeout(r, timeout))),
            ]);
            clearTimeout(timer);
        }
        if (this.call !== undefined)
            this.call.cancel();
        await this.running?.catch(() => undefined);
        for (const sub of [...this.subs.values()])
            sub._finish(undefined);
        this.subs.clear();
    }
    // === the loop ===
    nextHandle() {
        for (;;) {
            this.lastHandle = (this.lastHandle % 0xffffffff) + 1;
            if (!this.subs.has(this.lastHandle))
                return this.lastHandle;
        }
    }
    sendOpen(sub) {
        sub._generation += 1;
        sub._state = 1 /* State.Opening */;
        sub._taken = 0;
        // What it still holds from before counts against its window: the client
        // never holds more than the window (credit 0 would mean no limit).
        const credit = Math.max(1, sub.window - sub.pending);
        this.call.write({
            request: { $case: "open", value: { handle: sub._handle, subscription: sub._request, credit } },
        });
    }
    sleep(ms) {
        return new Promise((resolve) => {
            const timer = setTimeout(() => {
                this.sleeping = undefined;
                resolve();
            }, ms);
            this.sleeping = { timer, resolve };
        });
    }
    async run() {
        while (!this.closed) {
            let waiting = false;
            for (const s of this.subs.values())
                if (s._state === 0 /* State.Waiting */)
                    waiting = true;
            if (!waiting) {
                await new Promise((r) => (this.wake = r));
                this.wake = undefined;
                continue;
            }
            let failure;
            let starting = false;
            let moving = false;
            try {
                await this.serve();
                if (this.closed)
                    return;
                failure = new TinybrokerError(Status.UNAVAILABLE, "the broker ended the session");
            }
            catch (e) {
                if (e instanceof StartFailed) {
                    failure = e.error;
                    starting = true;
                }
                else if (e instanceof ReplicaUnavailable) {
                    failure = e.error;
                    moving = true;
                }
                else {
                    failure = TinybrokerError.from(e);
                }
            }
            finally {
                this.live = false;
                const call = this.call;
                this.call = undefined;
                call?.cancel();
            }
            if (this.closed)
                return;
            if (moving)
                this.conn.failover();
            if (this.subs.size === 0)
                continue; // every subscription had ended before (a shutdown)
            this.lost(failure, starting);
            if (this.subs.size === 0)
                continue;
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
            if (!moving &&
                RETRYABLE.has(failure.code) &&
                (this.conn.down() || starting || this.conn.targets.length > 1)) {
                this.conn.failover();
            }
        }
    }
    serve() {
        return new Promise((resolve, reject) => {
            const conn = this.conn;
            const call = conn.broker.session(conn.metadata);
            this.call = call;
            let accepted = false;
            let settled = false;
            const fail = (e) => {
                if (settled)
                    return;
                settled = true;
                clearTimeout(timer);
                reject(e);
            };
            const timer = setTimeout(() => {
                fail(new StartFailed(new TinybrokerError(Status.DEADLINE_EXCEEDED, `${targetString(conn.target)} did not accept a session within ${START_TIMEOUT / 1000} s`)));
            }, START_TIMEOUT);
            call.on("metadata", () => {
                if (settled || accepted)
                    return;
                clearTimeout(timer);
                accepted = true;
                this.live = true;
                this.started += 1;
                if (this.started > 1)
                    this.reconnects += 1;
                for (const sub of this.subs.values())
                    if (sub._state === 0 /* State.Waiting */)
                        this.sendOpen(sub);
            });
            const subs = this.subs;
            call.on("data", (event) => {
                if (settled)
                    return;
                const e = event.event;
                if (e === undefined)
                    return;
                switch (e.$case) {
                    case "delivery": {
                        const message = e.value.message;
                        if (message === undefined)
                            return;
                        for (const handle of e.value.handles)
                            subs.get(handle)?._deliver(message, handle);
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
                            fail(new ReplicaUnavailable(new TinybrokerError(Status.UNAVAILABLE, `${targetString(conn.target)}: ${ended.message}`)));
                        }
                        return;
                    }
                }
            });
            call.on("error", (err) => {
                const error = TinybrokerError.from(err);
                if (!accepted) {
                    fail(new StartFailed(new TinybrokerError(error.code, `${targetString(conn.target)}: ${error.details}`)));
                }
                else {
                    fail(error);
                }
            });
            call.on("status", (s) => {
                if (s.code === Status.OK && !settled) {
                    settled = true;
                    clearTimeout(timer);
                    resolve();
                }
            });
        });
    }
    lost(failure, starting) {
        for (const [handle, sub] of [...this.subs]) {
            if (!sub._onLost(failure, starting))
                this.subs.delete(handle);
        }
    }
}
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
export class Subscription {
    /** Credit window: deliveries the broker may send beyond what was taken. */
    window;
    /** Whether it is opened again after an eviction, a shutdown or a lost connection. */
    resubscribe;
    /** The id the broker gave it (the one the application named, if any). */
    subscriptionId;
    /** Counters: received, ends, evictions, resubscribes, gaps, dropped. */
    stats = {
        received: 0,
        ends: 0,
        evictions: 0,
        resubscribes: 0,
        gaps: 0,
        dropped: 0,
        byReason: {},
    };
    /** The last 100 events, oldest first. */
    events = [];
    /** The last gap reported, if any. */
    lastGap;
    /** @internal */ _request;
    /** @internal */ _handle = 0;
    /** @internal */ _state = 0 /* State.Waiting */;
    /** @internal */ _generation = 0;
    /** @internal */ _taken = 0;
    /** @internal */ _closing = false;
    /** @internal */ _lastCause;
    /** @internal */ _opened;
    session;
    batch;
    onEvent;
    buffer = [];
    head = 0;
    waiter;
    lastSequence = 0;
    resuming;
    final;
    openedOnce = false;
    resolveOpened;
    rejectOpened;
    openSettled = false;
    closedWaiter;
    retry;
    backoff = new Backoff();
    manual;
    /** @internal */
    constructor(session, request, opts) {
        if (!(opts.window >= 1))
            throw new RangeError("window must be at least 1");
        this.session = session;
        this._request = request;
        this.window = opts.window;
        this.batch = Math.max(1, Math.floor(opts.window / 4));
        this.resubscribe = opts.resubscribe;
        this.onEvent = opts.onEvent;
        this.subscriptionId = request.subscriptionId || undefined;
        this.manual = request.ackMode === PbAckMode.ACK_MODE_MANUAL;
        this._opened = new Promise((resolve, reject) => {
            this.resolveOpened = resolve;
            this.rejectOpened = reject;
        });
        this._opened.catch(() => undefined); // nobody may wait for it (a timed-out subscribe)
    }
    // --- what the application sees ---
    /** Its topic patterns. */
    get patterns() {
        return [...this._request.topicPatterns];
    }
    /** Its consumer group, if any. */
    get group() {
        return this._request.consumerGroup || undefined;
    }
    /** Open on the broker right now (not between an end and a re-open). */
    get isOpen() {
        return this._state === 2 /* State.Open */;
    }
    /** Ended for good: iteration stops or throws once the buffer is empty. */
    get done() {
        return this._state === 3 /* State.Done */;
    }
    /** Messages received and not yet taken (never more than the window). */
    get pending() {
        return this.buffer.length - this.head;
    }
    /** Iterates its messages: `for await (const msg of sub)`. */
    [Symbol.asyncIterator]() {
        return {
            next: async () => {
                const m = await this.take();
                return m === undefined ? { done: true, value: undefined } : { done: false, value: m };
            },
            // Leaving the loop does not close the subscription.
            return: async () => ({ done: true, value: undefined }),
        };
    }
    /**
     * The next message. Rejects with TinybrokerError(DEADLINE_EXCEEDED) after
     * `timeout` ms, with {@link SubscriptionEnded} when it ended for good, and
     * with TinybrokerError(CANCELLED) after {@link Subscription.close}.
     */
    async next(opts = {}) {
        const m = await this.take(opts.timeout, opts.signal);
        if (m === undefined)
            throw new TinybrokerError(Status.CANCELLED, "the subscription is closed");
        return m;
    }
    take(timeout, signal) {
        if (this.head < this.buffer.length)
            return this.shift();
        return this.wait(timeout, signal);
    }
    async wait(timeout, signal) {
        for (;;) {
            if (this.head < this.buffer.length)
                return this.shift();
            const final = this.final;
            if (final !== undefined) {
                if (final === CLOSED)
                    return undefined;
                throw final;
            }
            if (this.waiter !== undefined)
                throw new Error("only one next() at a time on a subscription");
            signal?.throwIfAborted();
            let timer;
            let onAbort;
            try {
                await new Promise((resolve, reject) => {
                    this.waiter = resolve;
                    if (timeout !== undefined) {
                        timer = setTimeout(() => reject(new TinybrokerError(Status.DEADLINE_EXCEEDED, `no message on ${this.subscriptionId ?? "the subscription"} within ${timeout} ms`)), timeout);
                    }
                    if (signal !== undefined) {
                        onAbort = () => reject(signal.reason);
                        signal.addEventListener("abort", onAbort, { once: true });
                    }
                });
            }
            finally {
                this.waiter = undefined;
                clearTimeout(timer);
                if (onAbort !== undefined)
                    signal.removeEventListener("abort", onAbort);
            }
        }
    }
    shift() {
        const message = this.buffer[this.head];
        this.head += 1;
        if (this.head === this.buffer.length) {
            this.buffer = [];
            this.head = 0;
        }
        else if (this.head >= 1024 && this.head * 2 >= this.buffer.length) {
            this.buffer = this.buffer.slice(this.head);
            this.head = 0;
        }
        this.stats.received += 1;
        if (this._state === 1 /* State.Opening */ || this._state === 2 /* State.Open */) {
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
    async close(timeout = 5000) {
        if (this._state === 3 /* State.Done */)
            return;
        this._closing = true;
        clearTimeout(this.retry);
        this.retry = undefined;
        this.buffer = [];
        this.head = 0;
        if ((this._state === 1 /* State.Opening */ || this._state === 2 /* State.Open */) && this.session.live) {
            let timer;
            const closed = new Promise((r) => {
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
    unsubscribe() {
        return this.close();
    }
    // --- what the session calls ---
    /** @internal */
    _emit(event) {
        this.events.push(event);
        if (this.events.length > 100)
            this.events.shift();
        if (this.onEvent !== undefined) {
            try {
                this.onEvent(event);
            }
            catch (e) {
                console.error("tinybroker: onEvent callback failed", e);
            }
        }
    }
    /** @internal */
    _deliver(raw, handle) {
        if (this.resuming !== undefined) {
            const ended = this.resuming;
            this.resuming = undefined;
            const gap = {
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
    _onOpened(subscriptionId) {
        this._state = 2 /* State.Open */;
        this.subscriptionId = subscriptionId;
        this._lastCause = undefined;
        if (!this.openedOnce) {
            this.openedOnce = true;
            this.settleOpened();
            this._emit({ type: "opened", subscriptionId });
        }
        else {
            this.backoff.reset();
            this.stats.resubscribes += 1;
            this._emit({ type: "resubscribed", subscriptionId });
        }
        if (this._closing)
            this.session.send({ request: { $case: "close", value: { handle: this._handle } } });
    }
    countEnd(ended) {
        this.stats.ends += 1;
        this.stats.dropped += ended.dropped;
        this.stats.byReason[ended.reason] = (this.stats.byReason[ended.reason] ?? 0) + 1;
        if (ended.reason === "evicted")
            this.stats.evictions += 1;
    }
    /** @internal */
    _onEnded(ended) {
        this._state = 0 /* State.Waiting */;
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
            this._finish(new SubscriptionEnded(reason, {
                code,
                message: ended.message,
                subscriptionId: this.subscriptionId,
                lastSequence: this.lastSequence,
            }));
            return;
        }
        const again = this.resubscribe && reason !== "closed_by_admin";
        const last = Math.max(ended.lastSequence, this.lastSequence);
        const event = {
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
        }
        else {
            this._finish(new SubscriptionEnded(reason, {
                dropped: ended.dropped,
                lastSequence: last,
                code,
                message: ended.message,
                subscriptionId: this.subscriptionId,
            }));
        }
    }
    /** @internal The session failed; true to stay and be opened on the next one. */
    _onLost(failure, starting) {
        const was = this._state;
        this._state = 0 /* State.Waiting */;
        if (this._closing) {
            this._finish(undefined);
            return false;
        }
        this._lastCause = failure;
        const retry = this.resubscribe && RETRYABLE.has(failure.code);
        if (!this.openedOnce) {
            // subscribe() waits (until its timeout) for a broker that answers.
            if (RETRYABLE.has(failure.code))
                return true;
            this._finish(undefined, failure);
            return false;
        }
        if (!starting && was !== 0 /* State.Waiting */) {
            const event = {
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
            if (retry)
                this.resuming = event;
        }
        if (retry)
            return true;
        this._finish(new SubscriptionEnded("connection_lost", {
            lastSequence: this.lastSequence,
            code: failure.code,
            message: failure.details,
            subscriptionId: this.subscriptionId,
        }));
        return false;
    }
    scheduleRetry(cause) {
        const delay = this.backoff.next();
        this._emit({ type: "resubscribing", subscriptionId: this.subscriptionId, delay, cause });
        this.retry = setTimeout(() => {
            this.retry = undefined;
            if (!this._closing && this._state !== 3 /* State.Done */ && !this.session.closed)
                this.session.open(this);
        }, delay);
    }
    /** @internal */
    settle(message, nack) {
        if (this._state !== 2 /* State.Open */ ||
            !this.manual ||
            message._generation !== this._generation ||
            message._handle !== this._handle) {
            return false;
        }
        const value = { handle: this._handle, sequences: [message.sequence] };
        this.session.send(nack ? { request: { $case: "nack", value } } : { request: { $case: "ack", value } });
        return true;
    }
    settleOpened(error) {
        if (this.openSettled)
            return;
        this.openSettled = true;
        if (error === undefined)
            this.resolveOpened();
        else
            this.rejectOpened(error);
    }
    /** @internal */
    _finish(final, openError) {
        this._state = 3 /* State.Done */;
        clearTimeout(this.retry);
        this.retry = undefined;
        if (this.final === undefined)
            this.final = final ?? CLOSED;
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
