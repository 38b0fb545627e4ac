package tinybroker

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// The tests start the real broker binary: $TINYBROKER_BIN, default
// ../../target/debug/tinybroker. Every process binds 127.0.0.1 only and is
// killed at the end of its test; every wait is bounded.

func brokerBinary(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("TINYBROKER_BIN")
	if bin == "" {
		bin = "../../target/debug/tinybroker"
	}
	abs, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(abs); err != nil {
		t.Fatalf("no tinybroker binary at %s: set TINYBROKER_BIN (%v)", abs, err)
	}
	return abs
}

func freePort(t testing.TB) int {
	t.Helper()
	return freePorts(t, 1)[0]
}

// freePorts returns n distinct free ports (all held until all are found),
// taken below the kernel's ephemeral range (32768-60999 by default): a
// broker that a test restarts on its port must find it free, and while it
// is down neither another test's ":0" bind nor the source port of a client's
// connection to it can take a port from there.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	var ports []int
	for attempt := 0; len(ports) < n; attempt++ {
		if attempt == 1000 {
			t.Fatal("no free port in 20000-31999")
		}
		port := 20000 + rand.IntN(12000)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		defer l.Close()
		ports = append(ports, port)
	}
	return ports
}

type broker struct {
	t           testing.TB
	env         map[string]string
	port        int
	metricsPort int
	addr        string
	cmd         *exec.Cmd
	mu          sync.Mutex
	lines       []string
	exited      chan struct{}
}

// startBroker starts a broker on a port of its own (kept across restarts).
func startBroker(t testing.TB, env map[string]string) *broker {
	t.Helper()
	b := &broker{t: t, env: env}
	// A port found free may be taken by another process before the broker
	// binds it: then two new ones.
	for attempt := 0; ; attempt++ {
		ports := freePorts(t, 2)
		b.port, b.metricsPort = ports[0], ports[1]
		if b.tryStart() || attempt == 4 {
			break
		}
	}
	t.Cleanup(b.kill)
	return b
}

var startedRe = regexp.MustCompile(`grpc_addr=\"?([0-9.:]+)`)

// start starts the broker on its ports (a restart: the same ones), trying
// again while a port is still held (TIME_WAIT of the killed one's sockets
// does not stop a listener, another process's socket does).
func (b *broker) start() {
	b.t.Helper()
	for attempt := 0; !b.tryStart(); attempt++ {
		if attempt == 20 {
			b.t.Fatalf("tinybroker could not bind its ports:\n%s", b.log())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tryStart starts the broker; false when a port was in use.
func (b *broker) tryStart() bool {
	b.t.Helper()
	cmd := exec.Command(brokerBinary(b.t), "serve")
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TINYBROKER_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		fmt.Sprintf("TINYBROKER_GRPC_ADDR=127.0.0.1:%d", b.port),
		fmt.Sprintf("TINYBROKER_METRICS_ADDR=127.0.0.1:%d", b.metricsPort),
		"RUST_LOG=info", "TINYBROKER_LOG_FORMAT=text", "NO_COLOR=1")
	for k, v := range b.env {
		env = append(env, k+"="+v)
	}
	cmd.Env = env
	stderr, err := cmd.StderrPipe()
	if err != nil {
		b.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.t.Fatal(err)
	}
	b.cmd = cmd
	started := make(chan string, 1)
	exited := make(chan struct{})
	b.exited = exited
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			b.mu.Lock()
			b.lines = append(b.lines, line)
			b.mu.Unlock()
			if strings.Contains(line, "tinybroker started") {
				if m := startedRe.FindStringSubmatch(line); m != nil {
					select {
					case started <- m[1]:
					default:
					}
				}
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		_ = cmd.Wait()
		close(exited)
	}()
	select {
	case addr := <-started:
		b.addr = addr
	case <-exited:
		if strings.Contains(b.log(), "Address already in use") {
			return false
		}
		b.t.Fatalf("tinybroker exited at start:\n%s", b.log())
	case <-time.After(30 * time.Second):
		b.kill()
		b.t.Fatalf("tinybroker did not start within 30 s:\n%s", b.log())
	}
	return true
}

func (b *broker) log() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := len(b.lines)
	return strings.Join(b.lines[max(0, n-30):], "\n")
}

// kill: SIGKILL, no goodbye to any client.
func (b *broker) kill() {
	if b.cmd == nil {
		return
	}
	_ = b.cmd.Process.Kill()
	select {
	case <-b.exited:
	case <-time.After(10 * time.Second):
	}
	b.cmd = nil
}

// stop: SIGTERM, as an orchestrator stops it (once its handler is installed).
func (b *broker) stop() {
	if b.cmd == nil {
		return
	}
	pid := b.cmd.Process.Pid
	waitFor(b.t, 5*time.Second, "the broker to handle SIGTERM", func() bool { return handlesSigterm(pid) })
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.exited:
	case <-time.After(20 * time.Second):
		b.kill()
	}
	b.cmd = nil
}

func handlesSigterm(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "SigCgt:") {
			v, _ := strconv.ParseUint(strings.TrimSpace(line[7:]), 16, 64)
			return v&(1<<(uint(syscall.SIGTERM)-1)) != 0
		}
	}
	return false
}

func (b *broker) restart() { b.start() }

// waitFor polls cond until it is true or the timeout passes (then fails).
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// metrics reads the broker's /metrics as {name{labels}: value}.
func (b *broker) metrics(t testing.TB) map[string]float64 {
	t.Helper()
	cl := http.Client{Timeout: 5 * time.Second}
	resp, err := cl.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", b.metricsPort))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	out := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

func waitServing(t testing.TB, b *broker) {
	t.Helper()
	conn, err := grpc.NewClient(b.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	const limit = 30 * time.Second
	deadline := time.Now().Add(limit)
	last := "no answer yet"
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && r.Status == healthpb.HealthCheckResponse_SERVING {
			return
		}
		if err != nil {
			last = err.Error()
		} else {
			last = r.Status.String()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not SERVING within %v (last answer: %s); the broker's log ends:\n%s", b.addr, limit, last, b.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func connect(t testing.TB, addrs []string, opts ...Option) *Client {
	t.Helper()
	c, err := Connect(ctxT(t, 20*time.Second), addrs, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}
