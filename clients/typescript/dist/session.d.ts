import { Message } from "./types.js";
import type { GapEvent, SubscriptionEvent, SubscriptionStats } from "./types.js";
/** The states of the client's session (docs/clients.md "The session's states"). */
export type SessionState = "IDLE" | "STARTING" | "OPEN" | "WAITING" | "CLOSED";
/** The states of a subscription (docs/clients.md "A subscription's states"). */
export type SubscriptionState = "WAITING" | "OPENING" | "OPEN" | "BACKOFF" | "DONE";
/** Options of {@link Subscription.next}. */
export interface NextOptions {
    /** Milliseconds to wait: then it rejects with a {@link TimeoutError} (DEADLINE_EXCEEDED). */
    timeout?: number;
    /** Stops waiting (rejects with the signal's reason). */
    signal?: AbortSignal;
}
/** A callback for a subscription's events. */
export type EventCallback = (event: SubscriptionEvent) => void;
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
export declare class Subscription implements AsyncIterable<Message> {
    /** Credit window: deliveries the broker may send beyond what was taken, and the most the client holds. */
    readonly window: number;
    /** Whether it is opened again after an eviction, a shutdown or a lost connection. */
    readonly resubscribe: boolean;
    /** The id the broker gave it (the one the application named, if any). */
    subscriptionId: string | undefined;
    /** Counters: received, ends, evictions, resubscribes, gaps, dropped. */
    readonly stats: SubscriptionStats;
    /** The last 100 events, oldest first. */
    readonly events: SubscriptionEvent[];
    /** The last gap reported, if any. */
    lastGap: GapEvent | undefined;
    private readonly session;
    private readonly topUp;
    private readonly onEvent;
    private buffer;
    private head;
    private waiter;
    private lastSequence;
    private lastOrigin;
    private resuming;
    private final;
    private openedOnce;
    private resolveOpened;
    private rejectOpened;
    private openSettled;
    private closedWaiter;
    private retry;
    private readonly backoff;
    private takenSinceOpen;
    private readonly manual;
    private acks;
    private nacks;
    /** Its topic patterns. */
    get patterns(): string[];
    /** Its consumer group, if any. */
    get group(): string | undefined;
    /** Its state: WAITING, OPENING, OPEN, BACKOFF or DONE (docs/clients.md). */
    get state(): SubscriptionState;
    /** Open on the broker right now. */
    get isOpen(): boolean;
    /** Ended for good: iteration stops or throws once the messages held are taken. */
    get done(): boolean;
    /** Messages received and not yet taken (never more than the window). */
    get pending(): number;
    /** Iterates its messages: `for await (const msg of sub)`. */
    [Symbol.asyncIterator](): AsyncIterator<Message>;
    /**
     * The next message. One at a time: a second call while one waits rejects
     * at once with {@link UsageError} (the first keeps waiting). Rejects with
     * {@link TimeoutError} after `timeout` ms, with {@link SubscriptionEnded}
     * when it ended for good, and with {@link ClientClosed} after
     * {@link Subscription.close} or the client's close.
     */
    next(opts?: NextOptions): Promise<Message>;
    /** A message, or undefined at the end of the iteration (closed). */
    private take;
    private wait;
    private shift;
    /**
     * Closes the subscription and waits (up to `timeout` ms) until the broker
     * has ended it (acks made before are sent first). Messages not yet taken
     * are dropped (a MANUAL group's go to another member). Iteration then
     * stops; a waiting `next()` rejects with {@link ClientClosed}.
     */
    close(timeout?: number): Promise<void>;
    /** The same as {@link Subscription.close} (the name nats.js uses). */
    unsubscribe(): Promise<void>;
    /** The first delivery after it was open again: one gap event, unless it follows the last one (docs/clients.md "Gaps"). */
    private reportGap;
    private countEnd;
    /** BACKOFF, then WAITING after the resubscribe delay. */
    private backOff;
    private settleOpened;
}
