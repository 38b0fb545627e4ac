// Publish and subscribe through one client: the round trip, the publisher
// stream and typed errors, the address list and the environment defaults.
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { test } from "node:test";
import { connect, PublishError, Status, TinybrokerError } from "../dist/index.js";
import { starter } from "./broker.mjs";

test("round trip delivers payload, headers and sequence", { timeout: 45_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe(["greet.*", "other.>"]);
  assert.ok(sub.subscriptionId);
  const result = await client.publishConfirmed("greet.world", Buffer.from("hello"), { headers: { k: "v" } });
  assert.ok(result.sequence > 0);
  assert.equal(result.matchedSubscriptions, 1);
  const msg = await sub.next({ timeout: 5000 });
  assert.deepEqual([msg.topic, msg.string(), msg.headers.k], ["greet.world", "hello", "v"]);
  assert.equal(msg.sequence, result.sequence);
  assert.equal(msg.subscriptionId, sub.subscriptionId);
  assert.ok(msg.publishTime.getFullYear() >= 2024);
  // A string payload goes as UTF-8; the subscription is an AsyncIterable.
  await client.publishConfirmed("other.a.b", "text");
  for await (const m of sub) {
    assert.equal(Buffer.from(m.data).toString(), "text");
    break;
  }
  // Leaving the loop did not close it.
  await client.publishConfirmed("greet.again", "still");
  assert.equal((await sub.next({ timeout: 5000 })).string(), "still");
});

test("publisher streams with counts and the first error typed", { timeout: 45_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("load.>");
  const pub = client.publisher();
  for (let i = 0; i < 500; i++) await pub.publish(`load.${i % 5}`, String(i));
  const result = await pub.end();
  assert.equal(result.accepted, 500);
  assert.equal(result.lastSequence - result.firstSequence, 499);
  const got = [];
  for (let i = 0; i < 500; i++) got.push(Number((await sub.next({ timeout: 5000 })).string()));
  assert.deepEqual(got, [...Array(500).keys()]);
  // A bad topic ends the stream; the error is typed.
  await assert.rejects(
    (async () => {
      await pub.publish("ok.topic", "1");
      await pub.publish("bad topic", "2");
      await pub.end();
    })(),
    (e) => e instanceof PublishError && e.code === Status.INVALID_ARGUMENT && e.details.includes("bad topic"),
  );
  await pub.close();
  await assert.rejects(
    client.publishConfirmed("bad..topic", ""),
    (e) => e instanceof TinybrokerError && e.code === Status.INVALID_ARGUMENT,
  );
  await assert.rejects(
    client.subscribe("bad pattern"),
    (e) => e instanceof TinybrokerError && e.code === Status.INVALID_ARGUMENT && e.codeName === "INVALID_ARGUMENT",
  );
});

test("publisher waits while the broker is behind; an AbortSignal cancels a call", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const pub = client.publisher();
  await pub.publish("big.x", "first"); // the stream is open
  // The broker stopped (SIGSTOP) reads nothing: after HTTP/2's windows fill,
  // a publish must wait instead of buffering without bound.
  await broker.pause();
  t.after(() => broker.proc.kill("SIGCONT"));
  const payload = Buffer.alloc(64 * 1024, 120);
  let pending;
  let written = 1;
  for (let i = 0; i < 400 && pending === undefined; i++) {
    const p = pub.publish("big.x", payload);
    written += 1;
    const state = await Promise.race([p.then(() => "done"), new Promise((r) => setTimeout(r, 300, "pending"))]);
    if (state === "pending") pending = p;
  }
  assert.ok(pending !== undefined, "400 publishes of 64 KiB never waited for the stopped broker");
  // A unary call to the stopped broker, cancelled by its signal.
  const abort = new AbortController();
  const call = client.publishConfirmed("x.y", "", { signal: abort.signal, timeout: 5000 });
  abort.abort();
  await assert.rejects(call, (e) => e instanceof TinybrokerError && e.code === Status.CANCELLED);
  broker.proc.kill("SIGCONT");
  await pending;
  const r = await pub.close();
  assert.equal(r.accepted, written);
});

test("address list is tried in turn and env defaults apply", { timeout: 45_000 }, async (t) => {
  const broker = await starter(t)();
  const dead = "127.0.0.1:1";
  let client = await connect([dead, `http://${broker.addr}`], { timeout: 3000 });
  assert.equal(client.address, `http://${broker.addr}`);
  await client.publishConfirmed("x.y", "");
  await client.close();
  const saved = process.env.TINYBROKER_ADDR;
  process.env.TINYBROKER_ADDR = broker.addr;
  try {
    client = await connect();
    assert.equal(client.address, `http://${broker.addr}`);
    await client.close();
  } finally {
    if (saved === undefined) delete process.env.TINYBROKER_ADDR;
    else process.env.TINYBROKER_ADDR = saved;
  }
  await assert.rejects(connect(dead, { timeout: 2000 }), (e) => e instanceof TinybrokerError && e.code === Status.UNAVAILABLE);
  // An AbortSignal gives up connecting (a blackholed address would take the whole timeout).
  const silent = createServer(() => {}); // accepts, never answers HTTP/2
  await new Promise((r) => silent.listen(0, "127.0.0.1", r));
  t.after(() => silent.close());
  const sockets = [];
  silent.on("connection", (s) => sockets.push(s));
  t.after(() => sockets.forEach((s) => s.destroy()));
  const giveUp = new AbortController();
  const started = Date.now();
  const attempt = connect(`127.0.0.1:${silent.address().port}`, { timeout: 20_000, signal: giveUp.signal });
  setTimeout(() => giveUp.abort(), 100);
  await assert.rejects(attempt, (e) => e instanceof TinybrokerError && e.code === Status.CANCELLED);
  assert.ok(Date.now() - started < 10_000);
  // An AbortSignal gives up a call.
  client = await connect(broker.addr);
  t.after(() => client.close());
  await assert.rejects(
    client.publishConfirmed("x.y", "", { signal: AbortSignal.abort() }),
    (e) => e instanceof TinybrokerError && e.code === Status.CANCELLED,
  );
});
