/** Bytes of `n` as a varint. */
function varintSize(n) {
    let size = 1;
    while (n >= 0x80) {
        n = Math.floor(n / 128);
        size += 1;
    }
    return size;
}
function writeVarint(buf, offset, n) {
    while (n >= 0x80) {
        buf[offset++] = (n % 128) | 0x80;
        n = Math.floor(n / 128);
    }
    buf[offset++] = n;
    return offset;
}
/** A length-delimited field of `len` bytes: its tag (one byte here), its length, its bytes. */
function fieldSize(len) {
    return 1 + varintSize(len) + len;
}
/** Encoded size of one PublishRequest's fields, and the byte lengths of its strings (reused when writing). */
function measure(request, lengths) {
    const topic = Buffer.byteLength(request.topic);
    lengths.push(topic);
    let size = topic > 0 ? fieldSize(topic) : 0;
    if (request.payload.length > 0)
        size += fieldSize(request.payload.length);
    for (const key in request.headers) {
        const k = Buffer.byteLength(key);
        const v = Buffer.byteLength(request.headers[key]);
        lengths.push(k, v);
        size += fieldSize((k > 0 ? fieldSize(k) : 0) + (v > 0 ? fieldSize(v) : 0));
    }
    return size;
}
/**
 * @internal `SessionRequest { publish: SessionPublish { id, messages } }`
 * encoded, as `SessionRequest.encode(...).finish()` would.
 */
export function encodePublish(id, messages) {
    const lengths = [];
    const sizes = new Array(messages.length);
    let inner = id > 0 ? 1 + varintSize(id) : 0; // SessionPublish.id = 1
    for (let i = 0; i < messages.length; i++) {
        sizes[i] = measure(messages[i], lengths);
        inner += fieldSize(sizes[i]); // SessionPublish.messages = 2
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
        const m = messages[i];
        buf[o++] = (2 << 3) | 2;
        o = writeVarint(buf, o, sizes[i]);
        const topic = lengths[l++];
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
            const k = lengths[l++];
            const v = lengths[l++];
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
                o += buf.write(m.headers[key], o, v, "utf8");
            }
        }
    }
    return buf;
}
