package tinybroker

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// Client is one connection to a broker (the first address of its list that
// answers) and, once anything needs it, one Session stream on it that
// carries every subscription, ack, credit and buffered publish. All its
// methods are safe for concurrent use. Close it when done.
type Client struct {
	opts    options
	targets []target

	connMu sync.RWMutex
	conn   *grpc.ClientConn
	idx    int
	inst   string

	batchMessages int
	batchBytes    int
	requestLimit  int

	// The session goroutine.
	cmds     chan func()
	kick     chan struct{}
	recv     chan recvItem
	loopDone chan struct{}
	wg       sync.WaitGroup
	s        *session // owned by the session goroutine

	// The publish buffer.
	pub pubBuffer

	// Subscriptions with acks, nacks or credit to send.
	dirtyMu sync.Mutex
	dirty   []*Subscription

	closing   atomic.Bool
	closeOnce sync.Once
	closeErr  error

	events   chan ConnectionEvent
	eventsMu sync.Mutex

	msgsIn, bytesIn, msgsOut, bytesOut atomic.Uint64
	reconnects, droppedLate, evDropped atomic.Uint64
	acksSent, nacksSent, creditsSent   atomic.Uint64 // for tests
}

// Connect connects to the first of addrs that answers ("host:port",
// "http://host:port", "https://host:port"; nil or empty:
// $TINYBROKER_ADDR, comma-separated, else 127.0.0.1:50051). It waits,
// bounded by ctx and by WithConnectTimeout per address, until one answers
// GetBrokerInfo (which sizes the publish batches); an *Error with code
// Unavailable when none does, or the broker's error when it refuses (a bad
// token). The token defaults to $TINYBROKER_AUTH_TOKEN.
func Connect(ctx context.Context, addrs []string, opts ...Option) (*Client, error) {
	o := options{
		window:         DefaultWindow,
		bufferBytes:    DefaultBufferBytes,
		resubscribe:    true,
		connectTimeout: DefaultConnectTimeout,
	}
	for _, opt := range opts {
		opt(&o)
	}
	if !o.tokenSet {
		o.token = os.Getenv("TINYBROKER_AUTH_TOKEN")
	}
	if o.window < 1 {
		return nil, usageError("the window must be at least 1, not %d", o.window)
	}
	if o.bufferBytes < 1 {
		return nil, usageError("the buffer must be at least 1 byte, not %d", o.bufferBytes)
	}
	targets, err := parseAddrs(addrs)
	if err != nil {
		return nil, err
	}
	if o.caFile != "" {
		pem, err := os.ReadFile(o.caFile)
		if err != nil {
			return nil, usageError("CA file %s: %v", o.caFile, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, usageError("CA file %s: no PEM certificate in it", o.caFile)
		}
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if o.tlsConfig != nil {
			cfg = o.tlsConfig.Clone()
		}
		cfg.RootCAs = pool
		o.tlsConfig = cfg
	}
	c := &Client{
		opts:          o,
		targets:       targets,
		batchMessages: DefaultBatchMessages,
		batchBytes:    BatchBytes,
		requestLimit:  1 << 62,
		cmds:          make(chan func(), 16),
		kick:          make(chan struct{}, 1),
		recv:          make(chan recvItem, 16),
		loopDone:      make(chan struct{}),
		events:        make(chan ConnectionEvent, 64),
	}
	c.pub.init(c, o.bufferBytes)
	var failures []string
	for i, t := range targets {
		conn, err := c.dial(t)
		if err != nil {
			return nil, err
		}
		actx, cancel := context.WithTimeout(ctx, o.connectTimeout)
		info, err := pb.NewAdminClient(conn).GetBrokerInfo(actx, &pb.GetBrokerInfoRequest{}, grpc.WaitForReady(true))
		cancel()
		if err == nil {
			c.conn, c.idx = conn, i
			if l := info.GetLimits(); l != nil {
				if l.MaxBatchMessages > 0 {
					c.batchMessages = int(min(l.MaxBatchMessages, 1<<20))
				}
				if l.MaxMessageBytes > 0 {
					c.requestLimit = int(l.MaxMessageBytes) + requestSlack
					c.batchBytes = min(BatchBytes, c.requestLimit)
				}
			}
			c.s = newSession(c)
			c.wg.Add(1)
			go c.run()
			return c, nil
		}
		_ = conn.Close()
		e := fromStatus(err, t.String())
		if ctx.Err() != nil {
			return nil, ctxError(ctx, "connect to "+t.String())
		}
		switch e.Code {
		case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Unknown, codes.Internal:
			failures = append(failures, t.String()+": "+e.Message)
		default:
			return nil, &Error{Code: e.Code, Message: t.String() + ": " + e.Message, cause: err}
		}
	}
	return nil, &Error{Code: codes.Unavailable, Message: "no broker answered: " + strings.Join(failures, "; ")}
}

type tokenCreds string

func (t tokenCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}
func (tokenCreds) RequireTransportSecurity() bool { return false }

func (c *Client) dial(t target) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if t.tls {
		cfg := c.opts.tlsConfig
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		creds = credentials.NewTLS(cfg)
	}
	bc := backoff.Config{BaseDelay: ConnectDelayFirst, Multiplier: 1.6, Jitter: jitter, MaxDelay: ConnectDelayCap}
	dopts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bc, MinConnectTimeout: 5 * time.Second}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30), grpc.MaxCallSendMsgSize(1<<30)),
		// Static flow-control windows: grpc-go's BDP estimation (on by
		// default) answers nearly every DATA frame of a quiet connection
		// with a PING; these turn it off (the user's options may set others).
		grpc.WithInitialWindowSize(4 << 20),
		grpc.WithInitialConnWindowSize(16 << 20),
	}
	if c.opts.token != "" {
		dopts = append(dopts, grpc.WithPerRPCCredentials(tokenCreds(c.opts.token)))
	}
	dopts = append(dopts, c.opts.dialOptions...)
	conn, err := grpc.NewClient(t.hostport, dopts...)
	if err != nil {
		return nil, usageError("broker address %s: %v", t, err)
	}
	return conn, nil
}

func (c *Client) current() (*grpc.ClientConn, target) {
	c.connMu.RLock()
	defer c.connMu.RUnlock()
	return c.conn, c.targets[c.idx]
}

// failover moves to the next address (a new connection; the old one closed).
func (c *Client) failover() {
	if len(c.targets) < 2 {
		return
	}
	c.connMu.Lock()
	idx := (c.idx + 1) % len(c.targets)
	conn, err := c.dial(c.targets[idx])
	if err != nil {
		c.connMu.Unlock()
		return
	}
	old := c.conn
	c.conn, c.idx = conn, idx
	c.connMu.Unlock()
	_ = old.Close()
}

// Address returns the address of the current connection ("http://host:port").
func (c *Client) Address() string {
	_, t := c.current()
	return t.String()
}

// Instance returns the tinybroker-instance of the current (or last) session,
// "" before the first one.
func (c *Client) Instance() string {
	c.connMu.RLock()
	defer c.connMu.RUnlock()
	return c.inst
}

// Stats returns the client's counters.
func (c *Client) Stats() Stats {
	pm, pb := c.pub.pending()
	return Stats{
		MessagesIn: c.msgsIn.Load(), BytesIn: c.bytesIn.Load(),
		MessagesOut: c.msgsOut.Load(), BytesOut: c.bytesOut.Load(),
		Reconnects: c.reconnects.Load(), PendingMessages: pm, PendingBytes: pb,
		DroppedLate: c.droppedLate.Load(), EventsDropped: c.evDropped.Load(),
	}
}

// ConnectionEvents returns the channel of connection events (buffered, 64;
// when the reader is slow the oldest is dropped and Stats().EventsDropped
// counts it). It is closed after the Closed event.
func (c *Client) ConnectionEvents() <-chan ConnectionEvent { return c.events }

func (c *Client) emit(ev ConnectionEvent) {
	if f := c.opts.onConnection; f != nil {
		f(ev)
	}
	c.eventsMu.Lock()
	defer c.eventsMu.Unlock()
	for {
		select {
		case c.events <- ev:
			return
		default:
		}
		select {
		case <-c.events:
			c.evDropped.Add(1)
		default:
		}
	}
}

// post runs f on the session goroutine; false when it has ended.
func (c *Client) post(f func()) bool {
	select {
	case c.cmds <- f:
		return true
	case <-c.loopDone:
		return false
	}
}

func (c *Client) wake() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

func (c *Client) markDirty(s *Subscription) {
	if s.dirty.Swap(true) {
		return
	}
	c.dirtyMu.Lock()
	c.dirty = append(c.dirty, s)
	c.dirtyMu.Unlock()
	c.wake()
}

// Publish publishes one message with the unary Publish (not through the
// buffer, so it may overtake buffered messages) and returns its sequence
// and matched counts, or a *PublishError with the broker's code and message.
func (c *Client) Publish(ctx context.Context, topic string, payload []byte, opts ...PublishOption) (PublishResult, error) {
	if c.closing.Load() {
		return PublishResult{}, ErrClosed
	}
	po := publishOptions{}
	for _, o := range opts {
		o(&po)
	}
	headers := c.injectHeaders(ctx, po.headers)
	conn, t := c.current()
	resp, err := pb.NewBrokerClient(conn).Publish(ctx, &pb.PublishRequest{Topic: topic, Payload: payload, Headers: headers})
	if err != nil {
		if c.closing.Load() {
			return PublishResult{}, ErrClosed
		}
		if ctx.Err() != nil {
			return PublishResult{}, ctxError(ctx, "publish")
		}
		e := fromStatus(err, "publish on "+t.String())
		return PublishResult{}, &PublishError{Code: e.Code, Message: e.Message}
	}
	return PublishResult{resp.Sequence, resp.MatchedSubscriptions, resp.MatchedGroups}, nil
}

func (c *Client) injectHeaders(ctx context.Context, h map[string]string) map[string]string {
	p := c.opts.propagator
	if p == nil {
		return h
	}
	out := make(map[string]string, len(h)+2)
	for k, v := range h {
		out[k] = v
	}
	p.Inject(ctx, out)
	return out
}

// Close is CloseContext with CLOSE_TIMEOUT (CloseTimeout) for the flush.
func (c *Client) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), CloseTimeout)
	defer cancel()
	return c.CloseContext(ctx)
}

// CloseContext flushes the buffer (bounded by ctx), then ends every
// subscription (SessionClose each, then the half-close), closes the
// connection and emits Closed. It returns a *CloseError when something
// published was not delivered (not sent, or unconfirmed and not reported
// by a Flush), nil otherwise. After it every method returns an error
// matching ErrClosed, waiting Next and PublishAsync calls end with it, and
// no goroutine of the client is left. Calling it again returns the first
// result.
func (c *Client) CloseContext(ctx context.Context) error {
	c.closeOnce.Do(func() {
		c.closing.Store(true)
		c.pub.waitSettled(ctx)
		done := make(chan struct{})
		deadline, ok := ctx.Deadline()
		if !ok || time.Until(deadline) < time.Second {
			deadline = time.Now().Add(time.Second)
		}
		if !c.post(func() { c.s.startClose(deadline, done) }) {
			close(done)
		}
		<-done
		<-c.loopDone
		c.connMu.Lock()
		conn := c.conn
		c.connMu.Unlock()
		_ = conn.Close()
		c.wg.Wait()
		notSent, unconfirmed := c.pub.closeCounts()
		if notSent > 0 || unconfirmed > 0 {
			c.closeErr = &CloseError{NotSent: notSent, Unconfirmed: unconfirmed}
		}
	})
	return c.closeErr
}

// rawCodec sends pre-encoded SessionRequests ([]byte) as they are,
// decodes SessionEvents with decodeEvent, and (un)marshals everything else
// with protobuf.
type rawCodec struct{}

var protoCodec = encoding.GetCodecV2("proto")

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	if b, ok := v.(*rawRequest); ok {
		return mem.BufferSlice{mem.SliceBuffer(b.b)}, nil
	}
	return protoCodec.Marshal(v)
}

// Unmarshal decodes a SessionEvent into *inEvents with decodeEvent, over
// one copy of the message's bytes (data is only valid during the call).
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if in, ok := v.(*inEvents); ok {
		return decodeEvent(data.Materialize(), in)
	}
	return protoCodec.Unmarshal(data, v)
}

func (rawCodec) Name() string { return "proto" }

type rawRequest struct{ b []byte }

func marshalRequest(r *pb.SessionRequest) *rawRequest {
	b, err := proto.Marshal(r)
	if err != nil {
		panic(fmt.Sprintf("tinybroker: marshal %v: %v", r, err))
	}
	return &rawRequest{b}
}
