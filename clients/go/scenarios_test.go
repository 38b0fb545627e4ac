package tinybroker

// docs/clients.md "The scenario list": one subtest per row, under its name,
// against the real broker binary (and nats-server for the cluster one).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

func TestScenarios(t *testing.T) {
	t.Run("publish_returns_at_once_and_flush_reports", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"pub.>"})
		// The broker answers nothing while stopped: publishes that waited
		// for it would not return.
		b.signal(syscall.SIGSTOP)
		pid := b.cmd.Process.Pid
		waitFor(t, 5*time.Second, "the broker to stop", func() bool { return stopped(pid) })
		ctx := ctxT(t, 2*time.Second)
		for i := range 500 {
			if err := c.PublishAsync(ctx, "pub.a", []byte(strconv.Itoa(i))); err != nil {
				b.signal(syscall.SIGCONT)
				t.Fatalf("publish %d waited: %v", i, err)
			}
		}
		if s := c.Stats(); s.PendingMessages+s.MessagesOut != 500 {
			t.Fatalf("pending %d + out %d != 500", s.PendingMessages, s.MessagesOut)
		}
		b.signal(syscall.SIGCONT)
		r := flush(t, c, 10*time.Second)
		if r.Accepted != 500 || len(r.Rejected) != 0 || r.UnconfirmedCount() != 0 {
			t.Fatalf("flush: %+v", r)
		}
		if s := c.Stats(); s.PendingMessages != 0 {
			t.Fatalf("pending after flush: %d", s.PendingMessages)
		}
		for i := range 500 {
			if m := next(t, sub, 5*time.Second); string(m.Payload) != strconv.Itoa(i) {
				t.Fatalf("message %d: %q", i, m.Payload)
			}
		}
		if r := flush(t, c, 5*time.Second); r.Accepted != 0 {
			t.Fatalf("an outcome reported twice: %+v", r)
		}
	})

	t.Run("flush_reports_each_rejection", func(t *testing.T) {
		b := startBroker(t, map[string]string{"TINYBROKER_MAX_MESSAGE_BYTES": "1024"})
		c := connect(t, []string{b.addr})
		publishAsync(t, c, "ok.1", []byte("a"))
		publishAsync(t, c, "bad topic", []byte("b"))
		publishAsync(t, c, "ok.2", []byte("c"))
		publishAsync(t, c, "ok.big", bytes.Repeat([]byte("x"), 2000))
		publishAsync(t, c, "ok.3", []byte("d"))
		r := flush(t, c, 10*time.Second)
		if r.Accepted != 3 || r.UnconfirmedCount() != 0 || len(r.Rejected) != 2 {
			t.Fatalf("flush: %+v", r)
		}
		r0, r1 := r.Rejected[0], r.Rejected[1]
		if r0.Index != 1 || r0.Topic != "bad topic" || r0.Code != codes.InvalidArgument || !strings.Contains(r0.Message, "bad topic") {
			t.Fatalf("first rejection: %+v", r0)
		}
		if r1.Index != 3 || r1.Topic != "ok.big" || r1.Code != codes.ResourceExhausted ||
			!(strings.Contains(r1.Message, "max_message_bytes") || strings.Contains(r1.Message, "1024")) {
			t.Fatalf("second rejection: %+v", r1)
		}
	})

	t.Run("publish_waits_when_the_buffer_is_full", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr}, WithBufferBytes(4096))
		sub := subscribe(t, c, []string{"full.>"})
		b.kill()
		waitLost(t, c)
		done := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			for i := range 20 {
				p := append([]byte(strconv.Itoa(i)+"."), bytes.Repeat([]byte("."), 1000)...)
				if err := c.PublishAsync(ctx, "full.a", p); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
		waitFor(t, 10*time.Second, "the buffer to fill", func() bool { return c.Stats().PendingBytes >= 4096 })
		// Waiting, seen from the buffer: a publisher is waiting for room.
		waitFor(t, 10*time.Second, "a PublishAsync waiting for room", func() bool {
			c.pub.mu.Lock()
			defer c.pub.mu.Unlock()
			return c.pub.roomWaiters == 1
		})
		select {
		case err := <-done:
			t.Fatalf("PublishAsync should wait while the buffer is full (returned %v)", err)
		default:
		}
		if pb := c.Stats().PendingBytes; pb >= 4096+1100 {
			t.Fatalf("the buffer grew to %d", pb)
		}
		b.restart()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("PublishAsync did not go on once the broker was back")
		}
		r := flush(t, c, 15*time.Second)
		if r.Accepted != 20 || r.UnconfirmedCount() != 0 || len(r.Rejected) != 0 {
			t.Fatalf("flush: %+v", r)
		}
		for i := range 20 {
			m := next(t, sub, 5*time.Second)
			if got := strings.SplitN(string(m.Payload), ".", 2)[0]; got != strconv.Itoa(i) {
				t.Fatalf("message %d: %s", i, got)
			}
		}
	})

	t.Run("publishers_share_one_clients_batches", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		var wg sync.WaitGroup
		for k := range 10 {
			wg.Go(func() {
				for i := range 100 {
					if err := c.PublishAsync(context.Background(), fmt.Sprintf("share.%d", k), []byte(strconv.Itoa(i))); err != nil {
						t.Error(err)
						return
					}
					runtime.Gosched() // a goroutine that yields after each message
				}
			})
		}
		wg.Wait()
		if r := flush(t, c, 10*time.Second); r.Accepted != 1000 {
			t.Fatalf("flush: %+v", r)
		}
		m := b.metrics(t)
		batches := m["tinybroker_publish_batch_size_count"]
		if m["tinybroker_publish_batch_size_sum"] != 1000 || 1000/batches < 5 {
			t.Fatalf("%v batches for %v messages", batches, m["tinybroker_publish_batch_size_sum"])
		}
		t.Logf("%v batches for 1000 messages", batches)
	})

	t.Run("buffered_publishes_go_out_after_a_restart", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"restart.>"})
		b.kill()
		waitLost(t, c)
		for i := range 100 {
			publishAsync(t, c, "restart.a", []byte(strconv.Itoa(i)))
		}
		if s := c.Stats(); s.PendingMessages != 100 {
			t.Fatalf("pending %d", s.PendingMessages)
		}
		b.restart()
		r := flush(t, c, 15*time.Second)
		if r.Accepted != 100 || r.UnconfirmedCount() != 0 || len(r.Rejected) != 0 {
			t.Fatalf("flush: %+v", r)
		}
		// The subscription is opened before the buffer is written: all of
		// them, once each, in order.
		for i := range 100 {
			if m := next(t, sub, 5*time.Second); string(m.Payload) != strconv.Itoa(i) {
				t.Fatalf("message %d: %q", i, m.Payload)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		if m, err := sub.Next(ctx); !errors.Is(err, ErrTimeout) {
			t.Fatalf("one more message: %v %v", m, err)
		}
		info, err := c.Admin().BrokerInfo(ctxT(t, 5*time.Second))
		if err != nil || info.MessagesPublished != 100 {
			t.Fatalf("published %v %v", info.GetMessagesPublished(), err)
		}
	})

	t.Run("unanswered_batches_are_unconfirmed", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		publishAsync(t, c, "un.a", []byte("first"))
		if r := flush(t, c, 5*time.Second); r.Accepted != 1 {
			t.Fatalf("flush: %+v", r)
		}
		b.signal(syscall.SIGSTOP) // it answers nothing now
		pid := b.cmd.Process.Pid
		waitFor(t, 5*time.Second, "the broker to stop", func() bool { return stopped(pid) })
		release := c.hold(t) // the ten are published at one moment: one batch
		for i := range 10 {
			publishAsync(t, c, "un.a", []byte(strconv.Itoa(i)))
		}
		release()
		waitFor(t, 10*time.Second, "the batch to be written", func() bool { return c.Stats().MessagesOut == 11 })
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err := c.Flush(ctx)
		cancel()
		if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("flush while the broker is stopped: %v", err)
		}
		b.kill() // the connection is cut before any answer
		waitLost(t, c)
		b.restart()
		publishAsync(t, c, "un.a", []byte("after"))
		r := flush(t, c, 15*time.Second)
		if r.UnconfirmedCount() != 10 || len(r.Unconfirmed) != 1 || r.Unconfirmed[0] != (IndexRange{1, 10}) || r.Accepted != 1 || len(r.Rejected) != 0 {
			t.Fatalf("flush: %+v", r)
		}
		// Never written again: the restarted broker got only "after".
		info, err := c.Admin().BrokerInfo(ctxT(t, 5*time.Second))
		if err != nil || info.MessagesPublished != 1 {
			t.Fatalf("published %v %v", info.GetMessagesPublished(), err)
		}
		if out := c.Stats().MessagesOut; out != 12 {
			t.Fatalf("messages out %d", out)
		}
	})

	t.Run("deliveries_come_in_batches", func(t *testing.T) {
		b := startBroker(t, nil)
		var mu sync.Mutex
		var sent []metadata.MD
		spy := grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if strings.HasSuffix(method, "/Session") {
				md, _ := metadata.FromOutgoingContext(ctx)
				mu.Lock()
				sent = append(sent, md)
				mu.Unlock()
			}
			return streamer(ctx, desc, cc, method, opts...)
		})
		receiver := connect(t, []string{b.addr}, WithDialOptions(spy))
		sender := connect(t, []string{b.addr})
		sub := subscribe(t, receiver, []string{"burst.>"})
		for i := range 200 {
			publishAsync(t, sender, "burst.a", []byte(strconv.Itoa(i)))
		}
		if r := flush(t, sender, 10*time.Second); r.Accepted != 200 {
			t.Fatalf("flush: %+v", r)
		}
		waitFor(t, 10*time.Second, "the whole burst", func() bool { return sub.Pending() == 200 })
		for i := range 200 {
			if m := next(t, sub, 5*time.Second); string(m.Payload) != strconv.Itoa(i) {
				t.Fatalf("message %d: %q", i, m.Payload)
			}
		}
		mu.Lock()
		for _, md := range sent {
			if v := md.Get("tinybroker-batch"); len(v) != 1 || v[0] != "1" {
				t.Fatalf("session metadata %v", md)
			}
		}
		n := len(sent)
		mu.Unlock()
		if n == 0 {
			t.Fatal("no session seen")
		}
		m := b.metrics(t)
		if events := m["tinybroker_delivery_batch_size_count"]; m["tinybroker_delivery_batch_size_sum"] < 200 || events >= 200 {
			t.Fatalf("%v deliveries events for %v deliveries", events, m["tinybroker_delivery_batch_size_sum"])
		}
	})

	t.Run("acks_are_coalesced", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		member := subscribe(t, c, []string{"job.>"}, WithGroup("workers"), WithManualAck(),
			WithAckDeadline(60*time.Second), WithMaxInFlight(200))
		for i := range 100 {
			publishAsync(t, c, "job.a", []byte(strconv.Itoa(i)))
		}
		flush(t, c, 10*time.Second)
		var taken []*Message
		for range 100 {
			taken = append(taken, next(t, member, 5*time.Second))
		}
		release := c.hold(t) // the acks are made at one moment
		for _, m := range taken {
			if !m.Ack() {
				release()
				t.Fatal("ack refused")
			}
		}
		sentBefore := c.acksSent.Load()
		release()
		if sentBefore != 0 {
			t.Fatalf("ack() sent %d requests on its own", sentBefore)
		}
		inFlight := func() uint64 {
			r, err := c.Admin().ListConsumerGroups(ctxT(t, 5*time.Second), nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, g := range r.Groups {
				if g.Name == "workers" {
					return g.InFlight
				}
			}
			return 1 << 62
		}
		waitFor(t, 10*time.Second, "the in-flight count to drop to 0", func() bool { return inFlight() == 0 })
		if n := c.acksSent.Load(); n != 1 {
			t.Fatalf("%d SessionAck requests for 100 acks", n)
		}
		var acked float64
		for k, v := range b.metrics(t) {
			if strings.HasPrefix(k, "tinybroker_consumer_group_acked_total") {
				acked += v
			}
		}
		if acked != 100 {
			t.Fatalf("the broker counted %v acks", acked)
		}
	})

	t.Run("window_holds_through_evictions", func(t *testing.T) {
		b := startBroker(t, map[string]string{"TINYBROKER_CONSUMER_CAPACITY": "32"})
		const window = 16
		c := connect(t, []string{b.addr}, WithWindow(window))
		sub := subscribe(t, c, []string{"win.>"})
		events := watch(sub.Events())
		evictions := func() int {
			n := 0
			for _, e := range events.all() {
				if e.Kind == EventEnded && e.Reason == "evicted" {
					n++
				}
			}
			return n
		}
		most := 0
		for round := range 3 {
			// Nobody reads: the broker's queue fills and it evicts.
			for i := 0; evictions() <= round; i++ {
				publish(t, c, "win.a", []byte(strconv.Itoa(i)))
				most = max(most, sub.Pending())
				if i > 5000 {
					t.Fatal("no eviction")
				}
			}
			waitFor(t, 10*time.Second, "the backoff to end", func() bool { return sub.stateNow() == subWaiting })
			most = max(most, sub.Pending())
			if sub.Pending() != window || sub.stateNow() != subWaiting {
				t.Fatalf("held %d, state %v", sub.Pending(), sub.stateNow())
			}
			next(t, sub, 5*time.Second) // one taken: room for one
			waitFor(t, 10*time.Second, "opened with the room it has", func() bool { return sub.stateNow() == subOpen })
		}
		if most > window {
			t.Fatalf("held %d > window %d", most, window)
		}
		if n := evictions(); n != 3 {
			t.Fatalf("%d evictions", n)
		}
	})

	t.Run("gap_is_a_range_on_one_instance", func(t *testing.T) {
		b := startBroker(t, map[string]string{"TINYBROKER_CONSUMER_CAPACITY": "32"})
		c := connect(t, []string{b.addr}, WithWindow(8))
		sub := subscribe(t, c, []string{"gap.>"})
		events := watch(sub.Events())
		var ended *SubscriptionEvent
		for i := 0; ended == nil; i++ {
			publish(t, c, "gap.a", []byte("x"))
			for _, e := range events.all() {
				if e.Kind == EventEnded {
					ended = &e
				}
			}
			if i > 5000 {
				t.Fatal("no eviction")
			}
		}
		var held []*Message
		for range 8 {
			held = append(held, next(t, sub, 5*time.Second))
		}
		waitFor(t, 10*time.Second, "open again", func() bool { return sub.stateNow() == subOpen })
		after := publish(t, c, "gap.a", []byte("after"))
		if m := next(t, sub, 5*time.Second); m.Sequence != after.Sequence {
			t.Fatalf("got %d, want %d", m.Sequence, after.Sequence)
		}
		var gaps []SubscriptionEvent
		waitFor(t, 5*time.Second, "the gap event", func() bool {
			gaps = nil
			for _, e := range events.all() {
				if e.Kind == EventResumed {
					gaps = append(gaps, e)
				}
			}
			return len(gaps) > 0
		})
		if len(gaps) != 1 {
			t.Fatalf("%d gap events", len(gaps))
		}
		g := gaps[0].Gap
		if !g.Known || g.First != held[7].Sequence+1 || g.Last != after.Sequence-1 || g.Reason != "" || gaps[0].Reason != "evicted" {
			t.Fatalf("gap %+v (event %+v)", g, gaps[0])
		}
		if g.Dropped != ended.Dropped || g.Dropped == 0 {
			t.Fatalf("dropped %d, ended said %d", g.Dropped, ended.Dropped)
		}
	})

	t.Run("gap_is_unknown_across_a_restart", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"rs.>"})
		events := watch(sub.Events())
		before := publish(t, c, "rs.a", []byte("1"))
		if m := next(t, sub, 5*time.Second); m.Sequence != before.Sequence {
			t.Fatal("wrong message")
		}
		first := c.Instance()
		b.kill()
		waitLost(t, c)
		b.restart()
		waitFor(t, 10*time.Second, "open again", func() bool { return sub.stateNow() == subOpen })
		// Sequences started again: 1 to 5 go elsewhere, so the next one
		// looks like a gap after the one before; it is not one.
		for range 5 {
			publish(t, c, "elsewhere.a", nil)
		}
		after := publish(t, c, "rs.a", []byte("3"))
		if m := next(t, sub, 5*time.Second); m.Sequence != after.Sequence || after.Sequence <= before.Sequence+1 {
			t.Fatalf("got %d; before %d after %d", m.Sequence, before.Sequence, after.Sequence)
		}
		var gap *SubscriptionEvent
		waitFor(t, 5*time.Second, "the gap event", func() bool {
			for _, e := range events.all() {
				if e.Kind == EventResumed {
					gap = &e
				}
			}
			return gap != nil
		})
		if gap.Gap.Known || gap.Gap.Reason != "instance_changed" || gap.Reason != "connection_lost" {
			t.Fatalf("gap %+v %+v", gap, gap.Gap)
		}
		if c.Instance() == first {
			t.Fatalf("instance %q did not change", first)
		}
	})

	t.Run("back_within_half_a_second_of_a_restart", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"back.>"})
		b.kill()
		waitLost(t, c)
		time.Sleep(3 * time.Second) // down long enough for a slow reconnect backoff to grow past 1 s
		b.restart()                 // returns once the broker answers
		time.Sleep(500 * time.Millisecond)
		other := connect(t, []string{b.addr})
		publish(t, other, "back.a", []byte("in time"))
		if m := next(t, sub, 5*time.Second); string(m.Payload) != "in time" {
			t.Fatal("wrong message")
		}
	})

	t.Run("connection_events_once_per_connection", func(t *testing.T) {
		b := startBroker(t, nil)
		c, err := Connect(ctxT(t, 10*time.Second), []string{b.addr})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		events := watch(c.ConnectionEvents())
		var subs []*Subscription
		for i := range 50 {
			subs = append(subs, subscribe(t, c, []string{fmt.Sprintf("ce.%d", i)}))
		}
		if evs := events.all(); len(evs) != 1 || evs[0].Kind != Connected {
			t.Fatalf("events %+v", evs)
		}
		b.kill()
		waitLost(t, c)
		b.restart()
		waitFor(t, 15*time.Second, "every subscription back", func() bool {
			for _, s := range subs {
				if s.stateNow() != subOpen {
					return false
				}
			}
			return true
		})
		evs := events.all()
		if len(evs) != 3 || evs[0].Kind != Connected || evs[1].Kind != Disconnected || evs[2].Kind != Reconnected {
			t.Fatalf("events %+v", evs)
		}
		if evs[1].Reason == "" || evs[2].Address != "http://"+b.addr || !evs[2].InstanceChanged {
			t.Fatalf("events %+v", evs)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-events.done:
		case <-time.After(5 * time.Second):
			t.Fatal("the events channel was not closed")
		}
		if evs := events.all(); len(evs) != 4 || evs[3].Kind != Closed {
			t.Fatalf("events %+v", evs)
		}
	})

	t.Run("stats_count_what_went_in_and_out", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"st.>"})
		for range 10 {
			publishAsync(t, c, "st.a", []byte("12345"))
		}
		flush(t, c, 5*time.Second)
		for range 10 {
			next(t, sub, 5*time.Second)
		}
		s := c.Stats()
		if s.MessagesOut != 10 || s.BytesOut != 50 || s.MessagesIn != 10 || s.BytesIn != 50 || s.Reconnects != 0 || s.PendingMessages != 0 || s.PendingBytes != 0 {
			t.Fatalf("stats %+v", s)
		}
		b.kill()
		waitLost(t, c)
		for range 3 {
			publishAsync(t, c, "st.b", []byte("abc"))
		}
		if s := c.Stats(); s.PendingMessages != 3 || s.PendingBytes < 3*uint64(len("st.babc")) {
			t.Fatalf("stats %+v", s)
		}
		b.restart()
		if r := flush(t, c, 10*time.Second); r.Accepted != 3 {
			t.Fatalf("flush %+v", r)
		}
		for range 3 {
			next(t, sub, 5*time.Second)
		}
		s = c.Stats()
		if s.MessagesOut != 13 || s.BytesOut != 59 || s.MessagesIn != 13 || s.BytesIn != 59 || s.Reconnects != 1 || s.PendingMessages != 0 || s.PendingBytes != 0 {
			t.Fatalf("stats %+v", s)
		}
	})

	t.Run("closed_means_closed", func(t *testing.T) {
		leaks := goleak.IgnoreCurrent()
		b := startBroker(t, nil)
		c, err := Connect(ctxT(t, 10*time.Second), []string{b.addr})
		if err != nil {
			t.Fatal(err)
		}
		sub := subscribe(t, c, []string{"cl.>"})
		msgs := sub.Messages()
		_ = msgs
		pub, err := c.NewPublisher(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish("elsewhere.a", []byte("open")); err != nil {
			t.Fatal(err)
		}
		other := subscribe(t, c, []string{"cl2.>"})
		waiting := make(chan error, 1)
		go func() {
			_, err := other.Next(context.Background())
			waiting <- err
		}()
		waitFor(t, 5*time.Second, "Next to wait", func() bool {
			other.mu.Lock()
			defer other.mu.Unlock()
			return other.nexting
		})
		if err := c.Close(); err != nil {
			t.Fatalf("close: %v", err)
		}
		select {
		case err := <-waiting:
			if !isClosed(err) {
				t.Fatalf("waiting Next: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a waiting Next did not end")
		}
		ctx := ctxT(t, 5*time.Second)
		calls := map[string]func() error{
			"PublishAsync": func() error { return c.PublishAsync(ctx, "cl.a", []byte("x")) },
			"Flush":        func() error { _, err := c.Flush(ctx); return err },
			"Publish":      func() error { _, err := c.Publish(ctx, "cl.a", []byte("x")); return err },
			"Subscribe":    func() error { _, err := c.Subscribe(ctx, []string{"cl.>"}); return err },
			"BrokerInfo":   func() error { _, err := c.Admin().BrokerInfo(ctx); return err },
			"Next":         func() error { _, err := sub.Next(ctx); return err },
			"Publisher":    func() error { return pub.Publish("cl.a", []byte("x")) },
			"NewPublisher": func() error { _, err := c.NewPublisher(ctx); return err },
		}
		for name, call := range calls {
			err := call()
			var e *Error
			if !errors.Is(err, ErrClosed) || !errors.As(err, &e) || e.Code != codes.Canceled || !strings.Contains(e.Message, "closed") {
				t.Fatalf("%s after Close: %v", name, err)
			}
		}
		for range msgs {
			t.Fatal("a closed subscription's channel yields nothing")
		}
		for range sub.All() {
			t.Fatal("a closed subscription's iterator yields nothing")
		}
		if err := c.Close(); err != nil {
			t.Fatalf("second close: %v", err)
		}
		// A publisher waiting for room ends with ErrClosed too; what was not
		// written is counted by Close.
		b2 := startBroker(t, nil)
		c2, err := Connect(ctxT(t, 10*time.Second), []string{b2.addr}, WithBufferBytes(64))
		if err != nil {
			t.Fatal(err)
		}
		publishAsync(t, c2, "w.a", []byte("x"))
		flush(t, c2, 5*time.Second)
		b2.signal(syscall.SIGSTOP)
		pid := b2.cmd.Process.Pid
		waitFor(t, 5*time.Second, "the broker to stop", func() bool { return stopped(pid) })
		blocked := make(chan error, 1)
		go func() {
			for {
				if err := c2.PublishAsync(context.Background(), "w.a", bytes.Repeat([]byte("y"), 40)); err != nil {
					blocked <- err
					return
				}
			}
		}()
		// Full both ways: BATCHES_IN_FLIGHT written and unanswered, and the
		// buffer at its bound behind them (seen once: Close came while a
		// slot was free, the buffer went out in it, and nothing was unsent).
		waitFor(t, 5*time.Second, "the buffer to fill behind 4 unanswered batches", func() bool {
			c2.pub.mu.Lock()
			defer c2.pub.mu.Unlock()
			return len(c2.pub.inFlight) == BatchesInFlight && c2.pub.pendBytes >= 64
		})
		closeCtx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		err = c2.CloseContext(closeCtx)
		cancel()
		var ce *CloseError
		if !errors.As(err, &ce) || ce.NotSent == 0 || ce.Unconfirmed == 0 {
			t.Fatalf("close with a stopped broker: %v", err)
		}
		select {
		case err := <-blocked:
			if !isClosed(err) {
				t.Fatalf("waiting PublishAsync: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a waiting PublishAsync did not end")
		}
		b2.signal(syscall.SIGCONT)
		// Nothing of a closed client is left.
		goleak.VerifyNone(t, leaks, goleak.IgnoreAnyFunction("github.com/tinybroker/tinybroker/clients/go.(*broker).tryStart.func1"))
	})

	t.Run("one_next_at_a_time", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		sub := subscribe(t, c, []string{"one.>"})
		first := make(chan *Message, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m, _ := sub.Next(ctx)
			first <- m
		}()
		waitFor(t, 5*time.Second, "the first Next to wait", func() bool {
			sub.mu.Lock()
			defer sub.mu.Unlock()
			return sub.nexting
		})
		start := time.Now()
		if _, err := sub.Next(ctxT(t, 5*time.Second)); !errors.Is(err, ErrUsage) || time.Since(start) > time.Second {
			t.Fatalf("second Next: %v after %v", err, time.Since(start))
		}
		publishAsync(t, c, "one.a", []byte("for the first"))
		select {
		case m := <-first:
			if m == nil || string(m.Payload) != "for the first" {
				t.Fatalf("first Next got %v", m)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the first Next got nothing")
		}
	})

	t.Run("status_ok_end_is_not_an_error", func(t *testing.T) {
		a := startBroker(t, nil)
		b := startBroker(t, nil)
		c, err := Connect(ctxT(t, 10*time.Second), []string{a.addr, b.addr})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		events := watch(c.ConnectionEvents())
		sub := subscribe(t, c, []string{"ok.>"})
		if c.Address() != "http://"+a.addr {
			t.Fatalf("address %s", c.Address())
		}
		a.stop() // shuts down: ends the session with status OK
		waitFor(t, 15*time.Second, "back on b", func() bool { return len(events.all()) == 3 && sub.stateNow() == subOpen })
		if c.Address() != "http://"+b.addr {
			t.Fatalf("address %s", c.Address())
		}
		evs := events.all()
		if evs[0].Kind != Connected || evs[1].Kind != Disconnected || evs[2].Kind != Reconnected || evs[1].Reason != "closed by the broker" {
			t.Fatalf("events %+v", evs)
		}
		fresh := subscribe(t, c, []string{"ok.>"})
		publishAsync(t, c, "ok.1", []byte("on b"))
		if r := flush(t, c, 5*time.Second); r.Accepted != 1 {
			t.Fatalf("flush %+v", r)
		}
		for _, s := range []*Subscription{sub, fresh} {
			if m := next(t, s, 5*time.Second); string(m.Payload) != "on b" {
				t.Fatal("wrong message")
			}
			if s.Err() != nil {
				t.Fatalf("err %v", s.Err())
			}
		}
		for _, e := range events.all() {
			if strings.Contains(e.Reason, "OK") {
				t.Fatalf("an OK end reported as %q", e.Reason)
			}
		}

		// A session that ends OK as it starts: the next address, no error.
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := grpc.NewServer()
		pb.RegisterBrokerServer(srv, endsAtOnce{})
		pb.RegisterAdminServer(srv, infoOnly{})
		go func() { _ = srv.Serve(lis) }()
		defer srv.Stop()
		c2, err := Connect(ctxT(t, 10*time.Second), []string{lis.Addr().String(), b.addr})
		if err != nil {
			t.Fatal(err)
		}
		defer c2.Close()
		sub2, err := c2.Subscribe(ctxT(t, 10*time.Second), []string{"ok.>"})
		if err != nil {
			t.Fatal(err)
		}
		if c2.Address() != "http://"+b.addr {
			t.Fatalf("address %s", c2.Address())
		}
		publishAsync(t, c2, "ok.2", []byte("served"))
		if m := next(t, sub2, 5*time.Second); string(m.Payload) != "served" {
			t.Fatal("wrong message")
		}
	})

	t.Run("publish_error_counts_what_the_broker_accepted", func(t *testing.T) {
		b := startBroker(t, nil)
		c := connect(t, []string{b.addr})
		pub, err := c.NewPublisher(ctxT(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for _, topic := range []string{"pe.1", "pe.2", "pe.3", "bad topic", "pe.4", "pe.5"} {
			if err = pub.Publish(topic, []byte("x")); err != nil {
				break
			}
		}
		if err == nil {
			_, err = pub.Close()
		}
		var pe *PublishError
		if !errors.As(err, &pe) || pe.Code != codes.InvalidArgument || pe.Accepted != 3 ||
			!regexp.MustCompile(`\b3 earlier messages`).MatchString(pe.Message) {
			t.Fatalf("error %#v", err)
		}
		var e *Error
		if !errors.As(err, &e) || e.Code != codes.InvalidArgument {
			t.Fatalf("not an *Error: %v", err)
		}
		info, err := c.Admin().BrokerInfo(ctxT(t, 5*time.Second))
		if err != nil || info.MessagesPublished != 3 {
			t.Fatalf("published %v %v", info.GetMessagesPublished(), err)
		}
	})

	t.Run("cluster_subscriptions_survive_a_replica", func(t *testing.T) {
		natsBin := natsServer(t)
		natsURL := startNats(t, natsBin)
		var replicas []*broker
		for _, id := range []string{"a", "b"} {
			r := startBroker(t, map[string]string{
				"TINYBROKER_NATS_URL": natsURL, "TINYBROKER_NATS_REPLICAS": "1", "TINYBROKER_REPLICA_ID": id,
			})
			waitServing(t, r)
			replicas = append(replicas, r)
		}
		a, b := replicas[0], replicas[1]
		c, err := Connect(ctxT(t, 10*time.Second), []string{a.addr, b.addr})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		other := connect(t, []string{b.addr})
		events := watch(c.ConnectionEvents())
		var subs []*Subscription
		var logs []*eventLog[SubscriptionEvent]
		for range 5 {
			s := subscribe(t, c, []string{"cs.>"})
			subs = append(subs, s)
			logs = append(logs, watch(s.Events()))
		}
		publish(t, other, "cs.1", []byte("before"))
		for _, s := range subs {
			if m := next(t, s, 10*time.Second); string(m.Payload) != "before" {
				t.Fatal("wrong message")
			}
		}
		a.stop() // the replica shuts down: its session ends OK
		waitFor(t, 30*time.Second, "every subscription on b", func() bool {
			if len(events.all()) != 3 {
				return false
			}
			for _, s := range subs {
				if s.stateNow() != subOpen {
					return false
				}
			}
			return true
		})
		if c.Address() != "http://"+b.addr {
			t.Fatalf("address %s", c.Address())
		}
		publish(t, other, "cs.2", []byte("after"))
		for i, s := range subs {
			if m := next(t, s, 10*time.Second); string(m.Payload) != "after" {
				t.Fatal("wrong message")
			}
			var gap *Gap
			waitFor(t, 5*time.Second, "the gap", func() bool {
				for _, e := range logs[i].all() {
					if e.Kind == EventEnded && !e.Again {
						t.Fatalf("a replica's shutdown ended the subscription: %+v", e)
					}
					if e.Kind == EventResumed {
						gap = e.Gap
					}
				}
				return gap != nil
			})
			if gap.Known || (gap.Reason != "instance_changed" && gap.Reason != "sequence_scope") {
				t.Fatalf("gap %+v", gap)
			}
		}
		evs := events.all()
		if evs[0].Kind != Connected || evs[1].Kind != Disconnected || evs[2].Kind != Reconnected {
			t.Fatalf("events %+v", evs)
		}
		fresh := subscribe(t, c, []string{"cs.>"})
		if fresh.stateNow() != subOpen {
			t.Fatal("a new subscription is not open")
		}
	})
}

type endsAtOnce struct{ pb.UnimplementedBrokerServer }

func (endsAtOnce) Session(stream grpc.BidiStreamingServer[pb.SessionRequest, pb.SessionEvent]) error {
	return stream.SendHeader(metadata.MD{})
}

type infoOnly struct{ pb.UnimplementedAdminServer }

func (infoOnly) GetBrokerInfo(context.Context, *pb.GetBrokerInfoRequest) (*pb.GetBrokerInfoResponse, error) {
	return &pb.GetBrokerInfoResponse{}, nil
}

func natsServer(t *testing.T) string {
	if p := os.Getenv("TB_NATS_SERVER"); p != "" {
		return p
	}
	if p, err := exec.LookPath("nats-server"); err == nil {
		return p
	}
	t.Skip("cluster mode needs nats-server 2.10+: set TB_NATS_SERVER or put nats-server on PATH")
	return ""
}

func startNats(t *testing.T, bin string) string {
	port := freePort(t)
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
		}
	})
	waitFor(t, 20*time.Second, "nats-server listening", func() bool {
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 500*time.Millisecond)
		if err == nil {
			conn.Close()
		}
		return err == nil
	})
	return fmt.Sprintf("nats://127.0.0.1:%d", port)
}
