package tinybroker

import (
	"context"
	"io"
	"sync"

	"google.golang.org/grpc"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// Publisher publishes a run of messages on one PublishStream of its own
// (PublishAsync on the session is the usual way; this one is for a run
// whose sequences are wanted as one range). The first bad message ends the
// stream: that Publish (or a later one, or Close) returns a *PublishError
// whose Accepted is the count the broker gives. Safe for concurrent use.
type Publisher struct {
	c      *Client
	ctx    context.Context
	mu     sync.Mutex
	stream grpc.ClientStreamingClient[pb.PublishRequest, pb.PublishStreamResponse]
	cancel context.CancelFunc
	err    error
}

// PublishStreamResult is what a Publisher's stream carried.
type PublishStreamResult struct {
	Accepted      uint64 // messages the broker accepted
	FirstSequence uint64 // the sequence of the first
	LastSequence  uint64 // the sequence of the last
}

// NewPublisher returns a Publisher; ctx bounds its stream.
func (c *Client) NewPublisher(ctx context.Context) (*Publisher, error) {
	if c.closing.Load() {
		return nil, ErrClosed
	}
	return &Publisher{c: c, ctx: ctx}, nil
}

// Publish writes one message on the stream (waits while HTTP/2 flow
// control holds it back).
func (p *Publisher) Publish(topic string, payload []byte, opts ...PublishOption) error {
	po := publishOptions{}
	for _, o := range opts {
		o(&po)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.c.closing.Load() {
		p.abort()
		return ErrClosed
	}
	if p.err != nil {
		return p.err
	}
	if p.stream == nil {
		conn, _ := p.c.current()
		ctx, cancel := context.WithCancel(p.ctx)
		stream, err := pb.NewBrokerClient(conn).PublishStream(ctx)
		if err != nil {
			cancel()
			return fromStatus(err, "PublishStream")
		}
		p.stream, p.cancel = stream, cancel
	}
	headers := p.c.injectHeaders(p.ctx, po.headers)
	if err := p.stream.Send(&pb.PublishRequest{Topic: topic, Payload: payload, Headers: headers}); err != nil {
		// The stream's status (naming the bad message and the count) is CloseAndRecv's.
		_, err = p.stream.CloseAndRecv()
		p.abort()
		if err == nil || err == io.EOF {
			return nil
		}
		p.err = publishStreamError(err)
		return p.err
	}
	return nil
}

// Close ends the stream and returns what it carried, or the *PublishError
// that ended it.
func (p *Publisher) Close() (PublishStreamResult, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return PublishStreamResult{}, p.err
	}
	if p.stream == nil {
		return PublishStreamResult{}, nil
	}
	resp, err := p.stream.CloseAndRecv()
	p.abort()
	if err != nil {
		if p.c.closing.Load() {
			return PublishStreamResult{}, ErrClosed
		}
		p.err = publishStreamError(err)
		return PublishStreamResult{}, p.err
	}
	return PublishStreamResult{resp.Accepted, resp.FirstSequence, resp.LastSequence}, nil
}

func (p *Publisher) abort() {
	if p.cancel != nil {
		p.cancel()
	}
	p.stream, p.cancel = nil, nil
}
