// Package tinybroker is the Go client of tinybroker, an in-memory pub/sub
// broker served over gRPC. It follows docs/clients.md of the repository
// (the behaviour every tinybroker client shares) to the letter.
//
// A [Client] is one HTTP/2 connection (the first address of its list that
// answers) and, once anything needs it, one Session stream on it: every
// subscription (each with its own credit window), every ack and nack
// (coalesced, one request per subscription per turn) and every buffered
// publish (sent in batches) rides on it. One goroutine owns the session;
// every method is safe for concurrent use.
//
//	client, err := tinybroker.Connect(ctx, nil) // $TINYBROKER_ADDR, else 127.0.0.1:50051
//	sub, err := client.Subscribe(ctx, []string{"greetings.>"})
//	err = client.PublishAsync(ctx, "greetings.world", []byte("hello"))
//	report, err := client.Flush(ctx) // accepted, rejected, unconfirmed
//	msg, err := sub.Next(ctx)
//	err = client.Close()
//
// Publishing: [Client.PublishAsync] appends to a buffer bounded in bytes
// and returns at once (it waits only while the buffer is full);
// [Client.Flush] reports what the broker did with everything published
// before it. [Client.Publish] is the unary call that returns the
// sequence. Across a reconnect the buffer waits for the next session;
// batches written to a lost session without an answer are reported as
// unconfirmed and never sent again.
//
// Subscribing: [Client.Subscribe] returns once the broker opened the
// subscription; take messages with [Subscription.Next],
// [Subscription.Messages] or [Subscription.All]. Evictions, shutdowns and
// lost connections are handled by the client: the subscription is opened
// again with a jittered backoff, and [Subscription.Events] reports the end
// and the gap in sequences ([Gap]) when it can be known.
//
// Errors: every error is an [*Error] (a gRPC code and a message) or wraps
// one; errors.Is matches [ErrClosed], [ErrUsage] and [ErrTimeout] (which
// also matches context.DeadlineExceeded); errors.As finds
// [*SubscriptionEndedError], [*PublishError] and [*CloseError]. After
// [Client.Close] every method returns an error matching ErrClosed and no
// goroutine of the client is left.
package tinybroker
