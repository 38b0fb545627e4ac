import { status as grpcStatus } from "@grpc/grpc-js";
/**
 * The gRPC status codes (grpc-js's `status` enum): compare
 * {@link TinybrokerError.code} with them, e.g. `Status.UNAUTHENTICATED`.
 */
export const Status = grpcStatus;
/** The name of a gRPC status code (`"INVALID_ARGUMENT"`, ...). */
export function codeName(code) {
    return Status[code] ?? `CODE_${code}`;
}
/**
 * A call the broker refused or could not take. `code` is the gRPC status
 * code (compare with {@link Status}: `Status.INVALID_ARGUMENT` for a bad
 * topic, `Status.UNAUTHENTICATED` for a missing or wrong token,
 * `Status.UNAVAILABLE` when no broker answers); `details` is the broker's
 * own message, which names the bad value. `message` is both.
 */
export class TinybrokerError extends Error {
    /** The gRPC status code (a {@link Status} value). */
    code;
    /** The code's name, e.g. `"NOT_FOUND"`. */
    codeName;
    /** The broker's message (or the client's, when no broker answered). */
    details;
    /** @param code a gRPC status code; @param details what went wrong. */
    constructor(code, details) {
        super(`${codeName(code)}: ${details}`);
        this.name = "TinybrokerError";
        this.code = code;
        this.codeName = codeName(code);
        this.details = details;
    }
    /** @internal */
    static from(error) {
        if (error instanceof TinybrokerError)
            return error;
        const e = error;
        if (e && typeof e.code === "number") {
            return new TinybrokerError(e.code, e.details || e.message || `the call ended with ${codeName(e.code)}`);
        }
        return new TinybrokerError(Status.UNKNOWN, String(error?.message || error || "unknown error"));
    }
}
/**
 * The client is closed ({@link Client.close} was called): every call made
 * after it, and every `next()` or `publish()` waiting when it was called,
 * ends with this error (code CANCELLED).
 */
export class ClientClosed extends TinybrokerError {
    /** @param what what is closed (default "the client"). */
    constructor(what = "the client") {
        super(Status.CANCELLED, `${what} is closed`);
        this.name = "ClientClosed";
    }
}
/**
 * The application used the client wrongly: a second `next()` on a
 * subscription while one is waiting, a bad argument. Code
 * FAILED_PRECONDITION or INVALID_ARGUMENT.
 */
export class UsageError extends TinybrokerError {
    /** @param details what was wrong; @param code FAILED_PRECONDITION (default) or INVALID_ARGUMENT. */
    constructor(details, code = Status.FAILED_PRECONDITION) {
        super(code, details);
        this.name = "UsageError";
    }
}
/** A wait of the client's own ran out (`next({timeout})`, `flush({timeout})`, `subscribe({timeout})`): code DEADLINE_EXCEEDED. */
export class TimeoutError extends TinybrokerError {
    /** @param details what did not happen in time. */
    constructor(details) {
        super(Status.DEADLINE_EXCEEDED, details);
        this.name = "TimeoutError";
    }
}
const ACCEPTED = /(\d+) (?:earlier )?messages of this stream were accepted/;
/**
 * A {@link Publisher}'s stream ended with an error: the first bad message
 * ends it, and the messages the broker accepted before it stay published.
 */
export class PublishError extends TinybrokerError {
    /**
     * Messages the broker accepted on the stream before the error, as its
     * message says; undefined when no broker said (the connection was lost:
     * then they may or may not have been published).
     */
    accepted;
    /** @param code gRPC status; @param details the broker's message, which says how many it accepted. */
    constructor(code, details) {
        super(code, details);
        this.name = "PublishError";
        const m = ACCEPTED.exec(details);
        this.accepted = m ? Number(m[1]) : undefined;
    }
}
/** The code of an end the broker sent with code 0: an error is never OK. */
const END_CODES = {
    evicted: Status.RESOURCE_EXHAUSTED,
    shutdown: Status.UNAVAILABLE,
    closed_by_admin: Status.CANCELLED,
    connection_lost: Status.UNAVAILABLE,
};
/**
 * A subscription ended for good and will not be opened again: thrown from
 * its iteration when an admin closed it (`closed_by_admin`), or when it
 * ended (`evicted`, `shutdown`, `connection_lost`, `rejected`) and
 * re-subscription is off. Your own `close()` ends the iteration without it.
 */
export class SubscriptionEnded extends TinybrokerError {
    /** `evicted`, `closed_by_admin`, `shutdown`, `rejected` or `connection_lost`. */
    reason;
    /** Messages queued for it that were never delivered. */
    dropped;
    /** Sequence of the last message delivered to it (0: none). */
    lastSequence;
    /** The id it had. */
    subscriptionId;
    /** @internal */
    constructor(reason, opts) {
        super(opts.code || END_CODES[reason] || Status.ABORTED, opts.message || reason);
        this.name = "SubscriptionEnded";
        this.reason = reason;
        this.dropped = opts.dropped ?? 0;
        this.lastSequence = opts.lastSequence ?? 0;
        this.subscriptionId = opts.subscriptionId;
        this.message =
            `subscription ${opts.subscriptionId ?? "?"} ended: ${reason} (dropped ${this.dropped}, ` +
                `last sequence ${this.lastSequence}` +
                (opts.message ? `, ${this.codeName}: ${opts.message}` : "") +
                ")";
    }
}
