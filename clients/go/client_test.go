package tinybroker

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
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

func TestParseAddrs(t *testing.T) {
	cases := []struct {
		in   []string
		want []string
	}{
		{[]string{"127.0.0.1:1234"}, []string{"http://127.0.0.1:1234"}},
		{[]string{"http://broker"}, []string{"http://broker:50051"}},
		{[]string{"https://broker"}, []string{"https://broker:443"}},
		{[]string{"https://broker:8443/", " http://[::1]:5 "}, []string{"https://broker:8443", "http://[::1]:5"}},
		{[]string{"localhost"}, []string{"http://localhost:50051"}},
	}
	for _, tc := range cases {
		got, err := parseAddrs(tc.in)
		if err != nil {
			t.Fatalf("%v: %v", tc.in, err)
		}
		var s []string
		for _, g := range got {
			s = append(s, g.String())
		}
		if fmt.Sprint(s) != fmt.Sprint(tc.want) {
			t.Fatalf("%v: got %v want %v", tc.in, s, tc.want)
		}
	}
	t.Setenv("TINYBROKER_ADDR", "a:1,https://b")
	got, err := parseAddrs(nil)
	if err != nil || len(got) != 2 || got[0].String() != "http://a:1" || got[1].String() != "https://b:443" {
		t.Fatalf("TINYBROKER_ADDR: %v %v", got, err)
	}
	t.Setenv("TINYBROKER_ADDR", "")
	if got, _ := parseAddrs(nil); len(got) != 1 || got[0].String() != "http://"+DefaultAddr {
		t.Fatalf("default: %v", got)
	}
	_, err = parseAddrs([]string{"grpc://broker:1"})
	if !errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), "grpc://broker:1") {
		t.Fatalf("bad scheme: %v", err)
	}
	if _, err := Connect(context.Background(), []string{"nats://x"}); !errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), "nats://x") {
		t.Fatalf("Connect with a bad scheme: %v", err)
	}
}

func TestConnectFailsWhenNoBrokerAnswers(t *testing.T) {
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	_, err := Connect(ctxT(t, 10*time.Second), []string{addr}, WithConnectTimeout(300*time.Millisecond))
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable || !strings.Contains(e.Message, addr) {
		t.Fatalf("%v", err)
	}
}

func TestToken(t *testing.T) {
	b := startBroker(t, map[string]string{"TINYBROKER_AUTH_TOKEN": "s3cret"})
	t.Setenv("TINYBROKER_AUTH_TOKEN", "")
	_, err := Connect(ctxT(t, 10*time.Second), []string{b.addr})
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unauthenticated {
		t.Fatalf("without a token: %v", err)
	}
	_, err = Connect(ctxT(t, 10*time.Second), []string{b.addr}, WithToken("wrong"))
	if !errors.As(err, &e) || e.Code != codes.Unauthenticated {
		t.Fatalf("with a wrong token: %v", err)
	}
	c := connect(t, []string{b.addr}, WithToken("s3cret"))
	ctx := ctxT(t, 10*time.Second)
	sub := subscribe(t, c, []string{"tok.>"})
	publishAsync(t, c, "tok.a", []byte("x"))
	if m := next(t, sub, 5*time.Second); string(m.Payload) != "x" {
		t.Fatal("wrong message")
	}
	if _, err := c.Publish(ctx, "tok.b", nil); err != nil {
		t.Fatal(err)
	}
	// The token from the environment.
	t.Setenv("TINYBROKER_AUTH_TOKEN", "s3cret")
	c2 := connect(t, []string{b.addr})
	if _, err := c2.Admin().BrokerInfo(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestGroupManualAckAndNack(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	ctx := ctxT(t, 20*time.Second)
	m1 := subscribe(t, c, []string{"work.>"}, WithGroup("g"), WithManualAck(), WithAckDeadline(30*time.Second))
	m2 := subscribe(t, c, []string{"work.>"}, WithGroup("g"), WithManualAck(), WithAckDeadline(30*time.Second))
	if _, err := c.Publish(ctx, "work.a", []byte("job")); err != nil {
		t.Fatal(err)
	}
	// One member gets it; a nack hands it back; it comes again, attempt 2.
	var got *Message
	var holder *Subscription
	waitFor(t, 10*time.Second, "the job", func() bool {
		for _, s := range []*Subscription{m1, m2} {
			if s.Pending() > 0 {
				got, holder = next(t, s, time.Second), s
				return true
			}
		}
		return false
	})
	if got.Group != "g" || got.DeliveryAttempt != 1 {
		t.Fatalf("%+v", got)
	}
	if !got.Nack() {
		t.Fatal("nack refused")
	}
	var again *Message
	waitFor(t, 10*time.Second, "the redelivery", func() bool {
		for _, s := range []*Subscription{m1, m2} {
			if s.Pending() > 0 {
				again = next(t, s, time.Second)
				return true
			}
		}
		return false
	})
	if again.Sequence != got.Sequence || again.DeliveryAttempt != 2 {
		t.Fatalf("redelivered %+v", again)
	}
	if !again.Ack() {
		t.Fatal("ack refused")
	}
	waitFor(t, 10*time.Second, "in flight 0", func() bool {
		r, err := c.Admin().ListConsumerGroups(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		return len(r.Groups) == 1 && r.Groups[0].InFlight == 0 && r.Groups[0].Members == 2
	})
	_ = holder
	// Auto-ack and broadcast messages cannot be acked.
	bc := subscribe(t, c, []string{"work.>"})
	if _, err := c.Publish(ctx, "work.b", nil); err != nil {
		t.Fatal(err)
	}
	if m := next(t, bc, 5*time.Second); m.Ack() || m.Nack() {
		t.Fatal("a broadcast message was acked")
	}
	if _, err := c.Subscribe(ctx, []string{"x"}, WithManualAck()); !errors.Is(err, ErrUsage) {
		t.Fatalf("manual ack without a group: %v", err)
	}
}

func TestAdmin(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	ctx := ctxT(t, 20*time.Second)
	sub := subscribe(t, c, []string{"adm.>"}, WithSubscriptionID("named-1"))
	if sub.ID() != "named-1" {
		t.Fatalf("id %q", sub.ID())
	}
	info, err := c.Admin().BrokerInfo(ctx)
	if err != nil || info.Limits.GetMaxBatchMessages() == 0 {
		t.Fatalf("%v %v", info, err)
	}
	subs, err := c.Admin().ListSubscriptions(ctx, nil)
	if err != nil || len(subs.Subscriptions) != 1 || subs.Subscriptions[0].SubscriptionId != "named-1" {
		t.Fatalf("%v %v", subs, err)
	}
	if _, err := c.Admin().ListEvictions(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Admin().ListConsumerGroups(ctx, nil); err != nil {
		t.Fatal(err)
	}
	_, err = c.Admin().CloseSubscription(ctx, &pb.CloseSubscriptionRequest{SubscriptionId: "nope"})
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.NotFound || e.Message == "" {
		t.Fatalf("close of an unknown id: %v", err)
	}
	events := watch(sub.Events())
	if _, err := c.Admin().CloseSubscription(ctx, &pb.CloseSubscriptionRequest{SubscriptionId: "named-1"}); err != nil {
		t.Fatal(err)
	}
	// An operator closed it: reported, done, not opened again.
	_, err = sub.Next(ctx)
	var ended *SubscriptionEndedError
	if !errors.As(err, &ended) || ended.Reason != "closed_by_admin" || !errors.As(sub.Err(), &ended) {
		t.Fatalf("next after an admin close: %v", err)
	}
	select {
	case <-events.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the events channel was not closed")
	}
	if evs := events.all(); len(evs) != 1 || evs[0].Kind != EventEnded || evs[0].Reason != "closed_by_admin" {
		t.Fatalf("events %+v", evs)
	}
}

func TestSubscriptionContextClosesIt(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	ctx, cancel := context.WithCancel(context.Background())
	sub, err := c.Subscribe(ctx, []string{"ctx.>"})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	_, err = sub.Next(ctxT(t, 5*time.Second))
	if !errors.Is(err, ErrClosed) {
		t.Fatalf("next: %v", err)
	}
	waitFor(t, 5*time.Second, "the broker to drop it", func() bool {
		r, err := c.Admin().ListSubscriptions(ctxT(t, 5*time.Second), nil)
		return err == nil && len(r.Subscriptions) == 0
	})
	if sub.Err() != nil {
		t.Fatalf("err after close: %v", sub.Err())
	}
	// A subscribe whose ctx is done before it opens returns the ctx error.
	done, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := c.Subscribe(done, []string{"ctx.>"}); err == nil || errors.Is(err, ErrClosed) {
		t.Fatalf("subscribe with a done ctx: %v", err)
	}
	// A rejected open: the broker's error.
	_, err = c.Subscribe(ctxT(t, 5*time.Second), []string{"bad pattern"})
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.InvalidArgument || !strings.Contains(e.Message, "bad pattern") {
		t.Fatalf("bad pattern: %v", err)
	}
}

func TestIterators(t *testing.T) {
	b := startBroker(t, nil)
	c := connect(t, []string{b.addr})
	ctx := ctxT(t, 20*time.Second)
	s1 := subscribe(t, c, []string{"it.>"})
	s2 := subscribe(t, c, []string{"it.>"})
	for i := range 5 {
		publishAsync(t, c, "it.a", []byte(strconv.Itoa(i)))
	}
	flush(t, c, 5*time.Second)
	i := 0
	for m := range s1.All() {
		if string(m.Payload) != strconv.Itoa(i) {
			t.Fatalf("All: %q", m.Payload)
		}
		i++
		if i == 5 {
			break
		}
	}
	i = 0
	watchdog := time.AfterFunc(10*time.Second, func() { _ = s2.Close() }) // bounds the loop
	defer watchdog.Stop()
	for m := range s2.Messages() {
		if string(m.Payload) != strconv.Itoa(i) {
			t.Fatalf("Messages: %q", m.Payload)
		}
		i++
		if i == 5 {
			_ = s2.Close()
		}
	}
	if i != 5 || s2.Err() != nil {
		t.Fatalf("%d messages, err %v", i, s2.Err())
	}
	if _, err := s2.Next(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("next after close: %v", err)
	}
	// Once the client closes, All ends.
	done := make(chan int)
	go func() {
		n := 0
		for range s1.All() {
			n++
		}
		done <- n
	}()
	_ = c.Close()
	select {
	case n := <-done:
		if n != 0 {
			t.Fatalf("%d messages after the close", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("All did not end at Close")
	}
	if !errors.Is(s1.Err(), ErrClosed) {
		t.Fatalf("err %v", s1.Err())
	}
}

func TestErrors(t *testing.T) {
	te := timeoutError("x")
	if !errors.Is(te, ErrTimeout) || !errors.Is(te, context.DeadlineExceeded) || errors.Is(te, ErrClosed) {
		t.Fatal("timeout")
	}
	if !errors.Is(errSubClosed, ErrClosed) || errors.Is(ErrClosed, ErrUsage) {
		t.Fatal("closed")
	}
	if st, ok := status.FromError(ErrClosed); !ok || st.Code() != codes.Canceled || st.Message() != "the client is closed" {
		t.Fatalf("status %v", st)
	}
	var e *Error
	for _, err := range []error{
		&SubscriptionEndedError{Reason: "evicted", Message: "m"},
		&PublishError{Code: codes.InvalidArgument, Message: "m", Accepted: 2},
		&CloseError{NotSent: 1},
	} {
		if !errors.As(err, &e) || e.Message == "" {
			t.Fatalf("%T does not wrap an *Error", err)
		}
	}
	pe := publishStreamError(status.Error(codes.InvalidArgument, "bad topic; 7 earlier messages of this stream were accepted and stay published"))
	if pe.Accepted != 7 || pe.Code != codes.InvalidArgument {
		t.Fatalf("%+v", pe)
	}
	r := FlushReport{Unconfirmed: []IndexRange{{1, 10}, {20, 20}}}
	if r.UnconfirmedCount() != 11 {
		t.Fatal("count")
	}
}

type ctxKey struct{}

type testPropagator struct{}

func (testPropagator) Inject(ctx context.Context, h map[string]string) {
	if v, ok := ctx.Value(ctxKey{}).(string); ok {
		h["traceparent"] = v
	}
}

func (testPropagator) Extract(ctx context.Context, h map[string]string) context.Context {
	return context.WithValue(ctx, ctxKey{}, h["traceparent"])
}

func TestPropagatorAndConnectionHandler(t *testing.T) {
	b := startBroker(t, nil)
	var mu sync.Mutex
	var kinds []ConnectionEventKind
	c := connect(t, []string{b.addr}, WithPropagator(testPropagator{}), WithConnectionHandler(func(ev ConnectionEvent) {
		mu.Lock()
		kinds = append(kinds, ev.Kind)
		mu.Unlock()
	}))
	sub := subscribe(t, c, []string{"tr.>"})
	tp := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	ctx := context.WithValue(ctxT(t, 10*time.Second), ctxKey{}, tp)
	if err := c.PublishAsync(ctx, "tr.a", []byte("x"), WithHeaders(map[string]string{"k": "v"})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Publish(ctx, "tr.b", []byte("y")); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		m := next(t, sub, 5*time.Second)
		if got, _ := m.Context(context.Background()).Value(ctxKey{}).(string); got != tp {
			t.Fatalf("%s: trace context %q (headers %v)", m.Topic, got, m.Headers)
		}
		if m.Topic == "tr.a" && m.Headers["k"] != "v" {
			t.Fatalf("headers %v", m.Headers)
		}
	}
	_ = c.Close()
	mu.Lock()
	defer mu.Unlock()
	if len(kinds) != 2 || kinds[0] != Connected || kinds[1] != Closed {
		t.Fatalf("handler saw %v", kinds)
	}
}
