package tinybroker

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// A batch encoded in place (sizeMessage, appendMessage, batch.request) is
// a SessionRequest that decodes to the messages published, every length
// prefix right (a wrong one would make the broker refuse the whole
// stream). It is not byte for byte Go protobuf's: map entries may come in
// another order, and an empty header key or value is left out where Go's
// encoder writes it (both are valid; decoders take either).
func TestBatchEncodingIsProtobufs(t *testing.T) {
	msgs := []*pb.PublishRequest{
		{Topic: "a.b", Payload: []byte("x")},
		{},
		{Topic: "big", Payload: bytes.Repeat([]byte("y"), 300)},
		{Topic: "h", Headers: map[string]string{"k": "v", "": "empty key", "empty value": "", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}},
	}
	for _, id := range []uint64{1, 300, 1 << 40} {
		b := &batch{buf: make([]byte, headerRoom)}
		for _, m := range msgs {
			body := sizeMessage(m.Topic, m.Payload, m.Headers)
			b.buf = appendMessage(b.buf, body, m.Topic, m.Payload, m.Headers)
			b.nbytes += 1 + protowire.SizeBytes(body)
		}
		got := b.request(id)
		want := &pb.SessionRequest{Request: &pb.SessionRequest_Publish{Publish: &pb.SessionPublish{Id: id, Messages: msgs}}}
		var decoded pb.SessionRequest
		if err := proto.Unmarshal(got, &decoded); err != nil {
			t.Fatalf("id %d: %v", id, err)
		}
		if !proto.Equal(&decoded, want) {
			t.Fatalf("id %d: decodes to %v, want %v", id, &decoded, want)
		}
	}
}
