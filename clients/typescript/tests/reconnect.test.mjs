// Every subscription back, with no application code, after the broker is
// killed and restarted on the same port, and after it shuts down.
import assert from "node:assert/strict";
import { test } from "node:test";
import { connect, SubscriptionEnded } from "../dist/index.js";
import { freePort, starter, until } from "./broker.mjs";

/** Publishes to `topic` until every subscription got that message. */
async function receives(client, subs, topic) {
  const result = await client.publishConfirmed(topic, "ping");
  for (const sub of subs) {
    for (;;) {
      const m = await sub.next({ timeout: 10_000 });
      if (m.sequence === result.sequence) break;
    }
  }
}

test("every subscription is back after the broker is killed and restarted", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const events = [];
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const subs = [];
  for (let i = 0; i < 20; i++) subs.push(await client.subscribe(`room.${i}.>`, { onEvent: (e) => events.push(e) }));
  const named = await client.subscribe("room.>", { subscriptionId: "my-named-sub" });
  const member = await client.subscribe("room.>", { group: "g", ackMode: "manual" });
  const everyone = [...subs, named, member];
  await client.publishConfirmed("room.1.x", "before");
  assert.equal((await subs[1].next({ timeout: 5000 })).string(), "before");

  await broker.kill();
  await until(() => everyone.every((s) => !s.isOpen), 10_000, "every subscription to notice");
  // A lost session is not an end of a subscription: no event of its own.
  assert.deepEqual(events.filter((e) => e.type === "ended"), []);

  await broker.start(); // the same port
  await until(() => everyone.every((s) => s.isOpen), 15_000, "every subscription back");
  assert.equal(client.reconnects, 1);
  assert.ok(everyone.every((s) => s.stats.resubscribes === 1));
  assert.equal(named.subscriptionId, "my-named-sub");
  for (const i of [0, 7, 19]) await receives(client, [subs[i], named, member], `room.${i}.y`);
  assert.equal(subs[0].lastGap?.cause, "connection_lost");
  assert.equal(subs[0].lastGap?.missed, undefined);
  const ids = new Set((await client.admin.subscriptions()).map((s) => s.subscriptionId));
  assert.ok(everyone.every((s) => ids.has(s.subscriptionId)));
});

test("subscriptions come back after a graceful shutdown and restart", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const events = [];
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("a.>", { onEvent: (e) => events.push(e) });
  await broker.stop();
  await until(() => events.some((e) => e.type === "ended"), 10_000, "the end");
  const ended = events.find((e) => e.type === "ended");
  assert.equal(ended.reason, "shutdown");
  assert.ok(ended.resubscribing);
  await broker.start();
  await until(() => sub.isOpen, 15_000, "back");
  await receives(client, [sub], "a.b");
});

test("re-subscription can be turned off", { timeout: 30_000 }, async (t) => {
  const broker = await starter(t)({}, { port: await freePort() });
  const client = await connect(broker.addr, { resubscribe: false });
  t.after(() => client.close());
  const sub = await client.subscribe("a.>");
  await broker.kill();
  await assert.rejects(sub.next({ timeout: 10_000 }), (e) => e instanceof SubscriptionEnded && e.reason === "connection_lost");
});
