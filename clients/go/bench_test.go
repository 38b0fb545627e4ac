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

// BenchmarkReceive: one subscription receives what another client
// publishes (buffered), 16-byte payloads.
func BenchmarkReceive(b *testing.B) {
	br := startBroker(b, map[string]string{"TINYBROKER_CONSUMER_CAPACITY": "1048576", "TINYBROKER_CONSUMER_MAX_BYTES": "1073741824"})
	pubc := connect(b, []string{br.addr})
	subc := connect(b, []string{br.addr})
	ctx := context.Background()
	sub, err := subc.Subscribe(ctx, []string{"recv.>"})
	if err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, 16)
	b.ReportAllocs()
	b.ResetTimer()
	go func() {
		for range b.N {
			if err := pubc.PublishAsync(ctx, "recv.a", payload); err != nil {
				return
			}
		}
	}()
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for range b.N {
		if _, err := sub.Next(rctx); err != nil {
			var evs []SubscriptionEvent
			for len(sub.Events()) > 0 {
				evs = append(evs, <-sub.Events())
			}
			b.Fatalf("%v; stats %+v; publisher %+v; events %+v", err, subc.Stats(), pubc.Stats(), evs)
		}
	}
}

// BenchmarkSubscriptions1000: 1,000 subscriptions on one client, each
// receiving one message per op.
func BenchmarkSubscriptions1000(b *testing.B) {
	br := startBroker(b, nil)
	c := connect(b, []string{br.addr})
	ctx := context.Background()
	subs := make([]*Subscription, 1000)
	for i := range subs {
		s, err := c.Subscribe(ctx, []string{"many.>"})
		if err != nil {
			b.Fatal(err)
		}
		subs[i] = s
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	b.ResetTimer()
	for range b.N {
		if err := c.PublishAsync(ctx, "many.a", []byte("x")); err != nil {
			b.Fatal(err)
		}
		for _, s := range subs {
			if _, err := s.Next(rctx); err != nil {
				b.Fatal(err)
			}
		}
	}
}
