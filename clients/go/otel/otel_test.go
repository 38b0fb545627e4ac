package tinybrokerotel_test

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
	tinybrokerotel "github.com/tinybroker/tinybroker/clients/go/otel"
)

// startBroker runs the real broker binary ($TINYBROKER_BIN, else the
// repository's target/debug/tinybroker) on a free 127.0.0.1 port and returns
// its address once it accepts connections; it is killed when the test ends.
func startBroker(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("TINYBROKER_BIN")
	if bin == "" {
		bin, _ = filepath.Abs("../../../target/debug/tinybroker")
	}
	addr, metrics := freeAddr(t), freeAddr(t)
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "TINYBROKER_GRPC_ADDR="+addr, "TINYBROKER_METRICS_ADDR="+metrics)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", bin, err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	deadline := time.Now().Add(15 * time.Second)
	for {
		conn, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			conn.Close()
			return addr
		}
		if time.Now().After(deadline) {
			t.Fatalf("the broker did not listen on %s within 15 s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// A consumer's context continues the publisher's trace, through both the
// buffered and the confirmed publish; with no propagator nothing is added.
func TestTraceContextCrossesTheBroker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	addr := startBroker(t)
	provider := sdktrace.NewTracerProvider()
	defer func() { _ = provider.Shutdown(context.Background()) }()
	tracer := provider.Tracer("test")

	traced, err := tinybroker.Connect(ctx, []string{addr},
		tinybroker.WithPropagator(tinybrokerotel.WithPropagator(propagation.TraceContext{})))
	if err != nil {
		t.Fatal(err)
	}
	defer traced.Close()
	plain, err := tinybroker.Connect(ctx, []string{addr})
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	sub, err := traced.Subscribe(ctx, []string{"traced.>"})
	if err != nil {
		t.Fatal(err)
	}

	spanCtx, span := tracer.Start(ctx, "publish")
	want := span.SpanContext().TraceID()
	if err := traced.PublishAsync(spanCtx, "traced.buffered", []byte("a")); err != nil {
		t.Fatal(err)
	}
	if _, err := traced.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := traced.Publish(spanCtx, "traced.confirmed", []byte("b")); err != nil {
		t.Fatal(err)
	}
	span.End()
	if _, err := plain.Publish(spanCtx, "traced.untraced", []byte("c")); err != nil {
		t.Fatal(err)
	}

	for _, topic := range []string{"traced.buffered", "traced.confirmed", "traced.untraced"} {
		msg, err := sub.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if msg.Topic != topic {
			t.Fatalf("got %s, want %s", msg.Topic, topic)
		}
		got := trace.SpanContextFromContext(msg.Context(context.Background()))
		if topic == "traced.untraced" {
			if _, ok := msg.Headers["traceparent"]; ok || got.IsValid() {
				t.Fatalf("%s: a client without a propagator added trace context: %v", topic, msg.Headers)
			}
			continue
		}
		if got.TraceID() != want {
			t.Fatalf("%s: trace %s in headers %v, want %s", topic, got.TraceID(), msg.Headers, want)
		}
	}
}
