"""A stock grpcio (Python) client reading OpenSubscription's id header, for
tests/stock_clients.rs.

On one channel (one HTTP/2 connection) it opens COUNT subscriptions, i = 1
to COUNT, subscription i on the topic `ids.<i>`: the odd ones with the id
`given-<i>`, the even ones blank (the broker generates one). For each it
reads the initial metadata's `tinybroker-subscription-id`, which must be
the given id, or for a blank one a UUID no other subscription has. It
prints `opened COUNT`; the test then publishes one message to each
`ids.<i>`, and each subscription's first message must carry the id its
header gave. At the end it prints one line `result {json}`.

Many ids on one connection: HPACK decodes each response's headers against
the connection's table, so a broker that indexed (or failed to encode) the
id headers would show here as a wrong or missing id on a later stream.

Usage: grpcio_subscription_ids.py ADDR PROTO_DIR COUNT
"""

import json
import re
import sys

from grpcio_publish import generate_stubs

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
TIMEOUT_SECONDS = 60


def main():
    addr, proto_dir, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    generate_stubs(proto_dir)
    import grpc
    from tinybroker.v1 import broker_pb2, broker_pb2_grpc

    result = {"opened": 0, "matched": 0, "problems": []}

    def problem(text):
        result["problems"].append(text)

    channel = grpc.insecure_channel(addr)
    stub = broker_pb2_grpc.BrokerStub(channel)
    calls, header_ids = {}, {}
    for i in range(1, count + 1):
        given = f"given-{i}" if i % 2 else ""
        calls[i] = stub.OpenSubscription(
            broker_pb2.OpenSubscriptionRequest(topic_patterns=[f"ids.{i}"], subscription_id=given),
            timeout=TIMEOUT_SECONDS,
        )
        metadata = dict(calls[i].initial_metadata())
        got = metadata.get("tinybroker-subscription-id")
        header_ids[i] = got
        if got is None:
            problem(f"subscription {i}: no tinybroker-subscription-id in {sorted(metadata)}")
        elif given and got != given:
            problem(f"subscription {i}: opened as {given!r}, the header says {got!r}")
        elif not given and not UUID.match(got):
            problem(f"subscription {i}: generated id {got!r} is not a UUID")
        result["opened"] += 1
    generated = [v for i, v in header_ids.items() if i % 2 == 0 and v]
    if len(set(generated)) != len(generated):
        problem(f"generated ids repeat: {generated}")
    print(f"opened {count}", flush=True)

    for i, call in calls.items():
        message = next(call)
        if message.topic != f"ids.{i}":
            problem(f"subscription {i}: got topic {message.topic!r}")
        if message.subscription_id != header_ids[i]:
            problem(f"subscription {i}: message names {message.subscription_id!r}, header {header_ids[i]!r}")
        else:
            result["matched"] += 1
        call.cancel()
    channel.close()
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
