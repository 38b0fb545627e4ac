"""A stock grpcio (Python) client with COUNT subscriptions on one Session,
for tests/stock_clients.rs.

It opens one `Session` stream and on it COUNT subscriptions, handles 1 to
COUNT, handle i with the patterns `load.<i>` and `all.*` (a wildcard they
all share). Once every handle is `opened` (each with an id of its own) it
prints `opened COUNT`; the test then publishes ROUNDS rounds, each one
message to every `load.<i>` (payload `<i>-<round>`) and then one to
`all.x` (payload `all-<round>`). Each handle must get exactly its
2 * ROUNDS messages, in that order, with increasing sequences; a message
for `all.x` may come once naming many handles. Then it closes the first
CLOSE handles (each must end "closed"), half-closes the session, and every
remaining handle must end "closed" before the stream ends with status OK.
At the end it prints one line `result {json}`.

Usage: grpcio_session.py ADDR PROTO_DIR COUNT ROUNDS CLOSE
Stubs are generated from PROTO_DIR with grpcio-tools' bundled protoc.
"""

import json
import queue
import sys
import threading
import time

from grpcio_publish import generate_stubs

# The most the whole run may take before the script cancels its stream.
WATCHDOG_SECONDS = 90


def main():
    addr, proto_dir, count, rounds, close = sys.argv[1:6]
    count, rounds, close = int(count), int(rounds), int(close)
    generate_stubs(proto_dir)
    import grpc
    from tinybroker.v1 import broker_pb2, broker_pb2_grpc

    result = {
        "grpcio": grpc.__version__,
        "count": count,
        "opened": 0,
        "distinct_ids": 0,
        "complete": 0,
        "problem": None,
        "deliveries": 0,
        "shared_deliveries": 0,
        "most_handles_in_one_delivery": 0,
        "closed_on_close": 0,
        "closed_on_half_close": 0,
        "stream_code": None,
        "stream_details": None,
        "seconds": {},
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
    started = time.monotonic()
    events = stub.Session(request_stream())
    watchdog = threading.Timer(WATCHDOG_SECONDS, events.cancel)
    watchdog.daemon = True
    watchdog.start()

    for handle in range(1, count + 1):
        requests.put(
            broker_pb2.SessionRequest(
                open=broker_pb2.SessionOpen(
                    handle=handle,
                    subscription=broker_pb2.OpenSubscriptionRequest(
                        topic_patterns=[f"load.{handle}", "all.*"]
                    ),
                )
            )
        )

    expected = {
        h: [p for r in range(rounds) for p in (f"{h}-{r}", f"all-{r}")]
        for h in range(1, count + 1)
    }
    received = {h: [] for h in range(1, count + 1)}
    last_sequence = {h: 0 for h in range(1, count + 1)}
    ids = {}
    ended = set()
    phase = "opening"
    marks = {}

    def mark(name):
        marks[name] = time.monotonic()

    try:
        for event in events:
            kind = event.WhichOneof("event")
            if kind == "opened":
                ids[event.opened.handle] = event.opened.subscription_id
                result["opened"] = len(ids)
                if phase == "opening" and len(ids) == count:
                    result["distinct_ids"] = len(set(ids.values()))
                    mark("opened")
                    phase = "receiving"
                    print(f"opened {count}", flush=True)
            elif kind == "delivery":
                delivery = event.delivery
                message = delivery.message
                result["deliveries"] += 1
                handles = list(delivery.handles)
                if len(handles) > 1:
                    result["shared_deliveries"] += 1
                    if message.subscription_id:
                        problem(f"a delivery naming {len(handles)} handles carries id {message.subscription_id}")
                elif message.subscription_id != ids.get(handles[0]):
                    problem(f"handle {handles[0]} got id {message.subscription_id!r}, opened as {ids.get(handles[0])!r}")
                if len(set(handles)) != len(handles):
                    problem(f"a delivery names a handle twice: {handles}")
                result["most_handles_in_one_delivery"] = max(
                    result["most_handles_in_one_delivery"], len(handles)
                )
                payload = message.payload.decode()
                for h in handles:
                    got = received.get(h)
                    if got is None:
                        problem(f"a delivery for unknown handle {h}")
                        continue
                    want = expected[h]
                    if len(got) >= len(want) or want[len(got)] != payload:
                        problem(f"handle {h}: got {payload!r} after {got}, expected {want}")
                    if message.sequence <= last_sequence[h]:
                        problem(f"handle {h}: sequence {message.sequence} after {last_sequence[h]}")
                    last_sequence[h] = message.sequence
                    got.append(payload)
                    if len(got) == len(want):
                        result["complete"] += 1
                if phase == "receiving" and result["complete"] == count:
                    mark("received")
                    phase = "closing"
                    for h in range(1, close + 1):
                        requests.put(broker_pb2.SessionRequest(close=broker_pb2.SessionClose(handle=h)))
                    if close == 0:
                        phase = "half-closed"
                        requests.put(None)
            elif kind == "ended":
                e = event.ended
                if e.handle in ended:
                    problem(f"handle {e.handle} ended twice")
                ended.add(e.handle)
                if e.reason != "closed":
                    problem(f"handle {e.handle} ended {e.reason!r} ({e.code}: {e.message})")
                if phase == "closing":
                    if e.handle > close:
                        problem(f"handle {e.handle} ended before the half-close")
                    result["closed_on_close"] += 1
                    if result["closed_on_close"] == close:
                        mark("closed")
                        phase = "half-closed"
                        requests.put(None)
                elif phase == "half-closed":
                    if e.handle <= close:
                        problem(f"handle {e.handle} ended again after the half-close")
                    result["closed_on_half_close"] += 1
                else:
                    problem(f"handle {e.handle} ended while {phase}: {e.reason!r}")
        result["stream_code"] = "OK"
    except grpc.RpcError as error:
        result["stream_code"] = str(error.code())
        result["stream_details"] = error.details()
    finally:
        watchdog.cancel()
        requests.put(None)
    mark("ended")
    previous = started
    for name in ("opened", "received", "closed", "ended"):
        if name in marks:
            result["seconds"][name] = round(marks[name] - previous, 3)
            previous = marks[name]
    result["seconds"]["total"] = round(time.monotonic() - started, 3)
    channel.close()
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
