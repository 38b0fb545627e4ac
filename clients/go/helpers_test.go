package tinybroker

import (
	"context"
	"errors"
	"os"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// sessionStateNow reads the session's state on its goroutine.
func (c *Client) sessionStateNow() sessionState {
	ch := make(chan sessionState, 1)
	if !c.post(func() { ch <- c.s.state }) {
		return stClosed
	}
	select {
	case st := <-ch:
		return st
	case <-c.loopDone:
		return stClosed
	}
}

func (s *Subscription) stateNow() subState {
	ch := make(chan subState, 1)
	if !s.c.post(func() { ch <- s.state }) {
		return subDone
	}
	select {
	case st := <-ch:
		return st
	case <-s.c.loopDone:
		return subDone
	}
}

// hold pauses the session goroutine until the returned function is called
// (what the application does meanwhile happens "at one moment").
func (c *Client) hold(t testing.TB) func() {
	held := make(chan struct{})
	release := make(chan struct{})
	if !c.post(func() { close(held); <-release }) {
		t.Fatal("the client is closed")
	}
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the session goroutine did not pause")
	}
	var once sync.Once
	return func() { once.Do(func() { close(release) }) }
}

type eventLog[T any] struct {
	mu   sync.Mutex
	evs  []T
	done chan struct{}
}

func (l *eventLog[T]) all() []T {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]T(nil), l.evs...)
}

func watch[T any](ch <-chan T) *eventLog[T] {
	l := &eventLog[T]{done: make(chan struct{})}
	go func() {
		defer close(l.done)
		for ev := range ch {
			l.mu.Lock()
			l.evs = append(l.evs, ev)
			l.mu.Unlock()
		}
	}()
	return l
}

func subscribe(t testing.TB, c *Client, patterns []string, opts ...SubscribeOption) *Subscription {
	t.Helper()
	s, err := c.Subscribe(ctxT(t, 30*time.Second), patterns, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func next(t testing.TB, s *Subscription, d time.Duration) *Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	m, err := s.Next(ctx)
	if err != nil {
		t.Fatalf("next: %v", err)
	}
	return m
}

func publishAsync(t testing.TB, c *Client, topic string, payload []byte) {
	t.Helper()
	if err := c.PublishAsync(ctxT(t, 30*time.Second), topic, payload); err != nil {
		t.Fatal(err)
	}
}

func flush(t testing.TB, c *Client, d time.Duration) FlushReport {
	t.Helper()
	r, err := c.Flush(ctxT(t, d))
	if err != nil {
		t.Fatalf("flush: %v", err)
	}
	return r
}

func publish(t testing.TB, c *Client, topic string, payload []byte) PublishResult {
	t.Helper()
	r, err := c.Publish(ctxT(t, 10*time.Second), topic, payload)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func waitLost(t testing.TB, c *Client) {
	t.Helper()
	waitFor(t, 10*time.Second, "the session to be lost", func() bool { return c.sessionStateNow() != stOpen })
}

func (b *broker) signal(sig syscall.Signal) {
	if b.cmd != nil {
		_ = b.cmd.Process.Signal(sig)
	}
}

// stopped reports whether every thread of pid is stopped (SIGSTOP), as /proc
// says. Not the main thread's state alone: a thread stops when the group stop
// reaches it, and on a loaded machine a worker can run on long enough to answer
// a request written after the signal.
func stopped(pid int) bool {
	tasks, err := os.ReadDir("/proc/" + itoa(pid) + "/task")
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		data, err := readFile("/proc/" + itoa(pid) + "/task/" + task.Name() + "/stat")
		if err != nil {
			return false
		}
		i := lastIndex(data, ')')
		if i < 0 || i+2 >= len(data) || data[i+2] != 'T' {
			return false
		}
	}
	return true
}

func isClosed(err error) bool {
	var e *Error
	return errors.Is(err, ErrClosed) && errors.As(err, &e) && e.Code == 1 && e.Message != ""
}

func readFile(p string) (string, error) {
	b, err := osReadFile(p)
	return string(b), err
}

func lastIndex(s string, c byte) int {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == c {
			return i
		}
	}
	return -1
}

func itoa(i int) string { return strconvItoa(i) }

var (
	osReadFile  = os.ReadFile
	strconvItoa = strconv.Itoa
)
