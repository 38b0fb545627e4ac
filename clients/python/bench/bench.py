"""tinybroker's Python client against nats-py, on this machine, in one run.

Starts a tinybroker (the release binary) and a nats-server on 127.0.0.1,
then measures, for each client:

1. publish rate: one publisher, N messages of SIZE bytes, nobody
   subscribed (both: `await client.publish()` each, into the client's
   buffer, then `await client.flush()`: the rate counts until the broker
   has answered for the last one);
2. receive rate on one subscription: a publisher in another process sends N
   messages as fast as it can, the measured process receives them on one
   subscription (tinybroker: `async for msg in sub`, deliveries arriving in
   batches; nats-py: a callback, its fastest documented way); rate from the
   first message to the last, and the receiving process's CPU per message;
3. 1,000 subscriptions in one process at 200 msg/s in all: a publisher in
   another process sends 200 msg/s round-robin over the 1,000 topics for
   DURATION seconds; the holding process's CPU time (time.process_time:
   every thread, gRPC's own included) per delivery, and the p99 of the
   delivery latency (publish time in the payload to receipt, both
   processes on this machine's clock).

Usage (from the repository root, after `pip install ./clients/python nats-py`):

    python clients/python/bench/bench.py [--messages 100000] [--size 128]
        [--duration 10] [--runs 1] [--profile receive|publish]

TINYBROKER_BIN (default target/release/tinybroker) and TB_NATS_SERVER
(default nats-server on PATH) name the servers. Not a test: it prints a
markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pathlib
import pstats
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tinybroker() -> tuple:
    binary = os.environ.get("TINYBROKER_BIN") or str(REPO / "target" / "release" / "tinybroker")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYBROKER_")}
    env.update(
        TINYBROKER_GRPC_ADDR="127.0.0.1:0",
        TINYBROKER_METRICS_ADDR="127.0.0.1:0",
        TINYBROKER_CONSUMER_CAPACITY="1000000",
        TINYBROKER_METRICS_PER_SUBSCRIPTION="false",
        RUST_LOG="warn,tinybroker::server=info",
        NO_COLOR="1",
    )
    proc = subprocess.Popen([binary, "serve"], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    found = threading.Event()
    box = {}

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            m = re.search(r"tinybroker started.*grpc_addr=(\S+)", line)
            if m:
                box["addr"] = m.group(1)
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(30):
        proc.kill()
        raise SystemExit("tinybroker did not start")
    return proc, box["addr"]


def start_nats() -> tuple:
    binary = os.environ.get("TB_NATS_SERVER") or shutil.which("nats-server")
    if not binary:
        raise SystemExit("no nats-server: set TB_NATS_SERVER")
    port = free_port()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("nats-server did not start")
            time.sleep(0.05)
    return proc, f"nats://127.0.0.1:{port}"


# === the two clients, behind the same four calls ===


class Tinybroker:
    name = "tinybroker (Python client)"

    def __init__(self, addr: str) -> None:
        self.addr = addr

    async def connect(self) -> None:
        import tinybroker

        self.client = await tinybroker.connect(self.addr, tracing=False)

    async def close(self) -> None:
        await self.client.close()

    async def publish_many(self, topic_of, n: int, payload, rate: float = 0) -> None:
        client = self.client
        await paced(n, rate, lambda i: client.publish(topic_of(i), payload(i) if callable(payload) else payload))
        result = await client.flush(timeout=120)
        assert result.accepted == n, result

    async def subscribe(self, subject: str, on_message) -> object:
        sub = await self.client.subscribe(subject)

        async def pump() -> None:
            async for msg in sub:
                on_message(msg)

        return asyncio.ensure_future(pump())


class Nats:
    name = "nats-py"

    def __init__(self, addr: str) -> None:
        self.addr = addr

    async def connect(self) -> None:
        import nats

        self.client = await nats.connect(self.addr)

    async def close(self) -> None:
        await self.client.close()

    async def publish_many(self, topic_of, n: int, payload, rate: float = 0) -> None:
        nc = self.client
        await paced(n, rate, lambda i: nc.publish(topic_of(i), payload(i) if callable(payload) else payload))
        await nc.flush()

    async def subscribe(self, subject: str, on_message) -> object:
        async def cb(msg) -> None:
            on_message(msg)

        return await self.client.subscribe(subject, cb=cb)


async def paced(n: int, rate: float, send) -> None:
    if rate <= 0:
        for i in range(n):
            await send(i)
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(n):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(i)


SYSTEMS = {"tinybroker": Tinybroker, "nats": Nats}


# === scenarios ===


async def publish_rate(system, n: int, size: int) -> dict:
    await system.connect()
    payload = b"x" * size
    t0, c0 = time.perf_counter(), time.process_time()
    await system.publish_many(lambda i: "bench.pub", n, payload)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    await system.close()
    return {"rate": n / wall, "cpu_us": cpu / n * 1e6}


def publisher_process(kind: str, addr: str, topics: str, n: int, size: int, rate: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "_publish", kind, addr, topics, str(n), str(size), str(rate)],
        stdout=subprocess.DEVNULL,
    )


async def receive_rate(kind: str, system, addr: str, n: int, size: int) -> dict:
    await system.connect()
    got = {"n": 0, "first": 0.0, "last": 0.0}
    done = asyncio.get_running_loop().create_future()

    def on_message(_msg) -> None:
        got["n"] += 1
        if got["n"] == 1:
            got["first"] = time.perf_counter()
            got["cpu0"] = time.process_time()
        if got["n"] == n and not done.done():
            got["last"] = time.perf_counter()
            got["cpu1"] = time.process_time()
            done.set_result(None)

    await system.subscribe("rx.>", on_message)
    pub = publisher_process(kind, addr, "rx.x", n, size, 0)
    try:
        await asyncio.wait_for(done, 120)
    except asyncio.TimeoutError:
        pass
    pub.wait(60)
    await system.close()
    if not got.get("last"):
        return {"rate": float("nan"), "cpu_us": float("nan"), "lost": n - got["n"]}
    wall = got["last"] - got["first"]
    return {"rate": (n - 1) / wall, "cpu_us": (got["cpu1"] - got["cpu0"]) / (n - 1) * 1e6, "lost": 0}


async def many_subscriptions(kind: str, system, addr: str, subs: int, rate: float, duration: float) -> dict:
    await system.connect()
    counts = {"n": 0}
    latencies = []

    def on_message(msg) -> None:
        counts["n"] += 1
        latencies.append(time.time() - float(msg.data))

    t0 = time.perf_counter()
    for i in range(subs):
        await system.subscribe(f"fan.{i}", on_message)
    setup = time.perf_counter() - t0
    total = int(rate * duration)
    # Settle, then measure only the run.
    await asyncio.sleep(1)
    c0, w0 = time.process_time(), time.perf_counter()
    pub = publisher_process(kind, addr, f"fan.%d/{subs}", total, 128, rate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration + 30
    while counts["n"] < total and loop.time() < deadline:
        await asyncio.sleep(0.05)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    pub.wait(60)
    await system.close()
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
    return {
        "cpu_us": cpu / max(counts["n"], 1) * 1e6,
        "cpu_pct": cpu / wall * 100,
        "p99_ms": p99 * 1000,
        "lost": total - counts["n"],
        "setup_s": setup,
    }


def publish_main(argv) -> None:
    kind, addr, topics, n, size, rate = argv
    n, size, rate = int(n), int(size), float(rate)
    if "/" in topics:
        pattern, count = topics.split("/")
        count = int(count)
        topic_of = lambda i: pattern % (i % count)  # noqa: E731
    else:
        topic_of = lambda i: topics  # noqa: E731
    if rate > 0:
        # Paced: each payload is its publish time (for the latency).
        payload = lambda i: (b"%.6f" % time.time()).ljust(size)  # noqa: E731
    else:
        payload = b"x" * size

    async def run() -> None:
        system = SYSTEMS[kind](addr)
        await system.connect()
        await system.publish_many(topic_of, n, payload, rate)
        await system.close()

    asyncio.run(run())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_publish":
        publish_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--subscriptions", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--profile", choices=["publish", "receive"], help="cProfile one tinybroker scenario")
    args = parser.parse_args()

    tb_proc, tb_addr = start_tinybroker()
    nats_proc, nats_addr = start_nats()
    addrs = {"tinybroker": tb_addr, "nats": nats_addr}
    try:
        if args.profile:
            profile(args, tb_addr)
            return
        rows = {k: {"pub": [], "rx": [], "rx_cpu": [], "fan": [], "fan_pct": [], "p99": [], "lost": 0} for k in SYSTEMS}
        for run in range(args.runs):
            for kind in ("nats", "tinybroker") if run % 2 else ("tinybroker", "nats"):
                cls, addr = SYSTEMS[kind], addrs[kind]
                r = asyncio.run(publish_rate(cls(addr), args.messages, args.size))
                rows[kind]["pub"].append(r["rate"])
                r = asyncio.run(receive_rate(kind, cls(addr), addr, args.messages, args.size))
                rows[kind]["rx"].append(r["rate"])
                rows[kind]["rx_cpu"].append(r["cpu_us"])
                rows[kind]["lost"] += r["lost"]
                r = asyncio.run(
                    many_subscriptions(kind, cls(addr), addr, args.subscriptions, args.rate, args.duration)
                )
                rows[kind]["fan"].append(r["cpu_us"])
                rows[kind]["fan_pct"].append(r["cpu_pct"])
                rows[kind]["p99"].append(r["p99_ms"])
                rows[kind]["lost"] += r["lost"]
                print(f"run {run + 1} {kind}: done", file=sys.stderr)
        from importlib.metadata import version

        print(
            f"\n{args.messages} messages of {args.size} B; {args.subscriptions} subscriptions at "
            f"{args.rate:g} msg/s for {args.duration:g} s; best of {args.runs} run(s); Python "
            f"{sys.version.split()[0]}, grpcio {version('grpcio')}, protobuf {version('protobuf')}, nats-py {version('nats-py')}\n"
        )
        print("| client | publish (msg/s) | receive, 1 subscription (msg/s) | receive CPU (µs/msg) | 1,000 subs: CPU per delivery (µs) | 1,000 subs: CPU (% of a core) | 1,000 subs: p99 latency (ms) | lost |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for kind in ("tinybroker", "nats"):
            r = rows[kind]
            print(
                f"| {SYSTEMS[kind].name} | {max(r['pub']):,.0f} | {max(r['rx']):,.0f} | {min(r['rx_cpu']):.1f} "
                f"| {min(r['fan']):.0f} | {min(r['fan_pct']):.1f} | {min(r['p99']):.2f} | {r['lost']} |"
            )
    finally:
        tb_proc.kill()
        nats_proc.kill()


def profile(args, addr: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    if args.profile == "publish":
        asyncio.run(publish_rate(Tinybroker(addr), args.messages, args.size))
    else:
        asyncio.run(receive_rate("tinybroker", Tinybroker(addr), addr, args.messages, args.size))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
