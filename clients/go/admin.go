package tinybroker

import (
	"context"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// Admin is the broker's Admin service on the client's current connection:
// thin wrappers returning the generated tinybrokerpb types. Errors are
// *Error values with the broker's code and message.
type Admin struct{ c *Client }

// Admin returns the client's Admin calls.
func (c *Client) Admin() *Admin { return &Admin{c} }

func adminCall[Req, Resp any](a *Admin, ctx context.Context, what string, req Req, call func(pb.AdminClient, context.Context, Req) (Resp, error)) (Resp, error) {
	var zero Resp
	if a.c.closing.Load() {
		return zero, ErrClosed
	}
	conn, t := a.c.current()
	resp, err := call(pb.NewAdminClient(conn), ctx, req)
	if err != nil {
		if a.c.closing.Load() {
			return zero, ErrClosed
		}
		if ctx.Err() != nil {
			return zero, ctxError(ctx, what)
		}
		return zero, fromStatus(err, what+" on "+t.String())
	}
	return resp, nil
}

// ListSubscriptions lists every open subscription.
func (a *Admin) ListSubscriptions(ctx context.Context, req *pb.ListSubscriptionsRequest) (*pb.ListSubscriptionsResponse, error) {
	if req == nil {
		req = &pb.ListSubscriptionsRequest{}
	}
	return adminCall(a, ctx, "ListSubscriptions", req, func(c pb.AdminClient, ctx context.Context, r *pb.ListSubscriptionsRequest) (*pb.ListSubscriptionsResponse, error) {
		return c.ListSubscriptions(ctx, r)
	})
}

// ListConsumerGroups lists every consumer group.
func (a *Admin) ListConsumerGroups(ctx context.Context, req *pb.ListConsumerGroupsRequest) (*pb.ListConsumerGroupsResponse, error) {
	if req == nil {
		req = &pb.ListConsumerGroupsRequest{}
	}
	return adminCall(a, ctx, "ListConsumerGroups", req, func(c pb.AdminClient, ctx context.Context, r *pb.ListConsumerGroupsRequest) (*pb.ListConsumerGroupsResponse, error) {
		return c.ListConsumerGroups(ctx, r)
	})
}

// ListEvictions lists the most recent evictions, newest first.
func (a *Admin) ListEvictions(ctx context.Context, req *pb.ListEvictionsRequest) (*pb.ListEvictionsResponse, error) {
	if req == nil {
		req = &pb.ListEvictionsRequest{}
	}
	return adminCall(a, ctx, "ListEvictions", req, func(c pb.AdminClient, ctx context.Context, r *pb.ListEvictionsRequest) (*pb.ListEvictionsResponse, error) {
		return c.ListEvictions(ctx, r)
	})
}

// CloseSubscription closes one subscription by id (NOT_FOUND if none).
func (a *Admin) CloseSubscription(ctx context.Context, req *pb.CloseSubscriptionRequest) (*pb.CloseSubscriptionResponse, error) {
	return adminCall(a, ctx, "CloseSubscription", req, func(c pb.AdminClient, ctx context.Context, r *pb.CloseSubscriptionRequest) (*pb.CloseSubscriptionResponse, error) {
		return c.CloseSubscription(ctx, r)
	})
}

// BrokerInfo returns the broker's version, uptime, limits and counters.
func (a *Admin) BrokerInfo(ctx context.Context) (*pb.GetBrokerInfoResponse, error) {
	return adminCall(a, ctx, "GetBrokerInfo", &pb.GetBrokerInfoRequest{}, func(c pb.AdminClient, ctx context.Context, r *pb.GetBrokerInfoRequest) (*pb.GetBrokerInfoResponse, error) {
		return c.GetBrokerInfo(ctx, r)
	})
}
