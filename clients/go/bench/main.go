// Command bench measures tinybroker's Go client against nats.go (the official
// NATS client) on this machine, in one run.
//
// It starts a tinybroker (the release binary) and a nats-server on
// 127.0.0.1, then measures, for each client, the workloads of
// clients/python/bench/bench.py and clients/typescript/bench/bench.mjs:
//
//  1. publish rate: one publisher, N messages of SIZE bytes, nobody
//     subscribed (tinybroker: PublishAsync each, into the client's buffer,
//     then Flush; nats.go: Publish each, then Flush): the rate counts until
//     the server has answered for the last one;
//  2. receive rate on one subscription: a publisher in another process (this
//     program re-executed, with the same client) sends N messages as fast as
//     it can; the measured process receives them on one subscription
//     (tinybroker: `for m := range sub.Messages()`; nats.go: an async
//     callback subscription, its fastest documented way); rate from the first
//     message to the last, and the receiving process's CPU (getrusage,
//     user + system, every thread) per message;
//  3. 1,000 subscriptions in one process at 200 msg/s in all: a publisher in
//     another process sends 200 msg/s round-robin over the 1,000 topics for
//     DURATION seconds, each payload carrying its send time; the holding
//     process's CPU per delivery and the 99th percentile of the
//     send-to-receive latency (both processes on this machine's clock).
//
// Usage (from clients/go/bench):
//
//	TINYBROKER_BIN=../../../target/release/tinybroker \
//	TB_NATS_SERVER=/usr/local/lib/tinybroker/nats-server-2.10/nats-server \
//	    go run . [-messages 100000] [-size 128] [-duration 10] [-runs 3]
//	    [-only tinybroker|nats] [-scenario publish|receive|fanout] [-next]
//	go run . -quick                     # CI smoke run: fails only on lost messages
//	go run . -profile receive           # pprof CPU profile of the tinybroker side
//
// TINYBROKER_BIN defaults to target/release/tinybroker of the repository,
// TB_NATS_SERVER to nats-server on PATH (as the Python benchmark does). Not a
// test: it prints a markdown table. It exits non-zero when a run fails or
// tinybroker's client loses a message.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// system is one client behind the calls every workload needs.
type system interface {
	label() string
	connect(ctx context.Context, addr string) error
	close() error
	// publishMany publishes n messages, paced at rate per second (0: as fast
	// as it can), and returns once the server answered for the last one.
	publishMany(ctx context.Context, topicOf func(int) string, n int, payloadOf func(int) []byte, rate float64) error
	// subscribe returns once the server has the subscription; onMessage is
	// called for each message, from one goroutine per subscription.
	subscribe(ctx context.Context, subject string, onMessage func(payload []byte)) error
}

var kinds = []string{"tinybroker", "nats"}

func newSystem(kind string) system {
	if kind == "nats" {
		return &natsSystem{}
	}
	return &tbSystem{}
}

func paced(n int, rate float64, send func(i int) error) error {
	start := time.Now()
	for i := range n {
		if rate > 0 {
			due := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
			if d := time.Until(due); d > 0 {
				time.Sleep(d)
			}
		}
		if err := send(i); err != nil {
			return err
		}
	}
	return nil
}

// cpuTime is the process's CPU time so far (user + system, every thread).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// === the workloads ===

type pubResult struct{ rate float64 }

func publishRate(kind, addr string, n, size int) (pubResult, error) {
	ctx := context.Background()
	s := newSystem(kind)
	if err := s.connect(ctx, addr); err != nil {
		return pubResult{}, err
	}
	defer s.close()
	payload := []byte(strings.Repeat("x", size))
	t0 := time.Now()
	if err := s.publishMany(ctx, func(int) string { return "bench.pub" }, n, func(int) []byte { return payload }, 0); err != nil {
		return pubResult{}, err
	}
	return pubResult{rate: float64(n) / time.Since(t0).Seconds()}, nil
}

type rxResult struct {
	rate, cpuUs float64
	lost        int
}

func receiveRate(kind, addr string, n, size int) (rxResult, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := newSystem(kind)
	if err := s.connect(ctx, addr); err != nil {
		return rxResult{}, err
	}
	defer s.close()
	var (
		got         atomic.Int64
		first, last time.Time
		cpu0, cpu1  time.Duration
		done        = make(chan struct{})
	)
	err := s.subscribe(ctx, "rx.>", func([]byte) {
		switch got.Add(1) {
		case 1:
			first, cpu0 = time.Now(), cpuTime()
			if n == 1 {
				last, cpu1 = first, cpu0
				close(done)
			}
		case int64(n):
			last, cpu1 = time.Now(), cpuTime()
			close(done)
		}
	})
	if err != nil {
		return rxResult{}, err
	}
	pub, err := startPublisher(kind, addr, "rx.x", n, size, 0)
	if err != nil {
		return rxResult{}, err
	}
	timer := time.NewTimer(120 * time.Second)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
	}
	pubErr := pub.wait(60 * time.Second)
	select {
	case <-done:
	default:
		lost := n - int(got.Load())
		return rxResult{rate: math.NaN(), cpuUs: math.NaN(), lost: lost}, pubErr
	}
	if n < 2 {
		return rxResult{}, nil
	}
	wall := last.Sub(first).Seconds()
	return rxResult{
		rate:  float64(n-1) / wall,
		cpuUs: float64((cpu1 - cpu0).Microseconds()) / float64(n-1),
	}, pubErr
}

type fanResult struct {
	cpuUs, cpuPct, p99Ms, setupS float64
	lost                         int
}

func manySubscriptions(kind, addr string, subs int, rate, duration float64) (fanResult, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := newSystem(kind)
	if err := s.connect(ctx, addr); err != nil {
		return fanResult{}, err
	}
	defer s.close()
	total := int(math.Round(rate * duration))
	var (
		count     atomic.Int64
		mu        sync.Mutex
		latencies = make([]time.Duration, 0, total)
	)
	onMessage := func(payload []byte) {
		now := time.Now().UnixNano()
		sent, err := strconv.ParseInt(strings.TrimSpace(string(payload)), 10, 64)
		count.Add(1)
		if err != nil {
			return
		}
		mu.Lock()
		latencies = append(latencies, time.Duration(now-sent))
		mu.Unlock()
	}
	t0 := time.Now()
	for i := range subs {
		if err := s.subscribe(ctx, fmt.Sprintf("fan.%d", i), onMessage); err != nil {
			return fanResult{}, fmt.Errorf("subscription %d: %w", i, err)
		}
	}
	setup := time.Since(t0).Seconds()
	time.Sleep(time.Second) // settle, then measure only the run
	c0, w0 := cpuTime(), time.Now()
	pub, err := startPublisher(kind, addr, fmt.Sprintf("fan.%%d/%d", subs), total, 128, rate)
	if err != nil {
		return fanResult{}, err
	}
	deadline := time.Now().Add(time.Duration((duration + 30) * float64(time.Second)))
	for int(count.Load()) < total && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	cpu, wall := cpuTime()-c0, time.Since(w0)
	pubErr := pub.wait(60 * time.Second)
	n := int(count.Load())
	mu.Lock()
	lat := slices.Clone(latencies)
	mu.Unlock()
	slices.Sort(lat)
	p99 := math.NaN()
	if len(lat) > 0 {
		p99 = float64(lat[min(len(lat)-1, len(lat)*99/100)]) / 1e6
	}
	return fanResult{
		cpuUs:  float64(cpu.Microseconds()) / float64(max(n, 1)),
		cpuPct: cpu.Seconds() / wall.Seconds() * 100,
		p99Ms:  p99,
		setupS: setup,
		lost:   total - n,
	}, pubErr
}

// === the publisher process ===

type child struct {
	cmd  *exec.Cmd
	done chan error
}

func startPublisher(kind, addr, topics string, n, size int, rate float64) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "_publish", kind, addr, topics, strconv.Itoa(n), strconv.Itoa(size), strconv.FormatFloat(rate, 'f', -1, 64))
	cmd.Stdout, cmd.Stderr = nil, os.Stderr
	cmd.SysProcAttr = childAttr()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, done: make(chan error, 1)}
	go func() { c.done <- cmd.Wait() }()
	return c, nil
}

// wait waits for the publisher at most d, then kills it.
func (c *child) wait(d time.Duration) error {
	select {
	case err := <-c.done:
		if err != nil {
			return fmt.Errorf("publisher: %w", err)
		}
		return nil
	case <-time.After(d):
		_ = c.cmd.Process.Kill()
		<-c.done
		return errors.New("publisher did not finish in time: killed")
	}
}

func publishMain(args []string) error {
	if len(args) != 6 {
		return errors.New("usage: _publish kind addr topics n size rate")
	}
	kind, addr, topics := args[0], args[1], args[2]
	n, err1 := strconv.Atoi(args[3])
	size, err2 := strconv.Atoi(args[4])
	rate, err3 := strconv.ParseFloat(args[5], 64)
	if err := errors.Join(err1, err2, err3); err != nil {
		return err
	}
	topicOf := func(int) string { return topics }
	if pattern, count, ok := strings.Cut(topics, "/"); ok {
		c, err := strconv.Atoi(count)
		if err != nil {
			return err
		}
		names := make([]string, c)
		for i := range names {
			names[i] = strings.Replace(pattern, "%d", strconv.Itoa(i), 1)
		}
		topicOf = func(i int) string { return names[i%c] }
	}
	fixed := []byte(strings.Repeat("x", size))
	payloadOf := func(int) []byte { return fixed }
	if rate > 0 {
		// Paced: each payload is its send time (for the latency), padded to size.
		payloadOf = func(int) []byte {
			b := strconv.AppendInt(make([]byte, 0, size), time.Now().UnixNano(), 10)
			for len(b) < size {
				b = append(b, ' ')
			}
			return b
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s := newSystem(kind)
	if err := s.connect(ctx, addr); err != nil {
		return err
	}
	if err := s.publishMany(ctx, topicOf, n, payloadOf, rate); err != nil {
		s.close()
		return err
	}
	return s.close()
}

// === the servers ===

type server struct {
	cmd    *exec.Cmd
	addr   string
	binary string
}

func (s *server) kill() {
	if s != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
	}
}

// repoRoot is the repository this source file is in (clients/go/bench), else
// the first directory above the working directory holding Cargo.toml.
func repoRoot() string {
	if _, file, _, ok := runtime.Caller(0); ok {
		root := filepath.Join(filepath.Dir(file), "..", "..", "..")
		if _, err := os.Stat(filepath.Join(root, "Cargo.toml")); err == nil {
			return filepath.Clean(root)
		}
	}
	dir, _ := os.Getwd()
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "Cargo.toml")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return dir
		}
	}
}

func startTinybroker() (*server, error) {
	binary := os.Getenv("TINYBROKER_BIN")
	if binary == "" {
		binary = filepath.Join(repoRoot(), "target", "release", "tinybroker")
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TINYBROKER_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		"TINYBROKER_GRPC_ADDR=127.0.0.1:0",
		"TINYBROKER_METRICS_ADDR=127.0.0.1:0",
		"TINYBROKER_CONSUMER_CAPACITY=1000000",
		"TINYBROKER_METRICS_PER_SUBSCRIPTION=false",
		"RUST_LOG=warn,tinybroker::server=info",
		"NO_COLOR=1",
	)
	cmd := exec.Command(binary, "serve")
	cmd.Env = env
	cmd.SysProcAttr = childAttr()
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("tinybroker (%s): %w", binary, err)
	}
	s := &server{cmd: cmd, binary: binary}
	found := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`tinybroker started.*grpc_addr="?([^"\s]+)`)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case found <- m[1]:
				default:
				}
			}
		}
	}()
	select {
	case s.addr = <-found:
		return s, nil
	case <-time.After(30 * time.Second):
		s.kill()
		return nil, errors.New("tinybroker did not start within 30 s")
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startNats() (*server, error) {
	binary := os.Getenv("TB_NATS_SERVER")
	if binary == "" {
		var err error
		if binary, err = exec.LookPath("nats-server"); err != nil {
			return nil, errors.New("no nats-server: set TB_NATS_SERVER")
		}
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(binary, "-a", "127.0.0.1", "-p", strconv.Itoa(port))
	cmd.SysProcAttr = childAttr()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("nats-server (%s): %w", binary, err)
	}
	s := &server{cmd: cmd, binary: binary, addr: fmt.Sprintf("127.0.0.1:%d", port)}
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", s.addr, 500*time.Millisecond)
		if err == nil {
			c.Close()
			return s, nil
		}
		if time.Now().After(deadline) {
			s.kill()
			return nil, errors.New("nats-server did not start within 20 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// === main ===

type row struct {
	pub, rx, rxCPU, fan, fanPct, p99 []float64
	lost                             int
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "_publish" {
		if err := publishMain(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "bench publisher:", err)
			os.Exit(1)
		}
		return
	}
	os.Exit(run())
}

func run() int {
	var (
		messages = flag.Int("messages", 100_000, "messages per rate workload")
		size     = flag.Int("size", 128, "payload bytes")
		subs     = flag.Int("subscriptions", 1000, "subscriptions of the fan-out workload")
		rate     = flag.Float64("rate", 200, "msg/s in all of the fan-out workload")
		duration = flag.Float64("duration", 10, "seconds of the fan-out workload")
		runs     = flag.Int("runs", 1, "runs, alternating the order of the clients; the best of them is shown")
		only     = flag.String("only", "", "tinybroker or nats: one client only")
		scenario = flag.String("scenario", "", "publish, receive or fanout: one workload only")
		quick    = flag.Bool("quick", false, "CI smoke run: 2,000 messages, 100 subscriptions for 2 s; fails only on lost messages")
		profile  = flag.String("profile", "", "publish, receive or fanout: run that tinybroker workload only, under a pprof CPU profile")
		profOut  = flag.String("profile-out", "", "where -profile writes (default tinybroker-<workload>.pprof)")
	)
	flag.BoolVar(&useNext, "next", false, "tinybroker receives with sub.Next instead of range sub.Messages()")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "bench: unexpected arguments:", flag.Args())
		return 2
	}
	if *quick {
		*messages, *subs, *duration = 2000, 100, 2
	}
	for _, v := range []string{*scenario, *profile} {
		if v != "" && v != "publish" && v != "receive" && v != "fanout" {
			fmt.Fprintf(os.Stderr, "bench: unknown workload %q (publish, receive or fanout)\n", v)
			return 2
		}
	}
	runKinds := kinds
	if *only != "" {
		if *only != "tinybroker" && *only != "nats" {
			fmt.Fprintf(os.Stderr, "bench: -only %q: tinybroker or nats\n", *only)
			return 2
		}
		runKinds = []string{*only}
	}
	if *profile != "" {
		runKinds, *scenario, *runs = []string{"tinybroker"}, *profile, 1
	}

	tb, err := startTinybroker()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	defer tb.kill()
	nats, err := startNats()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		tb.kill()
		return 1
	}
	defer nats.kill()
	// An interrupt still kills both servers.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		tb.kill()
		nats.kill()
		os.Exit(130)
	}()
	addrs := map[string]string{"tinybroker": tb.addr, "nats": nats.addr}

	if *profile != "" {
		out := *profOut
		if out == "" {
			out = "tinybroker-" + *profile + ".pprof"
		}
		f, err := os.Create(out)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		defer func() {
			pprof.StopCPUProfile()
			fmt.Fprintf(os.Stderr, "profile of tinybroker %s written to %s: go tool pprof -top %s\n", *profile, out, out)
		}()
	}

	want := func(s string) bool { return *scenario == "" || *scenario == s }
	rows := map[string]*row{}
	for _, k := range runKinds {
		rows[k] = &row{}
	}
	failed := false
	fail := func(kind, what string, err error) {
		fmt.Fprintf(os.Stderr, "bench: %s %s: %v\n", kind, what, err)
		failed = true
	}
	for r := range *runs {
		order := slices.Clone(runKinds)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		for _, kind := range order {
			addr, rw := addrs[kind], rows[kind]
			if want("publish") {
				if res, err := publishRate(kind, addr, *messages, *size); err != nil {
					fail(kind, "publish", err)
				} else {
					rw.pub = append(rw.pub, res.rate)
				}
			}
			if want("receive") {
				res, err := receiveRate(kind, addr, *messages, *size)
				if err != nil {
					fail(kind, "receive", err)
				}
				rw.lost += res.lost
				if !math.IsNaN(res.rate) && res.rate > 0 {
					rw.rx = append(rw.rx, res.rate)
					rw.rxCPU = append(rw.rxCPU, res.cpuUs)
				}
			}
			if want("fanout") {
				res, err := manySubscriptions(kind, addr, *subs, *rate, *duration)
				if err != nil {
					fail(kind, "fanout", err)
				}
				rw.lost += res.lost
				if res.cpuUs > 0 {
					rw.fan = append(rw.fan, res.cpuUs)
					rw.fanPct = append(rw.fanPct, res.cpuPct)
					rw.p99 = append(rw.p99, res.p99Ms)
				}
				fmt.Fprintf(os.Stderr, "run %d %s: %d subscriptions opened in %.2f s\n", r+1, kind, *subs, res.setupS)
			}
			fmt.Fprintf(os.Stderr, "run %d %s: done\n", r+1, kind)
		}
	}

	printTable(rows, *messages, *size, *subs, *rate, *duration, *runs, tb.binary, nats.binary)
	if *quick {
		fmt.Println("\n-quick: a smoke run; its figures say nothing of speed. It fails only on lost messages or a failed run.")
	}
	if rw := rows["tinybroker"]; rw != nil && rw.lost > 0 {
		fmt.Fprintf(os.Stderr, "bench: tinybroker's client lost %d messages\n", rw.lost)
		failed = true
	}
	if rw := rows["nats"]; rw != nil && rw.lost > 0 {
		fmt.Fprintf(os.Stderr, "bench: warning: nats.go lost %d messages (core NATS may drop for a slow consumer)\n", rw.lost)
	}
	if failed {
		return 1
	}
	return 0
}

func best(xs []float64, higher bool) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	if higher {
		return slices.Max(xs)
	}
	return slices.Min(xs)
}

func moduleVersion(path string) string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == path {
				return d.Version
			}
		}
	}
	return "?"
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}

func printTable(rows map[string]*row, n, size, subs int, rate, duration float64, runs int, tbBin, natsBin string) {
	tb, nt := rows["tinybroker"], rows["nats"]
	if tb == nil {
		tb = &row{}
	}
	if nt == nil {
		nt = &row{}
	}
	receiveWith := "range sub.Messages()"
	if useNext {
		receiveWith = "sub.Next"
	}
	fmt.Printf("\n%d messages of %d B; %d subscriptions at %g msg/s in all for %g s; best of %d run(s); "+
		"tinybroker receives with %s; %s, %d CPUs, load average %s; grpc %s, nats.go %s; %s; %s\n\n",
		n, size, subs, rate, duration, runs, receiveWith, runtime.Version(), runtime.NumCPU(), loadAverage(),
		moduleVersion("google.golang.org/grpc"), moduleVersion("github.com/nats-io/nats.go"), tbBin, natsBin)
	fmt.Println("| workload | tinybroker (Go client) | nats.go | ratio | target |")
	fmt.Println("|---|---:|---:|---:|---|")
	line := func(name string, a, b float64, digits int, higher *bool) {
		ratio := a / b
		target := "—"
		if higher != nil {
			switch {
			case math.IsNaN(ratio):
				target = "?"
			case *higher && ratio >= 1:
				target = "≥ ×1: met"
			case *higher:
				target = "≥ ×1: **missed**"
			case ratio <= 1:
				target = "≤ ×1: met"
			default:
				target = "≤ ×1: **missed**"
			}
		}
		r := "-"
		if !math.IsNaN(ratio) && !math.IsInf(ratio, 0) {
			r = fmt.Sprintf("×%.2f", ratio)
		}
		fmt.Printf("| %s | %s | %s | %s | %s |\n", name, num(a, digits), num(b, digits), r, target)
	}
	up, down := true, false
	line("publish (msg/s)", best(tb.pub, true), best(nt.pub, true), 0, &up)
	line("receive, 1 subscription (msg/s)", best(tb.rx, true), best(nt.rx, true), 0, &up)
	line("receive CPU (µs/msg)", best(tb.rxCPU, false), best(nt.rxCPU, false), 2, &down)
	line(fmt.Sprintf("%s subs: CPU per delivery (µs)", num(float64(subs), 0)), best(tb.fan, false), best(nt.fan, false), 0, &down)
	line(fmt.Sprintf("%s subs: CPU (%% of a core)", num(float64(subs), 0)), best(tb.fanPct, false), best(nt.fanPct, false), 2, nil)
	line(fmt.Sprintf("%s subs: p99 latency (ms)", num(float64(subs), 0)), best(tb.p99, false), best(nt.p99, false), 2, nil)
	fmt.Printf("| lost messages | %d | %d | | 0 |\n", tb.lost, nt.lost)
}

// num formats x with digits decimals and thousands separators.
func num(x float64, digits int) string {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return "-"
	}
	s := strconv.FormatFloat(x, 'f', digits, 64)
	intPart, frac, _ := strings.Cut(s, ".")
	neg := strings.HasPrefix(intPart, "-")
	intPart = strings.TrimPrefix(intPart, "-")
	var b strings.Builder
	for i, c := range intPart {
		if i > 0 && (len(intPart)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	out := b.String()
	if neg {
		out = "-" + out
	}
	if frac != "" {
		out += "." + frac
	}
	return out
}
