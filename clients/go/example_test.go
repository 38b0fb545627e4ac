package tinybroker_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	tinybroker "github.com/tinybroker/tinybroker/clients/go"
)

// Connect, subscribe, publish (buffered), flush, receive, close.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	client, err := tinybroker.Connect(ctx, []string{"127.0.0.1:50051"})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	sub, err := client.Subscribe(ctx, []string{"greetings.>"})
	if err != nil {
		log.Fatal(err)
	}
	if err := client.PublishAsync(ctx, "greetings.world", []byte("hello")); err != nil {
		log.Fatal(err)
	}
	report, err := client.Flush(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("accepted", report.Accepted)
	msg, err := sub.Next(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s %s\n", msg.Topic, msg.Payload)
}

// A consumer-group worker with manual acks; it ends when ctx is done.
func ExampleClient_Subscribe() {
	ctx := context.Background()
	client, err := tinybroker.Connect(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	sub, err := client.Subscribe(ctx, []string{"jobs.>"},
		tinybroker.WithGroup("workers"), tinybroker.WithManualAck(), tinybroker.WithAckDeadline(30*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		for ev := range sub.Events() {
			if ev.Gap != nil && !ev.Gap.Known {
				log.Printf("may have missed messages (%s)", ev.Gap.Reason)
			}
		}
	}()
	for msg := range sub.All() {
		fmt.Println(msg.Topic, msg.DeliveryAttempt)
		msg.Ack()
	}
	var ended *tinybroker.SubscriptionEndedError
	if errors.As(sub.Err(), &ended) {
		log.Printf("ended: %s", ended.Reason)
	}
}
