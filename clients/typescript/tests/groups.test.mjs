// A MANUAL consumer group: ack, nack and redelivery, all in-band.
import assert from "node:assert/strict";
import { test } from "node:test";
import { connect } from "../dist/index.js";
import { starter, until } from "./broker.mjs";

test("manual group: ack, nack and redelivery", { timeout: 45_000 }, async (t) => {
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const a = await client.subscribe("jobs.>", { group: "workers", ackMode: "manual", ackDeadline: 30_000 });
  for (let i = 0; i < 3; i++) await client.publishConfirmed("jobs.run", `job-${i}`);
  const first = [];
  for (let i = 0; i < 3; i++) first.push(await a.next({ timeout: 5000 }));
  assert.deepEqual(first.map((m) => m.string()), ["job-0", "job-1", "job-2"]);
  assert.ok(first.every((m) => m.deliveryAttempt === 1 && m.consumerGroup === "workers"));

  // Nack: handed back at once, redelivered with the next attempt.
  assert.equal(first[0].nack(), true);
  const again = await a.next({ timeout: 5000 });
  assert.deepEqual([again.string(), again.deliveryAttempt], ["job-0", 2]);
  assert.equal(again.sequence, first[0].sequence);

  // Ack two; the third stays in flight until its member leaves.
  assert.equal(again.ack(), true);
  assert.equal(first[1].ack(), true);
  const inFlight = async () => (await client.admin.groups()).find((g) => g.name === "workers").inFlight;
  await until(async () => (await inFlight()) === 1, 5000, "in_flight 1");

  // A second member on another client; the first leaves with job-2 unacked:
  // it is redelivered to the second.
  const other = await connect(broker.addr);
  t.after(() => other.close());
  const b = await other.subscribe("jobs.>", { group: "workers", ackMode: "manual", ackDeadline: 30_000 });
  await a.close();
  assert.equal(first[2].ack(), false, "an ack after close is not sent");
  const moved = await b.next({ timeout: 5000 });
  assert.deepEqual([moved.string(), moved.deliveryAttempt], ["job-2", 2]);
  assert.equal(moved.ack(), true);
  await until(async () => (await inFlight()) === 0, 5000, "in_flight 0");
  const g = (await client.admin.groups()).find((g) => g.name === "workers");
  assert.ok(g.redeliveries >= 2);
});
