package tinybroker

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protowire"
)

// headerRoom is the room kept in front of a batch's messages for the
// SessionRequest.publish tag and length and SessionPublish.id.
const headerRoom = 1 + 10 + 1 + 10

// batch is one SessionPublish being filled, sealed, or written: its
// messages as wire bytes after headerRoom bytes, and their topics (to name
// a rejected one).
type batch struct {
	buf      []byte
	topics   []string
	first    uint64 // index of its first message
	nbytes   int    // encoded bytes of its messages
	payload  uint64
	oversize bool
	id       uint64
}

func (b *batch) count() int { return len(b.topics) }

// request returns the SessionRequest{publish: {id, messages}} bytes, made
// in place in front of the messages.
func (b *batch) request(id uint64) []byte {
	body := protowire.SizeTag(1) + protowire.SizeVarint(id) + b.nbytes
	head := protowire.SizeTag(6) + protowire.SizeVarint(uint64(body)) + protowire.SizeTag(1) + protowire.SizeVarint(id)
	start := headerRoom - head
	h := b.buf[start:start:headerRoom]
	h = protowire.AppendTag(h, 6, protowire.BytesType)
	h = protowire.AppendVarint(h, uint64(body))
	h = protowire.AppendTag(h, 1, protowire.VarintType)
	h = protowire.AppendVarint(h, id)
	_ = h
	return b.buf[start:]
}

// pubBuffer is the client's publish buffer (docs/clients.md "Publishing"):
// publishers append under mu; the session goroutine seals and writes.
type pubBuffer struct {
	c     *Client
	mu    sync.Mutex
	limit int

	filling   *batch
	sealed    []*batch
	inFlight  []*batch
	nextIndex uint64
	written   uint64 // messages written (or refused here), from index 0
	settled   uint64 // every index below it has an outcome
	pendBytes int
	lastBytes int // bytes of the last batch sealed
	lastCount int // its messages

	roomCh      chan struct{} // closed when room is made
	roomWaiters int
	flushes     []flushWaiter
	closed      bool

	accepted         uint64
	rejected         []Rejection
	unconfirmed      []IndexRange
	unconfirmedCount uint64
}

type flushWaiter struct {
	target uint64
	ch     chan struct{}
}

func (p *pubBuffer) init(c *Client, limit int) {
	p.c, p.limit = c, limit
	p.roomCh = make(chan struct{})
}

func (p *pubBuffer) pending() (uint64, uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextIndex - p.written, uint64(p.pendBytes)
}

func sizeMessage(topic string, payload []byte, headers map[string]string) int {
	n := 0
	if topic != "" {
		n += 1 + protowire.SizeBytes(len(topic))
	}
	if len(payload) > 0 {
		n += 1 + protowire.SizeBytes(len(payload))
	}
	for k, v := range headers {
		n += 1 + protowire.SizeBytes(headerEntrySize(k, v))
	}
	return n
}

// headerEntrySize is the encoded size of one entry of the headers map (a
// key and a value, each left out when empty, as protobuf does).
func headerEntrySize(k, v string) int {
	e := 0
	if k != "" {
		e += 1 + protowire.SizeBytes(len(k))
	}
	if v != "" {
		e += 1 + protowire.SizeBytes(len(v))
	}
	return e
}

func appendMessage(b []byte, body int, topic string, payload []byte, headers map[string]string) []byte {
	b = append(b, 0x12) // SessionPublish.messages
	b = protowire.AppendVarint(b, uint64(body))
	if topic != "" {
		b = append(b, 0x0a)
		b = protowire.AppendVarint(b, uint64(len(topic)))
		b = append(b, topic...)
	}
	if len(payload) > 0 {
		b = append(b, 0x12)
		b = protowire.AppendVarint(b, uint64(len(payload)))
		b = append(b, payload...)
	}
	for k, v := range headers {
		e := headerEntrySize(k, v)
		b = append(b, 0x1a)
		b = protowire.AppendVarint(b, uint64(e))
		if k != "" {
			b = append(b, 0x0a)
			b = protowire.AppendVarint(b, uint64(len(k)))
			b = append(b, k...)
		}
		if v != "" {
			b = append(b, 0x12)
			b = protowire.AppendVarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return b
}

// PublishAsync appends the message to the client's buffer and returns at
// once (docs/clients.md publish()): the session goroutine writes it in a
// SessionPublish batch as soon as it wakes (a message never waits for
// others to arrive). It waits only while the buffer holds BUFFER_BYTES or
// more (backpressure; ctx bounds that wait). Flush reports its outcome.
func (c *Client) PublishAsync(ctx context.Context, topic string, payload []byte, opts ...PublishOption) error {
	var headers map[string]string
	if len(opts) > 0 || c.opts.propagator != nil {
		po := publishOptions{}
		for _, o := range opts {
			o(&po)
		}
		headers = c.injectHeaders(ctx, po.headers)
	}
	p := &c.pub
	body := sizeMessage(topic, payload, headers)
	size := 1 + protowire.SizeBytes(body)
	p.mu.Lock()
	for p.pendBytes >= p.limit && !p.closed {
		room := p.roomCh
		p.roomWaiters++
		p.mu.Unlock()
		select {
		case <-room:
		case <-ctx.Done():
			p.mu.Lock()
			p.roomWaiters--
			p.mu.Unlock()
			return ctxError(ctx, "publish: waiting for room in the buffer")
		case <-c.loopDone:
		}
		p.mu.Lock()
		p.roomWaiters--
	}
	if p.closed || c.closing.Load() {
		p.mu.Unlock()
		return ErrClosed
	}
	kick := false
	b := p.filling
	if b != nil && b.nbytes+size > c.batchBytes {
		p.seal()
		kick = true
		b = nil
	}
	if b == nil {
		b = &batch{first: p.nextIndex}
		// Sized as the last batch was: a steady publisher fills it without regrowing.
		b.buf = make([]byte, headerRoom, headerRoom+min(max(size, 4096, p.lastBytes), c.batchBytes+size))
		b.topics = make([]string, 0, p.lastCount)
		p.filling = b
		kick = true
	}
	b.buf = appendMessage(b.buf, body, topic, payload, headers)
	b.topics = append(b.topics, topic)
	b.nbytes += size
	b.payload += uint64(len(payload))
	if size > c.requestLimit {
		b.oversize = true
	}
	p.nextIndex++
	p.pendBytes += size
	if len(b.topics) >= c.batchMessages || b.nbytes >= c.batchBytes {
		p.seal()
		kick = true
	}
	p.mu.Unlock()
	if kick {
		c.wake()
	}
	return nil
}

// seal moves the batch being filled to the sealed ones (mu held).
func (p *pubBuffer) seal() {
	if p.filling != nil && len(p.filling.topics) > 0 {
		p.sealed = append(p.sealed, p.filling)
		p.lastBytes, p.lastCount = p.filling.nbytes, len(p.filling.topics)
	}
	p.filling = nil
}

// write writes batches while fewer than BATCHES_IN_FLIGHT are unanswered
// (session goroutine, session OPEN).
func (p *pubBuffer) write(send func(*rawRequest), nextID func() uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	wrote := false
	for len(p.inFlight) < BatchesInFlight {
		if len(p.sealed) == 0 {
			if p.filling == nil || len(p.filling.topics) == 0 {
				break
			}
			p.seal()
		}
		b := p.sealed[0]
		if b.oversize {
			if len(p.inFlight) > 0 {
				break // its outcome comes after theirs
			}
			p.sealed = p.sealed[1:]
			p.unbuffer(b)
			p.rejectOversize(b)
			wrote = true
			continue
		}
		p.sealed[0] = nil
		p.sealed = p.sealed[1:]
		b.id = nextID()
		send(&rawRequest{b.request(b.id)})
		p.inFlight = append(p.inFlight, b)
		p.unbuffer(b)
		p.c.msgsOut.Add(uint64(b.count()))
		p.c.bytesOut.Add(b.payload)
		wrote = true
	}
	if wrote {
		p.wakeRoom()
	}
}

func (p *pubBuffer) unbuffer(b *batch) {
	p.written = b.first + uint64(b.count())
	p.pendBytes -= b.nbytes
	b.buf = nil // written: not needed again
}

func (p *pubBuffer) wakeRoom() {
	if p.pendBytes < p.limit && p.roomWaiters > 0 {
		close(p.roomCh)
		p.roomCh = make(chan struct{})
	}
}

func (p *pubBuffer) rejectOversize(b *batch) {
	for i, t := range b.topics {
		p.rejected = append(p.rejected, Rejection{
			Index: b.first + uint64(i), Topic: t, Code: codes.ResourceExhausted,
			Message: fmt.Sprintf("the message exceeds max_message_bytes (%d)", p.c.requestLimit-requestSlack),
		})
	}
	p.settleTo(b.first + uint64(b.count()))
}

// answered takes the broker's answer to the oldest batch written.
func (p *pubBuffer) answered(id uint64, accepted uint32, rejected []rejection) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.inFlight) == 0 || p.inFlight[0].id != id {
		return false
	}
	b := p.inFlight[0]
	p.inFlight[0] = nil
	p.inFlight = p.inFlight[1:]
	p.accepted += uint64(accepted)
	for _, r := range rejected {
		topic := ""
		if int(r.index) < len(b.topics) {
			topic = b.topics[r.index]
		}
		msg := r.message
		if msg == "" {
			msg = "rejected with " + codes.Code(r.code).String()
		}
		p.rejected = append(p.rejected, Rejection{Index: b.first + uint64(r.index), Topic: topic, Code: codes.Code(r.code), Message: msg})
	}
	p.settleTo(b.first + uint64(b.count()))
	return true
}

type rejection struct {
	index, code uint32
	message     string
}

func (p *pubBuffer) addUnconfirmed(first uint64, count int) {
	if count == 0 {
		return
	}
	last := first + uint64(count) - 1
	p.unconfirmedCount += uint64(count)
	if n := len(p.unconfirmed); n > 0 && p.unconfirmed[n-1].Last+1 == first {
		p.unconfirmed[n-1].Last = last
		return
	}
	p.unconfirmed = append(p.unconfirmed, IndexRange{first, last})
}

// unconfirmInFlight: the batches written to a lost session without an
// answer are unconfirmed, never written again.
func (p *pubBuffer) unconfirmInFlight() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.inFlight) == 0 {
		return
	}
	for _, b := range p.inFlight {
		p.addUnconfirmed(b.first, b.count())
	}
	last := p.inFlight[len(p.inFlight)-1]
	p.inFlight = nil
	p.settleTo(last.first + uint64(last.count()))
}

func (p *pubBuffer) settleTo(index uint64) {
	p.settled = index
	if len(p.flushes) == 0 {
		return
	}
	keep := p.flushes[:0]
	for _, w := range p.flushes {
		if w.target <= index {
			close(w.ch)
		} else {
			keep = append(keep, w)
		}
	}
	clear(p.flushes[len(keep):])
	p.flushes = keep
}

func (p *pubBuffer) takeOutcomes() FlushReport {
	r := FlushReport{Accepted: p.accepted, Rejected: p.rejected, Unconfirmed: p.unconfirmed}
	p.accepted, p.rejected, p.unconfirmed, p.unconfirmedCount = 0, nil, nil, 0
	return r
}

func (p *pubBuffer) hasWork() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextIndex > p.settled
}

// Flush returns once every message published (PublishAsync) before the call
// has an outcome, with the outcomes of the messages published since the
// previous Flush. ctx's deadline is the timeout: then it returns an error
// matching ErrTimeout and context.DeadlineExceeded, and loses nothing (the
// outcomes go to the next Flush).
func (c *Client) Flush(ctx context.Context) (FlushReport, error) {
	p := &c.pub
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return FlushReport{}, ErrClosed
	}
	w, waiting := p.waiterLocked()
	if !waiting {
		r := p.takeOutcomes()
		p.mu.Unlock()
		return r, nil
	}
	p.mu.Unlock()
	c.wake()
	select {
	case <-w.ch:
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed && p.settled < w.target {
			return FlushReport{}, ErrClosed
		}
		return p.takeOutcomes(), nil
	case <-ctx.Done():
		p.mu.Lock()
		defer p.mu.Unlock()
		p.dropWaiterLocked(w)
		if ctx.Err() == context.DeadlineExceeded {
			return FlushReport{}, timeoutError("flush: %d messages without an outcome when the deadline passed (they are reported by the next flush)", w.target-p.settled)
		}
		return FlushReport{}, ctxError(ctx, "flush")
	}
}

// waitSettled waits (bounded by ctx) until everything published has an outcome.
func (p *pubBuffer) waitSettled(ctx context.Context) {
	p.mu.Lock()
	w, waiting := p.waiterLocked()
	p.mu.Unlock()
	if !waiting {
		return
	}
	p.c.wake()
	select {
	case <-w.ch:
		return
	case <-ctx.Done():
	case <-p.c.loopDone:
	}
	p.mu.Lock()
	p.dropWaiterLocked(w)
	p.mu.Unlock()
}

// waiterLocked (mu held) registers a wait until every message published so
// far has an outcome; false when they all have one already.
func (p *pubBuffer) waiterLocked() (flushWaiter, bool) {
	if p.settled >= p.nextIndex {
		return flushWaiter{}, false
	}
	w := flushWaiter{p.nextIndex, make(chan struct{})}
	p.flushes = append(p.flushes, w)
	return w, true
}

// dropWaiterLocked (mu held) forgets a wait given up on.
func (p *pubBuffer) dropWaiterLocked(w flushWaiter) {
	for i, x := range p.flushes {
		if x.ch == w.ch {
			p.flushes = append(p.flushes[:i], p.flushes[i+1:]...)
			return
		}
	}
}

// shut ends the buffer: waiting publishers and flushes get ErrClosed.
func (p *pubBuffer) shut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	close(p.roomCh)
	p.roomCh = make(chan struct{})
	for _, w := range p.flushes {
		close(w.ch)
	}
	p.flushes = nil
}

func (p *pubBuffer) closeCounts() (notSent, unconfirmed uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextIndex - p.written, p.unconfirmedCount
}
