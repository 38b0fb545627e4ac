package tinybroker

import (
	"fmt"
	"strconv"
	"testing"
	"time"
)

// TestMessagesWindows: through Messages() every message comes, in order,
// whatever the window (credit flows, the buffered channel never holds it
// back), and what the client holds for a subscription nobody reads stays
// within the window, the channel's content included.
func TestMessagesWindows(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	for _, window := range []int{1, 2, 3, 4, 5, 8, 64, 256} {
		t.Run(strconv.Itoa(window), func(t *testing.T) {
			topic := "mw" + strconv.Itoa(window)
			sub := subscribe(t, c, []string{topic + ".>"}, WithSubscriptionWindow(window))
			defer func() { _ = sub.Close() }()
			msgs := sub.Messages()
			const n = 600
			for i := range n {
				publishAsync(t, c, topic+".a", []byte(strconv.Itoa(i)))
			}
			flush(t, c, 10*time.Second)
			// Unread: the client comes to hold the window, never more.
			waitFor(t, 10*time.Second, fmt.Sprintf("the window (%d) held", window), func() bool {
				p := sub.Pending()
				if p > window {
					t.Fatalf("pending %d > window %d", p, window)
				}
				return p == window
			})
			timeout := time.After(20 * time.Second)
			for i := range n {
				select {
				case m, ok := <-msgs:
					if !ok {
						t.Fatalf("closed after %d: %v", i, sub.Err())
					}
					if string(m.Payload) != strconv.Itoa(i) {
						t.Fatalf("message %d: %q", i, m.Payload)
					}
					if p := sub.Pending(); p > window {
						t.Fatalf("pending %d > window %d", p, window)
					}
				case <-timeout:
					t.Fatalf("%d of %d messages; pending %d, stats %+v", i, n, sub.Pending(), c.Stats())
				}
			}
		})
	}
}

// TestOneDeliveryToSeveralSubscriptions: a message for several handles of
// the session comes to each subscription as a Message of its own.
func TestOneDeliveryToSeveralSubscriptions(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	var subs []*Subscription
	for range 3 {
		subs = append(subs, subscribe(t, c, []string{"many.>"}))
	}
	for i := range 5 {
		publishAsync(t, c, "many.a", []byte(strconv.Itoa(i)))
	}
	flush(t, c, 10*time.Second)
	seen := map[*Message]bool{}
	for i := range 5 {
		for _, s := range subs {
			m := next(t, s, 5*time.Second)
			if string(m.Payload) != strconv.Itoa(i) || m.Topic != "many.a" || m.SubscriptionID != s.ID() || m.sub != s || seen[m] {
				t.Fatalf("message %d of %s: %+v", i, s.ID(), m)
			}
			seen[m] = true
		}
	}
}

// TestMessagesDroppedOnClose: what the Messages channel holds is dropped
// when the subscription or its client is closed, as what the queue holds.
func TestMessagesDroppedOnClose(t *testing.T) {
	b := startBroker(t, nil)
	for _, closeClient := range []bool{false, true} {
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"drop.>"})
		msgs := sub.Messages()
		for i := range 64 { // the channel full, Messages' goroutine waiting for more
			publishAsync(t, c, "drop.a", []byte(strconv.Itoa(i)))
		}
		flush(t, c, 10*time.Second)
		waitFor(t, 5*time.Second, "the messages", func() bool { return len(msgs) == cap(msgs) && cap(msgs) > 0 })
		if closeClient {
			_ = c.Close()
		} else {
			_ = sub.Close()
		}
		for m := range msgs {
			t.Fatalf("client closed %v: got %q after the close", closeClient, m.Payload)
		}
		_ = c.Close()
	}
}
