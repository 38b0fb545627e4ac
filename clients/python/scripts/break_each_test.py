"""Breaks the client once for each test and checks that the test fails
(a mutation check, run by hand: python scripts/break_each_test.py, with
TINYBROKER_BIN set). Each break is applied to the source tree, the test
run, and the file restored."""
import subprocess, sys, os
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = "tinybroker/"
breaks = [
 ("round trip: publish drops the headers", T+"client.py",
  "        request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload), headers=headers)\n        try:",
  "        request = pb.PublishRequest(topic=topic, payload=_as_bytes(payload))\n        try:", "test_round_trip.py::test_round_trip_delivers_payload_headers_and_sequence"),
 ("publisher: the stream's error is swallowed at flush", T+"publisher.py",
  "                raise PublishError(e.code(), e.details() or \"\", accepted=self._written) from None", "                return PublishStreamResult(self._written, 0, 0)",
  "test_round_trip.py::test_publisher_streams_with_counts_and_first_error_typed"),
 ("address list: only the first address is used", T+"_connection.py",
  "        targets.append(Target(item, tls))", "        targets.append(Target(item, tls)); break",
  "test_round_trip.py::test_address_list_is_tried_in_turn_and_env_defaults_apply"),
 ("groups: nack sent as an ack", T+"session.py",
  "request = pb.SessionRequest(nack=pb.SessionNack(", "request = pb.SessionRequest(ack=pb.SessionAck(",
  "test_groups.py"),
 ("credit isolation: credit never given back", T+"session.py",
  "            if self._taken >= self._batch:", "            if False:",
  "test_flow_control.py::test_unread_subscription_is_evicted_alone_and_its_sibling_keeps_receiving"),
 ("credit isolation: subscriptions opened without a credit limit", T+"session.py",
  "subscription=sub._request, credit=credit)", "subscription=sub._request, credit=0)",
  "test_flow_control.py::test_unread_subscription_is_evicted_alone_and_its_sibling_keeps_receiving"),
 ("eviction gap: no Gap reported after re-subscribing", T+"session.py",
  "            self._resuming = event\n            self._schedule_retry(None)", "            self._schedule_retry(None)",
  "test_flow_control.py::test_eviction_is_reported_with_its_gap_then_resubscribed"),
 ("restart: subscriptions dropped when the session is lost", T+"session.py",
  "            if not sub._on_lost(failure, starting):", "            if sub._on_lost(failure, starting) or True:",
  "test_reconnect.py::test_every_subscription_is_back_after_the_broker_is_killed_and_restarted"),
 ("restart: no session started again after the first", T+"session.py",
  "            if not any(s._state == _WAITING for s in self._subs.values()):", "            if self._started or not any(s._state == _WAITING for s in self._subs.values()):",
  "test_reconnect.py::test_every_subscription_is_back_after_the_broker_is_killed_and_restarted"),
 ("shutdown: a shutdown end is not re-subscribed", T+"session.py",
  'again = self.resubscribe and reason != "closed_by_admin"', 'again = self.resubscribe and reason not in ("closed_by_admin", "shutdown")',
  "test_reconnect.py::test_subscriptions_come_back_after_a_graceful_shutdown_and_restart"),
 ("resubscribe off: the flag is ignored on a lost connection", T+"session.py",
  "        retry = self.resubscribe and failure.code in _RETRYABLE", "        retry = failure.code in _RETRYABLE",
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
  "        return self._sub._sync_loop.run(_AsyncMessage.ack(self))  # type: ignore[attr-defined]", "        return True",
  "test_sync.py"),
 ("cluster: no failover to the next address", T+"_connection.py",
  "        if len(self.targets) < 2:\n            return\n        old", "        if True:\n            return\n        old",
  "test_cluster.py::test_client_moves_to_the_other_replica_when_its_own_is_stopped"),
 ("cluster: an UNAVAILABLE open does not move to the next address", T+"session.py",
  "            if moving:\n                await self._conn.failover()", "            pass",
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
