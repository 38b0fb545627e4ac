package tinybroker

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
)

// PublishResult is what Publish returns: the message's sequence and the
// subscriptions and groups it matched.
type PublishResult struct {
	Sequence             uint64 // the broker's sequence of the message
	MatchedSubscriptions uint32 // broadcast subscriptions it matched
	MatchedGroups        uint32 // consumer groups it matched
}

// Rejection is one message the broker refused, as FlushReport names it.
type Rejection struct {
	// Index counts the client's publishes from 0, in the order of the calls.
	Index uint64
	// Topic is the message's topic.
	Topic string
	// Code is the broker's gRPC code.
	Code codes.Code
	// Message is the broker's text.
	Message string
}

// IndexRange is an inclusive range of publish indexes.
type IndexRange struct {
	First, Last uint64 // publish indexes, both included
}

// FlushReport is what happened to the messages published since the
// previous Flush (each message's outcome is reported by exactly one Flush).
type FlushReport struct {
	// Accepted is the count the broker accepted.
	Accepted uint64
	// Rejected names each refused message.
	Rejected []Rejection
	// Unconfirmed are the messages written to a session lost before its
	// answer: they may or may not have been published; never written again.
	Unconfirmed []IndexRange
}

// UnconfirmedCount is the number of unconfirmed messages.
func (r FlushReport) UnconfirmedCount() uint64 {
	var n uint64
	for _, ir := range r.Unconfirmed {
		n += ir.Last - ir.First + 1
	}
	return n
}

// Message is one delivery. Its Payload and strings share one copy of the
// bytes of the gRPC message that brought it (a batch of deliveries): a
// message kept keeps that batch's bytes; copy the Payload to keep a few
// messages of many for long.
type Message struct {
	Topic           string            // the topic it was published to
	Payload         []byte            // its payload (do not modify: shared by the subscriptions of one delivery)
	Headers         map[string]string // its headers (with the broker's traceparent)
	Sequence        uint64            // the broker's sequence (names it in Ack/Nack)
	PublishTime     time.Time         // when the broker took it
	SubscriptionID  string            // the subscription it was delivered to
	Group           string            // the consumer group, for a group member
	DeliveryAttempt uint32            // 1, then more with each redelivery

	sub    *Subscription
	handle uint32
}

// Ack acknowledges the message (MANUAL group members). It never sends on
// its own: the acks of a subscription go out coalesced, as one SessionAck,
// on the session goroutine's next turn. False when the message came on an
// earlier session (that session's unacked messages are redelivered), or
// the subscription is not a MANUAL one or is closed: nothing is sent then.
func (m *Message) Ack() bool {
	if m.sub == nil {
		return false
	}
	return m.sub.settle(m, false)
}

// Nack hands the message back for redelivery (MANUAL group members), as
// Ack does (coalesced, false when it cannot be sent).
func (m *Message) Nack() bool {
	if m.sub == nil {
		return false
	}
	return m.sub.settle(m, true)
}

// Context returns parent with the trace context of the message's headers
// (the client's Propagator), else parent.
func (m *Message) Context(parent context.Context) context.Context {
	if m.sub == nil || m.sub.c.opts.propagator == nil || len(m.Headers) == 0 {
		return parent
	}
	return m.sub.c.opts.propagator.Extract(parent, m.Headers)
}

// EventKind is the kind of a SubscriptionEvent.
type EventKind int

const (
	// EventEnded: the broker ended the subscription (evicted, shutdown,
	// closed_by_admin, rejected on a re-open) or its session was lost with
	// re-subscription off (connection_lost).
	EventEnded EventKind = iota + 1
	// EventResumed: the first delivery after the subscription was away (an
	// end, a lost session) came, and messages may have been missed: Gap says
	// which. No event when nothing was missed.
	EventResumed
)

// String names the kind.
func (k EventKind) String() string {
	switch k {
	case EventEnded:
		return "ended"
	case EventResumed:
		return "resumed"
	}
	return "unknown"
}

// SubscriptionEvent is an event of one subscription (Subscription.Events).
type SubscriptionEvent struct {
	// Kind is EventEnded or EventResumed.
	Kind EventKind
	// Reason: the end's reason ("evicted", "shutdown", "closed_by_admin",
	// "rejected", "connection_lost"); on EventResumed, why it was away.
	Reason string
	// Code is the gRPC code of a "rejected".
	Code codes.Code
	// Message is the broker's message, if any.
	Message string
	// Dropped is what the broker said it dropped.
	Dropped uint64
	// LastSequence is the sequence of the last delivery before the end.
	LastSequence uint64
	// Gap is set on EventResumed.
	Gap *Gap
	// Again: on EventEnded, the subscription will be opened again.
	Again bool
}

// Gap is what a subscription may have missed while it was away
// (docs/clients.md "Gaps").
type Gap struct {
	// Known: First..Last (inclusive) are the sequences missed.
	Known       bool
	First, Last uint64 // the sequences missed, both included, when Known
	// Reason when !Known: "instance_changed", "sequence_scope" or "nothing_before".
	Reason string
	// Dropped is what the broker's ended said it dropped, when there was one.
	Dropped uint64
}

// ConnectionEventKind is the kind of a ConnectionEvent.
type ConnectionEventKind int

const (
	// Connected: the first session of the client reached OPEN.
	Connected ConnectionEventKind = iota + 1
	// Disconnected: an OPEN session was lost (Reason says why).
	Disconnected
	// Reconnected: a session reached OPEN after a Disconnected.
	Reconnected
	// Closed: Close finished.
	Closed
)

// String names the kind.
func (k ConnectionEventKind) String() string {
	switch k {
	case Connected:
		return "connected"
	case Disconnected:
		return "disconnected"
	case Reconnected:
		return "reconnected"
	case Closed:
		return "closed"
	}
	return "unknown"
}

// ConnectionEvent is one change of the client's connection, emitted once
// per change whatever the number of subscriptions.
type ConnectionEvent struct {
	Kind            ConnectionEventKind // Connected, Disconnected, Reconnected or Closed
	Address         string              // the address of the session (Connected, Disconnected, Reconnected)
	Instance        string              // the broker's tinybroker-instance (Connected, Disconnected, Reconnected)
	InstanceChanged bool                // Reconnected to another instance than before
	// Reason (Disconnected): the gRPC code and message, or "closed by the broker".
	Reason string
}

// Stats are the client's counters.
type Stats struct {
	// MessagesIn, BytesIn: deliveries received (payload bytes).
	MessagesIn, BytesIn uint64
	// MessagesOut, BytesOut: buffered messages written to a session (payload bytes).
	MessagesOut, BytesOut uint64
	// Reconnects counts sessions that reached OPEN after a Disconnected.
	Reconnects uint64
	// PendingMessages, PendingBytes: in the publish buffer, not yet written.
	PendingMessages, PendingBytes uint64
	// DroppedLate counts deliveries for a handle the client no longer has.
	DroppedLate uint64
	// EventsDropped counts events dropped because their channel was full.
	EventsDropped uint64
}
