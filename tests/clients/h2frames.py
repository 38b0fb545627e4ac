#!/usr/bin/env python3
"""Counts HTTP/2 frames by type in each direction of a captured connection.

Not run by the tests: it is how issue 12's grpc-js timing was investigated.
tshark's own HTTP/2 dissector misses frames when a segment carries many
small ones, so this parses the reassembled TCP byte streams itself.

    tcpdump -i lo -s 0 -w run.pcap "tcp port $PORT" &   # the broker's gRPC port
    node tests/clients/grpcjs_publish.js 127.0.0.1:$PORT proto 100000 10 -1 0
    kill %1; python3 tests/clients/h2frames.py run.pcap

Needs tshark (Debian package `tshark`). Reads TCP stream 0 (the first
connection in the capture); pass a stream index as the second argument for
another.
"""

import collections
import subprocess
import sys

NAMES = {
    0: "DATA",
    1: "HEADERS",
    2: "PRIORITY",
    3: "RST_STREAM",
    4: "SETTINGS",
    5: "PUSH_PROMISE",
    6: "PING",
    7: "GOAWAY",
    8: "WINDOW_UPDATE",
    9: "CONTINUATION",
}


def streams(pcap, index):
    """The client's and the server's bytes of TCP stream `index`."""
    out = subprocess.run(
        ["tshark", "-r", pcap, "-q", "-z", f"follow,tcp,raw,{index}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    client, server = bytearray(), bytearray()
    body = False
    for line in out.splitlines():
        if line.startswith("====="):
            body = True
            continue
        if not body or line.startswith(("Follow:", "Filter:", "Node ")) or not line.strip():
            continue
        # tshark indents the second peer's (the server's) data with a tab.
        target = server if line.startswith("\t") else client
        try:
            target += bytes.fromhex(line.strip())
        except ValueError:
            pass
    return client, server


def report(buf, label):
    i = 24 if buf.startswith(b"PRI * HTTP/2.0") else 0
    counts = collections.Counter()
    small = data_bytes = increments = 0
    while i + 9 <= len(buf):
        length = int.from_bytes(buf[i : i + 3], "big")
        kind = buf[i + 3]
        counts[NAMES.get(kind, kind)] += 1
        if kind == 0:
            data_bytes += length
            small += length < 256
        if kind == 8:
            increments += int.from_bytes(buf[i + 9 : i + 13], "big") & 0x7FFFFFFF
        i += 9 + length
    frames = ", ".join(f"{k} {v}" for k, v in counts.most_common())
    print(f"{label}: {len(buf)} bytes; frames: {frames}")
    if counts["DATA"]:
        print(f"    DATA payload {data_bytes} B, {small} frames under 256 B")
    if increments:
        print(f"    WINDOW_UPDATE increments sum {increments}")


def main():
    pcap = sys.argv[1]
    index = sys.argv[2] if len(sys.argv) > 2 else "0"
    client, server = streams(pcap, index)
    report(client, "client->broker")
    report(server, "broker->client")


if __name__ == "__main__":
    main()
