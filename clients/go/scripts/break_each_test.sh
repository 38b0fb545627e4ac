#!/usr/bin/env bash
# Breaks the client once per scenario (one edit each), runs that scenario
# and expects it to FAIL; the source is restored after each. Prints one
# line per scenario: CAUGHT (the test failed) or MISSED.
#   TINYBROKER_BIN=... TB_NATS_SERVER=... scripts/break_each_test.sh [name...]
set -u
cd "$(dirname "$0")/.."
run() { # name file perl-substitution
	local name=$1 file=$2 expr=$3
	if [ $# -gt 0 ] && [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
	cp "$file" "/tmp/break.$$.bak"
	perl -0pi -e "$expr" "$file"
	if cmp -s "$file" "/tmp/break.$$.bak"; then
		echo "NOEDIT  $name (the edit did not apply)"
	elif go test -count=1 -timeout 120s -run "TestScenarios/^${name}\$" . >"/tmp/break.$$.log" 2>&1; then
		echo "MISSED  $name"
	else
		echo "CAUGHT  $name: $(grep -m1 -E 'scenarios_test.go:[0-9]+|panic|build failed' "/tmp/break.$$.log" | sed 's/^ *//' | cut -c1-110)"
	fi
	cp "/tmp/break.$$.bak" "$file"
}
ONLY="$*"
run publish_returns_at_once_and_flush_reports publish.go 's/\tif kick \{\n\t\tc.wake\(\)\n\t\}\n\treturn nil/\tif kick {\n\t\tc.wake()\n\t}\n\tif _, err := c.Flush(ctx); err != nil {\n\t\treturn err\n\t}\n\treturn nil/'
run flush_reports_each_rejection publish.go 's/topic = b.topics\[r.index\]/topic = ""/'
run publish_waits_when_the_buffer_is_full publish.go 's/for p.pendBytes >= p.limit && !p.closed/for false \&\& p.pendBytes >= p.limit/'
run publishers_share_one_clients_batches publish.go 's/if len\(b.topics\) >= c.batchMessages \|\|/if true ||/'
run buffered_publishes_go_out_after_a_restart session.go 's/(\tfor sub := range s.subs \{\n\t\ts.tryOpen\(sub\)\n\t\}\n)(\tc.pub.write\(s.send, s.nextBatchID\)\n)/$2$1/'
run unanswered_batches_are_unconfirmed publish.go 's/\t\tp.addUnconfirmed\(b.first, b.count\(\)\)\n\t\}\n\tlast/\t\t_ = b\n\t}\n\tlast/'
run deliveries_come_in_batches session.go 's/"tinybroker-batch", "1"/"tinybroker-batched", "1"/'
run acks_are_coalesced subscription.go 's/\t\t\tss.c.acksSent.Add\(1\)\n(\t\t\tss.send.*?)Sequences: acks\}/\t\t\tfor _, a := range acks {\n\t\t\tss.c.acksSent.Add(1)\n$1Sequences: []uint64{a}}/s; s/(Sequences: \[\]uint64\{a\}\}\}\}\)\))/$1\n\t\t\t}/'
run window_holds_through_evictions session.go 's/if held >= sub.window \{\n\t\treturn/if false {\n\t\treturn/'
run gap_is_a_range_on_one_instance subscription.go 's/g.Known, g.First, g.Last = true, last\+1, first-1/g.Reason = "nothing_before"/'
run gap_is_unknown_across_a_restart subscription.go 's/case s.lastInst != ss.instKey:/case false:/'
run back_within_half_a_second_of_a_restart client.go 's/bc := backoff.Config\{[^}]*\}/bc := backoff.DefaultConfig/'
run connection_events_once_per_connection subscription.go 's/(func \(s \*Subscription\) onLost\(\) \{\n)/$1\ts.c.emit(ConnectionEvent{Kind: Disconnected, Reason: "lost"})\n/'
run stats_count_what_went_in_and_out publish.go 's/p.c.bytesOut.Add\(b.payload\)/p.c.bytesOut.Add(uint64(b.nbytes))/'
run closed_means_closed client.go 's/\t\t_ = conn.Close\(\)\n\t\tc.wg.Wait\(\)/\t\t_ = conn\n\t\tc.wg.Wait()/'
run one_next_at_a_time subscription.go 's/\tif s.nexting \{/\tif false \&\& s.nexting {/'
run status_ok_end_is_not_an_error session.go 's/(\tcase err == io.EOF:\n)/$1\t\tfor sub := range s.subs {\n\t\t\tsub.finish(\&SubscriptionEndedError{Reason: "OK", Code: codes.OK, Message: "OK"}, nil)\n\t\t}\n/'
run publish_error_counts_what_the_broker_accepted errors.go 's/\(\?:earlier \)\?messages/messages/'
run cluster_subscriptions_survive_a_replica session.go 's/\t\t\tif len\(c.targets\) > 1 \{\n\t\t\t\tc.failover\(\)\n\t\t\t\}\n//'
rm -f "/tmp/break.$$.bak" "/tmp/break.$$.log"
