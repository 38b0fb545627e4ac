package tinybroker

import (
	"context"
	"testing"
	"time"
)

// BenchmarkPublishAsync: buffered publishes of 16-byte payloads, flushed
// at the end (the broker's answers included).
func BenchmarkPublishAsync(b *testing.B) {
	br := startBroker(b, nil)
	c := connect(b, []string{br.addr})
	ctx := context.Background()
	payload := make([]byte, 16)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if err := c.PublishAsync(ctx, "bench.a", payload); err != nil {
			b.Fatal(err)
		}
	}
	fctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, err := c.Flush(fctx); err != nil {
		b.Fatal(err)
	}
}
