package tinybroker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// The session's states (docs/clients.md "The session's states").
type sessionState int

const (
	stIdle sessionState = iota
	stStarting
	stOpen
	stWaiting
	stClosed
)

// backoffDelay is a delay that starts at first, doubles up to limit, each
// one times a uniform factor (JITTER).
type backoffDelay struct {
	first, limit, next time.Duration
}

func newBackoff(first, limit time.Duration) backoffDelay {
	return backoffDelay{first, limit, first}
}

func (b *backoffDelay) reset() { b.next = b.first }

func (b *backoffDelay) delay() time.Duration {
	d := time.Duration(float64(b.next) * (1 - jitter + 2*jitter*rand.Float64()))
	b.next = min(b.next*2, b.limit)
	return d
}

// recvItem is what a stream's receiving goroutine hands the session goroutine.
type recvItem struct {
	gen     uint64
	headers metadata.MD
	gotHdr  bool
	in      *inEvents // one SessionEvent, decoded
	err     error
}

// outQueue is one stream's outgoing requests, written by its writer
// goroutine (the session goroutine never blocks on the network).
type outQueue struct {
	mu     sync.Mutex
	items  []*rawRequest
	signal chan struct{}
	closed bool
}

func (q *outQueue) put(r *rawRequest) {
	q.mu.Lock()
	q.items = append(q.items, r)
	q.mu.Unlock()
	select {
	case q.signal <- struct{}{}:
	default:
	}
}

func (q *outQueue) halfClose() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	select {
	case q.signal <- struct{}{}:
	default:
	}
}

// session is the state of the client's Session stream, owned by the
// session goroutine (Client.run).
type session struct {
	c     *Client
	state sessionState
	gen   uint64

	cancel     context.CancelFunc
	out        *outQueue
	startTimer *time.Timer
	startTimed bool
	delay      *time.Timer
	backoff    backoffDelay
	batchID    uint64

	instance, scope string
	instKey         string
	wasConnected    bool
	disconnected    bool
	moveOn          *Error

	subs       map[*Subscription]struct{}
	handles    map[uint32]*Subscription
	lastHandle uint32
	touched    []*Subscription // subscriptions with deliveries staged (onEvent)

	closing    bool
	closeTimer *time.Timer
	closeDone  chan struct{}
	finished   bool
}

func newSession(c *Client) *session {
	return &session{
		c:       c,
		backoff: newBackoff(ConnectDelayFirst, ConnectDelayCap),
		subs:    map[*Subscription]struct{}{},
		handles: map[uint32]*Subscription{},
	}
}

func timerC(t *time.Timer) <-chan time.Time {
	if t == nil {
		return nil
	}
	return t.C
}

// run is the session goroutine: it owns the session and the subscriptions'
// states, and does everything the stream needs.
func (c *Client) run() {
	defer c.wg.Done()
	s := c.s
	for !s.finished {
		select {
		case f := <-c.cmds:
			f()
		case <-c.kick:
			s.pump()
		case it := <-c.recv:
			s.onRecv(it)
		case <-timerC(s.startTimer):
			s.startTimer = nil
			if s.state == stStarting {
				// The stream is given up here: what its goroutine hands
				// over afterwards is from an older generation.
				s.startTimed = true
				s.ended(context.DeadlineExceeded)
			}
		case <-timerC(s.delay):
			s.delay = nil
			if len(c.targets) > 1 {
				c.failover()
			}
			s.state = stIdle
			s.need()
		case <-timerC(s.closeTimer):
			s.closeTimer = nil
			s.finish()
		}
	}
}

// needed: something needs a session (a subscription, a message to publish).
func (s *session) needed() bool {
	return len(s.subs) > 0 || s.c.pub.hasWork()
}

// need: IDLE -> STARTING when something needs a session.
func (s *session) need() {
	if s.state != stIdle || s.closing || !s.needed() {
		return
	}
	s.start()
}

func (s *session) start() {
	c := s.c
	s.gen++
	gen := s.gen
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.out = &outQueue{signal: make(chan struct{}, 1)}
	s.state = stStarting
	s.startTimed = false
	s.startTimer = time.NewTimer(StartTimeout)
	conn, _ := c.current()
	out := s.out
	waitForReady := len(c.targets) == 1
	c.wg.Add(1)
	go c.receive(ctx, gen, conn, out, waitForReady)
}

// receive starts a stream, hands its headers and events to the session
// goroutine, and starts its writer.
func (c *Client) receive(ctx context.Context, gen uint64, conn *grpc.ClientConn, out *outQueue, waitForReady bool) {
	defer c.wg.Done()
	hand := func(it recvItem) bool {
		it.gen = gen
		select {
		case c.recv <- it:
			return true
		case <-ctx.Done():
			return false
		}
	}
	sctx := metadata.AppendToOutgoingContext(ctx, "tinybroker-batch", "1")
	stream, err := pb.NewBrokerClient(conn).Session(sctx, grpc.WaitForReady(waitForReady), grpc.ForceCodecV2(rawCodec{}))
	if err != nil {
		hand(recvItem{err: err})
		return
	}
	hdr, err := stream.Header()
	if err != nil {
		hand(recvItem{err: err})
		return
	}
	if hdr == nil {
		// Ended without headers: the status is RecvMsg's.
		err = stream.RecvMsg(new(pb.SessionEvent))
		if err == nil || err == io.EOF {
			err = errEndedAtStart
		}
		hand(recvItem{err: err})
		return
	}
	c.wg.Add(1)
	go c.write(ctx, stream, out)
	if !hand(recvItem{headers: hdr, gotHdr: true}) {
		return
	}
	for {
		in := new(inEvents)
		if err := stream.RecvMsg(in); err != nil {
			hand(recvItem{err: err})
			return
		}
		if !hand(recvItem{in: in}) {
			return
		}
	}
}

var errEndedAtStart = errors.New("the broker ended the session as it started")

// write sends the queued requests in order; CloseSend once half-closed.
func (c *Client) write(ctx context.Context, stream grpc.ClientStream, out *outQueue) {
	defer c.wg.Done()
	var items []*rawRequest
	for {
		out.mu.Lock()
		items, out.items = out.items, items[:0]
		closed := out.closed
		out.mu.Unlock()
		for i, r := range items {
			if err := stream.SendMsg(r); err != nil {
				return // the receiver sees the stream's end
			}
			items[i] = nil
		}
		if closed && len(items) == 0 {
			_ = stream.CloseSend()
			return
		}
		if len(items) > 0 {
			continue
		}
		select {
		case <-out.signal:
		case <-ctx.Done():
			return
		}
	}
}

func (s *session) send(r *rawRequest) {
	if s.state == stOpen && s.out != nil {
		s.out.put(r)
	}
}

func (s *session) nextBatchID() uint64 {
	s.batchID++
	return s.batchID
}

// pump, on each turn of the session goroutine: the publish buffer is
// written, and the dirty subscriptions' acks, nacks and credit go out (one
// SessionAck and one SessionNack per handle).
func (s *session) pump() {
	c := s.c
	if s.state == stOpen {
		c.pub.write(s.send, s.nextBatchID)
	} else if s.state == stIdle {
		s.need()
	}
	c.dirtyMu.Lock()
	dirty := c.dirty
	c.dirty = nil
	c.dirtyMu.Unlock()
	for _, sub := range dirty {
		sub.dirty.Store(false)
		sub.flushRequests(s)
	}
}

func (s *session) onRecv(it recvItem) {
	if it.gen != s.gen || s.state == stClosed {
		return
	}
	switch {
	case it.gotHdr:
		s.opened(it.headers)
	case it.err != nil:
		s.ended(it.err)
	default:
		s.onEvent(it.in)
		if s.moveOn != nil {
			err := s.moveOn
			s.moveOn = nil
			s.lost(err.Message, err)
			s.afterLoss()
		}
	}
}

// opened: STARTING -> OPEN; every subscription to be open is opened, then
// the publish buffer is written from its oldest message.
func (s *session) opened(md metadata.MD) {
	c := s.c
	if s.startTimer != nil {
		s.startTimer.Stop()
		s.startTimer = nil
	}
	inst, scope := "", ""
	hasInst := false
	if v := md.Get("tinybroker-instance"); len(v) > 0 {
		inst, hasInst = v[0], true
	}
	if v := md.Get("tinybroker-sequence-scope"); len(v) > 0 {
		scope = v[0]
	}
	prev := s.instKey
	s.instance, s.scope = inst, scope
	if hasInst {
		s.instKey = "i:" + inst
	} else {
		s.instKey = fmt.Sprintf("session:%d", s.gen)
	}
	c.connMu.Lock()
	c.inst = inst
	c.connMu.Unlock()
	s.state = stOpen
	s.batchID = 0
	s.backoff.reset()
	addr := c.Address()
	if !s.wasConnected {
		s.wasConnected = true
		c.emit(ConnectionEvent{Kind: Connected, Address: addr, Instance: inst})
	} else if s.disconnected {
		s.disconnected = false
		c.reconnects.Add(1)
		c.emit(ConnectionEvent{Kind: Reconnected, Address: addr, Instance: inst, InstanceChanged: s.instKey != prev})
	}
	if s.closing {
		s.sendCloses()
		return
	}
	for sub := range s.subs {
		s.tryOpen(sub)
	}
	c.pub.write(s.send, s.nextBatchID)
}

// tryOpen opens sub (WAITING) if the session is open and its window has room.
func (s *session) tryOpen(sub *Subscription) {
	if s.state != stOpen || sub.state != subWaiting || s.closing {
		return
	}
	held := sub.held()
	if held >= sub.window {
		return // opened once the application takes one
	}
	s.lastHandle++
	h := s.lastHandle
	sub.opening(h, s.instKey)
	s.handles[h] = sub
	s.send(marshalRequest(&pb.SessionRequest{Request: &pb.SessionRequest_Open{Open: &pb.SessionOpen{
		Handle: h, Subscription: sub.req, Credit: uint32(sub.window - held),
	}}}))
}

func (s *session) onEvent(in *inEvents) {
	c := s.c
	if in.ev == nil {
		// Deliveries: each subscription's are staged, then queued under one
		// lock with one wake-up per subscription.
		var nbytes uint64
		for i := range in.dels {
			d := &in.dels[i]
			nbytes += uint64(len(d.msg.Payload))
			s.deliver(d, in.handles)
		}
		if len(in.dels) > 0 {
			c.msgsIn.Add(uint64(len(in.dels)))
			c.bytesIn.Add(nbytes)
		}
		for i, sub := range s.touched {
			sub.queueStaged()
			s.touched[i] = nil
		}
		s.touched = s.touched[:0]
		return
	}
	switch e := in.ev.Event.(type) {
	case *pb.SessionEvent_Published:
		p := e.Published
		rs := make([]rejection, len(p.Rejected))
		for i, r := range p.Rejected {
			rs[i] = rejection{r.Index, r.Code, r.Message}
		}
		if c.pub.answered(p.Id, p.Accepted, rs) {
			c.pub.write(s.send, s.nextBatchID)
		}
	case *pb.SessionEvent_Opened:
		if sub := s.handles[e.Opened.Handle]; sub != nil {
			sub.onOpened(e.Opened.SubscriptionId)
		}
	case *pb.SessionEvent_Ended:
		h := e.Ended.Handle
		if sub := s.handles[h]; sub != nil {
			delete(s.handles, h)
			sub.onEnded(e.Ended)
		}
	}
}

// deliver stages one delivery for each of its handles' subscriptions: the
// last one gets d's own Message, the others a copy.
func (s *session) deliver(d *inDelivery, all []uint32) {
	if !d.hasMsg {
		return
	}
	hs := d.handleList(all)
	var copies []Message // one allocation for the copies of a delivery to several handles
	for i, h := range hs {
		sub := s.handles[h]
		if sub == nil {
			s.c.droppedLate.Add(1)
			continue
		}
		m := &d.msg
		if i < len(hs)-1 {
			if copies == nil {
				copies = make([]Message, len(hs)-1-i)
			}
			copies[0] = d.msg
			m = &copies[0]
			copies = copies[1:]
		}
		if sub.stage(m, h) {
			s.touched = append(s.touched, sub)
		}
	}
}

// finalStartCodes: a session refused with one of these is not tried again
// for subscriptions.
func finalStartCode(code codes.Code) bool {
	switch code {
	case codes.Unauthenticated, codes.PermissionDenied, codes.InvalidArgument, codes.Unimplemented, codes.FailedPrecondition:
		return true
	}
	return false
}

// ended: the stream ended or failed (STARTING or OPEN -> WAITING).
func (s *session) ended(err error) {
	c := s.c
	_, t := c.current()
	starting := s.state == stStarting
	var failure *Error
	reason := ""
	switch {
	case err == io.EOF:
		failure = &Error{Code: codes.Unavailable, Message: t.String() + ": closed by the broker"}
		reason = "closed by the broker"
	case err == errEndedAtStart:
		failure = &Error{Code: codes.Unavailable, Message: t.String() + ": " + err.Error()}
	case starting && s.startTimed:
		failure = &Error{Code: codes.DeadlineExceeded, Message: fmt.Sprintf("%s did not accept a session within %v", t, StartTimeout)}
	default:
		failure = fromStatus(err, "the session on "+t.String())
		if failure.Code == codes.OK {
			failure = &Error{Code: codes.Unavailable, Message: t.String() + ": closed by the broker"}
			reason = "closed by the broker"
		}
	}
	if reason == "" {
		reason = failure.Code.String() + ": " + failure.Message
	}
	if s.closing {
		s.finish()
		return
	}
	s.lost(reason, failure)
	if starting && finalStartCode(failure.Code) {
		for sub := range s.subs {
			if !sub.openedOnce {
				sub.finish(nil, failure)
				s.forget(sub)
			}
		}
	}
	s.afterLoss()
}

// lost: the session is gone; what was open goes back to WAITING.
func (s *session) lost(reason string, failure *Error) {
	if s.state == stOpen {
		s.disconnected = true
		s.c.emit(ConnectionEvent{Kind: Disconnected, Address: s.c.Address(), Instance: s.instance, Reason: reason})
	}
	s.stopStream()
	s.state = stWaiting
	s.c.pub.unconfirmInFlight()
	handles := s.handles
	s.handles = map[uint32]*Subscription{}
	for _, sub := range handles {
		sub.onLost()
	}
	for sub := range s.subs {
		sub.lastCause = failure
	}
}

func (s *session) afterLoss() {
	if s.closing {
		s.finish()
		return
	}
	s.state = stWaiting
	s.delay = time.NewTimer(s.backoff.delay())
}

func (s *session) stopStream() {
	s.gen++ // what the old stream's goroutine still hands over is dropped
	if s.cancel != nil {
		s.cancel()
		s.cancel = nil
	}
	if s.startTimer != nil {
		s.startTimer.Stop()
		s.startTimer = nil
	}
	s.out = nil
}

// requestMoveOn: after the current event the session ends and the client
// goes to the next address.
func (s *session) requestMoveOn(err *Error) {
	if len(s.c.targets) > 1 {
		s.moveOn = err
	}
}

func (s *session) forget(sub *Subscription) {
	delete(s.subs, sub)
	if sub.handle != 0 && s.handles[sub.handle] == sub {
		delete(s.handles, sub.handle)
	}
	sub.closeEvents()
}

func (s *session) sendCloses() {
	for sub := range s.subs {
		sub.flushRequests(s)
	}
	for h := range s.handles {
		s.send(marshalRequest(&pb.SessionRequest{Request: &pb.SessionRequest_Close{Close: &pb.SessionClose{Handle: h}}}))
	}
	s.out.halfClose()
}

// startClose: every subscription is closed (SessionClose each, then the
// half-close) and the session goroutine ends once the stream has ended or
// the deadline passed.
func (s *session) startClose(deadline time.Time, done chan struct{}) {
	s.closeDone = done
	s.closing = true
	for sub := range s.subs {
		sub.stopRetry()
	}
	if s.delay != nil {
		s.delay.Stop()
		s.delay = nil
	}
	if s.state != stOpen {
		s.finish()
		return
	}
	s.sendCloses()
	s.closeTimer = time.NewTimer(time.Until(deadline))
}

// finish: CLOSED. Everything waiting ends with ErrClosed.
func (s *session) finish() {
	if s.finished {
		return
	}
	c := s.c
	s.stopStream()
	if s.delay != nil {
		s.delay.Stop()
		s.delay = nil
	}
	if s.closeTimer != nil {
		s.closeTimer.Stop()
		s.closeTimer = nil
	}
	c.pub.unconfirmInFlight()
	s.state = stClosed
	for sub := range s.subs {
		sub.finish(ErrClosed, nil)
		s.forget(sub)
	}
	s.handles = map[uint32]*Subscription{}
	c.pub.shut()
	c.emit(ConnectionEvent{Kind: Closed})
	c.eventsMu.Lock()
	close(c.events)
	c.eventsMu.Unlock()
	s.finished = true
	close(c.loopDone)
	if s.closeDone != nil {
		close(s.closeDone)
	}
}
