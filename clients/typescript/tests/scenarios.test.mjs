// The scenario list of docs/clients.md, one test per row, titled by its
// name, against the real broker binary.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import {
  ClientClosed,
  connect,
  PublishError,
  Status,
  SubscriptionEnded,
  TimeoutError,
  TinybrokerError,
  UsageError,
} from "../dist/index.js";
import { Broker, NatsServer, freePort, starter, until } from "./broker.mjs";

const DIST = fileURLToPath(new URL("../dist/index.js", import.meta.url));

/** The broker's Prometheus metrics as a map of series to value. */
async function metrics(broker) {
  const addr = /metrics_addr=(\S+)/.exec(broker.log())[1].replace(/"/g, "");
  const text = await (await fetch(`http://${addr}/metrics`)).text();
  const values = new Map();
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const at = line.lastIndexOf(" ");
    values.set(line.slice(0, at), Number(line.slice(at + 1)));
  }
  return values;
}

/** Whether `promise` is still pending after the event loop turned a few times. */
async function isPending(promise) {
  let settled = false;
  promise.then(
    () => (settled = true),
    () => (settled = true),
  );
  for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
  return !settled;
}

/** Counts the SessionRequests the client writes, by kind (a look inside, for the tests). */
function countRequests(client) {
  const session = client["session"];
  const counts = {};
  const write = session.write.bind(session);
  session.write = (request) => {
    // (Publish batches are written by hand-encoded bytes, not through write().)
    counts[request.request.$case] = (counts[request.request.$case] ?? 0) + 1;
    counts[`${request.request.$case}:items`] =
      (counts[`${request.request.$case}:items`] ?? 0) + (request.request.value.sequences?.length ?? 1);
    write(request);
  };
  return counts;
}

test("publish_returns_at_once_and_flush_reports", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  await client.publish("warm.up", "x"); // the session opens
  await client.flush({ timeout: 5000 });
  // The broker stopped: publish() still returns at once, every time.
  await broker.pause();
  t.after(() => broker.proc.kill("SIGCONT"));
  // A few checked one by one (each check turns the event loop), the rest in one go.
  for (let i = 0; i < 20; i++) assert.equal(await isPending(client.publish("p.x", String(i))), false, `publish ${i} waited`);
  const rest = [];
  for (let i = 20; i < 2000; i++) rest.push(client.publish("p.x", String(i)));
  assert.equal(await isPending(Promise.all(rest)), false);
  const flushed = client.flush({ timeout: 10_000 });
  assert.equal(await isPending(flushed), true, "flush waits for the stopped broker");
  broker.proc.kill("SIGCONT");
  const result = await flushed;
  assert.deepEqual(result, { accepted: 2000, rejected: [], unconfirmed: 0, unconfirmedIndexes: [] });
  assert.equal((await client.admin.info()).messagesPublished, 2001);
  // Each outcome is reported by one flush only.
  assert.equal((await client.flush({ timeout: 5000 })).accepted, 0);
});

test("flush_reports_each_rejection", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)({ TINYBROKER_MAX_MESSAGE_BYTES: "1024" });
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const big = Buffer.alloc(2000, 120);
  // Indexes count over the client's life, not per batch: ten before.
  for (let i = 0; i < 10; i++) client.publish("good.0", String(i));
  assert.equal((await client.flush({ timeout: 10_000 })).accepted, 10);
  client.publish("good.1", "a"); // index 10
  client.publish("bad topic", "b"); // 11
  client.publish("good.2", "c"); // 12
  client.publish("good.big", big); // 13
  client.publish("good.3", "d"); // 14
  const result = await client.flush({ timeout: 10_000 });
  assert.equal(result.accepted, 3);
  assert.equal(result.unconfirmed, 0);
  // Each as the unary Publish refuses it: same code, the broker's message.
  const expected = [];
  for (const [index, topic, payload] of [
    [11, "bad topic", "b"],
    [13, "good.big", big],
  ]) {
    const e = await client.publishConfirmed(topic, payload).then(assert.fail, (e) => e);
    assert.ok(e instanceof TinybrokerError && e.code !== Status.OK);
    expected.push({ index, topic, code: e.code });
  }
  assert.deepEqual(
    result.rejected.map(({ index, topic, code }) => ({ index, topic, code })),
    expected,
  );
  assert.equal(result.rejected[0].code, Status.INVALID_ARGUMENT);
  assert.match(result.rejected[0].message, /bad topic/);
  assert.match(result.rejected[1].message, /1024/);
});

test("publish_waits_when_the_buffer_is_full", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr, { bufferBytes: 4096 });
  t.after(() => client.close());
  const sub = await client.subscribe("full.>");
  await broker.kill();
  await until(() => client.state === "WAITING" || client.state === "STARTING", 10_000, "the session lost");
  const payload = Buffer.alloc(1000, 120);
  const publishes = [];
  let waiting;
  for (let i = 0; i < 20 && waiting === undefined; i++) {
    const p = client.publish("full.x", payload);
    publishes.push(p);
    if (await isPending(p)) waiting = p;
  }
  assert.ok(waiting !== undefined, "publish never waited with no broker and a 4 KiB buffer");
  assert.ok(client.stats().pendingBytes >= 4096);
  const count = publishes.length;
  assert.ok(count <= 6, `${count} publishes before one waited`);
  await broker.start();
  await waiting;
  assert.equal((await client.flush({ timeout: 10_000 })).accepted, count);
  for (let i = 0; i < count; i++) assert.equal((await sub.next({ timeout: 10_000 })).payload.length, 1000);
});

test("publishers_share_one_clients_batches", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const tasks = [];
  for (let task = 0; task < 10; task++) {
    tasks.push(
      (async () => {
        for (let i = 0; i < 200; i++) await client.publish(`share.${task}`, String(i));
      })(),
    );
  }
  await Promise.all(tasks);
  assert.equal((await client.flush({ timeout: 10_000 })).accepted, 2000);
  const m = await metrics(broker);
  const batches = m.get("tinybroker_publish_batch_size_count");
  assert.equal(m.get("tinybroker_publish_batch_size_sum"), 2000);
  assert.ok(batches >= 1 && batches < 2000 / 2, `${batches} batches for 2000 messages`);
  assert.ok(m.get('tinybroker_publish_batch_size_bucket{le="1"}') < batches, "every batch held one message");
});

test("buffered_publishes_go_out_after_a_restart", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("restart.>");
  await broker.kill();
  await until(() => client.state !== "OPEN", 10_000, "the session lost");
  for (let i = 0; i < 100; i++) await client.publish("restart.x", String(i));
  assert.equal(client.stats().pendingMessages, 100);
  await broker.start();
  const result = await client.flush({ timeout: 15_000 });
  assert.deepEqual([result.accepted, result.unconfirmed, result.rejected.length], [100, 0, 0]);
  // Subscriptions are opened before the buffer is written: all of them, once, in order.
  const got = [];
  for (let i = 0; i < 100; i++) got.push(Number((await sub.next({ timeout: 10_000 })).string()));
  assert.deepEqual(got, [...Array(100).keys()]);
  assert.equal((await client.admin.info()).messagesPublished, 100);
  await assert.rejects(sub.next({ timeout: 300 }), TimeoutError);
});

test("unanswered_batches_are_unconfirmed", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr);
  t.after(() => client.close());
  await client.publish("u.warm", "x");
  await client.flush({ timeout: 5000 });
  await broker.pause();
  for (let i = 0; i < 10; i++) client.publish("u.x", String(i));
  await until(() => client.stats().messagesOut === 11, 5000, "the batch written");
  await broker.kill(); // the connection is cut before any answer
  const result = await client.flush({ timeout: 10_000 });
  assert.deepEqual(result, { accepted: 0, rejected: [], unconfirmed: 10, unconfirmedIndexes: [{ first: 1, last: 10 }] });
  // Not written again on the next session: the restarted broker publishes only what comes after.
  await broker.start();
  await client.publish("u.after", "y");
  assert.equal((await client.flush({ timeout: 10_000 })).accepted, 1);
  assert.equal((await client.admin.info()).messagesPublished, 1);
});

test("deliveries_come_in_batches", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("burst.>");
  for (let i = 0; i < 1000; i++) client.publish("burst.x", String(i));
  assert.equal((await client.flush({ timeout: 10_000 })).accepted, 1000);
  const got = [];
  for await (const m of sub) {
    got.push(Number(m.string()));
    if (got.length === 1000) break;
  }
  assert.deepEqual(got, [...Array(1000).keys()]);
  const m = await metrics(broker);
  const events = m.get("tinybroker_delivery_batch_size_count");
  assert.equal(m.get("tinybroker_delivery_batch_size_sum"), 1000, "every delivery came in a deliveries event");
  assert.ok(events < 1000 / 2, `${events} events for 1000 deliveries`);
  assert.equal(client.stats().messagesIn, 1000);
});

test("acks_are_coalesced", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("jobs.>", { group: "workers", ackMode: "manual", maxInFlight: 200 });
  const requests = countRequests(client);
  for (let i = 0; i < 100; i++) client.publish("jobs.x", String(i));
  await client.flush({ timeout: 10_000 });
  const messages = [];
  for (let i = 0; i < 100; i++) messages.push(await sub.next({ timeout: 5000 }));
  for (const m of messages) assert.equal(m.ack(), true);
  const inFlight = async () => (await client.admin.groups()).find((g) => g.name === "workers").inFlight;
  await until(async () => (await inFlight()) === 0, 10_000, "in_flight 0");
  assert.equal(requests.ack, 1, "100 acks of one handle at one moment: one SessionAck");
  assert.equal(requests["ack:items"], 100);
  assert.equal((await metrics(broker)).get('tinybroker_consumer_group_acked_total{consumer_group="workers"}'), 100);
});

test("window_holds_through_evictions", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({ TINYBROKER_CONSUMER_CAPACITY: "16" });
  const window = 8;
  const client = await connect(broker.addr, { window });
  t.after(() => client.close());
  const sub = await client.subscribe("w.>");
  let most = 0;
  for (let round = 1; round <= 8; round++) {
    // Messages one by one while nobody reads: the window fills, then the
    // broker's queue (16) overflows and it is evicted.
    for (let i = 0; i < 200 && sub.stats.evictions < round; i++) await client.publishConfirmed("w.x", "m");
    await until(() => sub.stats.evictions >= round && sub.state !== "BACKOFF", 10_000, `eviction ${round}`);
    most = Math.max(most, sub.pending);
    assert.ok(sub.pending <= window, `holds ${sub.pending} > window ${window} after ${round} evictions`);
    // Holding its whole window, it is not opened again until the application takes one.
    assert.equal(sub.state, "WAITING");
    assert.equal(sub.pending, window);
    await sub.next({ timeout: 5000 }); // room for one: opened again with credit 1
    await until(() => sub.isOpen, 10_000, `open again ${round}`);
  }
  assert.equal(most, window);
  assert.equal(sub.stats.evictions, 8);
});

test("gap_is_a_range_on_one_instance", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({ TINYBROKER_CONSUMER_CAPACITY: "16" });
  const events = [];
  const client = await connect(broker.addr, { window: 8 });
  t.after(() => client.close());
  const sub = await client.subscribe("g.>", { onEvent: (e) => events.push(e) });
  for (let i = 0; i < 200 && sub.stats.evictions === 0; i++) await client.publishConfirmed("g.x", String(i));
  await until(() => sub.stats.evictions === 1, 10_000, "the eviction");
  const ended = events.find((e) => e.type === "ended");
  let last;
  while (sub.pending > 0) last = await sub.next({ timeout: 5000 });
  await until(() => sub.isOpen, 10_000, "open again");
  const after = await client.publishConfirmed("g.x", "after");
  assert.equal((await sub.next({ timeout: 5000 })).sequence, after.sequence);
  const gap = events.find((e) => e.type === "gap");
  assert.deepEqual(gap.missed, { first: last.sequence + 1, last: after.sequence - 1 });
  assert.equal(gap.reason, undefined);
  assert.equal(gap.cause, "evicted");
  assert.equal(gap.dropped, ended.dropped);
  assert.ok(ended.dropped > 0);
  assert.equal(sub.stats.gaps, 1);
});

test("gap_is_unknown_across_a_restart", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("r.>");
  for (let i = 0; i < 5; i++) await client.publishConfirmed("r.x", String(i));
  for (let i = 0; i < 5; i++) await sub.next({ timeout: 5000 });
  const reconnected = new Promise((r) => client.on("connection", (e) => e.type === "reconnected" && r(e)));
  await broker.kill();
  await broker.start();
  assert.equal((await reconnected).instanceChanged, true);
  await until(() => sub.isOpen, 10_000, "open again");
  const after = await client.publishConfirmed("r.x", "after"); // sequences started again
  assert.equal((await sub.next({ timeout: 5000 })).sequence, after.sequence);
  assert.equal(sub.lastGap.missed, undefined);
  assert.equal(sub.lastGap.reason, "instance_changed");
  assert.equal(sub.lastGap.cause, "connection_lost");
});

test("back_within_half_a_second_of_a_restart", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("b.>");
  await broker.kill();
  // Down long enough for the channel's and the session's delays to reach
  // their caps (with grpc's defaults the channel would then wait seconds).
  await until(() => client.state === "WAITING", 10_000, "the session lost");
  await new Promise((r) => setTimeout(r, 4000));
  await broker.start(); // resolves once the broker logs that it serves
  const answered = Date.now();
  const other = await connect(broker.addr);
  t.after(() => other.close());
  const wait = answered + 500 - Date.now();
  if (wait > 0) await new Promise((r) => setTimeout(r, wait));
  const published = await other.publishConfirmed("b.x", "half a second later");
  assert.equal(published.matchedSubscriptions, 1, "the subscription was not back 0.5 s after the broker answered");
  assert.equal((await sub.next({ timeout: 5000 })).string(), "half a second later");
});

test("connection_events_once_per_connection", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr);
  const seen = [];
  client.on("connection", (e) => seen.push(e));
  const iterated = (async () => {
    const events = [];
    for await (const e of client.connectionEvents()) events.push(e);
    return events;
  })();
  const subs = [];
  for (let i = 0; i < 50; i++) subs.push(await client.subscribe(`c.${i}`));
  await broker.kill();
  await broker.start();
  await until(() => subs.every((s) => s.isOpen), 10_000, "50 subscriptions back");
  await client.close();
  const types = seen.map((e) => e.type);
  assert.deepEqual(types, ["connected", "disconnected", "reconnected", "closed"]);
  assert.equal(seen[0].address, `http://${broker.addr}`);
  assert.ok(seen[0].instance);
  assert.ok(seen[1].reason.length > 0 && seen[1].code !== Status.OK);
  assert.equal(seen[2].address, `http://${broker.addr}`);
  assert.equal(seen[2].instanceChanged, true);
  assert.deepEqual((await iterated).map((e) => e.type), types);
});

test("stats_count_what_went_in_and_out", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("s.>");
  for (let i = 0; i < 10; i++) client.publish("s.x", "12345");
  await client.flush({ timeout: 5000 });
  for (let i = 0; i < 10; i++) await sub.next({ timeout: 5000 });
  await client.publishConfirmed("s.y", "abc");
  await sub.next({ timeout: 5000 });
  let stats = client.stats();
  assert.deepEqual(
    [stats.messagesOut, stats.bytesOut, stats.messagesIn, stats.bytesIn, stats.reconnects, stats.pendingMessages],
    [11, 53, 11, 53, 0, 0],
  );
  await broker.kill();
  await until(() => client.state !== "OPEN", 10_000, "the session lost");
  for (let i = 0; i < 3; i++) client.publish("s.x", "pending");
  stats = client.stats();
  assert.equal(stats.pendingMessages, 3);
  assert.ok(stats.pendingBytes >= 3 * "pending".length);
  await broker.start();
  assert.equal((await client.flush({ timeout: 10_000 })).accepted, 3);
  stats = client.stats();
  assert.deepEqual([stats.messagesOut, stats.reconnects, stats.pendingMessages, stats.pendingBytes], [14, 1, 0, 0]);
});

test("closed_means_closed", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  // Nothing of a closed client keeps its process alive.
  const code = `import { connect } from ${JSON.stringify(DIST)};
    const c = await connect(${JSON.stringify(broker.addr)});
    const sub = await c.subscribe("x.>");
    const pub = c.publisher(); await pub.publish("x.y", "1");
    c.publish("x.y", "2"); await c.publishConfirmed("x.y", "3"); await sub.next({ timeout: 5000 });
    await c.close(); console.log(Date.now());`;
  const child = spawn(process.execPath, ["--input-type=module", "-e", code], { stdio: ["ignore", "pipe", "inherit"] });
  let out = "";
  child.stdout.on("data", (d) => (out += d));
  const killer = setTimeout(() => child.kill("SIGKILL"), 20_000);
  const exitCode = await new Promise((r) => child.once("exit", r));
  const exited = Date.now();
  clearTimeout(killer);
  assert.equal(exitCode, 0);
  const closed = Number(out.trim());
  assert.ok(closed > 0, `the child printed ${JSON.stringify(out)}`);
  assert.ok(exited - closed < 2000, `the process lived ${exited - closed} ms after close()`);

  const client = await connect(broker.addr, { bufferBytes: 1024 });
  const sub = await client.subscribe("x.>");
  const pub = client.publisher();
  await pub.publish("x.y", "1");
  const waitingNext = sub.next();
  await broker.kill(); // publishes now wait: the buffer fills
  await until(() => client.state !== "OPEN", 10_000, "the session lost");
  client.publish("x.y", Buffer.alloc(2000));
  const waitingPublish = client.publish("x.y", "waits");
  assert.equal(await isPending(waitingPublish), true);
  const result = await client.close();
  assert.equal(result.notSent, 2);
  await assert.rejects(waitingNext, ClientClosed);
  await assert.rejects(waitingPublish, ClientClosed);
  for (const call of [
    () => client.publish("x.y", "after"),
    () => client.flush(),
    () => client.publishConfirmed("x.y", "after"),
    () => client.subscribe("x.>"),
    () => client.admin.info(),
    () => pub.publish("x.y", "after"),
    async () => client.publisher(),
    () => sub.next(),
  ]) {
    await assert.rejects(call(), (e) => {
      assert.ok(e instanceof ClientClosed && e instanceof TinybrokerError, `${e}`);
      assert.equal(e.code, Status.CANCELLED);
      assert.match(e.message, /closed/);
      return true;
    });
  }
});

test("one_next_at_a_time", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("n.>");
  const first = sub.next({ timeout: 10_000 });
  await assert.rejects(sub.next({ timeout: 10_000 }), (e) => e instanceof UsageError && e.message.includes("one next()"));
  await client.publish("n.x", "for the first");
  assert.equal((await first).string(), "for the first");
});

test("status_ok_end_is_not_an_error", { timeout: 60_000 }, async (t) => {
  const start = starter(t);
  const a = await start();
  const b = await start();
  const client = await connect([a.addr, b.addr]);
  t.after(() => client.close());
  const connection = [];
  client.on("connection", (e) => connection.push(e));
  const events = [];
  const sub = await client.subscribe("ok.>", { onEvent: (e) => events.push(e) });
  const once = await client.subscribe("ok.>", { resubscribe: false });
  const raised = [];
  const onUnhandled = (e) => raised.push(e);
  process.on("unhandledRejection", onUnhandled);
  t.after(() => process.off("unhandledRejection", onUnhandled));
  // A graceful shutdown ends the subscription (shutdown) and then the session with status OK.
  await a.stop();
  await until(() => client.address === `http://${b.addr}` && sub.isOpen, 15_000, "back on the next address");
  // What does end for good raises an error that is not OK, with a message.
  await assert.rejects(once.next({ timeout: 5000 }), (e) => {
    assert.ok(e instanceof SubscriptionEnded && e.reason === "shutdown", `${e}`);
    assert.notEqual(e.code, Status.OK);
    assert.ok(e.details.length > 0 && !e.message.startsWith("OK"));
    return true;
  });
  const lost = connection.find((e) => e.type === "disconnected");
  assert.equal(lost.reason, "closed by the broker");
  assert.ok(connection.some((e) => e.type === "reconnected" && e.address === `http://${b.addr}`));
  const other = await connect(b.addr);
  t.after(() => other.close());
  await other.publishConfirmed("ok.x", "on b");
  assert.equal((await sub.next({ timeout: 5000 })).string(), "on b");
  assert.deepEqual(raised, []);
  assert.ok(events.every((e) => e.type !== "ended" || e.reason === "shutdown"));
});

test("publish_error_counts_what_the_broker_accepted", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const pub = client.publisher();
  for (const topic of ["a.1", "a.2", "a.3", "bad topic", "a.5"]) await pub.publish(topic, "x");
  const e = await pub.close().then(assert.fail, (e) => e);
  assert.ok(e instanceof PublishError, String(e));
  assert.equal(e.code, Status.INVALID_ARGUMENT);
  assert.equal(e.accepted, 3, e.message);
  assert.equal((await client.admin.info()).messagesPublished, 3);
});

test("cluster_subscriptions_survive_a_replica", { timeout: 90_000 }, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "tinybroker-nats-"));
  const nats = await NatsServer.start(dir);
  const replicas = [];
  t.after(async () => {
    for (const r of replicas) await r.kill();
    await nats.kill();
    rmSync(dir, { recursive: true, force: true });
  });
  for (const id of ["a", "b"]) {
    const env = { TINYBROKER_NATS_URL: nats.url, TINYBROKER_NATS_REPLICAS: "1", TINYBROKER_REPLICA_ID: id };
    replicas.push(await Broker.start(env, { port: await freePort(), waitServing: true }));
  }
  const [a, b] = replicas;
  const client = await connect([a.addr, b.addr]);
  t.after(() => client.close());
  const sub = await client.subscribe("cl.>");
  const other = await connect(b.addr);
  t.after(() => other.close());
  await other.publishConfirmed("cl.1", "before");
  assert.equal((await sub.next({ timeout: 10_000 })).string(), "before");
  await a.kill();
  await until(() => sub.isOpen && client.address === `http://${b.addr}`, 30_000, "open again on replica b");
  await other.publishConfirmed("cl.2", "after");
  assert.equal((await sub.next({ timeout: 10_000 })).string(), "after");
  assert.equal(sub.lastGap.missed, undefined);
  assert.ok(["instance_changed", "sequence_scope"].includes(sub.lastGap.reason), sub.lastGap.reason);
});

