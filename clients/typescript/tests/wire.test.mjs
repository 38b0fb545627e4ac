// The hand-coded hot messages (src/wire.ts) against the generated codec:
// the same bytes out, the same objects in.
import assert from "node:assert/strict";
import { test } from "node:test";
import { decodeEvent, encodePublish } from "../dist/wire.js";
import { SessionEvent, SessionRequest } from "../dist/gen/tinybroker/v1/broker.js";

const message = (i) => ({
  topic: i % 3 ? `t.ü.${i}` : "",
  payload: Buffer.alloc((i * 7) % 300, i),
  headers: i % 2 ? { a: "b", traceparent: "x".repeat(i), "": "" } : {},
  sequence: 2 ** 40 + i,
  publishTime: i % 4 ? { seconds: 1733380000 + i, nanos: i * 1000 } : undefined,
  subscriptionId: i % 5 ? "" : `sub-${i}`,
  consumerGroup: i % 6 ? "" : "g",
  deliveryAttempt: i % 3,
});

test("a SessionPublish batch encodes as the generated encoder does", { timeout: 5000 }, () => {
  for (const [id, n] of [[1, 1], [300, 2], [2 ** 40, 200]]) {
    const messages = Array.from({ length: n }, (_, i) => {
      const { topic, payload, headers } = message(i);
      return { topic, payload: i === 1 ? Buffer.alloc(70_000, 1) : payload, headers: { ...headers, e: "" } };
    });
    const expected = Buffer.from(SessionRequest.encode({ request: { $case: "publish", value: { id, messages } } }).finish());
    assert.ok(encodePublish(id, messages).equals(expected), `batch ${id} of ${n}`);
  }
});

test("a deliveries event decodes as the generated decoder does", { timeout: 5000 }, () => {
  const events = [
    { $case: "deliveries", value: { deliveries: Array.from({ length: 50 }, (_, i) => ({ handles: i % 2 ? [1, 300, 70000] : [i + 1], message: message(i) })) } },
    { $case: "deliveries", value: { deliveries: [] } },
    { $case: "delivery", value: { handles: [3], message: message(3) } },
    { $case: "opened", value: { handle: 5, subscriptionId: "x" } },
    { $case: "published", value: { id: 3, firstSequence: 10, accepted: 2, rejected: [{ index: 1, code: 3, message: "bad" }] } },
  ];
  for (const event of events) {
    const bytes = Buffer.from(SessionEvent.encode({ event }).finish());
    assert.deepStrictEqual(decodeEvent(bytes), SessionEvent.decode(bytes), event.$case);
  }
});
