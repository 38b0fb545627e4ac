package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
)

// Three replicas re-read their configuration on a signal, and after a broker
// restart (on the same port) without one: the signal sent while the broker
// was down is lost, so they read the file again once resubscribed.
func TestEveryReplicaReloadsOnSignalAndAfterABrokerRestart(t *testing.T) {
	deadline := time.Now().Add(55 * time.Second)
	if d, ok := t.Deadline(); ok && d.Before(deadline) {
		deadline = d.Add(-2 * time.Second)
	}
	bin := brokerBinary(t)
	dir := t.TempDir()
	config := filepath.Join(dir, "config.json")
	writeConfig(t, config, "v1")

	grpcAddr, metricsAddr := freeAddr(t), freeAddr(t)
	broker := startBroker(t, bin, grpcAddr, metricsAddr, deadline)

	watcherBin := filepath.Join(dir, "go-config-watcher")
	build := exec.Command("go", "build", "-o", watcherBin, ".")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		t.Fatalf("go build: %v", err)
	}
	var replicas []*replica
	for i := range 3 {
		replicas = append(replicas, startReplica(t, i, watcherBin, config, grpcAddr))
	}
	for _, r := range replicas {
		r.waitFor(t, deadline, `msg="config loaded" version=v1 changed=true reason=start`)
		r.waitFor(t, deadline, `msg=subscribed topic=config.shop.reload`)
	}

	// A change, then the signal: every replica reads it.
	writeConfig(t, config, "v2")
	publishSignal(t, grpcAddr, deadline, 3)
	for _, r := range replicas {
		r.waitFor(t, deadline, `msg="config loaded" version=v2 changed=true reason=signal`)
	}

	// The broker goes away; the file changes meanwhile (its signal would be
	// lost); the broker comes back on the same address.
	broker.kill()
	writeConfig(t, config, "v3")
	for _, r := range replicas {
		r.waitFor(t, deadline, `msg="disconnected from the broker"`)
	}
	startBroker(t, bin, grpcAddr, metricsAddr, deadline)
	for _, r := range replicas {
		r.waitFor(t, deadline, `msg="config loaded" version=v3 changed=true reason=(reconnected|resumed)`)
	}

	// Resubscribed indeed: the next signal reaches all three (the
	// subscription's EventResumed, which comes with it, may be read first).
	writeConfig(t, config, "v4")
	publishSignal(t, grpcAddr, deadline, 3)
	for _, r := range replicas {
		r.waitFor(t, deadline, `msg="config loaded" version=v4 changed=true reason=(signal|resumed)`)
	}

	// SIGTERM: each closes its client and exits 0.
	for _, r := range replicas {
		if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range replicas {
		select {
		case <-r.exited:
			if code := r.cmd.ProcessState.ExitCode(); code != 0 {
				t.Errorf("replica %d exited with %d after SIGTERM", r.n, code)
			}
		case <-time.After(time.Until(deadline)):
			t.Fatalf("replica %d still running after SIGTERM", r.n)
		}
		r.waitFor(t, deadline, `msg=stopped`)
	}
}

func brokerBinary(t *testing.T) string {
	bin := os.Getenv("TINYBROKER_BIN")
	if bin == "" {
		bin = filepath.Join("..", "..", "target", "debug", "tinybroker")
		if _, err := os.Stat(bin); err != nil {
			t.Skipf("no broker binary at %s: build it (cargo build) or set TINYBROKER_BIN", bin)
		}
	}
	abs, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}

func writeConfig(t *testing.T, path, version string) {
	t.Helper()
	// Written aside, then renamed: a reader sees the old file or the new one.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, `{"version": %q, "replicas": 3}`+"\n", version), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

type broker struct{ cmd *exec.Cmd }

func (b *broker) kill() {
	_ = b.cmd.Process.Kill()
	_ = b.cmd.Wait()
}

// startBroker starts the broker on grpcAddr and returns once it says it
// listens; it is killed at the end of the test.
func startBroker(t *testing.T, bin, grpcAddr, metricsAddr string, deadline time.Time) *broker {
	t.Helper()
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TINYBROKER_") {
			env = append(env, kv)
		}
	}
	cmd := exec.Command(bin, "serve")
	cmd.Env = append(env, "TINYBROKER_GRPC_ADDR="+grpcAddr, "TINYBROKER_METRICS_ADDR="+metricsAddr,
		"RUST_LOG=warn,tinybroker::server=info", "NO_COLOR=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	b := &broker{cmd: cmd}
	t.Cleanup(b.kill)
	started := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := sync.Once{}
		for sc.Scan() {
			if strings.Contains(sc.Text(), "tinybroker started") {
				once.Do(func() { close(started) })
			}
		}
	}()
	select {
	case <-started:
		return b
	case <-time.After(time.Until(deadline)):
		t.Fatal("the broker did not start")
		return nil
	}
}

type replica struct {
	n      int
	cmd    *exec.Cmd
	exited chan struct{}
	mu     sync.Mutex
	lines  []string
	newLog chan struct{} // signalled on each new line
	seen   int           // lines before this one were matched already
}

func startReplica(t *testing.T, n int, bin, config, grpcAddr string) *replica {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "CONFIG_FILE="+config, "APP_NAME=shop", "TINYBROKER_ADDR="+grpcAddr)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &replica{n: n, cmd: cmd, exited: make(chan struct{}), newLog: make(chan struct{}, 1)}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			r.mu.Lock()
			r.lines = append(r.lines, sc.Text())
			r.mu.Unlock()
			select {
			case r.newLog <- struct{}{}:
			default:
			}
		}
		_ = cmd.Wait()
		close(r.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-r.exited
		if t.Failed() {
			r.mu.Lock()
			t.Logf("replica %d's log:\n%s", n, strings.Join(r.lines, "\n"))
			r.mu.Unlock()
		}
	})
	return r
}

// waitFor waits until the replica logs a line matching pattern after the
// last line matched before.
func (r *replica) waitFor(t *testing.T, deadline time.Time, pattern string) {
	t.Helper()
	re := regexp.MustCompile(pattern)
	match := func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for i := r.seen; i < len(r.lines); i++ {
			if re.MatchString(r.lines[i]) {
				r.seen = i + 1
				return true
			}
		}
		return false
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for !match() {
		select {
		case <-r.newLog:
		case <-r.exited:
			if !match() {
				t.Fatalf("replica %d exited without logging %q", r.n, pattern)
			}
			return
		case <-timer.C:
			t.Fatalf("replica %d did not log %q in time", r.n, pattern)
		}
	}
}

// publishSignal publishes the reload signal until it reaches want
// subscriptions (after a restart the replicas' subscriptions are reopened
// a moment after their Reconnected event).
func publishSignal(t *testing.T, addr string, deadline time.Time, want uint32) {
	t.Helper()
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	c, err := tinybroker.Connect(ctx, []string{addr})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for {
		res, err := c.Publish(ctx, "config.shop.reload", []byte("reload"))
		if err != nil {
			t.Fatal(err)
		}
		if res.MatchedSubscriptions == want {
			return
		}
		t.Logf("the signal reached %d subscriptions of %d; again", res.MatchedSubscriptions, want)
		sleep(ctx, 100*time.Millisecond)
		if ctx.Err() != nil {
			t.Fatalf("the signal never reached %d subscriptions", want)
		}
	}
}
