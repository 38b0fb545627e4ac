#!/usr/bin/env bash
# Checks the wire contract in proto/ the way well-kept gRPC projects do (the
# public tinybroker.v1, and tinybroker.cluster.v1, what replicas exchange):
#   1. installs the buf CLI (npm package @bufbuild/buf, the version pinned in
#      scripts/buf/package-lock.json) into target/buf, unless it is there;
#   2. `buf lint` with the STANDARD rules, the exceptions written down in
#      buf.yaml with their reasons;
#   3. `buf breaking` (FILE rules): the proto of the working tree against the
#      proto of the last commit on main. On a branch that is the merge-base
#      with main; on main itself (as in CI, which runs on a fresh clone of
#      main) it is HEAD's first parent, the main the merge was made onto.
#      PROTO_BASELINE=<commit> compares against another commit.
# One line per check; the output of a failing one is shown. Exits non-zero
# when any check fails. Run from anywhere; works on the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."

tools=target/buf
export BUF_CACHE_DIR="$PWD/$tools/cache"
failed=0
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
fail() {
    # The check's own output first, then its one line.
    [ -s "$2" ] && sed 's/^/    /' "$2"
    echo "check-proto: FAILED: $1"
    failed=1
}

# --- 1. the buf CLI --------------------------------------------------------
start=$(now)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
buf="$tools/node_modules/@bufbuild/buf-linux-x64/bin/buf"
[ "$(uname -m)" = x86_64 ] || buf="$tools/node_modules/.bin/buf"
if [ -x "$buf" ] && cmp -s scripts/buf/package-lock.json "$tools/package-lock.json"; then
    echo "check-proto: buf $("$buf" --version) already installed in $tools ($(took "$start"))"
else
    if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -q && apt-get install -y -q nodejs npm; } >"$log" 2>&1
    fi
    mkdir -p "$tools"
    cp scripts/buf/package.json scripts/buf/package-lock.json "$tools/"
    # --ignore-scripts: the package's postinstall only relinks its launcher;
    # the binary comes in its platform package.
    if (cd "$tools" && npm ci --ignore-scripts --no-audit --no-fund) >>"$log" 2>&1 && [ -x "$buf" ]; then
        echo "check-proto: buf $("$buf" --version) installed in $tools with npm ci ($(took "$start"))"
    else
        rm -f "$tools/package-lock.json"
        fail "installing @bufbuild/buf with npm ci in $tools (needs Node.js and npm)" "$log"
        exit 1
    fi
fi

# --- 2. buf lint -----------------------------------------------------------
start=$(now)
if "$buf" lint >"$log" 2>&1; then
    echo "check-proto: buf lint (STANDARD, exceptions in buf.yaml): ok ($(took "$start"))"
else
    fail "buf lint (STANDARD): fix the names above, or write the exception and its reason in buf.yaml" "$log"
fi

# --- 3. buf breaking -------------------------------------------------------
start=$(now)
# The commit whose proto is the contract clients rely on now.
baseline() {
    if [ -n "${PROTO_BASELINE:-}" ]; then
        git rev-parse --verify --quiet "${PROTO_BASELINE}^{commit}" && echo "PROTO_BASELINE=$PROTO_BASELINE"
        return
    fi
    local main="" head=""
    head=$(git rev-parse --verify --quiet HEAD) || return
    for ref in refs/heads/main refs/remotes/origin/main; do
        main=$(git rev-parse --verify --quiet "$ref") && break
    done
    if [ -n "$main" ] && [ "$main" != "$head" ]; then
        git merge-base "$head" "$main" && echo "the merge-base with main"
    else
        git rev-parse --verify --quiet "HEAD^1" && echo "HEAD^1, main before its last commit"
    fi
}
found=$(baseline)
if [ -z "$found" ] && [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then
    # A shallow clone lacks the parent: fetch one more commit, if origin answers.
    GIT_TERMINAL_PROMPT=0 timeout 60 git fetch --quiet --deepen=1 >"$log" 2>&1
    found=$(baseline)
fi
base=$(sed -n 1p <<<"$found")
what=$(sed -n 2p <<<"$found")
if [ -z "$base" ]; then
    shallow=$(git rev-parse --is-shallow-repository 2>/dev/null || echo "not a git repository")
    echo "check-proto: WARNING: buf breaking SKIPPED: no previous commit to compare with (shallow clone: $shallow); lint still ran"
    echo "check-proto: WARNING: a wire-incompatible change would NOT be caught by this run"
elif ! git cat-file -e "$base:proto" 2>/dev/null; then
    echo "check-proto: WARNING: buf breaking SKIPPED: ${base:0:12} ($what) has no proto/ directory to compare with"
else
    against=$(mktemp -d "$PWD/$tools/baseline.XXXXXX")
    trap 'rm -f "$log"; rm -rf "$against"' EXIT
    # The baseline's proto/ with today's buf.yaml, so both sides are laid out
    # as one module the same way (the baseline may predate buf.yaml).
    git archive "$base" proto | tar -x -C "$against"
    cp buf.yaml "$against/"
    if "$buf" breaking --against "$against" >"$log" 2>&1; then
        echo "check-proto: buf breaking (FILE) against ${base:0:12} ($what): ok ($(took "$start"))"
    else
        fail "buf breaking (FILE) against ${base:0:12} ($what): a change above breaks clients of the contract (tinybroker.v1) or replicas of the previous version in a rolling update (tinybroker.cluster.v1); add fields and RPCs instead of renaming, renumbering, retyping or removing" "$log"
    fi
fi

exit "$failed"
