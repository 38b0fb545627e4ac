#!/usr/bin/env python3
"""Writes the checked-in seed corpus of nasty inputs (fuzz/corpus/<target>/).

Run from anywhere: python3 fuzz/scripts/make_corpus.py. Re-running rewrites
the same files; the fuzzer adds its own next to them when run locally.
"""
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "corpus")


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data)


# ---- topic: one string, or several separated by newlines (a trie set) ----
topics = {
    "empty": "",
    "256-bytes": "a" * 256,
    "257-bytes": "a" * 257,
    "256-bytes-of-tokens": ".".join(["ab"] * 85) + "a",
    "256-bytes-wildcard-tail": "a" * 254 + ".>",
    "257-bytes-wildcard-tail": "a" * 255 + ".>",
    "tab": "a\tb",
    "space": "a b",
    "leading-space": " a",
    "nul": "a\0b",
    "del": "a\x7fb",
    "multibyte": "caf\u00e9.\u65e5\u672c.\U0001f600",
    "multibyte-at-limit": "\u00e9" * 128,
    "lone-star": "*",
    "lone-gt": ">",
    "gt-not-last": "a.>.b",
    "gt-first": ">.a",
    "double-dot": "a..b",
    "leading-dot": ".a",
    "trailing-dot": "a.",
    "only-dots": "...",
    "double-star": "**",
    "star-in-token": "a*",
    "gt-in-token": "a>",
    "double-gt": "a.>>",
    "10k-dots": "." * 10000,
    "10k-tokens": ".".join(["a"] * 5000),
    "case": "Deploy.rollout",
    "punctuation": "x-y_z.1~2!@#$%^&()",
    "dlq": "_dlq.g",
    "crlf": "a\r\nb",
    "set-wildcards": "a.*\na.>\n*.b\n>\n*.*\na.b\na.b.c\nb\na",
    "set-overlapping-ids": "a\na\na.*\na.*\n>\n>\na.b",
    "set-invalid-mixed": "a..b\n*\n\n>.a\na.>\n \na.b",
    "set-deep": "\n".join(".".join(["*"] * n) for n in range(1, 12)),
    "set-long": "\n".join(["a" * 256, "*." + "a" * 254, "a" * 254 + ".>", "a" * 255]),
    "invalid-utf8": b"a.\xff\xfe.b",
    "surrogate-bytes": b"\xed\xa0\x80",
}
for name, value in topics.items():
    write("topic", name, value)


# ---- requests: protobuf-encoded requests (also read as arbitrary scenarios) ----
def varint(n):
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_len(num, data):
    if isinstance(data, str):
        data = data.encode("utf-8")
    return varint(num << 3 | 2) + varint(len(data)) + data


def field_varint(num, n):
    return varint(num << 3) + varint(n)


def publish(topic, payload=b"", headers=()):
    out = field_len(1, topic) + field_len(2, payload)
    for k, v in headers:
        out += field_len(3, field_len(1, k) + field_len(2, v))
    return out


def open_sub(patterns, mode=0, sid="", group="", ack=0, mif=0, deadline=0):
    out = b"".join(field_len(1, p) for p in patterns)
    for num, n in ((2, mode), (5, ack), (6, mif), (7, deadline)):
        if n:
            out += field_varint(num, n)
    if sid:
        out += field_len(3, sid)
    if group:
        out += field_len(4, group)
    return out


def ack(sid, seqs, packed=True):
    out = field_len(1, sid)
    if packed:
        out += field_len(2, b"".join(varint(s) for s in seqs))
    else:
        out += b"".join(field_varint(2, s) for s in seqs)
    return out


def session_publish(id_, messages):
    """A SessionPublish {id, messages}: what the requests target also sends
    on a Session (plain, then batched with the same id twice)."""
    out = field_varint(1, id_) if id_ else b""
    return out + b"".join(field_len(2, m) for m in messages)


def frames(*messages):
    return b"".join(b"\0" + struct.pack(">I", len(m)) + m for m in messages)


requests = {
    "empty": b"",
    "publish-ok": publish("a.b", b"hello"),
    "publish-256-topic": publish("a" * 256, b"x"),
    "publish-257-topic": publish("a" * 257, b"x"),
    "publish-wildcard-topic": publish("a.*"),
    "publish-tab-topic": publish("a\tb"),
    "publish-nul-topic": publish("a\0b"),
    "publish-multibyte-topic": publish("caf\u00e9"),
    "publish-10k-dots": publish("." * 10000),
    "publish-65-headers": publish("a", b"", [("h%d" % i, "v") for i in range(65)]),
    "publish-64-headers": publish("a", b"", [("h%d" % i, "v") for i in range(64)]),
    "publish-huge-header-map": publish("a", b"", [("k%05d" % i, "v" * 8) for i in range(3000)]),
    "publish-header-8193": publish("a", b"", [("k", "v" * 8193)]),
    "publish-empty-header-name": publish("a", b"", [("", "v")]),
    "publish-duplicate-header": publish("a", b"", [("k", "1"), ("k", "2")]),
    "publish-over-max-bytes": publish("a", b"p" * 5000),
    "publish-traceparent": publish("a", b"", [("traceparent", "00-zzzz-yyyy-01")]),
    "open-broadcast": open_sub(["a.>", "a.*", "a.>"]),
    "open-no-patterns": open_sub([], mode=1),
    "open-65-patterns": open_sub(["p%d" % i for i in range(65)]),
    "open-64-patterns-256-bytes": open_sub([("%03d" % i) + "a" * 253 for i in range(64)]),
    "open-bad-mode": open_sub(["a"], mode=7),
    "open-negative-mode": open_sub(["a"], mode=(1 << 64) - 1),
    "open-bad-ack-mode": open_sub(["a"], mode=2, group="g", ack=9),
    "open-single-no-group": open_sub(["a"], mode=2),
    "open-multi-with-group": open_sub(["a"], mode=1, group="g"),
    "open-id-256": open_sub(["a"], sid="i" * 256),
    "open-id-257": open_sub(["a"], sid="i" * 257),
    "open-id-space": open_sub(["a"], sid="a b"),
    "open-id-multibyte": open_sub(["a"], sid="\u00e9"),
    "open-group-252": open_sub(["a"], mode=2, group="g" * 251, ack=2),
    "open-group-253": open_sub(["a"], mode=2, group="g" * 252, ack=2),
    "open-group-dot": open_sub(["a"], mode=2, group="g.h", ack=2),
    "open-group-double-dot": open_sub(["a"], mode=2, group="g..h"),
    "open-group-wildcard": open_sub(["a"], mode=2, group="*"),
    "open-group-max-in-flight-max": open_sub(["a"], mode=2, group="g", ack=2, mif=(1 << 32) - 1, deadline=(1 << 32) - 1),
    "open-gt-not-last": open_sub(["a.>.b"]),
    # Regression: the FAILED_PRECONDITION for a member whose patterns differ
    # lists both full sets (2 x 64 x 256 bytes): over a real connection the
    # grpc-message trailer is too large and the client gets INTERNAL "h2
    # protocol error" instead.
    "regression-group-mismatch-64-long-patterns": open_sub(
        [("%03d" % i) + "a" * 250 for i in range(64)], mode=2, group="g", ack=2
    ),
    "ack-empty-id": ack("", [1]),
    "ack-no-sequences": field_len(1, "s1"),
    "ack-unknown": ack("nope", [1, 2, 3]),
    "ack-max-sequences": ack("s1", [(1 << 64) - 1, 0, 1, 1]),
    "ack-unpacked": ack("s1", [5, 6], packed=False),
    "ack-many-sequences": ack("s1", list(range(20000))),
    "invalid-protobuf-truncated": publish("a.b", b"hello")[:-2],
    "invalid-protobuf-bad-wiretype": b"\x0f\x01\x02",
    "invalid-protobuf-huge-length": b"\x0a\xff\xff\xff\xff\x0f",
    "invalid-protobuf-varint-overflow": b"\x08" + b"\xff" * 11,
    "invalid-utf8-string": b"\x0a\x02\xc3\x28",
    "stream-frames-ok-then-bad": frames(publish("a"), publish("b"), publish("a..b"), publish("c")),
    "stream-frame-compressed": b"\x01" + struct.pack(">I", 3) + b"\x0a\x01a",
    "stream-frame-truncated": b"\0" + struct.pack(">I", 100) + b"\x0a\x01a",
    "stream-frame-huge-length": b"\0\xff\xff\xff\xff",
    "stream-frames-oversized": frames(publish("a"), publish("a", b"p" * 70000)),
    # Batches (SessionPublish), checked on a Session against the model; the
    # checks' default limits are max_message_bytes 1 (a request may be
    # 65,537 bytes) and max_batch_messages 1024.
    "session-publish-ok": session_publish(7, [publish("a.b", b"x"), publish("a", b""), publish("a.b.c", b"y")]),
    "session-publish-bad-by-index": session_publish(
        1,
        [
            publish("a", b"x"),
            publish("a.*"),
            publish(""),
            publish("a", b"too big"),
            publish("a", b"", [("h%d" % i, "") for i in range(65)]),
            publish("a", b"", [("", "v")]),
            publish("a" * 257),
            publish("a\tb"),
            publish("b", b"z"),
        ],
    ),
    "session-publish-all-bad": session_publish(2, [publish("a.>"), publish(""), publish("a..b")]),
    "session-publish-empty": session_publish(3, []),
    "session-publish-id-max": session_publish((1 << 64) - 1, [publish("a")]),
    "session-publish-at-limit": session_publish(4, [publish("a")] * 1024),
    "session-publish-over-limit": session_publish(5, [publish("a")] * 1025),
    "session-publish-far-over-limit": session_publish(6, [publish("a")] * 4097),
    # A huge count of tiny messages within the request size, and just over it.
    "session-publish-9000-tiny": session_publish(8, [publish("a")] * 9000),
    "session-publish-over-request-size": session_publish(9, [publish("a")] * 10000),
}
for name, value in requests.items():
    write("requests", name, value)

# Scenario-shaped inputs: arbitrary's byte reading is positional, so these are
# starting points for mutation rather than readable scenarios.
for i in range(6):
    write("requests", "scenario-%d" % i, bytes((j * (i + 3) + i) % 256 for j in range(64 + 97 * i)))
