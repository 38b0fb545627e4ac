import { status as grpcStatus } from "@grpc/grpc-js";
/**
 * The gRPC status codes (grpc-js's `status` enum): compare
 * {@link TinybrokerError.code} with them, e.g. `Status.UNAUTHENTICATED`.
 */
export declare const Status: typeof grpcStatus;
/** A gRPC status code. */
export type Status = grpcStatus;
/** The name of a gRPC status code (`"INVALID_ARGUMENT"`, ...). */
export declare function codeName(code: number): string;
/**
 * A call the broker refused or could not take. `code` is the gRPC status
 * code (compare with {@link Status}: `Status.INVALID_ARGUMENT` for a bad
 * topic, `Status.UNAUTHENTICATED` for a missing or wrong token,
 * `Status.UNAVAILABLE` when no broker answers); `details` is the broker's
 * own message, which names the bad value. `message` is both.
 */
export declare class TinybrokerError extends Error {
    /** The gRPC status code (a {@link Status} value). */
    readonly code: number;
    /** The code's name, e.g. `"NOT_FOUND"`. */
    readonly codeName: string;
    /** The broker's message (or the client's, when no broker answered). */
    readonly details: string;
    /** @param code a gRPC status code; @param details what went wrong. */
    constructor(code: number, details: string);
}
/**
 * The client is closed ({@link Client.close} was called): every call made
 * after it, and every `next()` or `publish()` waiting when it was called,
 * ends with this error (code CANCELLED).
 */
export declare class ClientClosed extends TinybrokerError {
    /** @param what what is closed (default "the client"). */
    constructor(what?: string);
}
/**
 * The application used the client wrongly: a second `next()` on a
 * subscription while one is waiting, a bad argument. Code
 * FAILED_PRECONDITION or INVALID_ARGUMENT.
 */
export declare class UsageError extends TinybrokerError {
    /** @param details what was wrong; @param code FAILED_PRECONDITION (default) or INVALID_ARGUMENT. */
    constructor(details: string, code?: number);
}
/** A wait of the client's own ran out (`next({timeout})`, `flush({timeout})`, `subscribe({timeout})`): code DEADLINE_EXCEEDED. */
export declare class TimeoutError extends TinybrokerError {
    /** @param details what did not happen in time. */
    constructor(details: string);
}
/**
 * A {@link Publisher}'s stream ended with an error: the first bad message
 * ends it, and the messages the broker accepted before it stay published.
 */
export declare class PublishError extends TinybrokerError {
    /**
     * Messages the broker accepted on the stream before the error, as its
     * message says; undefined when no broker said (the connection was lost:
     * then they may or may not have been published).
     */
    readonly accepted: number | undefined;
    /** @param code gRPC status; @param details the broker's message, which says how many it accepted. */
    constructor(code: number, details: string);
}
/**
 * A subscription ended for good and will not be opened again: thrown from
 * its iteration when an admin closed it (`closed_by_admin`), or when it
 * ended (`evicted`, `shutdown`, `connection_lost`, `rejected`) and
 * re-subscription is off. Your own `close()` ends the iteration without it.
 */
export declare class SubscriptionEnded extends TinybrokerError {
    /** `evicted`, `closed_by_admin`, `shutdown`, `rejected` or `connection_lost`. */
    readonly reason: string;
    /** Messages queued for it that were never delivered. */
    readonly dropped: number;
    /** Sequence of the last message delivered to it (0: none). */
    readonly lastSequence: number;
    /** The id it had. */
    readonly subscriptionId: string | undefined;
}
