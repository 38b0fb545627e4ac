package tinybroker

import (
	"fmt"
	"testing"
	"time"
)

func TestRoundTrip(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	ctx := ctxT(t, 20*time.Second)
	sub, err := c.Subscribe(ctx, []string{"greetings.>"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := c.PublishAsync(ctx, "greetings.x", []byte(fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	r, err := c.Flush(ctx)
	if err != nil || r.Accepted != 10 {
		t.Fatalf("flush: %+v %v", r, err)
	}
	for i := range 10 {
		m, err := sub.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if string(m.Payload) != fmt.Sprint(i) {
			t.Fatalf("got %q want %d", m.Payload, i)
		}
	}
	res, err := c.Publish(ctx, "greetings.y", []byte("u"))
	if err != nil || res.Sequence != 11 || res.MatchedSubscriptions != 1 {
		t.Fatalf("%+v %v", res, err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}
