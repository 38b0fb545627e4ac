// 1,000 WebSocket clients on the gateway, each with its own subscription on
// the gateway's one session: each gets its own messages and the broadcast.
import assert from "node:assert/strict";
import { test } from "node:test";
import { WebSocket } from "ws";
import { startGateway } from "../gateway.mjs";
import { Broker, until } from "../../../clients/typescript/tests/broker.mjs";

const USERS = 1000;

test("1,000 WebSocket clients, one subscription each, on one session", { timeout: 120_000 }, async (t) => {
  const broker = await Broker.start({ TINYBROKER_METRICS_PER_SUBSCRIPTION: "false" });
  t.after(() => broker.kill());
  const gw = await startGateway({ brokerAddr: broker.addr });
  t.after(() => gw.close());

  const sockets = [];
  const received = Array.from({ length: USERS }, () => []);
  let ready = 0;
  for (let i = 0; i < USERS; i++) {
    const ws = new WebSocket(`ws://127.0.0.1:${gw.port}/?user=u${i}`);
    ws.on("message", (data) => {
      const m = JSON.parse(data.toString());
      if (m.type === "ready") ready += 1;
      else received[i].push(m);
    });
    ws.on("error", () => {});
    sockets.push(ws);
  }
  t.after(() => sockets.forEach((ws) => ws.terminate()));
  await until(() => ready === USERS, 60_000, `${USERS} subscriptions ready (have ${ready})`, 20);

  // All on the gateway's one client: one peer address, USERS subscriptions.
  const subs = (await gw.client.admin.subscriptions()).filter((s) => s.topicPatterns.includes("broadcast.>"));
  assert.equal(subs.length, USERS);
  assert.equal(new Set(subs.map((s) => s.peerAddress)).size, 1);

  // One message to each user, then one broadcast: buffered on the gateway's
  // session, sent in batches, and flush() says what the broker accepted.
  for (let i = 0; i < USERS; i++) await gw.client.publish(`user.u${i}.greeting`, `hello u${i}`);
  await gw.client.publish("broadcast.news", "to everyone");
  const r = await gw.client.flush({ timeout: 30_000 });
  assert.deepEqual([r.accepted, r.rejected, r.unconfirmed], [USERS + 1, [], 0]);
  await until(() => received.every((r) => r.length >= 2), 60_000, "every client's two messages", 20);
  for (let i = 0; i < USERS; i++) {
    assert.deepEqual(
      received[i].map((m) => [m.topic, m.payload]),
      [
        [`user.u${i}.greeting`, `hello u${i}`],
        ["broadcast.news", "to everyone"],
      ],
      `client u${i}`,
    );
  }

  // A browser that leaves takes its subscription with it.
  sockets[0].close();
  await until(
    async () => (await gw.client.admin.subscriptions()).filter((s) => s.topicPatterns.includes("user.u0.>")).length === 0,
    10_000,
    "u0's subscription closed",
    50,
  );
});
