// tinybroker's Node client against nats.js (the `nats` npm package), on
// this machine, in one run.
//
// Starts a tinybroker (the release binary) and a nats-server on 127.0.0.1,
// then measures, for each client:
//
// 1. publish rate: one publisher, N messages of SIZE bytes, nobody
//    subscribed (tinybroker: `await client.publish()` each, buffered and
//    sent as SessionPublish batches, then `await client.flush()`; nats.js:
//    `nc.publish()` each, then `flush()`), until the server has them all;
// 2. receive rate on one subscription: a publisher in another process sends
//    N messages as fast as it can, the measured process receives them on one
//    subscription (tinybroker: `for await (const msg of sub)`, the session
//    asking for batched deliveries; nats.js: a callback subscription, its
//    fastest documented way); rate from the first message to the last, and
//    the receiving process's CPU per message;
// 3. 1,000 subscriptions in one process at 200 msg/s in all: a publisher in
//    another process sends 200 msg/s round-robin over the 1,000 topics for
//    DURATION seconds, each payload carrying its send time; the holding
//    process's CPU time (process.cpuUsage(), user + system) per delivery
//    and the 99th percentile of send-to-receive latency.
//
// Usage (from clients/typescript, after `npm ci`):
//
//     TINYBROKER_BIN=../../target/release/tinybroker TB_NATS_SERVER=... \
//         node bench/bench.mjs [--messages 100000] [--size 128] [--duration 10] [--runs 1]
//         [--only tinybroker|nats] [--scenario publish|receive|fanout]
//
// `node --cpu-prof --cpu-prof-dir=prof bench/bench.mjs --only tinybroker
// --scenario receive` profiles one scenario (the publisher child is
// profiled too). Not a test: it prints a markdown table.
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { createConnection, createServer } from "node:net";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const here = dirname(fileURLToPath(import.meta.url));
const REPO = resolve(here, "..", "..", "..");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function freePort() {
  return new Promise((res) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => res(port));
    });
  });
}

async function startTinybroker() {
  const binary = process.env.TINYBROKER_BIN || join(REPO, "target", "release", "tinybroker");
  const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("TINYBROKER_")));
  Object.assign(env, {
    TINYBROKER_GRPC_ADDR: "127.0.0.1:0",
    TINYBROKER_METRICS_ADDR: "127.0.0.1:0",
    TINYBROKER_CONSUMER_CAPACITY: "1000000",
    TINYBROKER_METRICS_PER_SUBSCRIPTION: "false",
    RUST_LOG: "warn,tinybroker::server=info",
    NO_COLOR: "1",
  });
  const proc = spawn(binary, ["serve"], { env, stdio: ["ignore", "ignore", "pipe"] });
  const addr = await new Promise((res, rej) => {
    const timer = setTimeout(() => rej(new Error("tinybroker did not start")), 30_000);
    let buf = "";
    proc.stderr.setEncoding("utf8");
    proc.stderr.on("data", (d) => {
      buf += d;
      const m = /tinybroker started.*grpc_addr=(\S+)/.exec(buf);
      if (m) {
        clearTimeout(timer);
        res(m[1].replace(/"/g, ""));
      }
    });
  });
  return { proc, addr, binary };
}

async function startNats() {
  const binary =
    process.env.TB_NATS_SERVER ||
    ["/usr/local/lib/tinybroker/nats-server-2.10/nats-server", "/usr/sbin/nats-server"].find(existsSync);
  if (!binary) throw new Error("no nats-server: set TB_NATS_SERVER");
  const port = await freePort();
  const proc = spawn(binary, ["-a", "127.0.0.1", "-p", String(port)], { stdio: "ignore" });
  const deadline = Date.now() + 20_000;
  for (;;) {
    const ok = await new Promise((res) => {
      const s = createConnection({ host: "127.0.0.1", port }, () => (s.destroy(), res(true)));
      s.on("error", () => res(false));
    });
    if (ok) break;
    if (Date.now() > deadline) throw new Error("nats-server did not start");
    await sleep(50);
  }
  return { proc, addr: `127.0.0.1:${port}`, binary };
}

// === the two clients, behind the same calls ===

class Tinybroker {
  static label = "tinybroker (this client)";
  constructor(addr) {
    this.addr = addr;
  }
  async connect() {
    const { connect } = await import("../dist/index.js");
    this.client = await connect(this.addr);
  }
  close() {
    return this.client.close();
  }
  async publishMany(topicOf, n, payloadOf, rate = 0) {
    const client = this.client;
    await paced(n, rate, (i) => client.publish(topicOf(i), payloadOf(i)));
    const r = await client.flush();
    if (r.accepted !== n) throw new Error(`flush: ${JSON.stringify(r)}`);
  }
  async subscribe(subject, onMessage) {
    const sub = await this.client.subscribe(subject);
    (async () => {
      for await (const msg of sub) onMessage(msg);
    })();
    return sub;
  }
}

class Nats {
  static label = "nats.js (nats 2.29.3)";
  constructor(addr) {
    this.addr = addr;
  }
  async connect() {
    const { connect } = await import("nats");
    this.client = await connect({ servers: this.addr });
  }
  close() {
    return this.client.close();
  }
  async publishMany(topicOf, n, payloadOf, rate = 0) {
    const nc = this.client;
    await paced(n, rate, (i) => nc.publish(topicOf(i), payloadOf(i)));
    await nc.flush();
  }
  async subscribe(subject, onMessage) {
    const sub = this.client.subscribe(subject, { callback: (_err, msg) => onMessage(msg) });
    await this.client.flush(); // the server has the subscription
    return sub;
  }
}

const SYSTEMS = { tinybroker: Tinybroker, nats: Nats };

async function paced(n, rate, send) {
  if (rate <= 0) {
    for (let i = 0; i < n; i++) {
      const r = send(i);
      if (r !== undefined) await r;
    }
    return;
  }
  const start = performance.now();
  for (let i = 0; i < n; i++) {
    const delay = start + (i * 1000) / rate - performance.now();
    if (delay > 0) await sleep(delay);
    const r = send(i);
    if (r !== undefined) await r;
  }
}

const cpuUs = () => {
  const u = process.cpuUsage();
  return u.user + u.system;
};

// === scenarios ===

async function publishRate(system, n, size) {
  await system.connect();
  const payload = Buffer.alloc(size, 120);
  const t0 = performance.now();
  const c0 = cpuUs();
  await system.publishMany(() => "bench.pub", n, () => payload);
  const wall = (performance.now() - t0) / 1000;
  const cpu = cpuUs() - c0;
  await system.close();
  return { rate: n / wall, cpuUs: cpu / n };
}

function publisherProcess(kind, addr, topics, n, size, rate) {
  const args = [...process.execArgv, fileURLToPath(import.meta.url), "_publish", kind, addr, topics, n, size, rate];
  const proc = spawn(process.execPath, args.map(String), { stdio: ["ignore", "ignore", "inherit"] });
  return new Promise((res) => proc.once("exit", res));
}

async function receiveRate(kind, system, addr, n, size) {
  await system.connect();
  const got = { n: 0 };
  let done;
  const finished = new Promise((r) => (done = r));
  await system.subscribe("rx.>", () => {
    got.n += 1;
    if (got.n === 1) {
      got.first = performance.now();
      got.cpu0 = cpuUs();
    }
    if (got.n === n) {
      got.last = performance.now();
      got.cpu1 = cpuUs();
      done();
    }
  });
  const pub = publisherProcess(kind, addr, "rx.x", n, size, 0);
  await Promise.race([finished, sleep(120_000)]);
  await pub;
  await system.close();
  if (got.last === undefined) return { rate: NaN, cpuUs: NaN, lost: n - got.n };
  const wall = (got.last - got.first) / 1000;
  return { rate: (n - 1) / wall, cpuUs: (got.cpu1 - got.cpu0) / (n - 1), lost: 0 };
}

const decoder = new TextDecoder();
const nowMs = () => performance.timeOrigin + performance.now();

async function manySubscriptions(kind, system, addr, subs, rate, duration) {
  await system.connect();
  const counts = { n: 0 };
  const latencies = [];
  const onMessage = (msg) => {
    counts.n += 1;
    latencies.push(nowMs() - Number(decoder.decode(msg.data)));
  };
  const t0 = performance.now();
  for (let i = 0; i < subs; i++) await system.subscribe(`fan.${i}`, onMessage);
  const setup = (performance.now() - t0) / 1000;
  const total = Math.round(rate * duration);
  await sleep(1000); // settle, then measure only the run
  const c0 = cpuUs();
  const w0 = performance.now();
  const pub = publisherProcess(kind, addr, `fan.%d/${subs}`, total, 128, rate);
  const deadline = Date.now() + (duration + 30) * 1000;
  while (counts.n < total && Date.now() < deadline) await sleep(50);
  const cpu = cpuUs() - c0;
  const wallS = (performance.now() - w0) / 1000;
  await pub;
  await system.close();
  latencies.sort((a, b) => a - b);
  const p99 = latencies.length ? latencies[Math.min(latencies.length - 1, Math.floor(latencies.length * 0.99))] : NaN;
  return { cpuUs: cpu / Math.max(counts.n, 1), cpuPct: (cpu / 1e6 / wallS) * 100, p99, lost: total - counts.n, setup };
}

async function publishMain([kind, addr, topics, n, size, rate]) {
  let topicOf = () => topics;
  if (topics.includes("/")) {
    const [pattern, count] = topics.split("/");
    topicOf = (i) => pattern.replace("%d", String(i % Number(count)));
  }
  const system = new SYSTEMS[kind](addr);
  await system.connect();
  // Paced runs carry their send time (ms) for the latency; others fixed bytes.
  const fixed = Buffer.alloc(Number(size), 120);
  const payloadOf = Number(rate) > 0 ? () => Buffer.from(nowMs().toFixed(3)) : () => fixed;
  await system.publishMany(topicOf, Number(n), payloadOf, Number(rate));
  await system.close();
}

async function main() {
  if (process.argv[2] === "_publish") return publishMain(process.argv.slice(3));
  const { values: o } = parseArgs({
    options: {
      messages: { type: "string", default: "100000" },
      size: { type: "string", default: "128" },
      subscriptions: { type: "string", default: "1000" },
      rate: { type: "string", default: "200" },
      duration: { type: "string", default: "10" },
      runs: { type: "string", default: "1" },
      only: { type: "string" },
      scenario: { type: "string" },
    },
  });
  const [n, size, subs, rate, duration, runs] = [o.messages, o.size, o.subscriptions, o.rate, o.duration, o.runs].map(Number);
  const tb = await startTinybroker();
  const nats = await startNats();
  const addrs = { tinybroker: tb.addr, nats: nats.addr };
  const kinds = o.only ? [o.only] : ["tinybroker", "nats"];
  const want = (s) => !o.scenario || o.scenario === s;
  const rows = Object.fromEntries(
    kinds.map((k) => [k, { pub: [], rx: [], rxCpu: [], fan: [], fanPct: [], fanP99: [], lost: 0 }]),
  );
  try {
    for (let run = 0; run < runs; run++) {
      for (const kind of run % 2 ? [...kinds].reverse() : kinds) {
        const Cls = SYSTEMS[kind];
        const addr = addrs[kind];
        const row = rows[kind];
        if (want("publish")) row.pub.push((await publishRate(new Cls(addr), n, size)).rate);
        if (want("receive")) {
          const r = await receiveRate(kind, new Cls(addr), addr, n, size);
          row.rx.push(r.rate);
          row.rxCpu.push(r.cpuUs);
          row.lost += r.lost;
        }
        if (want("fanout")) {
          const r = await manySubscriptions(kind, new Cls(addr), addr, subs, rate, duration);
          row.fan.push(r.cpuUs);
          row.fanPct.push(r.cpuPct);
          row.fanP99.push(r.p99);
          row.lost += r.lost;
        }
        console.error(`run ${run + 1} ${kind}: done`);
      }
    }
    const { createRequire } = await import("node:module");
    const require = createRequire(import.meta.url);
    const v = (p) => require(`${p}/package.json`).version;
    const max = (a) => (a.length ? Math.max(...a).toLocaleString("en-US", { maximumFractionDigits: 0 }) : "-");
    const min = (a, d) => (a.length ? Math.min(...a).toFixed(d) : "-");
    console.log(
      `\n${n} messages of ${size} B; ${subs} subscriptions at ${rate} msg/s for ${duration} s; best of ${runs} run(s); ` +
        `Node ${process.version}, @grpc/grpc-js ${v("@grpc/grpc-js")}, nats ${v("nats")}; ${tb.binary}\n`,
    );
    console.log(
      "| client | publish (msg/s) | receive, 1 subscription (msg/s) | receive CPU (µs/msg) | 1,000 subs: CPU per delivery (µs) | 1,000 subs: CPU (% of a core) | 1,000 subs: p99 latency (ms) | lost |",
    );
    console.log("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (const kind of kinds) {
      const r = rows[kind];
      console.log(
        `| ${SYSTEMS[kind].label} | ${max(r.pub)} | ${max(r.rx)} | ${min(r.rxCpu, 1)} | ${min(r.fan, 0)} | ${min(r.fanPct, 1)} | ${min(r.fanP99, 2)} | ${r.lost} |`,
      );
    }
  } finally {
    tb.proc.kill("SIGKILL");
    nats.proc.kill("SIGKILL");
  }
}

await main();
