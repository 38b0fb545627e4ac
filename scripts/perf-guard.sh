#!/usr/bin/env bash
# The performance guard (issue 37): instructions per message (callgrind),
# syscalls and context switches per message (perf stat), and bytes per idle
# subscription (Sessions and OpenSubscription), for the paths that matter
# (one in cluster mode, over nats-server 2.10: $TB_NATS_SERVER or
# scripts/install-nats.sh's; skipped, saying so, without it), against the baseline in
# bench/perf-baseline.txt. Fails when a figure rises past its threshold
# (instructions: 2 %). On a fresh Debian 12 machine, as root, it installs
# valgrind and perf with apt when missing, builds the release binaries and
# runs `tinybroker-bench --guard`; every argument goes to it, e.g.
#
#   bash scripts/perf-guard.sh                                # compare with the baseline
#   bash scripts/perf-guard.sh --only fanout                  # some workloads only
#   bash scripts/perf-guard.sh --write-baseline "why"         # a change that costs more on purpose
#   bash scripts/perf-guard.sh --inflate-instructions 0.03    # show that a 3 % rise fails
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
perf stat -e context-switches true >/dev/null 2>&1 || missing+=(linux-perf)
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "perf-guard.sh: ${missing[*]} missing; install as root: apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "perf-guard.sh: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
perf stat -e 'raw_syscalls:sys_enter,context-switches' true >/dev/null 2>&1 || {
    echo "perf-guard.sh: perf cannot count syscalls here (perf_event_paranoid $(cat /proc/sys/kernel/perf_event_paranoid), not root?)" >&2
    exit 1
}

cargo build --release --locked -p tinybroker -p tinybroker-bench
exec target/release/tinybroker-bench --guard --tinybroker-bin target/release/tinybroker "$@"
