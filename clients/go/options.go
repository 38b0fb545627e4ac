package tinybroker

import (
	"context"
	"crypto/tls"
	"time"

	"google.golang.org/grpc"
)

// The constants of docs/clients.md "The constants".
const (
	// DefaultWindow is WINDOW: the credit of one subscription, and the most
	// deliveries the client holds for it.
	DefaultWindow = 256
	// DefaultBufferBytes is BUFFER_BYTES: encoded bytes published and not yet
	// written to a session before PublishAsync waits.
	DefaultBufferBytes = 8 << 20
	// DefaultBatchMessages is BATCH_MESSAGES when the broker does not say
	// its max_batch_messages.
	DefaultBatchMessages = 1024
	// BatchBytes is BATCH_BYTES: encoded bytes of one SessionPublish (never
	// over the broker's max_message_bytes + requestSlack).
	BatchBytes = 512 << 10
	// BatchesInFlight is BATCHES_IN_FLIGHT: SessionPublish requests written
	// and not yet answered.
	BatchesInFlight = 4
	// ConnectDelayFirst is CONNECT_DELAY_FIRST.
	ConnectDelayFirst = 100 * time.Millisecond
	// ConnectDelayCap is CONNECT_DELAY_CAP.
	ConnectDelayCap = 250 * time.Millisecond
	// ResubscribeDelayFirst is RESUBSCRIBE_DELAY_FIRST.
	ResubscribeDelayFirst = 100 * time.Millisecond
	// ResubscribeDelayCap is RESUBSCRIBE_DELAY_CAP.
	ResubscribeDelayCap = 5 * time.Second
	// StartTimeout is START_TIMEOUT: how long the broker has to accept a session.
	StartTimeout = 10 * time.Second
	// CloseTimeout is CLOSE_TIMEOUT: how long Close waits for the buffer to be answered.
	CloseTimeout = 5 * time.Second
	// DefaultConnectTimeout is how long Connect waits for one address.
	DefaultConnectTimeout = 5 * time.Second
	// DefaultOpenTimeout is how long Subscribe waits for the first open.
	DefaultOpenTimeout = 10 * time.Second

	requestSlack = 64<<10 - 1<<10
	// jitter is JITTER: each delay is multiplied by a uniform factor in
	// [1-jitter, 1+jitter].
	jitter = 0.2
)

// topUp is TOP_UP for a window.
func topUp(window int) int { return max(1, window/4) }

type options struct {
	token          string
	tokenSet       bool
	tlsConfig      *tls.Config
	caFile         string
	window         int
	bufferBytes    int
	resubscribe    bool
	connectTimeout time.Duration
	dialOptions    []grpc.DialOption
	propagator     Propagator
	onConnection   func(ConnectionEvent)
}

// Option configures Connect.
type Option func(*options)

// WithToken sets the bearer token (default: $TINYBROKER_AUTH_TOKEN).
func WithToken(token string) Option {
	return func(o *options) { o.token, o.tokenSet = token, true }
}

// WithTLSConfig sets the TLS configuration of https:// addresses.
func WithTLSConfig(cfg *tls.Config) Option { return func(o *options) { o.tlsConfig = cfg } }

// WithCAFile sets a PEM file of CA certificates trusted for https:// addresses.
func WithCAFile(path string) Option { return func(o *options) { o.caFile = path } }

// WithWindow sets WINDOW, the credit of each subscription (default DefaultWindow).
func WithWindow(n int) Option { return func(o *options) { o.window = n } }

// WithBufferBytes sets BUFFER_BYTES, the bound of the publish buffer (default DefaultBufferBytes).
func WithBufferBytes(n int) Option { return func(o *options) { o.bufferBytes = n } }

// WithResubscribe sets whether subscriptions the broker ended (evicted,
// shutdown) or whose session was lost are opened again (default true).
func WithResubscribe(on bool) Option { return func(o *options) { o.resubscribe = on } }

// WithConnectTimeout bounds Connect's wait for each address (default 5 s).
func WithConnectTimeout(d time.Duration) Option { return func(o *options) { o.connectTimeout = d } }

// WithDialOptions adds gRPC dial options (after the client's own).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOptions = append(o.dialOptions, opts...) }
}

// WithPropagator sets the tracing hook: publishes inject into the headers,
// Message.Context extracts from them.
func WithPropagator(p Propagator) Option { return func(o *options) { o.propagator = p } }

// WithConnectionHandler sets a function called with every ConnectionEvent,
// on the client's session goroutine (it must not block).
func WithConnectionHandler(f func(ConnectionEvent)) Option {
	return func(o *options) { o.onConnection = f }
}

type publishOptions struct {
	headers map[string]string
}

// PublishOption configures one publish.
type PublishOption func(*publishOptions)

// WithHeaders sets the message's headers.
func WithHeaders(h map[string]string) PublishOption {
	return func(o *publishOptions) { o.headers = h }
}

type subscribeOptions struct {
	id          string
	group       string
	manualAck   bool
	maxInFlight uint32
	ackDeadline time.Duration
	window      int
	resubscribe *bool
	openTimeout time.Duration
}

// SubscribeOption configures Subscribe.
type SubscribeOption func(*subscribeOptions)

// WithSubscriptionID names the subscription (blank: the broker makes one).
func WithSubscriptionID(id string) SubscribeOption { return func(o *subscribeOptions) { o.id = id } }

// WithGroup makes the subscription a member of a consumer group
// (DELIVERY_MODE_SINGLE).
func WithGroup(name string) SubscribeOption { return func(o *subscribeOptions) { o.group = name } }

// WithManualAck sets ACK_MODE_MANUAL (consumer groups): each message stays in
// flight until Message.Ack.
func WithManualAck() SubscribeOption { return func(o *subscribeOptions) { o.manualAck = true } }

// WithMaxInFlight sets a group member's max_in_flight (0: the broker's default).
func WithMaxInFlight(n uint32) SubscribeOption {
	return func(o *subscribeOptions) { o.maxInFlight = n }
}

// WithAckDeadline sets a MANUAL member's ack deadline (0: the broker's default).
func WithAckDeadline(d time.Duration) SubscribeOption {
	return func(o *subscribeOptions) { o.ackDeadline = d }
}

// WithSubscriptionWindow sets this subscription's WINDOW (default: the client's).
func WithSubscriptionWindow(n int) SubscribeOption { return func(o *subscribeOptions) { o.window = n } }

// WithSubscriptionResubscribe overrides the client's WithResubscribe for
// this subscription.
func WithSubscriptionResubscribe(on bool) SubscribeOption {
	return func(o *subscribeOptions) { o.resubscribe = &on }
}

// WithOpenTimeout bounds Subscribe's wait for the first open (default 10 s).
func WithOpenTimeout(d time.Duration) SubscribeOption {
	return func(o *subscribeOptions) { o.openTimeout = d }
}

// Propagator is the tracing hook (this module has no OpenTelemetry
// dependency; an OpenTelemetry TextMapPropagator fits in a few lines).
type Propagator interface {
	// Inject writes ctx's trace context into a publish's headers.
	Inject(ctx context.Context, headers map[string]string)
	// Extract returns parent with the trace context of a message's headers.
	Extract(ctx context.Context, headers map[string]string) context.Context
}
