// The Admin calls; a subscription an admin closes ends for good.
import assert from "node:assert/strict";
import { test } from "node:test";
import { connect, Status, SubscriptionEnded, TinybrokerError } from "../dist/index.js";
import { starter, until } from "./broker.mjs";

test("admin lists subscriptions, groups, info, and closes one", { timeout: 45_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const events = [];
  const sub = await client.subscribe(["a.*", "b.>"], { subscriptionId: "watched", onEvent: (e) => events.push(e) });
  const member = await client.subscribe("jobs.>", { group: "workers", ackMode: "manual", maxInFlight: 5 });
  await client.publishConfirmed("a.x", "1");
  await sub.next({ timeout: 5000 });

  const byId = async () => new Map((await client.admin.subscriptions()).map((s) => [s.subscriptionId, s]));
  const subs = await byId();
  const w = subs.get("watched");
  assert.deepEqual(w.topicPatterns, ["a.*", "b.>"]);
  assert.equal(w.mode, "multi");
  assert.equal(w.delivered, 1);
  assert.ok(w.openedAt instanceof Date);
  assert.equal(subs.get(member.subscriptionId).consumerGroup, "workers");
  assert.equal(subs.get(member.subscriptionId).ackMode, "manual");
  // A member that takes a message and does not ack it: named by it.
  await client.publishConfirmed("jobs.1", "job");
  await member.next({ timeout: 5000 });
  const held = await until(async () => {
    const s = (await byId()).get(member.subscriptionId);
    return s.unacked === 1 ? s : undefined;
  }, 5000, "unacked 1");
  assert.ok(held.oldestUnackedAge !== undefined);
  assert.equal(w.unacked, 0);
  assert.equal(w.oldestUnackedAge, undefined);
  const g = (await client.admin.groups()).find((g) => g.name === "workers");
  assert.equal(g.members, 1);
  assert.deepEqual(g.topicPatterns, ["jobs.>"]);
  const info = await client.admin.info();
  assert.ok(info.version && info.subscriptions === 2 && info.lastSequence >= 1);
  assert.ok(info.limits.consumerCapacity > 0 && !info.authEnabled);
  assert.deepEqual(await client.admin.evictions(), []);

  await client.admin.closeSubscription("watched");
  await assert.rejects(
    sub.next({ timeout: 5000 }),
    (e) => e instanceof SubscriptionEnded && e.reason === "closed_by_admin" && e.lastSequence > 0,
  );
  const ended = events.find((e) => e.type === "ended");
  assert.ok(ended && !ended.resubscribing);
  await assert.rejects(
    client.admin.closeSubscription("watched"),
    (e) => e instanceof TinybrokerError && e.code === Status.NOT_FOUND,
  );
});
