package main

import (
	"context"
	"fmt"
	"time"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
)

// tbSystem is tinybroker's Go client, used as its README shows.
type tbSystem struct{ c *tinybroker.Client }

// useNext: receive with sub.Next rather than range sub.Messages() (-next).
var useNext bool

func (s *tbSystem) label() string { return "tinybroker (Go client)" }

func (s *tbSystem) connect(ctx context.Context, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := tinybroker.Connect(ctx, []string{addr})
	if err != nil {
		return err
	}
	s.c = c
	return nil
}

func (s *tbSystem) close() error { return s.c.Close() }

func (s *tbSystem) publishMany(ctx context.Context, topicOf func(int) string, n int, payloadOf func(int) []byte, rate float64) error {
	c := s.c
	if err := paced(n, rate, func(i int) error { return c.PublishAsync(ctx, topicOf(i), payloadOf(i)) }); err != nil {
		return err
	}
	// Every message has an outcome: the broker has answered for the last.
	fctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	r, err := c.Flush(fctx)
	if err != nil {
		return err
	}
	if r.Accepted != uint64(n) || len(r.Rejected) > 0 || r.UnconfirmedCount() > 0 {
		return fmt.Errorf("flush: accepted %d of %d, %d rejected, %d unconfirmed", r.Accepted, n, len(r.Rejected), r.UnconfirmedCount())
	}
	return nil
}

func (s *tbSystem) subscribe(ctx context.Context, subject string, onMessage func([]byte)) error {
	// ctx is the subscription's life; the open is bounded on its own.
	sub, err := s.c.Subscribe(ctx, []string{subject}, tinybroker.WithOpenTimeout(10*time.Second))
	if err != nil {
		return err
	}
	if useNext {
		go func() {
			for {
				m, err := sub.Next(ctx)
				if err != nil {
					return
				}
				onMessage(m.Payload)
			}
		}()
		return nil
	}
	go func() {
		for m := range sub.Messages() {
			onMessage(m.Payload)
		}
	}()
	return nil
}
