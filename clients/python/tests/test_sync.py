"""The blocking facade: the same client on a loop of its own."""

import threading

import pytest

import tinybroker
import tinybroker.sync


def test_blocking_facade_subscribes_publishes_acks_and_iterates(broker):
    with tinybroker.sync.connect(broker.addr) as client:
        sub = client.subscribe("jobs.>", group="w", ack_mode="manual", ack_deadline=30)
        results = [client.publish_confirmed("jobs.a", f"{i}") for i in range(3)]
        assert [r.sequence for r in results] == sorted(r.sequence for r in results)
        got = []
        for msg in sub:
            got.append(msg.payload)
            if msg.payload == b"1" and msg.delivery_attempt == 1:
                assert msg.nack()
                continue
            assert msg.ack()
            if len(got) == 4:
                break
        assert sorted(got) == [b"0", b"1", b"1", b"2"]
        assert client.admin.groups()[0].in_flight == 0

        # Two other threads publish through the same client's buffer.
        threads = [threading.Thread(target=lambda: [client.publish("jobs.b", b"x") for _ in range(25)])
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert client.flush(timeout=10).accepted == 50
        for _ in range(50):
            sub.next(timeout=5).ack()
        with pytest.raises(TimeoutError):
            sub.next(timeout=0.2)
        sub.close()
        with pytest.raises(StopIteration):
            next(sub)
        with pytest.raises(tinybroker.TinybrokerError):
            client.publish_confirmed("bad topic", b"")
