"""W3C trace context: publish injects the current span's traceparent and a
delivered message gives the context back (OpenTelemetry API only)."""

import pytest

import tinybroker
from conftest import run

trace = pytest.importorskip("opentelemetry.trace")
context = pytest.importorskip("opentelemetry.context")


def test_publish_injects_and_delivery_extracts_trace_context(broker):
    span_context = trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=False,
        trace_flags=trace.TraceFlags(1),
    )

    async def body():
        async with tinybroker.connect(broker.addr) as client:
            sub = await client.subscribe("tr.>")
            token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
            try:
                await client.publish_confirmed("tr.1", b"x", headers={"tracestate": "k=v"})
                async with client.publisher() as pub:
                    await pub.publish("tr.2", b"y")
            finally:
                context.detach(token)
            for topic in ("tr.1", "tr.2"):
                msg = await sub.next(timeout=5)
                assert msg.topic == topic
                assert msg.headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
                carried = trace.get_current_span(msg.trace_context).get_span_context()
                assert carried.trace_id == span_context.trace_id
            # Without a current span nothing is added by the client.
            await client.publish_confirmed("tr.3", b"z")
            assert "0af7651916cd43dd" not in (await sub.next(timeout=5)).headers.get("traceparent", "")

    run(body())
