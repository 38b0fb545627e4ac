"""Breaks the client once for each test and checks that the test fails
(a mutation check, run by hand: python scripts/break_each_test.py, with
TINYBROKER_BIN set). Each break is applied to the source tree, the test
run, and the file restored."""
import subprocess, sys, os
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = "tinybroker/"
breaks = [
 ("round trip: publish_confirmed drops the headers", T+"client.py",
  "request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload), headers=self._headers(headers))",
  "request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload))",
  "test_round_trip.py::test_round_trip_delivers_payload_headers_and_sequence"),
 ("publisher: the stream's error is swallowed at its end", T+"publisher.py",
  "                raise PublishError.from_stream_error(e.code(), e.details() or \"\") from None",
  "                return PublishStreamResult(0, 0, 0)",
  "test_round_trip.py::test_publisher_streams_with_counts_and_first_error_typed"),
 ("publisher: accepted counted by the client again", T+"errors.py",
  "return cls(code, details, int(m.group(1)) if m else None)", "return cls(code, details, None)",
  "test_scenarios.py::test_publish_error_counts_what_the_broker_accepted"),
 ("address list: only the first address is used", T+"_connection.py",
  "        targets.append(Target(item, tls))", "        targets.append(Target(item, tls)); break",
  "test_round_trip.py::test_address_list_is_tried_in_turn_and_env_defaults_apply"),
 ("groups: nack sent as an ack", T+"session.py",
  "requests.put(pb.SessionRequest(nack=pb.SessionNack(", "requests.put(pb.SessionRequest(ack=pb.SessionAck(",
  "test_groups.py"),
 ("acks: one SessionAck per ack", T+"session.py",
  "        (self._nacks if nack else self._acks).append(message.raw.sequence)\n        self._session.mark_dirty(self)",
  "        (self._nacks if nack else self._acks).append(message.raw.sequence)\n        self._session.mark_dirty(self)\n        self._session._pump()",
  "test_scenarios.py::test_acks_are_coalesced"),
 ("credit isolation: credit never given back", T+"session.py",
  "            if self._taken >= self._top_up:\n                self._session.send(", "            if False:\n                self._session.send(",
  "test_flow_control.py::test_unread_subscription_is_evicted_alone_and_its_sibling_keeps_receiving"),
 ("credit isolation: subscriptions opened without a credit limit", T+"session.py",
  "subscription=sub._request, credit=sub.window - held)", "subscription=sub._request, credit=0)",
  "test_flow_control.py::test_unread_subscription_is_evicted_alone_and_its_sibling_keeps_receiving"),
 ("window: opened again with a full window (the old max(1, ...))", T+"session.py",
  "        if held >= sub.window:\n            return", "        if False:\n            return",
  "test_scenarios.py::test_window_holds_through_evictions"),
 ("gap: a range across a restart", T+"session.py",
  "        elif self._last_instance is not session._instance_key:\n            reason = \"instance_changed\"\n",
  "",
  "test_scenarios.py::test_gap_is_unknown_across_a_restart"),
 ("gap: no range on one instance", T+"session.py",
  "            missed = (last + 1, first - 1)", "            reason = \"sequence_scope\"",
  "test_scenarios.py::test_gap_is_a_range_on_one_instance"),
 ("restart: subscriptions not opened on the next session", T+"session.py",
  "        for sub in list(self._subs):\n            self.try_open(sub)\n", "",
  "test_reconnect.py::test_every_subscription_is_back_after_the_broker_is_killed_and_restarted"),
 ("restart: the buffer is not written on the next session", T+"session.py",
  "            self.try_open(sub)\n        self._seal()\n        self._write_batches()", "            self.try_open(sub)",
  "test_scenarios.py::test_buffered_publishes_go_out_after_a_restart"),
 ("restart: unanswered batches written again", T+"session.py",
  "            for _, batch in self._in_flight:\n                self._unconfirmed_range(batch.first, batch.count)",
  "            for _, batch in self._in_flight:\n                self._sealed.appendleft(batch)",
  "test_scenarios.py::test_unanswered_batches_are_unconfirmed"),
 ("restart: grpc's default reconnect backoff", T+"_connection.py",
  '("grpc.max_reconnect_backoff_ms", 250)', '("grpc.max_reconnect_backoff_ms", 120000)',
  "test_scenarios.py::test_back_within_half_a_second_of_a_restart"),
 ("events: one disconnected per subscription", T+"session.py",
  "        for sub in handles.values():\n            sub._on_lost()",
  "        for sub in handles.values():\n            sub._on_lost()\n            self.emit(Disconnected(reason))",
  "test_scenarios.py::test_connection_events_once_per_connection"),
 ("buffer: publish never waits", T+"client.py",
  "        if session.pending_bytes >= session.buffer_bytes:\n            await session.wait_room()", "",
  "test_scenarios.py::test_publish_waits_when_the_buffer_is_full"),
 ("buffer: one message per batch", T+"session.py",
  "        if len(parts) >= self.batch_messages or", "        if True or",
  "test_scenarios.py::test_publishers_share_one_clients_batches"),
 ("flush: rejections not reported", T+"session.py",
  "            self._rejected.append(\n                Rejection(batch.first + r.index,", "            (\n                Rejection(batch.first + r.index,",
  "test_scenarios.py::test_flush_reports_each_rejection"),
 ("stats: bytes in not counted", T+"session.py", "                self.bytes_in += nbytes", "",
  "test_scenarios.py::test_stats_count_what_went_in_and_out"),
 ("next: a second next() not refused", T+"session.py",
  "        if self._nexting or self._thread_waiter is not None:", "        if False:",
  "test_scenarios.py::test_one_next_at_a_time"),
 ("close: publish() after close() goes on", T+"client.py",
  "        if session is None or self._closed:\n            session = self._session_or_raise()",
  "        if session is None:\n            session = self._session_or_raise()",
  "test_scenarios.py::test_closed_means_closed"),
 ("status OK: a session that ends (OK) before a first open fails its subscriptions", T+"session.py",
  "        final = starting and failure.code in _FINAL_START_CODES",
  "        final = True",
  "test_scenarios.py::test_status_ok_end_is_not_an_error"),
 ("shutdown: a shutdown end is not re-subscribed", T+"session.py",
  'again = self.resubscribe and reason != "closed_by_admin"', 'again = self.resubscribe and reason not in ("closed_by_admin", "shutdown")',
  "test_reconnect.py::test_subscriptions_come_back_after_a_graceful_shutdown_and_restart"),
 ("resubscribe off: the flag is ignored", T+"session.py",
  'again = self.resubscribe and reason != "closed_by_admin"', 'again = reason != "closed_by_admin"',
  "test_reconnect.py::test_resubscription_can_be_turned_off"),
 ("admin: a subscription closed by an admin comes back", T+"session.py",
  'again = self.resubscribe and reason != "closed_by_admin"', 'again = self.resubscribe',
  "test_admin.py"),
 ("token: the authorization header is not sent", T+"_connection.py",
  '(("authorization", f"Bearer {token}"),) if token else None', 'None',
  "test_security.py::test_token_good_bad_and_from_env"),
 ("TLS: the CA file is not used", T+"_connection.py",
  "root_certificates=self._root_certificates)", "root_certificates=None)",
  "test_security.py::test_tls_with_a_ca_file"),
 ("sync facade: ack() does nothing", T+"sync.py",
  "        sub._sync_loop.post(sub._settle, self, nack)  # type: ignore[attr-defined]", "",
  "test_sync.py"),
 ("cluster: no failover to the next address", T+"_connection.py",
  "        if len(self.targets) < 2:\n            return\n        old", "        if True:\n            return\n        old",
  "test_cluster.py::test_client_moves_to_the_other_replica_when_its_own_is_stopped"),
 ("cluster: an UNAVAILABLE open does not move to the next address", T+"session.py",
  "        if len(self._conn.targets) > 1:\n            self._move_on = error", "        pass",
  "test_cluster.py::test_a_replica_that_cannot_serve_is_passed_over_for_the_next_address"),
 ("tracing: nothing injected", T+"_tracing.py",
  "    _propagate.inject(carrier)", "    pass",
  "test_tracing.py"),
]
env = dict(os.environ)
only = os.environ.get("ONLY", "")
for name, path, old, new, test in breaks:
    if only not in name:
        continue
    full = os.path.join(ROOT, path)
    src = open(full).read()
    if src.count(old) != 1:
        print(f"!! {name}: pattern found {src.count(old)} times"); continue
    open(full, "w").write(src.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--timeout=60", "tests/" + test],
                           cwd=ROOT, capture_output=True, text=True, timeout=200)
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
        err = [l for l in r.stdout.splitlines() if l.startswith("E ")][:1]
        print(f"{'FAILS' if r.returncode else 'PASSES(!)'}  {name}  [{test}]  {last}  {err[0][:150] if err else ''}")
    finally:
        open(full, "w").write(src)
