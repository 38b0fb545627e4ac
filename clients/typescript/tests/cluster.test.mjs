// Cluster mode: two replicas over one nats-server (JetStream); the client
// has both addresses, its replica is killed, and it is back on the other.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { connect } from "../dist/index.js";
import { Broker, NatsServer, freePort, until } from "./broker.mjs";

async function cluster(t) {
  const dir = mkdtempSync(join(tmpdir(), "tinybroker-nats-"));
  const nats = await NatsServer.start(dir);
  const started = [];
  t.after(async () => {
    for (const b of started) await b.kill();
    await nats.kill();
    rmSync(dir, { recursive: true, force: true });
  });
  return {
    nats,
    replica: async (id, natsUrl = nats.url, waitServing = true) => {
      const env = { TINYBROKER_NATS_URL: natsUrl, TINYBROKER_NATS_REPLICAS: "1", TINYBROKER_REPLICA_ID: id };
      const b = await Broker.start(env, { port: await freePort(), waitServing });
      started.push(b);
      return b;
    },
  };
}

test("the client moves to the other replica when its own is killed", { timeout: 90_000 }, async (t) => {
  const c = await cluster(t);
  const a = await c.replica("a");
  const b = await c.replica("b");
  const events = [];
  const client = await connect([a.addr, b.addr]);
  t.after(() => client.close());
  assert.equal(client.address, `http://${a.addr}`);
  const broadcast = await client.subscribe("c.>", { onEvent: (e) => events.push(e) });
  const member = await client.subscribe("c.>", { group: "cg", ackMode: "manual" });
  assert.equal((await client.admin.info()).replicaId, "a");
  // A message published on b reaches the subscriptions on a.
  const other = await connect(b.addr);
  t.after(() => other.close());
  await other.publishConfirmed("c.1", "via-b");
  assert.equal((await broadcast.next({ timeout: 10_000 })).string(), "via-b");
  assert.ok((await member.next({ timeout: 10_000 })).ack());

  await a.kill();
  await until(
    () => broadcast.stats.resubscribes >= 1 && broadcast.isOpen && member.isOpen,
    30_000,
    "both subscriptions back on replica b",
  );
  assert.equal(client.address, `http://${b.addr}`);
  assert.equal((await client.admin.info()).replicaId, "b");
  // Published on b, received on b: the application needed no code.
  await other.publishConfirmed("c.2", "after");
  assert.equal((await broadcast.next({ timeout: 10_000 })).string(), "after");
  const m = await member.next({ timeout: 10_000 });
  assert.equal(m.string(), "after");
  assert.ok(m.ack());
  assert.deepEqual(events.filter((e) => e.type === "ended"), []); // a lost session is not an end
});

test("a replica that cannot serve is passed over for the next address", { timeout: 60_000 }, async (t) => {
  const c = await cluster(t);
  // A replica whose NATS does not answer: it listens, NOT_SERVING, and
  // refuses opens with UNAVAILABLE.
  const cutOff = await c.replica("cut-off", `nats://127.0.0.1:${await freePort()}`, false);
  const good = await c.replica("good");
  const client = await connect([cutOff.addr, good.addr]);
  t.after(() => client.close());
  assert.equal(client.address, `http://${cutOff.addr}`);
  const sub = await client.subscribe("d.>", { timeout: 20_000 });
  assert.equal(client.address, `http://${good.addr}`);
  await client.publishConfirmed("d.1", "served");
  assert.equal((await sub.next({ timeout: 10_000 })).string(), "served");
});
