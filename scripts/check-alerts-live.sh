#!/usr/bin/env bash
# The shipped alerts and dashboard against live situations (issue 17), on a
# fresh Debian 12 machine as root: installs Debian's prometheus package when
# the server is missing, then runs tests/monitoring/, which starts the
# broker binary and a Prometheus (127.0.0.1 only, 1 s scrape and rule
# evaluation, deploy/monitoring/alerts.yaml loaded), creates at the same time
# an evicted slow subscriber, a queue that fills and drains between scrapes,
# MANUAL groups whose member never acks (1 h and 2 s ack deadlines), a busy
# MANUAL group of three whose one member never acks while the others do (10 s
# ack deadline), a memberless group with a growing backlog and groups removed
# by their idle TTL, and asserts through the Prometheus API that each alert
# fires within its promise, naming the subscriber, member or group, that no
# other fires (not for the acking members), and that every dashboard panel
# shows what it is for. It prints how long each took; about 70 s, bounded by
# the test's own 300 s timeout. Then the cluster session: two replicas over
# a nats-server (TB_NATS_SERVER, as .ci/run sets it), one Prometheus
# scraping both, known counts made across them, and every consumer-group
# panel and group rule must add the replicas up to those counts, and the
# hung-member rule must name a member hung on one replica while its group
# acks on the other, once (about 40 s). One after the other: the first session's timings are its promises.
#
# The same rules at the chart's 30 s scrape interval: promtool test rules
# deploy/monitoring/alerts_test.yaml (scripts/check-prometheus.sh runs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v prometheus >/dev/null 2>&1; then
    echo "installing prometheus with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    fi
    hash -r
fi
echo "== $(prometheus --version 2>&1 | head -n 1)"
started=$SECONDS
cargo test --locked --test monitoring -- --ignored --nocapture --test-threads=1
echo "live alert checks took $((SECONDS - started))s"
