import { Message } from "./types.js";
import type { GapEvent, SubscriptionEvent, SubscriptionStats } from "./types.js";
/** Options of {@link Subscription.next}. */
export interface NextOptions {
    /** Milliseconds to wait: then it rejects with a TinybrokerError(DEADLINE_EXCEEDED). */
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
export declare class Subscription implements AsyncIterable<Message> {
    /** Credit window: deliveries the broker may send beyond what was taken. */
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
    private readonly batch;
    private readonly onEvent;
    private buffer;
    private head;
    private waiter;
    private lastSequence;
    private resuming;
    private final;
    private openedOnce;
    private resolveOpened;
    private rejectOpened;
    private openSettled;
    private closedWaiter;
    private retry;
    private readonly backoff;
    private readonly manual;
    /** Its topic patterns. */
    get patterns(): string[];
    /** Its consumer group, if any. */
    get group(): string | undefined;
    /** Open on the broker right now (not between an end and a re-open). */
    get isOpen(): boolean;
    /** Ended for good: iteration stops or throws once the buffer is empty. */
    get done(): boolean;
    /** Messages received and not yet taken (never more than the window). */
    get pending(): number;
    /** Iterates its messages: `for await (const msg of sub)`. */
    [Symbol.asyncIterator](): AsyncIterator<Message>;
    /**
     * The next message. Rejects with TinybrokerError(DEADLINE_EXCEEDED) after
     * `timeout` ms, with {@link SubscriptionEnded} when it ended for good, and
     * with TinybrokerError(CANCELLED) after {@link Subscription.close}.
     */
    next(opts?: NextOptions): Promise<Message>;
    private take;
    private wait;
    private shift;
    /**
     * Closes the subscription and waits (up to `timeout` ms) until the broker
     * has ended it (acks sent before have then been applied). Messages not yet
     * taken are dropped (a MANUAL group's go to another member). Iteration then
     * stops.
     */
    close(timeout?: number): Promise<void>;
    /** The same as {@link Subscription.close} (the name nats.js uses). */
    unsubscribe(): Promise<void>;
    private countEnd;
    private scheduleRetry;
    private settleOpened;
}
