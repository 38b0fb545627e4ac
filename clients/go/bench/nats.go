package main

import (
	"context"
	"time"

	"github.com/nats-io/nats.go"
)

// natsSystem is nats.go, the official NATS client, used as its README shows.
type natsSystem struct{ nc *nats.Conn }

func (s *natsSystem) label() string { return "nats.go" }

func (s *natsSystem) connect(_ context.Context, addr string) error {
	nc, err := nats.Connect("nats://"+addr, nats.Timeout(10*time.Second))
	if err != nil {
		return err
	}
	s.nc = nc
	return nil
}

func (s *natsSystem) close() error {
	s.nc.Close()
	return nil
}

func (s *natsSystem) publishMany(_ context.Context, topicOf func(int) string, n int, payloadOf func(int) []byte, rate float64) error {
	nc := s.nc
	if err := paced(n, rate, func(i int) error { return nc.Publish(topicOf(i), payloadOf(i)) }); err != nil {
		return err
	}
	// The server has answered the PING sent after the last message.
	return nc.FlushTimeout(120 * time.Second)
}

func (s *natsSystem) subscribe(_ context.Context, subject string, onMessage func([]byte)) error {
	// An async subscription: the callback runs on the subscription's own
	// goroutine (nats.go's fastest documented way to receive).
	if _, err := s.nc.Subscribe(subject, func(m *nats.Msg) { onMessage(m.Data) }); err != nil {
		return err
	}
	return s.nc.FlushTimeout(10 * time.Second) // the server has the subscription
}
