import { ClientClosed, Status, TinybrokerError } from "./errors.js";
function time(ts) {
    if (ts === undefined || (ts.seconds === 0 && ts.nanos === 0))
        return undefined;
    return new Date(ts.seconds * 1000 + Math.floor(ts.nanos / 1e6));
}
function seconds(d) {
    return d === undefined ? undefined : d.seconds + d.nanos / 1e9;
}
/** @internal Runs one unary call with a deadline and an AbortSignal. */
export function unary(method, self, request, metadata, opts, onError) {
    const signal = opts?.signal;
    if (signal?.aborted)
        return Promise.reject(new TinybrokerError(Status.CANCELLED, "aborted"));
    return new Promise((resolve, reject) => {
        const deadline = Date.now() + (opts?.timeout ?? 10_000);
        let onAbort;
        const call = method.call(self, request, metadata, { deadline }, (err, response) => {
            if (onAbort !== undefined)
                signal.removeEventListener("abort", onAbort);
            if (err) {
                const e = TinybrokerError.from(err);
                onError?.(e);
                reject(e);
            }
            else
                resolve(response);
        });
        if (signal !== undefined) {
            onAbort = () => call.cancel();
            signal.addEventListener("abort", onAbort, { once: true });
        }
    });
}
/**
 * `client.admin`: the broker's Admin service (needs the token when the
 * broker has one). Each method rejects with a {@link TinybrokerError}
 * carrying the gRPC code on failure, and with {@link ClientClosed} once the
 * client is closed.
 */
export class Admin {
    conn;
    onError;
    isClosed;
    /** @internal */
    constructor(conn, onError, isClosed) {
        this.conn = conn;
        this.onError = onError;
        this.isClosed = isClosed;
    }
    call(name, request, opts) {
        if (this.isClosed())
            return Promise.reject(new ClientClosed());
        const conn = this.conn();
        const admin = conn.admin;
        return unary(admin[name], conn.admin, request, conn.metadata, opts, this.onError);
    }
    /** Every open subscription (of the whole cluster in cluster mode). */
    async subscriptions(opts) {
        const r = await this.call("listSubscriptions", {}, opts);
        return r.subscriptions.map((s) => ({
            subscriptionId: s.subscriptionId,
            mode: s.mode === 2 ? "single" : "multi",
            consumerGroup: s.consumerGroup,
            topicPatterns: s.topicPatterns,
            queueDepth: s.queueDepth,
            capacity: s.capacity,
            delivered: s.delivered,
            openedAt: time(s.openedAt),
            peerAddress: s.peerAddress,
            ackMode: s.ackMode === 2 ? "manual" : "auto",
            replicaId: s.replicaId,
            unacked: s.unacked,
            oldestUnackedAge: seconds(s.oldestUnackedAge),
        }));
    }
    /** Every consumer group, including memberless ones holding a backlog. */
    async groups(opts) {
        const r = await this.call("listConsumerGroups", {}, opts);
        return r.groups.map((g) => ({
            name: g.name,
            topicPatterns: g.topicPatterns,
            members: g.members,
            backlog: g.backlog,
            inFlight: g.inFlight,
            redeliveries: g.redeliveries,
            deadLettered: g.deadLettered,
            dropped: g.dropped,
            oldestUnackedAge: seconds(g.oldestUnackedAge),
        }));
    }
    /** The most recent evictions (slow consumers), newest first. */
    async evictions(opts) {
        const r = await this.call("listEvictions", {}, opts);
        return r.evictions.map((e) => ({
            subscriptionId: e.subscriptionId,
            evictedAt: time(e.evictedAt),
            topicPatterns: e.topicPatterns,
            queueDepth: e.queueDepth,
            lastDeliveredSequence: e.lastDeliveredSequence,
            peerAddress: e.peerAddress,
            replicaId: e.replicaId,
        }));
    }
    /** Version, uptime, effective limits and counters. */
    async info(opts) {
        const r = await this.call("getBrokerInfo", {}, opts);
        return {
            version: r.version,
            uptime: seconds(r.uptime) ?? 0,
            startedAt: time(r.startedAt),
            limits: r.limits,
            subscriptions: r.subscriptions,
            consumerGroups: r.consumerGroups,
            lastSequence: r.lastSequence,
            authEnabled: r.authEnabled,
            tlsEnabled: r.tlsEnabled,
            clusterMode: r.clusterMode,
            replicaId: r.replicaId,
            natsServer: r.natsServer,
            messagesPublished: r.messagesPublished,
            messagesDelivered: r.messagesDelivered,
        };
    }
    /** Closes one subscription by id (NOT_FOUND if none); its client hears `closed_by_admin` and does not re-subscribe. */
    async closeSubscription(subscriptionId, opts) {
        await this.call("closeSubscription", { subscriptionId }, opts);
    }
}
