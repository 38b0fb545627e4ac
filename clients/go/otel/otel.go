// Package tinybrokerotel carries OpenTelemetry trace context through
// tinybroker messages: publishing injects the W3C `traceparent` and
// `tracestate` of the publisher's context into the message's headers, and a
// delivered message's Context extracts them, so a consumer's span continues
// the producer's trace (the broker's own spans join it too: docs/contract.md
// "Tracing").
//
// It is a module of its own, so that the client module depends on gRPC and
// protobuf only:
//
//	client, err := tinybroker.Connect(ctx, nil,
//		tinybroker.WithPropagator(tinybrokerotel.Propagator()))
//	...
//	for msg := range sub.All() {
//		ctx, span := tracer.Start(msg.Context(ctx), "handle "+msg.Topic)
//		...
//	}
package tinybrokerotel

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
)

// Propagator returns a tinybroker.Propagator that uses the global
// OpenTelemetry propagator (otel.GetTextMapPropagator) at each call, so one
// set after the client was made is used too. With no global propagator set,
// OpenTelemetry's default does nothing and messages carry no trace headers.
func Propagator() tinybroker.Propagator { return propagator{} }

// WithPropagator returns a tinybroker.Propagator that uses p (for example
// propagation.TraceContext{}) rather than the global one.
func WithPropagator(p propagation.TextMapPropagator) tinybroker.Propagator {
	return propagator{p: p}
}

type propagator struct{ p propagation.TextMapPropagator }

func (w propagator) get() propagation.TextMapPropagator {
	if w.p != nil {
		return w.p
	}
	return otel.GetTextMapPropagator()
}

// Inject writes the trace context of ctx into headers.
func (w propagator) Inject(ctx context.Context, headers map[string]string) {
	w.get().Inject(ctx, propagation.MapCarrier(headers))
}

// Extract returns ctx with the trace context found in headers, if any.
func (w propagator) Extract(ctx context.Context, headers map[string]string) context.Context {
	return w.get().Extract(ctx, propagation.MapCarrier(headers))
}
