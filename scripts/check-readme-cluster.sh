#!/usr/bin/env bash
# Runs README's "Trying it on one machine" block as written: the shell lines
# between `<!-- recipe: local-cluster -->` and the end of the code fence
# after it, with `tinybroker` and a nats-server >= 2.10 first on PATH, in a
# temporary directory. Passes when the subscriber on one replica printed the
# message published on the other; every process it started is stopped.
#   TINYBROKER_BIN  the binary (default target/debug/tinybroker)
#   TB_NATS_SERVER  nats-server >= 2.10 (default: scripts/install-nats.sh's)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${TINYBROKER_BIN:-target/debug/tinybroker}")
nats=${TB_NATS_SERVER:-$(bash scripts/install-nats.sh | tail -n1)}
[ -x "$bin" ] || { echo "no tinybroker binary at $bin (cargo build first)" >&2; exit 1; }
work=$(mktemp -d)
mkdir -p "$work/bin"
ln -s "$bin" "$work/bin/tinybroker"
ln -s "$(realpath "$nats")" "$work/bin/nats-server"
recipe=$(awk '/<!-- recipe: local-cluster -->/ {on=1; next}
              on && /^```sh/ {inside=1; next}
              inside && /^```/ {exit}
              inside {print}' README.md)
[ -n "$recipe" ] || { echo "README.md has no local-cluster recipe" >&2; exit 1; }
printf '%s\n' "$recipe" > "$work/recipe.sh"
echo "--- README's recipe:"; cat "$work/recipe.sh"; echo "---"
status=0
cd "$work"
# setsid: the recipe and what it starts in the background are one process
# group, stopped as one when it is done (or after 60 s).
PATH="$work/bin:$PATH" RUST_LOG=warn setsid bash -e recipe.sh > out.txt 2> err.txt &
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
    echo "the recipe failed (exit $status)" >&2
    exit 1
fi
if ! grep -qx 'hello from r1' "$work/received.txt"; then
    echo "the subscriber on r2 did not print the message published on r1" >&2
    exit 1
fi
rm -rf "$work"
echo "README's local cluster recipe: ok"
