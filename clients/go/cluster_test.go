package tinybroker

import (
	"fmt"
	"testing"
	"time"
)

// A replica cut off from NATS listens but refuses opens UNAVAILABLE: the
// client passes it over for the next address of its list.
func TestClusterReplicaThatCannotServeIsPassedOver(t *testing.T) {
	natsURL := startNats(t, natsServer(t))
	cutOff := startBroker(t, map[string]string{
		"TINYBROKER_NATS_URL":      fmt.Sprintf("nats://127.0.0.1:%d", freePort(t)),
		"TINYBROKER_NATS_REPLICAS": "1", "TINYBROKER_REPLICA_ID": "cut-off",
	})
	good := startBroker(t, map[string]string{
		"TINYBROKER_NATS_URL": natsURL, "TINYBROKER_NATS_REPLICAS": "1", "TINYBROKER_REPLICA_ID": "good",
	})
	waitServing(t, good)
	c := connect(t, []string{cutOff.addr, good.addr})
	if c.Address() != "http://"+cutOff.addr {
		t.Fatalf("connected to %s first, not the cut-off replica", c.Address())
	}
	sub, err := c.Subscribe(ctxT(t, 30*time.Second), []string{"d.>"}, WithOpenTimeout(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if c.Address() != "http://"+good.addr {
		t.Fatalf("address %s", c.Address())
	}
	publish(t, c, "d.1", []byte("served"))
	if m := next(t, sub, 10*time.Second); string(m.Payload) != "served" {
		t.Fatal("wrong message")
	}
}
