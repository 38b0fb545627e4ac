package tinybroker

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type errKind uint8

const (
	kindNone errKind = iota
	kindClosed
	kindUsage
	kindTimeout
)

// Error is the client's error: a gRPC code and a non-empty message (the
// broker's, else one the client writes naming what happened). Every error
// the client returns is an *Error or wraps one (errors.As).
type Error struct {
	// Code is the gRPC status code.
	Code codes.Code
	// Message says what happened.
	Message string

	kind  errKind
	cause error
}

// Error implements error.
func (e *Error) Error() string {
	return "tinybroker: " + e.Message + " (" + e.Code.String() + ")"
}

// Is makes errors.Is(err, ErrClosed), errors.Is(err, ErrUsage) and
// errors.Is(err, ErrTimeout) match every error of that kind.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	if !ok {
		return false
	}
	if t.kind != kindNone {
		return e.kind == t.kind
	}
	return e == t
}

// Unwrap returns the cause (context.DeadlineExceeded for a timeout), if any.
func (e *Error) Unwrap() error { return e.cause }

// GRPCStatus returns the error as a gRPC status (status.FromError uses it).
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

var (
	// ErrClosed matches (errors.Is) every error saying the client, or the
	// subscription, is closed: an *Error with code Canceled.
	ErrClosed = &Error{Code: codes.Canceled, Message: "the client is closed", kind: kindClosed}
	// ErrUsage matches errors of the application's use of the client: a
	// second concurrent Next, a bad argument (code FailedPrecondition).
	ErrUsage = &Error{Code: codes.FailedPrecondition, Message: "usage error", kind: kindUsage}
	// ErrTimeout matches a bounded wait that ran out (code
	// DeadlineExceeded); such errors also match context.DeadlineExceeded.
	ErrTimeout = &Error{Code: codes.DeadlineExceeded, Message: "timed out", kind: kindTimeout, cause: context.DeadlineExceeded}
)

func closedError(what string) *Error {
	return &Error{Code: codes.Canceled, Message: what, kind: kindClosed}
}

var errSubClosed = closedError("the subscription is closed")

func usageError(format string, args ...any) *Error {
	return &Error{Code: codes.FailedPrecondition, Message: fmt.Sprintf(format, args...), kind: kindUsage}
}

func timeoutError(format string, args ...any) *Error {
	return &Error{Code: codes.DeadlineExceeded, Message: fmt.Sprintf(format, args...), kind: kindTimeout, cause: context.DeadlineExceeded}
}

// ctxError turns a done context into the client's error: ErrTimeout for a
// deadline, else an *Error with code Canceled wrapping ctx's error.
func ctxError(ctx context.Context, what string) error {
	err := ctx.Err()
	if errors.Is(err, context.DeadlineExceeded) {
		return timeoutError("%s: the context's deadline passed", what)
	}
	return &Error{Code: codes.Canceled, Message: what + ": the context was canceled", cause: err}
}

// fromStatus converts a gRPC error into an *Error, with a message naming
// what failed when the status has none.
func fromStatus(err error, what string) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	st, _ := status.FromError(err)
	msg := st.Message()
	if msg == "" {
		msg = what + ": " + st.Code().String()
	}
	return &Error{Code: st.Code(), Message: msg, cause: err}
}

// SubscriptionEndedError says why a subscription ended for good (evicted or
// shut down with re-subscription off, closed by an operator, refused, or
// its session lost with re-subscription off). It wraps an *Error.
type SubscriptionEndedError struct {
	// Reason is the broker's ended.reason ("evicted", "shutdown",
	// "closed_by_admin", "rejected") or "connection_lost".
	Reason string
	// Code is the gRPC code for "rejected", else OK.
	Code codes.Code
	// Message is the broker's message, or one the client writes.
	Message string
	// Dropped is what the broker said it dropped.
	Dropped uint64
	// LastSequence is the sequence of the last message delivered to it.
	LastSequence uint64
}

// Error implements error.
func (e *SubscriptionEndedError) Error() string {
	return fmt.Sprintf("tinybroker: the subscription ended (%s): %s (dropped %d, last sequence %d)",
		e.Reason, e.Message, e.Dropped, e.LastSequence)
}

// Unwrap returns the *Error form (code Aborted unless the broker gave one).
func (e *SubscriptionEndedError) Unwrap() error {
	code := e.Code
	if code == codes.OK {
		code = codes.Aborted
	}
	return &Error{Code: code, Message: e.Message}
}

// GRPCStatus returns the error as a gRPC status.
func (e *SubscriptionEndedError) GRPCStatus() *status.Status {
	return e.Unwrap().(*Error).GRPCStatus()
}

// PublishError is a publish the broker refused: Publish's (Accepted 0) or a
// Publisher's stream, which the first bad message ends (the messages before
// it stay published). It wraps an *Error.
type PublishError struct {
	// Code is the broker's gRPC code.
	Code codes.Code
	// Message is the broker's message.
	Message string
	// Accepted is what the broker accepted, as it said (never what the
	// client wrote).
	Accepted uint64
}

// Error implements error.
func (e *PublishError) Error() string {
	return "tinybroker: publish refused: " + e.Message + " (" + e.Code.String() + ")"
}

// Unwrap returns the *Error form.
func (e *PublishError) Unwrap() error { return &Error{Code: e.Code, Message: e.Message} }

// GRPCStatus returns the error as a gRPC status.
func (e *PublishError) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

var acceptedRe = regexp.MustCompile(`(\d+) (?:earlier )?messages of this stream were accepted`)

func publishStreamError(err error) *PublishError {
	e := fromStatus(err, "the publish stream")
	pe := &PublishError{Code: e.Code, Message: e.Message}
	if m := acceptedRe.FindStringSubmatch(e.Message); m != nil {
		pe.Accepted, _ = strconv.ParseUint(m[1], 10, 64)
	}
	return pe
}

// CloseError is what Close returns when something published was not
// delivered: NotSent messages were still in the buffer (never written),
// Unconfirmed ones were written without an answer (they may or may not
// have been published) and no Flush reported them. It wraps an *Error with
// code Unavailable.
type CloseError struct {
	NotSent     uint64 // messages never written
	Unconfirmed uint64 // messages written without an answer, not reported by a Flush
}

// Error implements error.
func (e *CloseError) Error() string {
	return fmt.Sprintf("tinybroker: closed with %d messages not sent and %d unconfirmed", e.NotSent, e.Unconfirmed)
}

// Unwrap returns the *Error form.
func (e *CloseError) Unwrap() error {
	return &Error{Code: codes.Unavailable, Message: fmt.Sprintf("closed with %d messages not sent and %d unconfirmed", e.NotSent, e.Unconfirmed)}
}
