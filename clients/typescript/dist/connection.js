// Addresses, TLS, the token and the one gRPC channel (one HTTP/2
// connection) a client uses; with several addresses, the next one is tried
// when the current one stops answering.
import { readFileSync } from "node:fs";
import * as grpc from "@grpc/grpc-js";
import { AdminClient } from "./gen/tinybroker/v1/admin.js";
import { BrokerClient } from "./gen/tinybroker/v1/broker.js";
import { Status, TinybrokerError } from "./errors.js";
/** Where a client connects when given no address and no `TINYBROKER_ADDR`. */
export const DEFAULT_ADDR = "127.0.0.1:50051";
// grpc-js's own reconnect backoff starts at 1 s and grows to 120 s: a
// channel that saw its broker go away would refuse calls for seconds after
// it is back. docs/clients.md: CONNECT_DELAY_FIRST, at most CONNECT_DELAY_CAP.
const CHANNEL_OPTIONS = {
    "grpc.max_receive_message_length": -1,
    "grpc.max_send_message_length": -1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 250,
    "grpc.keepalive_time_ms": 20000,
    "grpc.keepalive_timeout_ms": 10000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.enable_retries": 0,
    // One client is one HTTP/2 connection, not shared with other clients.
    "grpc.use_local_subchannel_pool": 1,
};
/** @internal */
export function targetString(t) {
    return (t.tls ? "https://" : "http://") + t.address;
}
/**
 * Parses `host:port`, `http://host:port`, `https://host:port`, a
 * comma-separated string of them, or a list; undefined reads
 * `TINYBROKER_ADDR` (default `127.0.0.1:50051`).
 * @internal
 */
export function parseTargets(addr) {
    if (addr === undefined || addr === "" || (Array.isArray(addr) && addr.length === 0)) {
        addr = process.env.TINYBROKER_ADDR || DEFAULT_ADDR;
    }
    const items = typeof addr === "string" ? addr.split(",") : [...addr].flatMap((a) => a.split(","));
    const targets = [];
    for (let item of items) {
        item = item.trim().replace(/\/+$/, "");
        if (!item)
            continue;
        let tls = false;
        if (item.startsWith("https://")) {
            tls = true;
            item = item.slice("https://".length);
        }
        else if (item.startsWith("http://")) {
            item = item.slice("http://".length);
        }
        else if (item.includes("://")) {
            throw new TypeError(`broker address ${JSON.stringify(item)}: the scheme must be http:// or https://`);
        }
        const afterBracket = item.slice(item.lastIndexOf("]") + 1);
        if (!afterBracket.includes(":"))
            item += tls ? ":443" : ":50051";
        targets.push({ address: item, tls });
    }
    if (targets.length === 0)
        throw new TypeError(`no broker address in ${JSON.stringify(addr)}`);
    return targets;
}
/** @internal The current channel and its stubs. */
export class Connection {
    targets;
    index = 0;
    metadata;
    ca;
    options;
    channel;
    broker;
    admin;
    failovers = 0;
    constructor(targets, opts) {
        this.targets = targets;
        this.metadata = new grpc.Metadata();
        if (opts.token)
            this.metadata.set("authorization", `Bearer ${opts.token}`);
        if (opts.ca !== undefined)
            this.ca = Buffer.from(opts.ca);
        else if (opts.caFile !== undefined)
            this.ca = readFileSync(opts.caFile);
        this.options = { ...CHANNEL_OPTIONS, ...(opts.channelOptions ?? {}) };
    }
    get target() {
        return this.targets[this.index];
    }
    open() {
        const target = this.target;
        const credentials = target.tls ? grpc.credentials.createSsl(this.ca ?? null) : grpc.credentials.createInsecure();
        const channel = new grpc.Channel(target.address, credentials, this.options);
        this.channel = channel;
        const override = { channelOverride: channel };
        this.broker = new BrokerClient(target.address, credentials, override);
        this.admin = new AdminClient(target.address, credentials, override);
    }
    /** Tries each address in turn until one is READY within `timeout` ms; TinybrokerError(UNAVAILABLE) otherwise. */
    async connect(timeout, signal) {
        const failures = [];
        for (let i = 0; i < this.targets.length; i++) {
            this.index = i;
            this.open();
            const outcome = await ready(this.channel, timeout, signal);
            if (outcome === undefined)
                return;
            failures.push(`${targetString(this.target)}: ${outcome}`);
            this.channel.close();
            if (signal?.aborted)
                break;
        }
        this.channel = undefined;
        const hint = this.targets.some((t) => t.tls)
            ? " (for https://, check the CA file and that the broker serves TLS)"
            : "";
        throw new TinybrokerError(signal?.aborted ? Status.CANCELLED : Status.UNAVAILABLE, "cannot connect: " + failures.join("; ") + hint);
    }
    /** Whether the channel has failed to reach its broker. */
    down() {
        return (this.channel === undefined ||
            this.channel.getConnectivityState(false) === grpc.connectivityState.TRANSIENT_FAILURE);
    }
    /** Moves to the next address of a list (no-op with one address). */
    failover() {
        if (this.targets.length < 2)
            return;
        const old = this.channel;
        this.index = (this.index + 1) % this.targets.length;
        this.failovers += 1;
        this.open();
        old?.close();
    }
    close() {
        this.channel?.close();
        this.channel = undefined;
    }
}
/** undefined once the channel is READY; why not, when it fails or times out. */
function ready(channel, timeout, signal) {
    const deadline = Date.now() + timeout;
    return new Promise((resolve) => {
        signal?.addEventListener("abort", () => resolve("aborted"), { once: true });
        const step = () => {
            if (signal?.aborted)
                return resolve("aborted");
            const state = channel.getConnectivityState(true);
            if (state === grpc.connectivityState.READY)
                return resolve(undefined);
            if (state === grpc.connectivityState.TRANSIENT_FAILURE)
                return resolve("connection failed");
            if (state === grpc.connectivityState.SHUTDOWN)
                return resolve("channel closed");
            if (Date.now() >= deadline)
                return resolve(`no connection within ${timeout} ms`);
            channel.watchConnectivityState(state, deadline, (err) => {
                if (err)
                    return resolve(`no connection within ${timeout} ms`);
                step();
            });
        };
        step();
    });
}
