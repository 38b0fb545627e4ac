package tinybroker

import (
	"errors"
	"slices"
	"time"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/tinybroker/tinybroker/clients/go/tinybrokerpb"
)

// inEvents is one SessionEvent as the session's receiving goroutine decodes
// it (rawCodec.Unmarshal): its deliveries (the deliveries or delivery
// events) straight into Message values, any other event as a
// pb.SessionEvent.
//
// Memory: the event's bytes are copied once out of gRPC's buffers (one
// allocation per gRPC message), and every Payload, Topic, header,
// SubscriptionID and Group of its deliveries points into that copy (the
// strings with unsafe.String). This is safe because the copy is made
// here, for this event only, and is never written to nor reused: a
// Payload is sliced with its capacity equal to its length (an append
// reallocates), and the strings lie in other bytes than any payload. A
// message kept alive keeps its whole batch's bytes alive.
type inEvents struct {
	ev      *pb.SessionEvent // an event other than deliveries, else nil
	dels    []inDelivery
	handles []uint32 // the deliveries' handles: dels[i].handles(handles)
}

// inDelivery is one SessionDelivery: its handles and its message, ready to
// be handed to a subscription (only sub and handle left to set).
type inDelivery struct {
	h0, hn int32 // handles[h0 : h0+hn]
	hasMsg bool
	hasTS  bool
	nanos  int32
	secs   int64
	msg    Message
}

func (d *inDelivery) handleList(all []uint32) []uint32 {
	return all[d.h0 : d.h0+d.hn]
}

var errUTF8 = errors.New("tinybroker: invalid UTF-8 in a string field of a SessionEvent")

// decodeEvent decodes b (a SessionEvent, as proto.Unmarshal would, unknown
// fields skipped) into in. b must not be modified afterwards: the
// deliveries alias it.
func decodeEvent(b []byte, in *inEvents) error {
	*in = inEvents{}
	all := b
	kind := protowire.Number(0) // the oneof member seen last: 2 or 5
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.BytesType {
			switch num {
			case 1, 3, 4:
				// Another event: protobuf's own decoding (rare events).
				return decodeOther(all, in)
			case 2, 5:
				v, n := protowire.ConsumeBytes(b)
				if n < 0 {
					return protowire.ParseError(n)
				}
				b = b[n:]
				if kind != num { // another oneof member: the previous one is dropped
					kind = num
					in.dels, in.handles = nil, nil
					if num == 2 {
						in.dels = make([]inDelivery, 1)
					}
				}
				var err error
				if num == 2 {
					err = decodeDelivery(v, &in.dels[0], &in.handles)
				} else {
					err = decodeDeliveries(v, in)
				}
				if err != nil {
					return err
				}
				continue
			}
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
	}
	return nil
}

// decodeOther: an event that is not only deliveries goes through
// proto.Unmarshal; deliveries that are its last member are converted.
func decodeOther(b []byte, in *inEvents) error {
	*in = inEvents{}
	ev := new(pb.SessionEvent)
	if err := proto.Unmarshal(b, ev); err != nil {
		return err
	}
	switch e := ev.Event.(type) {
	case *pb.SessionEvent_Deliveries:
		for _, d := range e.Deliveries.Deliveries {
			in.addPB(d)
		}
	case *pb.SessionEvent_Delivery:
		in.addPB(e.Delivery)
	case nil: // no event (unknown fields only): nothing to do
	default:
		in.ev = ev
	}
	return nil
}

// addPB appends a decoded pb.SessionDelivery (the reference conversion).
func (in *inEvents) addPB(d *pb.SessionDelivery) {
	x := inDelivery{h0: int32(len(in.handles)), hn: int32(len(d.GetHandles()))}
	in.handles = append(in.handles, d.GetHandles()...)
	if raw := d.GetMessage(); raw != nil {
		x.hasMsg = true
		x.msg = Message{
			Topic: raw.Topic, Payload: raw.Payload[:len(raw.Payload):len(raw.Payload)], Headers: raw.Headers,
			Sequence: raw.Sequence, SubscriptionID: raw.SubscriptionId, Group: raw.ConsumerGroup,
			DeliveryAttempt: raw.DeliveryAttempt,
		}
		if raw.PublishTime != nil {
			x.hasTS = true
			x.secs, x.nanos = raw.PublishTime.Seconds, raw.PublishTime.Nanos
			x.msg.PublishTime = raw.PublishTime.AsTime()
		}
	}
	in.dels = append(in.dels, x)
}

// decodeDeliveries: SessionDeliveries{repeated SessionDelivery deliveries = 1}.
func decodeDeliveries(b []byte, in *inEvents) error {
	// Count first: one allocation for the deliveries.
	count := 0
	for c := b; len(c) > 0; {
		num, typ, n := consumeTag(c)
		if n < 0 {
			return protowire.ParseError(n)
		}
		c = c[n:]
		if num == 1 && typ == protowire.BytesType {
			count++
		}
		n = protowire.ConsumeFieldValue(num, typ, c)
		if n < 0 {
			return protowire.ParseError(n)
		}
		c = c[n:]
	}
	if count == 0 {
		return nil
	}
	if in.dels == nil {
		in.dels = make([]inDelivery, 0, count)
		in.handles = make([]uint32, 0, count)
	} else {
		in.dels = slices.Grow(in.dels, count)
	}
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		b = b[n:] // checked by the count
		if num == 1 && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			b = b[n:]
			in.dels = append(in.dels, inDelivery{})
			if err := decodeDelivery(v, &in.dels[len(in.dels)-1], &in.handles); err != nil {
				return err
			}
			continue
		}
		b = b[protowire.ConsumeFieldValue(num, typ, b):]
	}
	return nil
}

// decodeDelivery: SessionDelivery{repeated uint32 handles = 1 (packed or
// not); Message message = 2}, merged into d as protobuf merges a repeated
// occurrence.
func decodeDelivery(b []byte, d *inDelivery, hs *[]uint32) error {
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			d.addHandle(hs, uint32(v))
			continue
		case num == 1 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			for len(v) > 0 {
				h, n := protowire.ConsumeVarint(v)
				if n < 0 {
					return protowire.ParseError(n)
				}
				v = v[n:]
				d.addHandle(hs, uint32(h))
			}
			continue
		case num == 2 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			d.hasMsg = true
			if err := decodeMessage(v, d); err != nil {
				return err
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
	}
	return nil
}

func (d *inDelivery) addHandle(hs *[]uint32, h uint32) {
	if d.hn == 0 {
		d.h0 = int32(len(*hs))
	}
	*hs = append(*hs, h)
	d.hn++
}

// aliasString returns the bytes as a string without copying (see inEvents),
// checked as UTF-8 as protobuf checks proto3 strings.
func aliasString(b []byte) (string, error) {
	if len(b) == 0 {
		return "", nil
	}
	if !utf8.Valid(b) {
		return "", errUTF8
	}
	return unsafe.String(unsafe.SliceData(b), len(b)), nil
}

// decodeMessage: tinybroker.v1.Message, merged into d.msg.
func decodeMessage(b []byte, d *inDelivery) error {
	m := &d.msg
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.BytesType && num <= 7 && num != 4 && num != 8 {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			var err error
			switch num {
			case 1:
				m.Topic, err = aliasString(v)
			case 2:
				m.Payload = v[:len(v):len(v)]
			case 3:
				err = decodeHeader(v, m)
			case 5:
				err = decodeTimestamp(v, d)
			case 6:
				m.SubscriptionID, err = aliasString(v)
			case 7:
				m.Group, err = aliasString(v)
			}
			if err != nil {
				return err
			}
			continue
		}
		if typ == protowire.VarintType && (num == 4 || num == 8) {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			if num == 4 {
				m.Sequence = v
			} else {
				m.DeliveryAttempt = uint32(v)
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
	}
	if d.hasTS {
		m.PublishTime = time.Unix(d.secs, int64(d.nanos)).UTC()
	}
	return nil
}

// decodeHeader: one map<string, string> entry {key = 1, value = 2}.
func decodeHeader(b []byte, m *Message) error {
	var key, val string
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if (num == 1 || num == 2) && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			s, err := aliasString(v)
			if err != nil {
				return err
			}
			if num == 1 {
				key = s
			} else {
				val = s
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
	}
	if m.Headers == nil {
		m.Headers = make(map[string]string, 2)
	}
	m.Headers[key] = val
	return nil
}

// decodeTimestamp: google.protobuf.Timestamp{int64 seconds = 1; int32 nanos = 2}.
func decodeTimestamp(b []byte, d *inDelivery) error {
	d.hasTS = true
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if (num == 1 || num == 2) && typ == protowire.VarintType {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			if num == 1 {
				d.secs = int64(v)
			} else {
				d.nanos = int32(v)
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
	}
	return nil
}

// consumeTag is protowire.ConsumeTag, and field numbers above the largest
// valid one are an error (as proto.Unmarshal has them).
func consumeTag(b []byte) (protowire.Number, protowire.Type, int) {
	num, typ, n := protowire.ConsumeTag(b)
	if n >= 0 && num > protowire.MaxValidNumber {
		return 0, 0, -1
	}
	return num, typ, n
}
