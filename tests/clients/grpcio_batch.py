"""A stock grpcio (Python) client publishing and receiving in batches on one
Session, for tests/stock_clients.rs (docs/contract.md, "Batches").

It opens one `Session` with the request metadata `tinybroker-batch: 1` and
on it two subscriptions: handle 1 with `batch.>`, handle 2 with
`batch.even`. Once both are `opened` it publishes, on the same session, one
`SessionPublish` (id 7) of COUNT messages, payload `<i>`, to `batch.even`
for even i and `batch.odd` for odd i, then one (id 8) of a good message and
a bad one (`batch.*`, a wildcard). Each answer must be a `published` event
with its id: the first accepts all COUNT, the second one, rejecting index 1
with INVALID_ARGUMENT. The deliveries must come in `deliveries` events only
(never a bare `delivery`): handle 1 gets every message, handle 2 the even
ones, each in order with the sequences the answer gave them (consecutive
from its first_sequence). Then it half-closes; both handles must end
"closed" and the stream with OK. At the end it prints `result {json}`.

Usage: grpcio_batch.py ADDR PROTO_DIR COUNT
Stubs are generated from PROTO_DIR with grpcio-tools' bundled protoc.
"""

import json
import queue
import sys
import threading

from grpcio_publish import generate_stubs

WATCHDOG_SECONDS = 60


def main():
    addr, proto_dir, count = sys.argv[1:4]
    count = int(count)
    generate_stubs(proto_dir)
    import grpc
    from tinybroker.v1 import broker_pb2, broker_pb2_grpc

    result = {
        "grpcio": grpc.__version__,
        "problem": None,
        "answers": [],
        "deliveries_events": 0,
        "bare_deliveries": 0,
        "largest_event": 0,
        "shared_deliveries": 0,
        "received": {"1": 0, "2": 0},
        "ended": [],
        "stream_code": None,
        "stream_details": None,
    }

    def problem(text):
        if result["problem"] is None:
            result["problem"] = text

    requests = queue.Queue()

    def request_stream():
        while True:
            request = requests.get()
            if request is None:
                return  # half-close
            yield request

    channel = grpc.insecure_channel(addr)
    stub = broker_pb2_grpc.BrokerStub(channel)
    events = stub.Session(request_stream(), metadata=[("tinybroker-batch", "1")])
    watchdog = threading.Timer(WATCHDOG_SECONDS, events.cancel)
    watchdog.daemon = True
    watchdog.start()

    for handle, pattern in ((1, "batch.>"), (2, "batch.even")):
        requests.put(
            broker_pb2.SessionRequest(
                open=broker_pb2.SessionOpen(
                    handle=handle,
                    subscription=broker_pb2.OpenSubscriptionRequest(topic_patterns=[pattern]),
                )
            )
        )

    def publish(id_, messages):
        requests.put(
            broker_pb2.SessionRequest(
                publish=broker_pb2.SessionPublish(
                    id=id_,
                    messages=[broker_pb2.PublishRequest(topic=t, payload=p.encode()) for t, p in messages],
                )
            )
        )

    opened = set()
    # (payload, sequence) each handle must get, in order, once answered.
    expected = {1: [], 2: []}
    received = {1: [], 2: []}
    answers = 0
    half_closed = False

    def maybe_half_close():
        nonlocal half_closed
        done = answers == 2 and all(len(received[h]) == len(expected[h]) for h in (1, 2))
        if done and not half_closed:
            half_closed = True
            requests.put(None)

    try:
        for event in events:
            kind = event.WhichOneof("event")
            if kind == "opened":
                opened.add(event.opened.handle)
                if opened == {1, 2}:
                    publish(7, [("batch.even" if i % 2 == 0 else "batch.odd", str(i)) for i in range(count)])
                    publish(8, [("batch.even", "good"), ("batch.*", "bad")])
            elif kind == "published":
                p = event.published
                result["answers"].append(
                    {
                        "id": p.id,
                        "accepted": p.accepted,
                        "first_sequence": p.first_sequence,
                        "rejected": [
                            {"index": r.index, "code": r.code, "message": r.message} for r in p.rejected
                        ],
                    }
                )
                answers += 1
                if p.id == 7:
                    for i in range(p.accepted):
                        seq = p.first_sequence + i
                        expected[1].append((str(i), seq))
                        if i % 2 == 0:
                            expected[2].append((str(i), seq))
                elif p.id == 8 and p.accepted == 1:
                    expected[1].append(("good", p.first_sequence))
                    expected[2].append(("good", p.first_sequence))
                maybe_half_close()
            elif kind == "deliveries":
                result["deliveries_events"] += 1
                result["largest_event"] = max(result["largest_event"], event.deliveries.ByteSize())
                for d in event.deliveries.deliveries:
                    handles = list(d.handles)
                    if len(handles) > 1:
                        result["shared_deliveries"] += 1
                    if len(set(handles)) != len(handles):
                        problem(f"a delivery names a handle twice: {handles}")
                    for h in handles:
                        if h not in received:
                            problem(f"a delivery for unknown handle {h}")
                            continue
                        received[h].append((d.message.payload.decode(), d.message.sequence))
                        result["received"][str(h)] = len(received[h])
                maybe_half_close()
            elif kind == "delivery":
                result["bare_deliveries"] += 1
            elif kind == "ended":
                e = event.ended
                result["ended"].append({"handle": e.handle, "reason": e.reason})
        result["stream_code"] = "OK"
    except grpc.RpcError as error:
        result["stream_code"] = str(error.code())
        result["stream_details"] = error.details()
    finally:
        watchdog.cancel()
        requests.put(None)
    for h in (1, 2):
        # The answers may come after deliveries: compare once all is in.
        if received[h] != expected[h]:
            first = next(
                (i for i, (a, b) in enumerate(zip(received[h], expected[h])) if a != b),
                min(len(received[h]), len(expected[h])),
            )
            problem(
                f"handle {h}: {len(received[h])} received, {len(expected[h])} expected; first difference at {first}: "
                f"{received[h][first:first + 3]} against {expected[h][first:first + 3]}"
            )
    channel.close()
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
