#!/usr/bin/env bash
# Side-by-side benchmark of tinybroker against NATS core and Redis pub/sub
# (issue 6), and of tinybroker's cluster mode against a NATS cluster (issue
# 15). On a fresh Debian 12 machine, as root: installs nats-server and
# redis-server with apt when missing (and nats-server 2.10 with
# scripts/install-nats.sh), builds the release binaries, and runs
# tinybroker-bench, which starts each server itself on 127.0.0.1 and prints
# one Markdown table. Every argument goes to tinybroker-bench, e.g.
#
#   bash scripts/bench.sh                      # the full run (3 rounds, 500k messages)
#   bash scripts/bench.sh --quick              # the tiny CI configuration
#   bash scripts/bench.sh --only fanout-3-256 --rounds 5 --out /tmp/table.md
#   bash scripts/bench.sh --only cluster --skip-redis --rounds 3   # cluster mode
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

# The cluster workloads (issue 15) need nats-server 2.10 or later beside
# Debian 12's 2.9: scripts/install-nats.sh puts Debian 13's next to it. When
# that cannot be done, tinybroker-bench skips them and says why.
if [[ -z ${TB_NATS_SERVER:-} && ! -x /usr/local/lib/tinybroker/nats-server-2.10/nats-server && $(id -u) -eq 0 ]]; then
    echo "bench.sh: installing nats-server 2.10 for the cluster workloads" >&2
    if TB_NATS_SERVER=$(bash scripts/install-nats.sh | tail -n1); then
        export TB_NATS_SERVER
    else
        echo "bench.sh: no nats-server 2.10; the cluster workloads will be skipped" >&2
    fi
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
