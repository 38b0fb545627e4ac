// Command go-config-watcher re-reads its configuration file when told to,
// the way each replica of a Deployment would.
//
// Every replica holds its own (broadcast) subscription to
// config.<app>.reload, so every replica gets each signal. It reads the file
// at start, again on each signal, and again whenever it may have missed one:
// when the client is connected again (its Reconnected event: a broker
// restart, a cut connection; the client reopens the subscription itself) and
// when the subscription reports EventResumed (with the first delivery after
// it was away, e.g. evicted, when messages may have been missed). SIGTERM or
// SIGINT stops it: the context is cancelled and the client closed.
//
//	CONFIG_FILE=config.json APP_NAME=shop TINYBROKER_ADDR=127.0.0.1:50051 go-config-watcher
//
// The file is JSON; its "version" field is logged (else a hash of the file).
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
	"google.golang.org/grpc/codes"
)

func main() {
	configFile := flag.String("config", os.Getenv("CONFIG_FILE"), "configuration file (env CONFIG_FILE)")
	app := flag.String("app", envOr("APP_NAME", "demo"), "application name: the signal topic is config.<app>.reload (env APP_NAME)")
	addr := flag.String("addr", "", "broker address(es), comma-separated (default: env TINYBROKER_ADDR, else 127.0.0.1:50051)")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if *configFile == "" {
		log.Error("no configuration file: set -config or CONFIG_FILE")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	w := &watcher{log: log, path: *configFile, topic: "config." + *app + ".reload"}
	if err := w.run(ctx, splitAddrs(*addr)); err != nil {
		log.Error("stopped", "err", err)
		os.Exit(1)
	}
	log.Info("stopped")
}

type watcher struct {
	log     *slog.Logger
	path    string
	topic   string
	version string // of the last configuration read
}

// run reads the configuration, then watches for reload signals until ctx is
// done. It returns nil on a shutdown.
func (w *watcher) run(ctx context.Context, addrs []string) error {
	w.reload("start")
	client, err := connect(ctx, w.log, addrs)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer func() {
		// Close ends the subscription and the connection (bounded: 5 s).
		if err := client.Close(); err != nil {
			w.log.Warn("close", "err", err)
		}
	}()
	conn := client.ConnectionEvents()
	backoff := time.Second
	for ctx.Err() == nil {
		sub, err := client.Subscribe(ctx, []string{w.topic}, tinybroker.WithOpenTimeout(10*time.Second))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			w.log.Warn("subscribe failed; retrying", "topic", w.topic, "err", err, "in", backoff)
			sleep(ctx, backoff)
			backoff = min(2*backoff, 30*time.Second)
			continue
		}
		backoff = time.Second
		w.log.Info("subscribed", "topic", w.topic, "subscription", sub.ID(), "broker", client.Address())
		w.watch(ctx, sub, &conn)
		if ctx.Err() != nil {
			return nil
		}
		// The subscription ended for good (closed by an operator, refused
		// on a re-open): open a new one, and read the file again since a
		// signal may have been missed meanwhile.
		w.log.Warn("subscription ended; subscribing again", "err", sub.Err())
		sleep(ctx, time.Second)
		w.reload("resubscribed")
	}
	return nil
}

// watch handles one subscription until it is done or ctx is.
func (w *watcher) watch(ctx context.Context, sub *tinybroker.Subscription, conn *<-chan tinybroker.ConnectionEvent) {
	messages, events := sub.Messages(), sub.Events()
	for {
		select {
		case <-ctx.Done():
			return
		case _, ok := <-messages:
			if !ok {
				return
			}
			w.reload("signal")
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			switch ev.Kind {
			case tinybroker.EventEnded:
				// With resubscribe (the default) the client opens it again
				// and reports Resumed.
				w.log.Warn("subscription ended", "reason", ev.Reason, "message", ev.Message)
			case tinybroker.EventResumed:
				// Reported with the first delivery after the subscription
				// was away, when messages may have been missed: a signal
				// (that delivery) is coming anyway, but it may not be the
				// latest one.
				w.reload("resumed")
			}
		case ev, ok := <-*conn:
			if !ok {
				*conn = nil
				continue
			}
			switch ev.Kind {
			case tinybroker.Disconnected:
				w.log.Warn("disconnected from the broker", "reason", ev.Reason)
			case tinybroker.Reconnected:
				// A signal sent during the outage is lost, and EventResumed
				// comes only with the next delivery: read the file now. The
				// client reopens the subscription on this connection itself.
				w.log.Info("reconnected", "broker", ev.Address, "instance_changed", ev.InstanceChanged)
				w.reload("reconnected")
			}
		}
	}
}

// reload reads the configuration file and logs its version. A file that
// cannot be read or parsed leaves the current configuration in place.
func (w *watcher) reload(reason string) {
	data, err := os.ReadFile(w.path)
	if err != nil {
		w.log.Error("config not read; keeping the current one", "path", w.path, "reason", reason, "err", err)
		return
	}
	var cfg struct {
		Version string `json:"version"`
	}
	if err := json.Unmarshal(data, &cfg); err != nil {
		w.log.Error("config not parsed; keeping the current one", "path", w.path, "reason", reason, "err", err)
		return
	}
	if cfg.Version == "" {
		sum := sha256.Sum256(data)
		cfg.Version = "sha256:" + hex.EncodeToString(sum[:6])
	}
	// Apply the configuration here.
	w.log.Info("config loaded", "version", cfg.Version, "changed", cfg.Version != w.version, "reason", reason)
	w.version = cfg.Version
}

// connect connects, trying again until the broker answers or ctx is done
// (a replica starting before the broker keeps its configuration meanwhile).
func connect(ctx context.Context, log *slog.Logger, addrs []string) (*tinybroker.Client, error) {
	for backoff := 500 * time.Millisecond; ; backoff = min(2*backoff, 10*time.Second) {
		client, err := tinybroker.Connect(ctx, addrs)
		if err == nil {
			log.Info("connected", "broker", client.Address())
			return client, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var terr *tinybroker.Error
		if !errors.As(err, &terr) || terr.Code != codes.Unavailable {
			return nil, fmt.Errorf("connect: %w", err)
		}
		log.Warn("broker not reachable; retrying", "err", err, "in", backoff)
		sleep(ctx, backoff)
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func splitAddrs(s string) []string {
	if s == "" {
		return nil // the client reads TINYBROKER_ADDR
	}
	return strings.Split(s, ",")
}
