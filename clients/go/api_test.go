package tinybroker_test

// The public API of /work/plan/go-client-api.md, name by name and
// signature by signature: this file does not compile when one changes.

import (
	"context"
	"crypto/tls"
	"iter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

var (
	_ func(context.Context, []string, ...tinybroker.Option) (*tinybroker.Client, error) = tinybroker.Connect
	_ func(string) tinybroker.Option                                                    = tinybroker.WithToken
	_ func(*tls.Config) tinybroker.Option                                               = tinybroker.WithTLSConfig
	_ func(string) tinybroker.Option                                                    = tinybroker.WithCAFile
	_ func(int) tinybroker.Option                                                       = tinybroker.WithWindow
	_ func(int) tinybroker.Option                                                       = tinybroker.WithBufferBytes
	_ func(bool) tinybroker.Option                                                      = tinybroker.WithResubscribe
	_ func(time.Duration) tinybroker.Option                                             = tinybroker.WithConnectTimeout
	_ func(...grpc.DialOption) tinybroker.Option                                        = tinybroker.WithDialOptions
	_ func(tinybroker.Propagator) tinybroker.Option                                     = tinybroker.WithPropagator
	_ func(func(tinybroker.ConnectionEvent)) tinybroker.Option                          = tinybroker.WithConnectionHandler

	_ func(*tinybroker.Client) error                                                                                           = (*tinybroker.Client).Close
	_ func(*tinybroker.Client, context.Context) error                                                                          = (*tinybroker.Client).CloseContext
	_ func(*tinybroker.Client) string                                                                                          = (*tinybroker.Client).Address
	_ func(*tinybroker.Client) string                                                                                          = (*tinybroker.Client).Instance
	_ func(*tinybroker.Client) tinybroker.Stats                                                                                = (*tinybroker.Client).Stats
	_ func(*tinybroker.Client) <-chan tinybroker.ConnectionEvent                                                               = (*tinybroker.Client).ConnectionEvents
	_ func(*tinybroker.Client) *tinybroker.Admin                                                                               = (*tinybroker.Client).Admin
	_ func(map[string]string) tinybroker.PublishOption                                                                         = tinybroker.WithHeaders
	_ func(tinybroker.FlushReport) uint64                                                                                      = tinybroker.FlushReport.UnconfirmedCount
	_ func(*tinybroker.Client, context.Context) (tinybroker.FlushReport, error)                                                = (*tinybroker.Client).Flush
	_ func(*tinybroker.Client, context.Context, string, []byte, ...tinybroker.PublishOption) (tinybroker.PublishResult, error) = (*tinybroker.Client).Publish
	_ func(*tinybroker.Client, context.Context, string, []byte, ...tinybroker.PublishOption) error                             = (*tinybroker.Client).PublishAsync

	_ func(string) tinybroker.SubscribeOption        = tinybroker.WithSubscriptionID
	_ func(string) tinybroker.SubscribeOption        = tinybroker.WithGroup
	_ func() tinybroker.SubscribeOption              = tinybroker.WithManualAck
	_ func(uint32) tinybroker.SubscribeOption        = tinybroker.WithMaxInFlight
	_ func(time.Duration) tinybroker.SubscribeOption = tinybroker.WithAckDeadline
	_ func(int) tinybroker.SubscribeOption           = tinybroker.WithSubscriptionWindow
	_ func(bool) tinybroker.SubscribeOption          = tinybroker.WithSubscriptionResubscribe
	_ func(time.Duration) tinybroker.SubscribeOption = tinybroker.WithOpenTimeout

	_ func(*tinybroker.Client, context.Context, []string, ...tinybroker.SubscribeOption) (*tinybroker.Subscription, error) = (*tinybroker.Client).Subscribe
	_ func(*tinybroker.Subscription) string                                                                                = (*tinybroker.Subscription).ID
	_ func(*tinybroker.Subscription, context.Context) (*tinybroker.Message, error)                                         = (*tinybroker.Subscription).Next
	_ func(*tinybroker.Subscription) <-chan *tinybroker.Message                                                            = (*tinybroker.Subscription).Messages
	_ func(*tinybroker.Subscription) iter.Seq[*tinybroker.Message]                                                         = (*tinybroker.Subscription).All
	_ func(*tinybroker.Subscription) <-chan tinybroker.SubscriptionEvent                                                   = (*tinybroker.Subscription).Events
	_ func(*tinybroker.Subscription) error                                                                                 = (*tinybroker.Subscription).Err
	_ func(*tinybroker.Subscription) error                                                                                 = (*tinybroker.Subscription).Close
	_ func(*tinybroker.Message) bool                                                                                       = (*tinybroker.Message).Ack
	_ func(*tinybroker.Message) bool                                                                                       = (*tinybroker.Message).Nack
	_ func(*tinybroker.Message, context.Context) context.Context                                                           = (*tinybroker.Message).Context

	_ func(*tinybroker.Admin, context.Context, *pb.ListSubscriptionsRequest) (*pb.ListSubscriptionsResponse, error)   = (*tinybroker.Admin).ListSubscriptions
	_ func(*tinybroker.Admin, context.Context, *pb.ListConsumerGroupsRequest) (*pb.ListConsumerGroupsResponse, error) = (*tinybroker.Admin).ListConsumerGroups
	_ func(*tinybroker.Admin, context.Context, *pb.ListEvictionsRequest) (*pb.ListEvictionsResponse, error)           = (*tinybroker.Admin).ListEvictions
	_ func(*tinybroker.Admin, context.Context, *pb.CloseSubscriptionRequest) (*pb.CloseSubscriptionResponse, error)   = (*tinybroker.Admin).CloseSubscription
	_ func(*tinybroker.Admin, context.Context) (*pb.GetBrokerInfoResponse, error)                                     = (*tinybroker.Admin).BrokerInfo

	_ error                                    = tinybroker.ErrClosed
	_ error                                    = tinybroker.ErrUsage
	_ error                                    = tinybroker.ErrTimeout
	_ interface{ GRPCStatus() *status.Status } = &tinybroker.Error{Code: codes.Canceled, Message: ""}
	_ error                                    = &tinybroker.SubscriptionEndedError{Reason: "", Code: codes.OK, Message: "", Dropped: 0, LastSequence: 0}
	_ error                                    = &tinybroker.PublishError{Code: codes.OK, Message: "", Accepted: 0}
	_ error                                    = &tinybroker.CloseError{NotSent: 0, Unconfirmed: 0}

	_                       = tinybroker.PublishResult{Sequence: 0, MatchedSubscriptions: 0, MatchedGroups: 0}
	_                       = tinybroker.FlushReport{Accepted: 0, Rejected: []tinybroker.Rejection{{Index: 0, Topic: "", Code: codes.OK, Message: ""}}, Unconfirmed: []tinybroker.IndexRange{{First: 0, Last: 0}}}
	_                       = tinybroker.Message{Topic: "", Payload: nil, Headers: nil, Sequence: 0, PublishTime: time.Time{}, SubscriptionID: "", Group: "", DeliveryAttempt: 0}
	_                       = tinybroker.SubscriptionEvent{Kind: tinybroker.EventEnded, Reason: "", Code: codes.OK, Message: "", Dropped: 0, LastSequence: 0, Gap: &tinybroker.Gap{Known: false, First: 0, Last: 0, Reason: "", Dropped: 0}}
	_                       = tinybroker.EventResumed
	_                       = tinybroker.ConnectionEvent{Kind: tinybroker.Connected, Address: "", Instance: "", InstanceChanged: false, Reason: ""}
	_                       = []tinybroker.ConnectionEventKind{tinybroker.Disconnected, tinybroker.Reconnected, tinybroker.Closed}
	_                       = tinybroker.Stats{MessagesIn: 0, BytesIn: 0, MessagesOut: 0, BytesOut: 0, Reconnects: 0, PendingMessages: 0, PendingBytes: 0, DroppedLate: 0, EventsDropped: 0}
	_ tinybroker.Propagator = nil
)
