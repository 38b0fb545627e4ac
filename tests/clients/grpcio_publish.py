"""A stock grpcio (Python) client for tests/stock_clients.rs.

On one channel it opens a broadcast subscription, then publishes COUNT
messages through PublishStream from a generator (grpcio writes one HTTP/2 DATA
frame per message). It prints `subscribed`, then `pause` once PAUSE_AT
messages have been handed to grpcio (the test then SIGSTOPs the broker for a
while), and at the end one line `result {json}` with what happened.

SUBSCRIPTION says what the same-channel subscription checks:
- `full`: it matches the published topic and must receive every message, in
  order (Python reads about as slowly as it publishes, and both share the
  GIL);
- `alive`: it matches only `stock.grpcio.alive`; after the stream, one
  message published there on the same channel must reach it, which shows
  the channel and the subscription outlived the stream. The test then checks
  order and completeness with a subscriber of its own.

Usage: grpcio_publish.py ADDR PROTO_DIR COUNT PAYLOAD_BYTES PAUSE_AT SUBSCRIPTION
Stubs are generated from PROTO_DIR with grpcio-tools' bundled protoc.
"""

import json
import os
import sys
import tempfile
import threading
import time


def generate_stubs(proto_dir):
    from grpc_tools import protoc
    import importlib.resources

    out = tempfile.mkdtemp(prefix="tinybroker-grpcio-")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "tinybroker/v1/broker.proto",
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with {rc}")
    sys.path.insert(0, out)


def main():
    addr, proto_dir, count, payload_bytes, pause_at, mode = sys.argv[1:7]
    count, payload_bytes, pause_at = int(count), int(payload_bytes), int(pause_at)
    if mode not in ("full", "alive"):
        raise SystemExit(f"SUBSCRIPTION must be full or alive, not {mode!r}")
    generate_stubs(proto_dir)
    import grpc
    from tinybroker.v1 import broker_pb2, broker_pb2_grpc

    topic = "stock.grpcio"
    result = {
        "grpcio": grpc.__version__,
        "count": count,
        "publish_code": None,
        "publish_details": None,
        "accepted": None,
        "received": 0,
        "subscription_error": None,
        "out_of_order": None,
    }
    channel = grpc.insecure_channel(addr)
    stub = broker_pb2_grpc.BrokerStub(channel)
    alive_topic = "stock.grpcio.alive"
    expect = count if mode == "full" else 1
    subscription = stub.OpenSubscription(
        broker_pb2.OpenSubscriptionRequest(
            topic_patterns=[topic if mode == "full" else alive_topic]
        )
    )
    subscription.initial_metadata()  # the subscription is open
    all_received = threading.Event()

    def receive():
        expected = 0
        last_sequence = 0
        try:
            for message in subscription:
                index = int(message.payload)
                if result["out_of_order"] is None and (
                    index != expected or message.sequence <= last_sequence
                ):
                    result["out_of_order"] = (
                        f"message {expected} expected, got payload {index} "
                        f"sequence {message.sequence} after {last_sequence}"
                    )
                expected = index + 1
                last_sequence = message.sequence
                result["received"] += 1
                if result["received"] == expect:
                    all_received.set()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED or result["received"] != expect:
                result["subscription_error"] = f"{error.code()}: {error.details()}"
        finally:
            all_received.set()

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    print("subscribed", flush=True)

    fmt = f"%0{payload_bytes}d"

    def requests():
        for i in range(count):
            if i == pause_at:
                print("pause", flush=True)
            yield broker_pb2.PublishRequest(topic=topic, payload=(fmt % i).encode())

    started = time.monotonic()
    try:
        response = stub.PublishStream(requests())
        result["publish_code"] = "OK"
        result["accepted"] = response.accepted
    except grpc.RpcError as error:
        result["publish_code"] = str(error.code())
        result["publish_details"] = error.details()
    result["publish_seconds"] = round(time.monotonic() - started, 2)
    print(f"published {result['publish_code']}", flush=True)
    if mode == "alive" and result["subscription_error"] is None:
        try:
            stub.Publish(
                broker_pb2.PublishRequest(topic=alive_topic, payload=b"0" * payload_bytes),
                timeout=30,
            )
        except grpc.RpcError as error:
            result["alive_publish_error"] = f"{error.code()}: {error.details()}"
    # Everything published has reached the broker's queue for this
    # subscription; give the reader time to take it (or to fail).
    all_received.wait(timeout=float(os.environ.get("RECEIVE_TIMEOUT_SECONDS", "90")))
    result["total_seconds"] = round(time.monotonic() - started, 2)
    subscription.cancel()
    receiver.join(timeout=10)
    channel.close()
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
