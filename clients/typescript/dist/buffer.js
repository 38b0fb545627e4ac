// The client's publish buffer (docs/clients.md "Publishing"): messages
// published and not yet written, written to the session as SessionPublish
// batches, and the outcome of every message until a flush() reports it.
import { BATCHES_IN_FLIGHT } from "./constants.js";
import { ClientClosed, Status, TimeoutError, TinybrokerError } from "./errors.js";
const RESOLVED = Promise.resolve();
/**
 * Encoded size of `request` as an element of `SessionPublish.messages`, an
 * upper bound: each length prefix counted at its largest (5 bytes).
 * @internal
 */
export function encodedSize(request) {
    let size = 12 + Buffer.byteLength(request.topic) + request.payload.length;
    for (const key in request.headers) {
        size += 17 + Buffer.byteLength(key) + Buffer.byteLength(request.headers[key]);
    }
    return size;
}
/**
 * @internal The bounded buffer of published messages and their outcomes.
 *
 * `publish()` appends while the buffer holds less than `limit` bytes and
 * resolves at once; when it holds more, the message waits (its promise
 * pending) in a queue of waiting publishers, in order, and enters the
 * buffer once batches written make room. That queue is bounded too, by
 * another `limit` bytes: beyond it `publish()` rejects at once with
 * RESOURCE_EXHAUSTED (a caller that does not await its publishes is told,
 * not buffered without bound, and nothing is dropped silently). So the
 * client never holds more than twice `limit` (plus one larger message) of
 * publishes that are not written.
 */
export class PublishBuffer {
    writer;
    limit;
    batchMessages;
    batchBytes;
    /** Messages in the buffer (not written), oldest first, from `head`. */
    queue = [];
    head = 0;
    /** Their encoded bytes. */
    bytes = 0;
    /** Publishers waiting for room, oldest first. */
    waiting = [];
    waitingHead = 0;
    waitingBytes = 0;
    /** The index the next published message gets. */
    nextIndex = 0;
    /** Every index below it has an outcome (batches are answered in order). */
    settled = 0;
    inFlight = [];
    nextId = 1;
    scheduled;
    flushes = [];
    // The outcomes since the previous flush.
    accepted = 0;
    rejected = [];
    unconfirmed = 0;
    unconfirmedIndexes = [];
    closed = false;
    /** Messages and payload bytes written (the client's stats). */
    messagesOut = 0;
    bytesOut = 0;
    constructor(writer, 
    /** BUFFER_BYTES. */
    limit, 
    /** BATCH_MESSAGES and BATCH_BYTES, set from the broker's limits once known. */
    batchMessages, batchBytes) {
        this.writer = writer;
        this.limit = limit;
        this.batchMessages = batchMessages;
        this.batchBytes = batchBytes;
    }
    /** Messages not written (in the buffer and waiting for room). */
    get pendingMessages() {
        return this.queue.length - this.head + this.waiting.length - this.waitingHead;
    }
    /** Their encoded bytes. */
    get pendingBytes() {
        return this.bytes + this.waitingBytes;
    }
    /** Whether anything waits to be written. */
    get hasPending() {
        return this.head < this.queue.length;
    }
    /** Appends one message (see the class comment for when it waits or is refused). */
    publish(request) {
        if (this.closed)
            return Promise.reject(new ClientClosed());
        const size = encodedSize(request);
        if (this.waitingHead === this.waiting.length && this.bytes < this.limit) {
            this.queue.push({ index: this.nextIndex++, request, size });
            this.bytes += size;
            this.schedule();
            return RESOLVED;
        }
        if (this.waitingBytes >= this.limit) {
            return Promise.reject(new TinybrokerError(Status.RESOURCE_EXHAUSTED, `the publish buffer holds ${this.bytes} bytes (limit ${this.limit}) and ${this.waitingBytes} more wait ` +
                "for room: await publish() (or flush()) before publishing more"));
        }
        return new Promise((resolve, reject) => {
            this.waiting.push({ index: this.nextIndex++, request, size, resolve, reject });
            this.waitingBytes += size;
        });
    }
    /** Writes full batches now and the rest on the next turn of the event loop. */
    schedule() {
        if (this.queue.length - this.head >= this.batchMessages || this.bytes >= this.batchBytes)
            this.write(true);
        if (this.scheduled === undefined) {
            this.scheduled = setImmediate(() => {
                this.scheduled = undefined;
                this.write(false);
            });
        }
    }
    /**
     * Writes batches while the session is open and fewer than
     * BATCHES_IN_FLIGHT are unanswered; with `onlyFull`, only full ones.
     */
    write(onlyFull) {
        while (this.writer.writable() && this.inFlight.length < BATCHES_IN_FLIGHT && this.head < this.queue.length) {
            const start = this.head;
            let end = start;
            let bytes = 0;
            while (end < this.queue.length &&
                end - start < this.batchMessages &&
                (end === start || bytes + this.queue[end].size <= this.batchBytes)) {
                bytes += this.queue[end].size;
                end += 1;
            }
            const full = end < this.queue.length || end - start >= this.batchMessages;
            if (onlyFull && !full)
                break;
            const messages = new Array(end - start);
            const topics = new Array(end - start);
            let payloadBytes = 0;
            for (let i = start; i < end; i++) {
                const request = this.queue[i].request;
                messages[i - start] = request;
                topics[i - start] = request.topic;
                payloadBytes += request.payload.length;
            }
            const id = this.nextId++;
            this.inFlight.push({ id, first: this.queue[start].index, topics });
            this.head = end;
            this.bytes -= bytes;
            this.messagesOut += end - start;
            this.bytesOut += payloadBytes;
            this.compact();
            this.writer.writePublish(id, messages);
            this.admitWaiting();
        }
    }
    compact() {
        if (this.head === this.queue.length) {
            this.queue = [];
            this.head = 0;
        }
        else if (this.head >= 4096 && this.head * 2 >= this.queue.length) {
            this.queue = this.queue.slice(this.head);
            this.head = 0;
        }
    }
    /** Moves waiting publishers into the buffer while it has room, and resolves them. */
    admitWaiting() {
        while (this.waitingHead < this.waiting.length && this.bytes < this.limit) {
            const entry = this.waiting[this.waitingHead];
            this.waiting[this.waitingHead++] = undefined;
            this.waitingBytes -= entry.size;
            this.queue.push(entry);
            this.bytes += entry.size;
            entry.resolve();
            entry.resolve = entry.reject = undefined;
        }
        if (this.waitingHead === this.waiting.length) {
            this.waiting = [];
            this.waitingHead = 0;
        }
    }
    /** The broker answered a batch. */
    onPublished(answer) {
        const at = this.inFlight.findIndex((b) => b.id === answer.id);
        if (at < 0)
            return; // an answer for no batch of this session: nothing to settle
        const [batch] = this.inFlight.splice(at, 1);
        this.accepted += answer.accepted;
        for (const r of answer.rejected) {
            this.rejected.push({
                index: batch.first + r.index,
                topic: batch.topics[r.index] ?? "",
                code: r.code,
                message: r.message || `rejected with code ${r.code}`,
            });
        }
        this.settled = Math.max(this.settled, batch.first + batch.topics.length);
        this.settleFlushes();
        this.write(false);
    }
    /** The session is open: batch ids count from 1 again, and the buffer is written from its oldest message. */
    onOpen() {
        this.nextId = 1;
        this.write(false);
    }
    /** The session was lost: its unanswered batches are unconfirmed (never written again). */
    onLost() {
        for (const batch of this.inFlight) {
            const count = batch.topics.length;
            this.unconfirmed += count;
            this.unconfirmedIndexes.push({ first: batch.first, last: batch.first + count - 1 });
            this.settled = Math.max(this.settled, batch.first + count);
        }
        this.inFlight = [];
        this.settleFlushes();
    }
    takeResult() {
        const result = {
            accepted: this.accepted,
            rejected: this.rejected,
            unconfirmed: this.unconfirmed,
            unconfirmedIndexes: this.unconfirmedIndexes,
        };
        this.accepted = 0;
        this.rejected = [];
        this.unconfirmed = 0;
        this.unconfirmedIndexes = [];
        return result;
    }
    settleFlushes() {
        if (this.flushes.length === 0)
            return;
        const ready = this.flushes.filter((f) => f.target <= this.settled);
        if (ready.length === 0)
            return;
        this.flushes = this.flushes.filter((f) => f.target > this.settled);
        for (const f of ready)
            f.resolve(this.takeResult());
    }
    /**
     * Resolves once every message published before the call has an outcome,
     * with the outcomes since the previous flush; rejects with TimeoutError
     * after `timeout` ms (the outcomes then go to the next flush).
     */
    flush(timeout) {
        if (this.closed)
            return Promise.reject(new ClientClosed());
        const target = this.nextIndex;
        if (this.settled >= target)
            return Promise.resolve(this.takeResult());
        if (this.scheduled !== undefined) {
            clearImmediate(this.scheduled);
            this.scheduled = undefined;
        }
        this.write(false);
        return new Promise((resolve, reject) => {
            let timer;
            const waiter = {
                target,
                resolve: (r) => {
                    clearTimeout(timer);
                    resolve(r);
                },
                reject: (e) => {
                    clearTimeout(timer);
                    reject(e);
                },
            };
            this.flushes.push(waiter);
            if (timeout !== undefined) {
                timer = setTimeout(() => {
                    this.flushes = this.flushes.filter((f) => f !== waiter);
                    reject(new TimeoutError(`flush: ${target - this.settled} of the messages published before it had no outcome within ${timeout} ms`));
                }, timeout);
            }
        });
    }
    /**
     * Ends the buffer: messages not written are counted as `notSent`,
     * waiting publishers and flushes end with ClientClosed, unanswered
     * batches are unconfirmed.
     */
    close() {
        this.closed = true;
        if (this.scheduled !== undefined)
            clearImmediate(this.scheduled);
        this.scheduled = undefined;
        const notSent = this.pendingMessages;
        const closed = new ClientClosed();
        for (let i = this.waitingHead; i < this.waiting.length; i++)
            this.waiting[i].reject(closed);
        this.waiting = [];
        this.waitingHead = 0;
        this.waitingBytes = 0;
        this.queue = [];
        this.head = 0;
        this.bytes = 0;
        for (const f of this.flushes)
            f.reject(closed);
        this.flushes = [];
        this.onLost();
        this.settled = this.nextIndex;
        return { ...this.takeResult(), notSent };
    }
}
