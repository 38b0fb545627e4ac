#!/usr/bin/env bash
# Runs one of README's recipes as written: the shell lines between
# `<!-- recipe: NAME -->` and the end of the code fence after it, in a
# temporary directory, with `tinybroker` (TINYBROKER_BIN) and a nats-server
# >= 2.10 first on PATH, the repository's scripts/ beside it, and the
# broker's addresses on 127.0.0.1 (the recipe's own settings come after and
# win). Passes when the recipe exits 0 within 60 s and FILE (relative to
# that directory; `out.txt` is the recipe's stdout) has the line LINE;
# every process it started is stopped.
#
#   bash scripts/check-readme-recipe.sh quick-start out.txt 'hello, tinybroker'
#   bash scripts/check-readme-recipe.sh local-cluster received.txt 'hello from r1'
#
#   TINYBROKER_BIN  the binary (default target/debug/tinybroker)
#   TB_NATS_SERVER  nats-server >= 2.10 (default: scripts/install-nats.sh's)
#
# Stand-ins on PATH, so that the block runs as a reader copies it: `cargo`
# does nothing (the binary is TINYBROKER_BIN, already built) and `sudo` runs
# its command (CI is root and may have no sudo).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 RECIPE FILE LINE" >&2; exit 2; }
name=$1 expected_file=$2 expected_line=$3
cd "$(dirname "$0")/.."
bin=$(realpath "${TINYBROKER_BIN:-target/debug/tinybroker}")
nats=${TB_NATS_SERVER:-$(bash scripts/install-nats.sh | tail -n1)}
[ -x "$bin" ] || { echo "no tinybroker binary at $bin (cargo build first)" >&2; exit 1; }
work=$(mktemp -d)
mkdir -p "$work/bin"
ln -s "$bin" "$work/bin/tinybroker"
ln -s "$(realpath "$nats")" "$work/bin/nats-server"
ln -s "$PWD/scripts" "$work/scripts"
printf '#!/bin/sh\nexit 0\n' > "$work/bin/cargo"
printf '#!/bin/sh\nexec "$@"\n' > "$work/bin/sudo"
chmod +x "$work/bin/cargo" "$work/bin/sudo"
recipe=$(awk -v name="$name" '$0 == "<!-- recipe: " name " -->" {on=1; next}
              on && /^```sh/ {inside=1; next}
              inside && /^```/ {exit}
              inside {print}' README.md)
[ -n "$recipe" ] || { echo "README.md has no recipe $name" >&2; exit 1; }
printf '%s\n' "$recipe" > "$work/recipe.sh"
echo "--- README's recipe $name:"; cat "$work/recipe.sh"; echo "---"
status=0
cd "$work"
# setsid: the recipe and what it starts in the background are one process
# group, stopped as one when it is done (or after 60 s).
env -u TINYBROKER_BIN PATH="$work/bin:$PATH" RUST_LOG=warn \
    TINYBROKER_GRPC_ADDR=127.0.0.1:50051 TINYBROKER_METRICS_ADDR=127.0.0.1:9090 \
    TB_NATS_SERVER="$nats" \
    setsid bash -e recipe.sh > out.txt 2> err.txt &
pid=$!
for _ in $(seq 600); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
    status=124
else
    wait "$pid" || status=$?
fi
kill -TERM -- "-$pid" 2>/dev/null || true
sleep 0.5
kill -KILL -- "-$pid" 2>/dev/null || true
cd - > /dev/null
echo "--- its output:"; cat "$work/out.txt"
echo "--- its stderr (last 20 lines):"; tail -n 20 "$work/err.txt"
if [ "$status" -ne 0 ]; then
    echo "the recipe $name failed (exit $status)" >&2
    exit 1
fi
if ! grep -qxF -- "$expected_line" "$work/$expected_file"; then
    echo "the recipe $name did not write the line '$expected_line' to $expected_file" >&2
    exit 1
fi
rm -rf "$work"
echo "README's recipe $name: ok"
