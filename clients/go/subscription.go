package tinybroker

import (
	"context"
	"iter"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// A subscription's states (docs/clients.md "A subscription's states").
type subState int

const (
	subWaiting subState = iota
	subOpening
	subOpen
	subBackoff
	subDone
)

func (s subState) String() string {
	return [...]string{"WAITING", "OPENING", "OPEN", "BACKOFF", "DONE"}[s]
}

// Subscription is one subscription on the client's session. Take its
// messages with Next, Messages or All (one of them at a time). The broker
// sends it at most its window of deliveries beyond what the application
// took, and the client holds at most that many for it. When the broker
// ends it (eviction, shutdown) the client opens it again after a jittered
// backoff (unless re-subscription is off); a lost session is not an end.
// Events reports ends and gaps. Its methods are safe for concurrent use.
type Subscription struct {
	c      *Client
	req    *pb.OpenSubscriptionRequest
	window int
	topUp  int
	resub  bool
	manual bool
	group  string

	stopCtx func() bool
	dirty   atomic.Bool

	// Owned by the session goroutine.
	state      subState
	handle     uint32
	openedOnce bool
	closing    bool
	closeWait  chan struct{}
	away       bool
	awayCause  string
	awayDrop   uint64
	hasLast    bool
	lastSeq    uint64
	lastInst   string
	recvAtOpen uint64
	backoff    backoffDelay
	retry      *time.Timer
	lastCause  *Error
	eventsDone bool
	staged     []*Message // this event's deliveries, not yet queued

	opened   chan struct{} // closed on the first open
	openErr  error
	events   chan SubscriptionEvent
	eventsMu sync.Mutex

	mu       sync.Mutex
	queue    []*Message
	head     int
	pumped   atomic.Int64 // taken out of queue by Messages' goroutine, not yet in its channel
	lotTotal uint64       // taken out of queue by Messages' goroutine, in all
	observed uint64       // of those, seen gone from its channel (counted taken)
	taken    int          // since the last credit
	received uint64       // taken, in all
	ackH     uint32       // the handle acks may be sent on (0: none)
	acks     []uint64
	nacks    []uint64
	nexting  bool
	notify   chan struct{}
	done     bool
	doneCh   chan struct{}
	final    error // what Next returns once done and empty
	endErr   error // Err()
	id       string

	msgsOnce sync.Once
	msgs     chan *Message // set under mu
}

// Subscribe opens a subscription to patterns and returns once the broker
// opened it (bounded by ctx and WithOpenTimeout, default 10 s). ctx also
// bounds the subscription's life: when ctx is done the subscription closes.
func (c *Client) Subscribe(ctx context.Context, patterns []string, opts ...SubscribeOption) (*Subscription, error) {
	if c.closing.Load() {
		return nil, ErrClosed
	}
	o := subscribeOptions{window: c.opts.window, openTimeout: DefaultOpenTimeout}
	for _, opt := range opts {
		opt(&o)
	}
	if o.window < 1 {
		return nil, usageError("the window must be at least 1, not %d", o.window)
	}
	if len(patterns) == 0 {
		return nil, usageError("subscribe: no pattern")
	}
	req := &pb.OpenSubscriptionRequest{
		TopicPatterns:  append([]string(nil), patterns...),
		SubscriptionId: o.id,
		MaxInFlight:    o.maxInFlight,
		AckDeadlineMs:  uint32(o.ackDeadline / time.Millisecond),
	}
	if o.group != "" {
		req.Mode = pb.DeliveryMode_DELIVERY_MODE_SINGLE
		req.ConsumerGroup = o.group
		req.AckMode = pb.AckMode_ACK_MODE_AUTO
		if o.manualAck {
			req.AckMode = pb.AckMode_ACK_MODE_MANUAL
		}
	} else if o.manualAck {
		return nil, usageError("manual ack needs a consumer group (WithGroup)")
	}
	resub := c.opts.resubscribe
	if o.resubscribe != nil {
		resub = *o.resubscribe
	}
	s := &Subscription{
		c: c, req: req, window: o.window, topUp: topUp(o.window), resub: resub,
		manual: o.manualAck, group: o.group,
		backoff: newBackoff(ResubscribeDelayFirst, ResubscribeDelayCap),
		opened:  make(chan struct{}),
		notify:  make(chan struct{}, 1),
		doneCh:  make(chan struct{}),
		id:      o.id,
	}
	if !c.post(func() {
		c.s.subs[s] = struct{}{}
		c.s.need()
		c.s.tryOpen(s)
	}) {
		return nil, ErrClosed
	}
	timer := time.NewTimer(o.openTimeout)
	defer timer.Stop()
	select {
	case <-s.opened:
		stop := context.AfterFunc(ctx, func() { _ = s.Close() })
		s.mu.Lock()
		s.stopCtx = stop
		s.mu.Unlock()
		return s, nil
	case <-s.doneCh:
		s.mu.Lock()
		err := s.openErr
		s.mu.Unlock()
		if err == nil {
			err = ErrClosed
		}
		return nil, err
	case <-timer.C:
		cause := make(chan *Error, 1)
		if !c.post(func() { cause <- s.lastCause }) {
			return nil, ErrClosed
		}
		var last *Error
		select {
		case last = <-cause:
		case <-c.loopDone:
			return nil, ErrClosed
		}
		_ = s.Close()
		if last != nil {
			return nil, last
		}
		return nil, timeoutError("subscribe %v: not opened within %v", patterns, o.openTimeout)
	case <-ctx.Done():
		_ = s.Close()
		return nil, ctxError(ctx, "subscribe")
	case <-c.loopDone:
		return nil, ErrClosed
	}
}

// ID returns the broker's subscription id.
func (s *Subscription) ID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.id
}

// Pending returns the deliveries held and not yet taken (never more than
// the window), those in the Messages channel included.
func (s *Subscription) Pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue) - s.head + max(0, int(s.pumped.Load())) + len(s.msgs)
}

// heldLocked (mu held) is what the window and credit count as held: the
// queue and what Messages' goroutine took from it and has not yet seen
// taken from its channel (it may have been taken unseen: then it is
// counted taken, and credited, once seen, as if taken after an open made
// in between, which counted it held).
func (s *Subscription) heldLocked() int {
	return len(s.queue) - s.head + int(s.lotTotal-s.observed)
}

// Next returns the next message, waiting for one (bounded by ctx: a
// deadline returns an error matching ErrTimeout). One caller at a time: a
// second concurrent Next returns an error matching ErrUsage at once. Once
// the subscription is closed (or its client) it returns an error matching
// ErrClosed; once it ended for good, and what it held was taken, a
// *SubscriptionEndedError.
func (s *Subscription) Next(ctx context.Context) (*Message, error) {
	s.mu.Lock()
	if s.nexting {
		s.mu.Unlock()
		return nil, usageError("another Next is already waiting on this subscription")
	}
	if m := s.take(); m != nil {
		return m, nil // take unlocked
	}
	if s.done {
		err := s.final
		s.mu.Unlock()
		return nil, err
	}
	s.nexting = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.nexting = false
		s.mu.Unlock()
	}()
	for {
		select {
		case <-s.notify:
		case <-s.doneCh:
		case <-ctx.Done():
			if ctx.Err() == context.DeadlineExceeded {
				return nil, timeoutError("no message before the context's deadline")
			}
			return nil, ctxError(ctx, "next")
		}
		s.mu.Lock()
		if m := s.take(); m != nil {
			return m, nil
		}
		if s.done {
			err := s.final
			s.mu.Unlock()
			return nil, err
		}
		s.mu.Unlock()
	}
}

// take returns the oldest held message and unlocks mu, or nil (mu still held).
func (s *Subscription) take() *Message {
	if s.head == len(s.queue) {
		return nil
	}
	held := s.heldLocked()
	m := s.queue[s.head]
	s.queue[s.head] = nil
	s.head++
	if s.head == len(s.queue) {
		s.queue, s.head = s.queue[:0], 0
	}
	s.received++
	s.taken++
	kick := s.taken >= s.topUp || held >= s.window
	s.mu.Unlock()
	if kick {
		s.c.markDirty(s)
	}
	return m
}

// Messages returns a channel of the subscription's messages, closed when
// the subscription is done (then Err says why). A goroutine of its own
// takes the messages, as Next does, so do not call Next as well. The
// channel is buffered (min(64, window - window/4)): what it holds counts in
// the window and in Pending, and a message counts taken (for credit) once
// it has left the channel.
func (s *Subscription) Messages() <-chan *Message {
	s.msgsOnce.Do(func() {
		ch := make(chan *Message, msgsBuffer(s.window, s.topUp))
		s.mu.Lock()
		s.msgs = ch
		s.mu.Unlock()
		s.c.wg.Add(1)
		go s.pump(ch)
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.msgs
}

// msgsBuffer is the Messages channel's capacity: at most window - topUp,
// so that messages taken from it unseen (seen at the next delivery or
// send) can never hold back the credit the broker needs to send more.
func msgsBuffer(window, topUp int) int {
	return max(0, min(64, window-topUp))
}

// pump is Messages' goroutine. It takes every held message at once
// (takeAll), puts them in the channel, and counts those gone from the
// channel taken (observe) before it waits and after each lot.
func (s *Subscription) pump(ch chan *Message) {
	defer s.c.wg.Done()
	defer close(ch)
	var lot []*Message
	var placed uint64 // put in ch, in all
	for {
		var err error
		lot, err = s.takeAll(lot[:0])
		if err != nil {
			s.observe(placed)
			s.mu.Lock()
			_, ended := s.final.(*SubscriptionEndedError)
			dropped := s.done && !ended
			s.mu.Unlock()
			if dropped {
				drain(ch) // closed: what the channel holds is dropped
			}
			return
		}
		for i, m := range lot {
			// Two non-blocking operations (no lock while the channel has
			// room and doneCh is open), then a blocking one.
			select {
			case <-s.doneCh:
				s.pumpDone(ch, lot[i:])
				return
			default:
			}
			select {
			case ch <- m:
				lot[i] = nil
				placed++
				s.pumped.Add(-1)
				continue
			default:
			}
			s.observe(placed)
			select {
			case ch <- m:
				lot[i] = nil
				placed++
				s.pumped.Add(-1)
			case <-s.doneCh:
				s.pumpDone(ch, lot[i:])
				return
			}
		}
		s.observe(placed)
	}
}

// takeAll waits, as Next does, for held messages and moves them all to
// dst (counted in pumped, as held).
func (s *Subscription) takeAll(dst []*Message) ([]*Message, error) {
	s.mu.Lock()
	if s.nexting {
		s.mu.Unlock()
		return nil, usageError("another Next is already waiting on this subscription")
	}
	for {
		if s.head < len(s.queue) {
			dst = append(dst, s.queue[s.head:]...)
			clear(s.queue[s.head:])
			s.queue, s.head = s.queue[:0], 0
			s.pumped.Add(int64(len(dst)))
			s.lotTotal += uint64(len(dst))
			s.mu.Unlock()
			return dst, nil
		}
		if s.done {
			err := s.final
			s.mu.Unlock()
			return nil, err
		}
		s.nexting = true
		s.mu.Unlock()
		select {
		case <-s.notify:
		case <-s.doneCh:
		}
		s.mu.Lock()
		s.nexting = false
	}
}

// observe: of the placed messages put in the channel, those gone from it
// and not yet counted are taken (take's accounting, for n at once).
func (s *Subscription) observe(placed uint64) {
	s.mu.Lock()
	n := int(placed - uint64(len(s.msgs)) - s.observed)
	if n <= 0 {
		s.mu.Unlock()
		return
	}
	held := s.heldLocked()
	s.observed += uint64(n)
	s.received += uint64(n)
	s.taken += n
	kick := s.taken >= s.topUp || held >= s.window
	s.mu.Unlock()
	if kick {
		s.c.markDirty(s)
	}
}

// pumpDone: the subscription is done with rest not put in the channel.
// When its held messages are dropped (closed), so are rest and what the
// channel holds; after an end for good, rest goes back to the queue (for
// Next) and the channel keeps what it has.
func (s *Subscription) pumpDone(ch chan *Message, rest []*Message) {
	s.mu.Lock()
	_, ended := s.final.(*SubscriptionEndedError)
	if ended {
		s.queue = append(append([]*Message(nil), rest...), s.queue[s.head:]...)
		s.head = 0
		s.lotTotal -= uint64(len(rest))
	}
	s.pumped.Store(0)
	s.mu.Unlock()
	if !ended {
		drain(ch)
	}
}

// drain empties ch without waiting (it may be closed).
func drain(ch chan *Message) {
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		default:
			return
		}
	}
}

// All returns an iterator over the subscription's messages, which ends when
// the subscription is done (then Err says why).
func (s *Subscription) All() iter.Seq[*Message] {
	return func(yield func(*Message) bool) {
		for {
			m, err := s.Next(context.Background())
			if err != nil || !yield(m) {
				return
			}
		}
	}
}

// Events returns the subscription's events (EventEnded, EventResumed with
// its Gap): buffered, 64; when full the oldest is dropped (counted in the
// client's Stats().EventsDropped). Closed when the subscription is done.
func (s *Subscription) Events() <-chan SubscriptionEvent {
	s.eventsMu.Lock()
	defer s.eventsMu.Unlock()
	return s.eventsChan()
}

// eventsChan makes the events channel on first use (eventsMu held): a
// subscription nobody watches, with no end, costs no buffer.
func (s *Subscription) eventsChan() chan SubscriptionEvent {
	if s.events == nil {
		s.events = make(chan SubscriptionEvent, 64)
	}
	return s.events
}

// Err says why the subscription is done: nil while it is open and after
// Close; a *SubscriptionEndedError when the broker ended it for good; an
// error matching ErrClosed when its client was closed.
func (s *Subscription) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.endErr
}

// Close closes the subscription and waits (at most CloseTimeout) until the broker
// has ended it; acks made before are sent first. Messages not yet taken
// are dropped (a MANUAL group's go to another member). A waiting Next
// returns an error matching ErrClosed.
func (s *Subscription) Close() error {
	s.mu.Lock()
	if s.done {
		s.mu.Unlock()
		return nil
	}
	s.done = true
	s.final = errSubClosed
	clear(s.queue)
	s.queue, s.head = nil, 0
	s.pumped.Store(0)
	close(s.doneCh)
	stop := s.stopCtx
	msgs := s.msgs
	s.mu.Unlock()
	if msgs != nil {
		drain(msgs) // not taken: dropped (Messages' goroutine drains it too)
	}
	if stop != nil {
		stop()
	}
	wait := make(chan struct{})
	c := s.c
	if !c.post(func() { c.s.closeSub(s, wait) }) {
		return nil
	}
	t := time.NewTimer(CloseTimeout)
	defer t.Stop()
	select {
	case <-wait:
	case <-t.C:
	case <-c.loopDone:
	}
	return nil
}

// closeSub (session goroutine): SessionClose for the subscription's handle
// (after its acks); done at once when it has none on this session.
func (ss *session) closeSub(s *Subscription, wait chan struct{}) {
	s.closing = true
	s.stopRetry()
	if (s.state == subOpening || s.state == subOpen) && ss.state == stOpen && ss.handles[s.handle] == s {
		s.flushRequests(ss)
		ss.send(marshalRequest(&pb.SessionRequest{Request: &pb.SessionRequest_Close{Close: &pb.SessionClose{Handle: s.handle}}}))
		s.closeWait = wait
		return
	}
	s.state = subDone
	ss.forget(s)
	close(wait)
}

func (s *Subscription) stopRetry() {
	if s.retry != nil {
		s.retry.Stop()
		s.retry = nil
	}
}

func (s *Subscription) held() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.heldLocked()
}

// settle appends an ack or nack for the session goroutine to send.
func (s *Subscription) settle(m *Message, nack bool) bool {
	if !s.manual {
		return false
	}
	s.mu.Lock()
	if s.done || s.ackH == 0 || s.ackH != m.handle {
		s.mu.Unlock()
		return false
	}
	if nack {
		s.nacks = append(s.nacks, m.Sequence)
	} else {
		s.acks = append(s.acks, m.Sequence)
	}
	s.mu.Unlock()
	s.c.markDirty(s)
	return true
}

// flushRequests (session goroutine): the subscription's pending acks,
// nacks and credit go out, one request each; a WAITING one with room opens.
func (s *Subscription) flushRequests(ss *session) {
	s.mu.Lock()
	acks, nacks := s.acks, s.nacks
	s.acks, s.nacks = nil, nil
	credit := 0
	onSession := (s.state == subOpen || s.state == subOpening) && ss.state == stOpen && ss.handles[s.handle] == s
	if onSession && s.taken >= s.topUp {
		credit, s.taken = s.taken, 0
	}
	s.mu.Unlock()
	if onSession {
		if len(acks) > 0 {
			ss.c.acksSent.Add(1)
			ss.send(marshalRequest(&pb.SessionRequest{Request: &pb.SessionRequest_Ack{Ack: &pb.SessionAck{Handle: s.handle, Sequences: acks}}}))
		}
		if len(nacks) > 0 {
			ss.c.nacksSent.Add(1)
			ss.send(marshalRequest(&pb.SessionRequest{Request: &pb.SessionRequest_Nack{Nack: &pb.SessionNack{Handle: s.handle, Sequences: nacks}}}))
		}
		if credit > 0 {
			ss.c.creditsSent.Add(1)
			ss.send(marshalRequest(&pb.SessionRequest{Request: &pb.SessionRequest_Credit{Credit: &pb.SessionCredit{Handle: s.handle, Messages: uint32(credit)}}}))
		}
	} else if s.state == subWaiting && !s.closing {
		ss.tryOpen(s)
	}
}

// opening (session goroutine): WAITING -> OPENING under handle h.
func (s *Subscription) opening(h uint32, instKey string) {
	s.handle = h
	s.state = subOpening
	s.mu.Lock()
	s.taken = 0
	s.ackH = h
	s.acks, s.nacks = nil, nil
	s.recvAtOpen = s.received
	s.mu.Unlock()
}

func (s *Subscription) emit(ev SubscriptionEvent) {
	if s.eventsDone {
		return
	}
	s.eventsMu.Lock()
	defer s.eventsMu.Unlock()
	ch := s.eventsChan()
	for {
		select {
		case ch <- ev:
			return
		default:
		}
		select {
		case <-ch:
			s.c.evDropped.Add(1)
		default:
		}
	}
}

func (s *Subscription) closeEvents() {
	if !s.eventsDone {
		s.eventsDone = true
		s.eventsMu.Lock()
		close(s.eventsChan())
		s.eventsMu.Unlock()
	}
}

// stage (session goroutine): one delivery for this subscription, queued
// with the others of its event by queueStaged. True when it is the first
// staged (the caller lists the subscription for queueStaged).
func (s *Subscription) stage(m *Message, h uint32) bool {
	ss := s.c.s
	if s.away {
		s.reportGap(m.Sequence, ss)
	}
	s.hasLast, s.lastSeq, s.lastInst = true, m.Sequence, ss.instKey
	m.sub, m.handle = s, h
	if m.SubscriptionID == "" {
		m.SubscriptionID = s.id // written on this goroutine only
	}
	s.staged = append(s.staged, m)
	return len(s.staged) == 1
}

// queueStaged (session goroutine): the staged deliveries join the queue
// under one lock, and a waiting taker is woken once.
func (s *Subscription) queueStaged() {
	s.mu.Lock()
	if !s.done {
		s.queue = append(s.queue, s.staged...)
	}
	s.mu.Unlock()
	clear(s.staged)
	s.staged = s.staged[:0]
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// reportGap: docs/clients.md "Gaps", at the first delivery after being away.
func (s *Subscription) reportGap(first uint64, ss *session) {
	s.away = false
	g := &Gap{Dropped: s.awayDrop}
	last := s.lastSeq
	switch {
	case !s.hasLast:
		g.Reason = "nothing_before"
	case s.lastInst != ss.instKey:
		g.Reason = "instance_changed"
	case ss.scope != "instance":
		g.Reason = "sequence_scope"
	case first == last+1:
		return
	case first > last+1:
		g.Known, g.First, g.Last = true, last+1, first-1
	default:
		g.Reason = "instance_changed"
	}
	s.emit(SubscriptionEvent{Kind: EventResumed, Reason: s.awayCause, Dropped: s.awayDrop, LastSequence: last, Gap: g})
}

func (s *Subscription) onOpened(id string) {
	s.state = subOpen
	s.lastCause = nil
	s.mu.Lock()
	s.id = id
	s.mu.Unlock()
	if !s.openedOnce {
		s.openedOnce = true
		close(s.opened)
	}
}

func (s *Subscription) setAway(cause string, dropped uint64) {
	if !s.away {
		s.away, s.awayCause, s.awayDrop = true, cause, dropped
	}
}

func (s *Subscription) leave() {
	s.mu.Lock()
	s.ackH = 0
	s.acks, s.nacks = nil, nil
	s.mu.Unlock()
}

// onEnded (session goroutine): docs/clients.md "Ends".
func (s *Subscription) onEnded(e *pb.SessionEnded) {
	ss := s.c.s
	s.leave()
	if s.closing || e.Reason == "closed" {
		s.state = subDone
		if ss.closing {
			s.finish(ErrClosed, nil) // the client's Close
		} else {
			s.finish(errSubClosed, nil)
		}
		ss.forget(s)
		return
	}
	s.state = subWaiting
	code := codes.Code(e.Code)
	if e.Reason == "rejected" {
		msg := e.Message
		if msg == "" {
			msg = "the broker refused the subscription (" + code.String() + ")"
		}
		err := &Error{Code: code, Message: msg}
		s.lastCause = err
		if s.resub && (code == codes.Unavailable || (s.openedOnce && code == codes.AlreadyExists)) {
			if code == codes.Unavailable {
				ss.requestMoveOn(&Error{Code: code, Message: s.c.Address() + ": " + msg})
			}
			if s.openedOnce {
				s.setAway("rejected", 0)
			}
			s.backoffThenReopen()
			return
		}
		if !s.openedOnce {
			s.finish(nil, err)
			ss.forget(s)
			return
		}
		s.emit(SubscriptionEvent{Kind: EventEnded, Reason: e.Reason, Code: code, Message: msg, LastSequence: s.lastSeq})
		s.finish(&SubscriptionEndedError{Reason: e.Reason, Code: code, Message: msg, LastSequence: s.lastSeq}, nil)
		ss.forget(s)
		return
	}
	again := s.resub && e.Reason != "closed_by_admin"
	last := max(e.LastSequence, s.lastSeq)
	msg := e.Message
	if msg == "" {
		msg = "the broker ended the subscription: " + e.Reason
	}
	s.emit(SubscriptionEvent{Kind: EventEnded, Reason: e.Reason, Message: msg, Dropped: e.Dropped, LastSequence: last, Again: again})
	if again {
		s.setAway(e.Reason, e.Dropped)
		s.backoffThenReopen()
		return
	}
	s.finish(&SubscriptionEndedError{Reason: e.Reason, Message: msg, Dropped: e.Dropped, LastSequence: last}, nil)
	ss.forget(s)
}

// onLost (session goroutine): the session was lost.
func (s *Subscription) onLost() {
	if s.state != subOpening && s.state != subOpen {
		return
	}
	s.leave()
	s.state = subWaiting
	if s.closing {
		s.state = subDone
		s.c.s.forget(s)
		if s.closeWait != nil {
			close(s.closeWait)
			s.closeWait = nil
		}
		return
	}
	if !s.resub && s.openedOnce {
		msg := "the session was lost"
		s.emit(SubscriptionEvent{Kind: EventEnded, Reason: "connection_lost", Message: msg, LastSequence: s.lastSeq})
		s.finish(&SubscriptionEndedError{Reason: "connection_lost", Code: codes.Unavailable, Message: msg, LastSequence: s.lastSeq}, nil)
		s.c.s.forget(s)
		return
	}
	if s.openedOnce {
		s.setAway("connection_lost", 0)
	}
}

func (s *Subscription) backoffThenReopen() {
	s.mu.Lock()
	if s.received > s.recvAtOpen {
		s.backoff.reset() // the application took one since the last open
	}
	s.mu.Unlock()
	s.state = subBackoff
	c := s.c
	s.retry = time.AfterFunc(s.backoff.delay(), func() {
		c.post(func() {
			s.retry = nil
			if !s.closing && s.state == subBackoff {
				s.state = subWaiting
				c.s.tryOpen(s)
			}
		})
	})
}

// finish (session goroutine): DONE. final is what Next returns once the
// held messages are taken (ErrClosed-like ones drop them); openErr is what
// a waiting Subscribe returns.
func (s *Subscription) finish(final error, openErr error) {
	s.state = subDone
	s.stopRetry()
	if s.closeWait != nil {
		close(s.closeWait)
		s.closeWait = nil
	}
	s.mu.Lock()
	if !s.done {
		s.done = true
		if final == nil {
			final = openErr
		}
		s.final = final
		if _, ok := final.(*SubscriptionEndedError); ok {
			s.endErr = final
		} else if final == ErrClosed {
			s.endErr = ErrClosed
			clear(s.queue)
			s.queue, s.head = nil, 0
			s.pumped.Store(0)
		}
		s.openErr = openErr
		close(s.doneCh)
	}
	stop := s.stopCtx
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
}
