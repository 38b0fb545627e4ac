#!/usr/bin/env bash
# Side-by-side benchmark of tinybroker against NATS core and Redis pub/sub
# (issue 6). On a fresh Debian 12 machine, as root: installs nats-server and
# redis-server with apt when missing, builds the release binaries, and runs
# tinybroker-bench, which starts each server itself on 127.0.0.1 and prints
# one Markdown table. Every argument goes to tinybroker-bench, e.g.
#
#   bash scripts/bench.sh                      # the full run (3 rounds, 500k messages)
#   bash scripts/bench.sh --quick              # the tiny CI configuration
#   bash scripts/bench.sh --only fanout-3-256 --rounds 5 --out /tmp/table.md
#   bash scripts/bench.sh --help
#
# Exits non-zero when a tinybroker run loses a message its contract says must
# arrive, or when a run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v nats-server >/dev/null 2>&1 || missing+=(nats-server)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "bench.sh: ${missing[*]} missing; install as root: apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "bench.sh: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# BENCH_PROFILE=dev runs the debug build instead (CI's smoke run checks that no
# message is lost, not speed, and reuses the test build); figures worth
# reading come only from the release build.
if [[ ${BENCH_PROFILE:-release} == dev ]]; then
    cargo build --locked -p tinybroker -p tinybroker-bench
    exec target/debug/tinybroker-bench --tinybroker-bin target/debug/tinybroker "$@"
fi
cargo build --release --locked -p tinybroker -p tinybroker-bench
exec target/release/tinybroker-bench --tinybroker-bin target/release/tinybroker "$@"
