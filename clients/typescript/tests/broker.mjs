// Starts the real tinybroker binary (and nats-server) for the tests.
//
// The binary: $TINYBROKER_BIN, else target/debug or target/release of the
// repository. Every process binds 127.0.0.1 only and is killed at the end
// of its test; every wait is bounded.
import { spawn } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { createServer, createConnection } from "node:net";
import { dirname, isAbsolute, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const START_TIMEOUT = 30_000;

export function brokerBinary() {
  const env = process.env.TINYBROKER_BIN;
  if (env) {
    const path = isAbsolute(env) ? env : resolve(process.cwd(), env);
    if (!existsSync(path)) throw new Error(`TINYBROKER_BIN=${env} does not exist`);
    return path;
  }
  for (const profile of ["debug", "release"]) {
    const path = join(REPO, "target", profile, "tinybroker");
    if (existsSync(path)) return path;
  }
  throw new Error("no tinybroker binary: set TINYBROKER_BIN or build it (cargo build)");
}

export function natsServerBinary() {
  const env = process.env.TB_NATS_SERVER;
  if (env && existsSync(env)) return env;
  const path = "/usr/local/lib/tinybroker/nats-server-2.10/nats-server";
  if (existsSync(path)) return path;
  throw new Error("no nats-server 2.10: set TB_NATS_SERVER (bash scripts/install-nats.sh | tail -n1)");
}

/** A free TCP port on 127.0.0.1. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** Awaits until condition() (sync or async) is truthy; returns its value. No fixed sleeps. */
export async function until(condition, timeout, what, interval = 10) {
  const deadline = Date.now() + timeout;
  for (;;) {
    const value = await condition();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeout} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, interval));
  }
}

/** Whether every thread of `pid` is stopped (state T), as /proc says. */
export function everyThreadStopped(pid) {
  try {
    const tasks = readdirSync(`/proc/${pid}/task`);
    return tasks.length > 0 && tasks.every((tid) => {
      const stat = readFileSync(`/proc/${pid}/task/${tid}/stat`, "utf8");
      return stat.slice(stat.lastIndexOf(")") + 2).startsWith("T");
    });
  } catch {
    return false;
  }
}

/** One tinybroker process; `addr` is its gRPC 127.0.0.1:port. */
export class Broker {
  constructor(env = {}, port = 0) {
    this.extraEnv = env;
    this.port = port;
    this.proc = undefined;
    this.lines = [];
    this.addr = "";
  }

  static async start(env = {}, { port = 0, waitServing = false } = {}) {
    const broker = new Broker(env, port);
    await broker.start({ waitServing });
    return broker;
  }

  async start({ waitServing = false } = {}) {
    const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("TINYBROKER_")));
    Object.assign(env, {
      TINYBROKER_GRPC_ADDR: `127.0.0.1:${this.port}`,
      TINYBROKER_METRICS_ADDR: "127.0.0.1:0",
      RUST_LOG: "info",
      TINYBROKER_LOG_FORMAT: "text",
      NO_COLOR: "1",
      ...this.extraEnv,
    });
    this.lines = [];
    const proc = spawn(brokerBinary(), ["serve"], { env, stdio: ["ignore", "ignore", "pipe"] });
    this.proc = proc;
    this.exited = new Promise((r) => proc.once("exit", r));
    await new Promise((resolve, reject) => {
      let rest = "";
      const timer = setTimeout(() => {
        this.kill();
        reject(new Error("tinybroker did not start:\n" + this.lines.slice(-20).join("\n")));
      }, START_TIMEOUT);
      proc.stderr.setEncoding("utf8");
      proc.stderr.on("data", (chunk) => {
        rest += chunk;
        const parts = rest.split("\n");
        rest = parts.pop();
        for (const line of parts) {
          this.lines.push(line);
          if (line.includes("tinybroker started")) {
            const m = /grpc_addr=(\S+)/.exec(line);
            if (m) {
              this.addr = m[1].replace(/"/g, "");
              clearTimeout(timer);
              resolve();
            }
          }
        }
      });
      proc.once("exit", (code) => {
        clearTimeout(timer);
        reject(new Error(`tinybroker exited (${code}):\n` + this.lines.slice(-20).join("\n")));
      });
    });
    this.port = Number(this.addr.split(":").pop());
    if (waitServing) {
      const { health } = await import("./health.mjs");
      await until(async () => (await health(this.addr)) === "SERVING", 30_000, `${this.addr} SERVING`, 50);
    }
    return this;
  }

  /**
   * SIGSTOP, then waits until /proc shows every thread of the broker
   * stopped. The signal does not stop them at once: a thread stops when the
   * group stop reaches it, and on a loaded machine a worker thread ran on
   * long enough to read a batch written after the signal and answer it
   * (CI: `unanswered_batches_are_unconfirmed` got `accepted: 10`).
   */
  async pause(timeout = 5000) {
    this.proc.kill("SIGSTOP");
    await until(() => everyThreadStopped(this.proc.pid), timeout, "every thread of the broker stopped", 2);
  }

  /** SIGKILL: no goodbye to any client. */
  async kill() {
    if (this.proc && this.proc.exitCode === null && this.proc.signalCode === null) {
      this.proc.kill("SIGKILL");
      await this.exited;
    }
  }

  handlesSigterm() {
    try {
      const status = readFileSync(`/proc/${this.proc.pid}/status`, "utf8");
      const m = /^SigCgt:\s*([0-9a-f]+)/m.exec(status);
      return m ? (BigInt("0x" + m[1]) & (1n << 14n)) !== 0n : false;
    } catch {
      return false;
    }
  }

  /** SIGTERM, as an orchestrator stops it. */
  async stop(timeout = 15_000) {
    if (this.proc && this.proc.exitCode === null && this.proc.signalCode === null) {
      await until(() => this.handlesSigterm(), 5000, "the broker to handle SIGTERM");
      this.proc.kill("SIGTERM");
      const timer = setTimeout(() => this.proc.kill("SIGKILL"), timeout);
      await this.exited;
      clearTimeout(timer);
    }
  }

  log() {
    return this.lines.join("\n");
  }
}

/** nats-server with JetStream (memory storage), on 127.0.0.1. */
export class NatsServer {
  static async start(dir) {
    const n = new NatsServer();
    n.port = await freePort();
    n.proc = spawn(natsServerBinary(), ["-a", "127.0.0.1", "-p", String(n.port), "-js", "-sd", join(dir, "js")], {
      stdio: "ignore",
    });
    n.exited = new Promise((r) => n.proc.once("exit", r));
    await until(
      () =>
        new Promise((resolve) => {
          const s = createConnection({ host: "127.0.0.1", port: n.port }, () => {
            s.destroy();
            resolve(true);
          });
          s.on("error", () => resolve(n.proc.exitCode !== null));
        }),
      20_000,
      "nats-server listening",
      50,
    );
    if (n.proc.exitCode !== null) throw new Error("nats-server exited");
    n.url = `nats://127.0.0.1:${n.port}`;
    return n;
  }

  async kill() {
    if (this.proc.exitCode === null && this.proc.signalCode === null) {
      this.proc.kill("SIGKILL");
      await this.exited;
    }
  }
}

/** Brokers started in a test, killed after it: `const start = starter(t)`. */
export function starter(t) {
  const started = [];
  t.after(async () => {
    for (const b of started) await b.kill();
  });
  return async (env = {}, opts = {}) => {
    const b = await Broker.start(env, opts);
    started.push(b);
    return b;
  };
}
