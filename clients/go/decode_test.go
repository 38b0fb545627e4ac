package tinybroker

import (
	"bytes"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// reference decodes b with proto.Unmarshal and the conversion the client
// made before decodeEvent.
func reference(b []byte) (*inEvents, error) {
	in := new(inEvents)
	return in, decodeOther(b, in)
}

func sameEvents(t testing.TB, b []byte, got, want *inEvents) {
	t.Helper()
	if (got.ev == nil) != (want.ev == nil) || (got.ev != nil && !proto.Equal(got.ev, want.ev)) {
		t.Fatalf("%x: event %v, want %v", b, got.ev, want.ev)
	}
	if len(got.dels) != len(want.dels) {
		t.Fatalf("%x: %d deliveries, want %d", b, len(got.dels), len(want.dels))
	}
	for i := range got.dels {
		g, w := &got.dels[i], &want.dels[i]
		gh, wh := g.handleList(got.handles), w.handleList(want.handles)
		if !slices.Equal(gh, wh) || g.hasMsg != w.hasMsg {
			t.Fatalf("%x: delivery %d: handles %v (message %v), want %v (%v)", b, i, gh, g.hasMsg, wh, w.hasMsg)
		}
		gm, wm := g.msg, w.msg
		if gm.Topic != wm.Topic || !bytes.Equal(gm.Payload, wm.Payload) || !maps.Equal(gm.Headers, wm.Headers) || gm.Sequence != wm.Sequence ||
			!gm.PublishTime.Equal(wm.PublishTime) || gm.PublishTime.Location() != wm.PublishTime.Location() ||
			gm.SubscriptionID != wm.SubscriptionID || gm.Group != wm.Group || gm.DeliveryAttempt != wm.DeliveryAttempt {
			t.Fatalf("%x: delivery %d: %+v, want %+v", b, i, gm, wm)
		}
		if cap(gm.Payload) != len(gm.Payload) {
			t.Fatalf("delivery %d: payload capacity %d beyond its length %d", i, cap(gm.Payload), len(gm.Payload))
		}
	}
}

func checkDecode(t testing.TB, b []byte) {
	t.Helper()
	var got inEvents
	err := decodeEvent(bytes.Clone(b), &got)
	want, werr := reference(b)
	if (err == nil) != (werr == nil) {
		t.Fatalf("%x: error %v, proto.Unmarshal's %v", b, err, werr)
	}
	if err == nil {
		sameEvents(t, b, &got, want)
	}
}

func randString(r *rand.Rand, n int) string {
	const chars = "abcdefghijklmnopqrstuvwxyz.>*-_é日"
	rs := []rune(chars)
	var sb []rune
	for range r.IntN(n + 1) {
		sb = append(sb, rs[r.IntN(len(rs))])
	}
	return string(sb)
}

func randMessage(r *rand.Rand) *pb.Message {
	m := &pb.Message{
		Topic:           randString(r, 20),
		Sequence:        r.Uint64() >> r.IntN(64),
		SubscriptionId:  randString(r, 8),
		ConsumerGroup:   randString(r, 6),
		DeliveryAttempt: r.Uint32() >> r.IntN(32),
	}
	if r.IntN(4) > 0 {
		m.Payload = make([]byte, r.IntN(300))
		for i := range m.Payload {
			m.Payload[i] = byte(r.IntN(256))
		}
	}
	if r.IntN(2) == 0 {
		m.Headers = map[string]string{}
		for range r.IntN(4) + 1 {
			m.Headers[randString(r, 10)] = randString(r, 30)
		}
	}
	if r.IntN(4) > 0 {
		m.PublishTime = &timestamppb.Timestamp{Seconds: r.Int64N(1 << 34), Nanos: r.Int32N(1e9)}
	}
	return m
}

func randDelivery(r *rand.Rand) *pb.SessionDelivery {
	d := &pb.SessionDelivery{}
	for range r.IntN(4) {
		d.Handles = append(d.Handles, r.Uint32()>>r.IntN(32))
	}
	if r.IntN(10) > 0 {
		d.Message = randMessage(r)
	}
	return d
}

// unknown adds unknown fields of every wire type to m (forward compatibility).
func unknown(r *rand.Rand, m proto.Message) {
	var b []byte
	for range r.IntN(3) {
		num := protowire.Number(20 + r.IntN(100))
		switch r.IntN(4) {
		case 0:
			b = protowire.AppendTag(b, num, protowire.VarintType)
			b = protowire.AppendVarint(b, r.Uint64())
		case 1:
			b = protowire.AppendTag(b, num, protowire.BytesType)
			b = protowire.AppendBytes(b, []byte(randString(r, 10)))
		case 2:
			b = protowire.AppendTag(b, num, protowire.Fixed64Type)
			b = protowire.AppendFixed64(b, r.Uint64())
		case 3:
			b = protowire.AppendTag(b, num, protowire.Fixed32Type)
			b = protowire.AppendFixed32(b, r.Uint32())
		}
	}
	m.ProtoReflect().SetUnknown(b)
}

// unpack rewrites the packed handles of a marshalled SessionDelivery as
// one varint field each.
func unpackHandles(b []byte) []byte {
	var out []byte
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if num == 1 && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b)
			for len(v) > 0 {
				h, k := protowire.ConsumeVarint(v)
				v = v[k:]
				out = protowire.AppendTag(out, 1, protowire.VarintType)
				out = protowire.AppendVarint(out, h)
			}
		} else {
			out = protowire.AppendTag(out, num, typ)
			out = append(out, b[:m]...)
		}
		b = b[m:]
	}
	return out
}

// genEvents: SessionEvents of every kind, marshalled, some with unknown
// fields and unpacked handles.
func genEvents(r *rand.Rand, n int) [][]byte {
	var out [][]byte
	for i := range n {
		var ev *pb.SessionEvent
		switch i % 6 {
		case 0, 1, 2:
			ds := &pb.SessionDeliveries{}
			for range r.IntN(20) {
				d := randDelivery(r)
				if r.IntN(5) == 0 {
					unknown(r, d)
					if d.Message != nil {
						unknown(r, d.Message)
					}
				}
				ds.Deliveries = append(ds.Deliveries, d)
			}
			ev = &pb.SessionEvent{Event: &pb.SessionEvent_Deliveries{Deliveries: ds}}
		case 3:
			d := randDelivery(r)
			ev = &pb.SessionEvent{Event: &pb.SessionEvent_Delivery{Delivery: d}}
			if r.IntN(2) == 0 {
				db, _ := proto.Marshal(d)
				b := protowire.AppendTag(nil, 2, protowire.BytesType)
				out = append(out, protowire.AppendBytes(b, unpackHandles(db)))
				continue
			}
		case 4:
			ev = &pb.SessionEvent{Event: &pb.SessionEvent_Opened{Opened: &pb.SessionOpened{Handle: r.Uint32(), SubscriptionId: randString(r, 5)}}}
		case 5:
			ev = &pb.SessionEvent{Event: &pb.SessionEvent_Ended{Ended: &pb.SessionEnded{Handle: 3, Reason: "evicted", Dropped: 7}}}
		}
		if r.IntN(4) == 0 {
			unknown(r, ev)
		}
		b, err := proto.MarshalOptions{Deterministic: r.IntN(2) == 0}.Marshal(ev)
		if err != nil {
			panic(err)
		}
		out = append(out, b)
	}
	return out
}

func TestDecodeEventMatchesProto(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	evs := genEvents(r, 3000)
	for _, b := range evs {
		checkDecode(t, b)
		// Two events' bytes after one another: protobuf merges them.
		checkDecode(t, append(slices.Clone(b), evs[r.IntN(len(evs))]...))
		// Truncated, and one byte changed: an error or the same result.
		if len(b) > 0 {
			checkDecode(t, b[:r.IntN(len(b))])
			c := slices.Clone(b)
			c[r.IntN(len(c))] ^= byte(1 + r.IntN(255))
			checkDecode(t, c)
		}
	}
}

func TestDecodeEventTable(t *testing.T) {
	tag := func(num protowire.Number, typ protowire.Type) []byte { return protowire.AppendTag(nil, num, typ) }
	bytesField := func(num protowire.Number, v []byte) []byte {
		return protowire.AppendBytes(tag(num, protowire.BytesType), v)
	}
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	msg := cat(bytesField(1, []byte("a.b")), bytesField(2, []byte("xy")), tag(4, protowire.VarintType), []byte{7})
	for name, b := range map[string][]byte{
		"empty":                    nil,
		"deliveries, empty":        bytesField(5, nil),
		"delivery without message": bytesField(2, cat(tag(1, protowire.VarintType), []byte{5})),
		"packed and unpacked":      bytesField(2, cat(tag(1, protowire.VarintType), []byte{5}, bytesField(1, []byte{1, 2, 0x80, 1}), bytesField(2, msg))),
		"message twice (merged)":   bytesField(2, cat(bytesField(2, msg), bytesField(2, bytesField(3, cat(bytesField(1, []byte("k")), bytesField(2, []byte("v"))))))),
		"delivery then deliveries": cat(bytesField(2, bytesField(2, msg)), bytesField(5, bytesField(1, bytesField(2, msg)))),
		"deliveries then opened":   cat(bytesField(5, bytesField(1, bytesField(2, msg))), bytesField(1, nil)),
		"opened then deliveries":   cat(bytesField(1, nil), bytesField(5, bytesField(1, bytesField(2, msg)))),
		"topic as a varint":        bytesField(2, bytesField(2, cat(tag(1, protowire.VarintType), []byte{1}))),
		"invalid UTF-8 topic":      bytesField(2, bytesField(2, bytesField(1, []byte{0xff}))),
		"invalid UTF-8 header":     bytesField(2, bytesField(2, bytesField(3, bytesField(2, []byte{0xc0})))),
		"truncated length":         cat(tag(5, protowire.BytesType), []byte{10, 1}),
		"bad varint":               cat(tag(5, protowire.VarintType), bytes.Repeat([]byte{0xff}, 11)),
		"field number 0":           {0x02, 0x00},
		"end group alone":          tag(9, protowire.EndGroupType),
		"group":                    cat(tag(9, protowire.StartGroupType), tag(1, protowire.VarintType), []byte{1}, tag(9, protowire.EndGroupType)),
		"timestamp merged":         bytesField(2, cat(bytesField(2, bytesField(5, cat(tag(1, protowire.VarintType), []byte{9}))), bytesField(2, bytesField(5, cat(tag(2, protowire.VarintType), []byte{3}))))),
	} {
		t.Run(name, func(t *testing.T) { checkDecode(t, b) })
	}
}

// FuzzDecode: decodeEvent never panics, fails exactly when proto.Unmarshal
// does, and otherwise gives the same deliveries.
//
//	go test -run XXX -fuzz FuzzDecode -fuzztime 30s -fuzzminimizetime 1s
func FuzzDecode(f *testing.F) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, b := range genEvents(r, 60) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkDecode(t, b) })
}

func BenchmarkDecodeEvent(b *testing.B) {
	ds := &pb.SessionDeliveries{}
	for i := range 256 {
		ds.Deliveries = append(ds.Deliveries, &pb.SessionDelivery{Handles: []uint32{1}, Message: &pb.Message{
			Topic: "bench.topic", Payload: make([]byte, 128), Sequence: uint64(1000 + i),
			PublishTime: timestamppb.Now(), DeliveryAttempt: 1,
		}})
	}
	raw, _ := proto.Marshal(&pb.SessionEvent{Event: &pb.SessionEvent_Deliveries{Deliveries: ds}})
	b.Run("decodeEvent", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var in inEvents
			if err := decodeEvent(bytes.Clone(raw), &in); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("proto.Unmarshal", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := reference(raw); err != nil {
				b.Fatal(err)
			}
		}
	})
}
