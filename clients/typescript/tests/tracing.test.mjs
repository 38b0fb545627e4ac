// W3C trace context: publish injects the active span's traceparent and a
// delivered message gives the context back (with @opentelemetry/api, a W3C
// propagator and a context manager registered, as the SDK does).
import assert from "node:assert/strict";
import { test } from "node:test";
import { context, propagation, trace, TraceFlags } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import { connect } from "../dist/index.js";
import { starter } from "./broker.mjs";

test("publish injects and delivery extracts trace context", { timeout: 30_000 }, async (t) => {
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  propagation.setGlobalPropagator(new W3CTraceContextPropagator());
  t.after(() => {
    context.disable();
    propagation.disable();
  });
  const broker = await starter(t)();
  const client = await connect(broker.addr);
  t.after(() => client.close());
  const sub = await client.subscribe("tr.>");
  const spanContext = {
    traceId: "0af7651916cd43dd8448eb211c80319c",
    spanId: "b7ad6b7169203331",
    traceFlags: TraceFlags.SAMPLED,
  };
  await context.with(trace.setSpanContext(context.active(), spanContext), async () => {
    await client.publishConfirmed("tr.1", "x", { headers: { tracestate: "k=v" } });
    const pub = client.publisher();
    await pub.publish("tr.2", "y");
    await pub.close();
  });
  for (const topic of ["tr.1", "tr.2"]) {
    const msg = await sub.next({ timeout: 5000 });
    assert.equal(msg.topic, topic);
    assert.ok(msg.headers.traceparent.startsWith("00-0af7651916cd43dd8448eb211c80319c-"), msg.headers.traceparent);
    assert.equal(trace.getSpanContext(msg.traceContext)?.traceId, spanContext.traceId);
  }
  // Without an active span the client adds nothing.
  await client.publishConfirmed("tr.3", "z");
  assert.ok(!((await sub.next({ timeout: 5000 })).headers.traceparent ?? "").includes("0af7651916cd43dd"));
});
