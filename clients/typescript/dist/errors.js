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
        if (e && typeof e.code === "number")
            return new TinybrokerError(e.code, e.details ?? e.message ?? "");
        return new TinybrokerError(Status.UNKNOWN, String(error?.message ?? error));
    }
}
/**
 * A {@link Publisher}'s stream ended with an error: the first bad message
 * ends it, and the messages written before it stay published.
 */
export class PublishError extends TinybrokerError {
    /** Messages this client wrote on the stream before the error (the broker's message says how many it accepted). */
    accepted;
    /** @param code gRPC status; @param details the broker's message; @param accepted messages written before. */
    constructor(code, details, accepted) {
        super(code, details);
        this.name = "PublishError";
        this.accepted = accepted;
    }
}
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
        super(opts.code ?? Status.OK, opts.message || reason);
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
