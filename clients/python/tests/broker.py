"""Starts the real tinybroker binary (and nats-server) for the tests.

The binary: $TINYBROKER_BIN, else target/debug or target/release of the
repository. Every process binds 127.0.0.1 only and is killed at the end of
its test; every wait is bounded.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Dict, List, Optional

import grpc

REPO = pathlib.Path(__file__).resolve().parents[3]
START_TIMEOUT = 30.0


def broker_binary() -> str:
    env = os.environ.get("TINYBROKER_BIN")
    if env:
        path = pathlib.Path(env)
        if not path.is_absolute():
            path = (pathlib.Path.cwd() / path).resolve()
        if not path.exists():
            raise RuntimeError(f"TINYBROKER_BIN={env} does not exist")
        return str(path)
    for profile in ("debug", "release"):
        path = REPO / "target" / profile / "tinybroker"
        if path.exists():
            return str(path)
    raise RuntimeError("no tinybroker binary: set TINYBROKER_BIN or build it (cargo build)")


def nats_server_binary() -> str:
    env = os.environ.get("TB_NATS_SERVER")
    if env and os.path.exists(env):
        return env
    for path in ("/usr/local/lib/tinybroker/nats-server-2.10/nats-server",):
        if os.path.exists(path):
            return path
    raise RuntimeError("no nats-server 2.10: set TB_NATS_SERVER (bash scripts/install-nats.sh | tail -n1)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.02):
    """Polls ``condition`` until it returns a true value (which is returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class Broker:
    """One tinybroker process; ``addr`` is its gRPC ``127.0.0.1:port``."""

    def __init__(self, env: Optional[Dict[str, str]] = None, port: int = 0, wait_serving: bool = False) -> None:
        self.extra_env = dict(env or {})
        self.port = port
        self.wait_serving = wait_serving
        self.proc: Optional[subprocess.Popen] = None
        self.lines: List[str] = []
        self.addr = ""
        self.start()

    def start(self) -> "Broker":
        env = {k: v for k, v in os.environ.items() if not k.startswith("TINYBROKER_")}
        env.update(
            TINYBROKER_GRPC_ADDR=f"127.0.0.1:{self.port}",
            TINYBROKER_METRICS_ADDR="127.0.0.1:0",
            RUST_LOG="info",
            TINYBROKER_LOG_FORMAT="text",
            NO_COLOR="1",
        )
        env.update(self.extra_env)
        self.lines = []
        started = threading.Event()
        self.proc = subprocess.Popen(
            [broker_binary(), "serve"], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
        )
        proc = self.proc

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                self.lines.append(line)
                if "tinybroker started" in line:
                    m = re.search(r"grpc_addr=(\S+)", line)
                    if m:
                        self.addr = m.group(1).strip('"')
                        started.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while not started.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("tinybroker did not start:\n" + "".join(self.lines[-20:]))
        self.port = int(self.addr.rsplit(":", 1)[1])
        if self.wait_serving:
            try:
                wait_for(lambda: health(self.addr) == "SERVING", 30, f"{self.addr} SERVING")
            except BaseException:
                self.kill()
                raise
        return self

    def kill(self) -> None:
        """SIGKILL: no goodbye to any client."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def handles_sigterm(self) -> bool:
        """Whether the process has installed its SIGTERM handler (SigCgt)."""
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("SigCgt:"):
                        return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
        except OSError:
            pass
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, as an orchestrator stops it."""
        if self.proc is not None and self.proc.poll() is None:
            # The broker installs its SIGTERM handler a moment after it logs
            # "tinybroker started" (and already serves): a SIGTERM before
            # that kills it outright, with no graceful shutdown.
            wait_for(self.handles_sigterm, 5, "the broker to handle SIGTERM")
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return "".join(self.lines)


def health(addr: str) -> str:
    """grpc.health.v1 Check of the whole server: SERVING, NOT_SERVING or an error name."""
    with grpc.insecure_channel(addr) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            response = check(b"", timeout=2)
        except grpc.RpcError as e:
            return e.code().name
    # HealthCheckResponse { ServingStatus status = 1; }: 1 SERVING, 2 NOT_SERVING.
    return {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(response, repr(response))


class NatsServer:
    """nats-server with JetStream (memory storage), on 127.0.0.1."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(tmp / "js")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def listening() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                return self.proc.poll() is not None

        wait_for(listening, 20, "nats-server listening")
        if self.proc.poll() is not None:
            raise RuntimeError("nats-server exited")
        self.url = f"nats://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
