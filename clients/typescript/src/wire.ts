// The two hot messages of a session, coded by hand: a SessionRequest
// carrying a SessionPublish batch, written into one Buffer sized exactly
// (the generated encoder goes through a growing writer and a copy per
// batch, a fifth of a publisher's CPU), and a SessionEvent carrying
// deliveries, read with each payload a view of the received bytes (the
// generated decoder copies each one). Everything else goes through the
// generated code. Field numbers are those of proto/tinybroker/v1/broker.proto.
import { SessionEvent as SessionEventCodec } from "./gen/tinybroker/v1/broker.js";
import type { Message, PublishRequest, SessionDelivery, SessionEvent } from "./gen/tinybroker/v1/broker.js";

/** Bytes of `n` as a varint. */
function varintSize(n: number): number {
  let size = 1;
  while (n >= 0x80) {
    n = Math.floor(n / 128);
    size += 1;
  }
  return size;
}

function writeVarint(buf: Buffer, offset: number, n: number): number {
  while (n >= 0x80) {
    buf[offset++] = (n % 128) | 0x80;
    n = Math.floor(n / 128);
  }
  buf[offset++] = n;
  return offset;
}

/** A length-delimited field of `len` bytes: its tag (one byte here), its length, its bytes. */
function fieldSize(len: number): number {
  return 1 + varintSize(len) + len;
}

/** Encoded size of one PublishRequest's fields, and the byte lengths of its strings (reused when writing). */
function measure(request: PublishRequest, lengths: number[]): number {
  const topic = Buffer.byteLength(request.topic);
  lengths.push(topic);
  let size = topic > 0 ? fieldSize(topic) : 0;
  if (request.payload.length > 0) size += fieldSize(request.payload.length);
  for (const key in request.headers) {
    const k = Buffer.byteLength(key);
    const v = Buffer.byteLength(request.headers[key]!);
    lengths.push(k, v);
    size += fieldSize((k > 0 ? fieldSize(k) : 0) + (v > 0 ? fieldSize(v) : 0));
  }
  return size;
}

/**
 * @internal `SessionRequest { publish: SessionPublish { id, messages } }`
 * encoded, as `SessionRequest.encode(...).finish()` would.
 */
export function encodePublish(id: number, messages: readonly PublishRequest[]): Buffer {
  const lengths: number[] = [];
  const sizes: number[] = new Array(messages.length);
  let inner = id > 0 ? 1 + varintSize(id) : 0; // SessionPublish.id = 1
  for (let i = 0; i < messages.length; i++) {
    sizes[i] = measure(messages[i]!, lengths);
    inner += fieldSize(sizes[i]!); // SessionPublish.messages = 2
  }
  const buf = Buffer.allocUnsafe(fieldSize(inner)); // SessionRequest.publish = 6
  let o = 0;
  buf[o++] = (6 << 3) | 2;
  o = writeVarint(buf, o, inner);
  if (id > 0) {
    buf[o++] = (1 << 3) | 0;
    o = writeVarint(buf, o, id);
  }
  let l = 0;
  for (let i = 0; i < messages.length; i++) {
    const m = messages[i]!;
    buf[o++] = (2 << 3) | 2;
    o = writeVarint(buf, o, sizes[i]!);
    const topic = lengths[l++]!;
    if (topic > 0) {
      buf[o++] = (1 << 3) | 2; // PublishRequest.topic = 1
      o = writeVarint(buf, o, topic);
      o += buf.write(m.topic, o, topic, "utf8");
    }
    const payload = m.payload;
    if (payload.length > 0) {
      buf[o++] = (2 << 3) | 2; // PublishRequest.payload = 2
      o = writeVarint(buf, o, payload.length);
      buf.set(payload, o);
      o += payload.length;
    }
    for (const key in m.headers) {
      const k = lengths[l++]!;
      const v = lengths[l++]!;
      buf[o++] = (3 << 3) | 2; // PublishRequest.headers = 3, a map entry
      o = writeVarint(buf, o, (k > 0 ? fieldSize(k) : 0) + (v > 0 ? fieldSize(v) : 0));
      if (k > 0) {
        buf[o++] = (1 << 3) | 2;
        o = writeVarint(buf, o, k);
        o += buf.write(key, o, k, "utf8");
      }
      if (v > 0) {
        buf[o++] = (2 << 3) | 2;
        o = writeVarint(buf, o, v);
        o += buf.write(m.headers[key]!, o, v, "utf8");
      }
    }
  }
  return buf;
}

/** A cursor over received bytes. */
class Reader {
  pos = 0;
  constructor(readonly buf: Buffer) {}

  varint(): number {
    const buf = this.buf;
    let result = 0;
    let scale = 1;
    for (;;) {
      if (this.pos >= buf.length) throw new RangeError("truncated varint");
      const b = buf[this.pos++]!;
      result += (b & 0x7f) * scale;
      if (b < 0x80) return result;
      scale *= 128;
    }
  }

  /** The end of a length-delimited field that starts here. */
  end(): number {
    const len = this.varint();
    const end = this.pos + len;
    if (end > this.buf.length) throw new RangeError("truncated field");
    return end;
  }

  string(): string {
    const end = this.end();
    const s = this.buf.toString("utf8", this.pos, end);
    this.pos = end;
    return s;
  }

  skip(wireType: number): void {
    switch (wireType) {
      case 0:
        this.varint();
        return;
      case 1:
        this.pos += 8;
        return;
      case 2:
        this.pos = this.end();
        return;
      case 5:
        this.pos += 4;
        return;
      default:
        throw new RangeError(`wire type ${wireType} cannot be skipped`);
    }
  }
}

function readMessage(r: Reader, end: number): Message {
  const m: Message = {
    topic: "",
    payload: EMPTY,
    headers: {},
    sequence: 0,
    publishTime: undefined,
    subscriptionId: "",
    consumerGroup: "",
    deliveryAttempt: 0,
  };
  while (r.pos < end) {
    const tag = r.varint();
    switch (tag) {
      case 10:
        m.topic = r.string();
        break;
      case 18: {
        const e = r.end();
        m.payload = r.buf.subarray(r.pos, e);
        r.pos = e;
        break;
      }
      case 26: {
        const e = r.end();
        let key = "";
        let value = "";
        while (r.pos < e) {
          const t = r.varint();
          if (t === 10) key = r.string();
          else if (t === 18) value = r.string();
          else r.skip(t & 7);
        }
        m.headers[key] = value;
        break;
      }
      case 32:
        m.sequence = r.varint();
        break;
      case 42: {
        const e = r.end();
        let seconds = 0;
        let nanos = 0;
        while (r.pos < e) {
          const t = r.varint();
          if (t === 8) seconds = r.varint();
          else if (t === 16) nanos = r.varint();
          else r.skip(t & 7);
        }
        m.publishTime = { seconds, nanos };
        break;
      }
      case 50:
        m.subscriptionId = r.string();
        break;
      case 58:
        m.consumerGroup = r.string();
        break;
      case 64:
        m.deliveryAttempt = r.varint();
        break;
      default:
        r.skip(tag & 7);
    }
  }
  return m;
}

function readDelivery(r: Reader, end: number): SessionDelivery {
  const d: SessionDelivery = { handles: [], message: undefined };
  while (r.pos < end) {
    const tag = r.varint();
    if (tag === 10) {
      const e = r.end(); // packed handles
      while (r.pos < e) d.handles.push(r.varint());
    } else if (tag === 8) {
      d.handles.push(r.varint());
    } else if (tag === 18) {
      const e = r.end();
      d.message = readMessage(r, e);
    } else {
      r.skip(tag & 7);
    }
  }
  return d;
}

const EMPTY = Buffer.alloc(0);

/**
 * @internal A SessionEvent as `SessionEvent.decode` gives it; a
 * `deliveries` event (the hot one) is read here, any other by the
 * generated decoder.
 */
export function decodeEvent(buf: Buffer): SessionEvent {
  // A deliveries event is field 5 (tag 42) and nothing else.
  if (buf.length === 0 || buf[0] !== 42) return SessionEventCodec.decode(buf);
  const r = new Reader(buf);
  const deliveries: SessionDelivery[] = [];
  while (r.pos < buf.length) {
    const tag = r.varint();
    if (tag !== 42) return SessionEventCodec.decode(buf);
    const end = r.end();
    while (r.pos < end) {
      const t = r.varint();
      if (t === 10) {
        const e = r.end();
        deliveries.push(readDelivery(r, e));
      } else {
        r.skip(t & 7);
      }
    }
  }
  return { event: { $case: "deliveries", value: { deliveries } } };
}
