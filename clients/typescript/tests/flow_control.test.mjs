// Credit per subscription: one left unread stalls (and is evicted) alone;
// an eviction is reported with its gap, then the subscription is back.
import assert from "node:assert/strict";
import { test } from "node:test";
import { connect, SubscriptionEnded } from "../dist/index.js";
import { starter, until } from "./broker.mjs";

const CAPACITY = 32;

test("an unread subscription is evicted alone and its sibling keeps receiving", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({ TINYBROKER_CONSUMER_CAPACITY: String(CAPACITY) });
  const window = 16;
  const client = await connect(broker.addr, { window });
  t.after(() => client.close());
  const unread = await client.subscribe("load.>", { resubscribe: false });
  const read = await client.subscribe("load.>");
  const total = 400;
  const batch = 8;
  const received = [];
  // Rounds the sibling keeps up with: each waits for it to catch up.
  const pub = client.publisher();
  for (let start = 0; start < total; start += batch) {
    for (let i = start; i < start + batch; i++) await pub.publish("load.x", String(i));
    while (received.length < start + batch) received.push(Number((await read.next({ timeout: 5000 })).string()));
  }
  await pub.close();
  assert.deepEqual(received, [...Array(total).keys()]);
  // The unread one held no more than its window and was evicted.
  await until(() => unread.done, 10_000, "the unread subscription to end");
  assert.ok(unread.pending <= window, `pending ${unread.pending} > window ${window}`);
  assert.equal(unread.stats.evictions, 1);
  assert.equal(read.stats.ends, 0);
  assert.ok(read.isOpen);
  const evicted = new Set((await client.admin.evictions()).map((e) => e.subscriptionId));
  assert.ok(evicted.has(unread.subscriptionId) && !evicted.has(read.subscriptionId));
  // Its end is an exception with the reason, after what it held.
  let got = 0;
  await assert.rejects(
    (async () => {
      for await (const _ of unread) got += 1;
    })(),
    (e) => e instanceof SubscriptionEnded && e.reason === "evicted" && e.dropped > 0 && e.lastSequence > 0,
  );
  assert.equal(got, window);
});

test("an eviction is reported with its gap, then re-subscribed", { timeout: 60_000 }, async (t) => {
  const broker = await starter(t)({ TINYBROKER_CONSUMER_CAPACITY: String(CAPACITY) });
  const events = [];
  const client = await connect(broker.addr, { window: 8 });
  t.after(() => client.close());
  const sub = await client.subscribe("feed.>", { subscriptionId: "feed-reader", onEvent: (e) => events.push(e) });
  // Nobody reads while messages arrive: evicted (publishing stops there, so
  // the re-opened subscription gets none of them).
  for (let i = 0; i < 1000 && sub.stats.evictions === 0; i++) await client.publishConfirmed("feed.a", String(i));
  // It holds its whole window: not opened again until the application takes one.
  await until(() => sub.state === "WAITING", 10_000, "waiting for room in its window");
  assert.equal(sub.pending, 8);
  assert.equal(sub.stats.resubscribes, 0);
  const before = [];
  for (let i = 0; i < 8; i++) before.push(await sub.next({ timeout: 5000 }));
  await until(() => sub.stats.resubscribes >= 1 && sub.isOpen, 10_000, "re-subscribed");
  const ended = events.find((e) => e.type === "ended");
  assert.equal(ended.reason, "evicted");
  assert.ok(ended.resubscribing && ended.dropped > 0 && ended.lastSequence > 0);
  assert.equal(sub.subscriptionId, "feed-reader"); // the id it named is kept
  assert.ok(events.some((e) => e.type === "resubscribed"));
  // What it had taken in before the eviction, then the next message after the gap.
  const result = await client.publishConfirmed("feed.a", "after");
  const msg = await sub.next({ timeout: 5000 });
  assert.equal(msg.string(), "after");
  const gap = sub.lastGap;
  assert.ok(gap !== undefined && sub.stats.gaps === 1);
  assert.equal(gap.lastBefore, ended.lastSequence);
  assert.equal(gap.lastBefore, before.at(-1).sequence);
  assert.equal(gap.firstAfter, result.sequence);
  assert.ok(gap.firstAfter > gap.lastBefore + 1);
  assert.equal(gap.cause, "evicted");
  assert.deepEqual(gap.missed, { first: gap.lastBefore + 1, last: gap.firstAfter - 1 });
  assert.equal(gap.dropped, ended.dropped);
  assert.equal(events.at(-1).type, "gap");
});
