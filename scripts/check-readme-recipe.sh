#!/usr/bin/env bash
# Runs one of README's recipes as written: the shell lines between
# `<!-- recipe: NAME -->` and the end of the code fence after it, in a
# temporary directory, with `tinybroker` (TINYBROKER_BIN) and a nats-server
# >= 2.10 first on PATH (not with --as: there the recipe must install its
# own), the repository's scripts/ beside it, and the broker's addresses on
# 127.0.0.1 (the recipe's own settings come after and win). Passes when the recipe exits 0 within 60 s and FILE (relative to
# that directory; `out.txt` is the recipe's stdout) has the line LINE;
# every process it started is stopped. Says how long the run took; when it
# fails, shows the end of each *.log the recipe wrote and keeps the
# directory.
#
#   bash scripts/check-readme-recipe.sh quick-start out.txt 'hello, tinybroker'
#   bash scripts/check-readme-recipe.sh local-cluster received.txt 'hello from r1'
#   bash scripts/check-readme-recipe.sh --as user-with-sudo local-cluster received.txt 'hello from r1'
#
#   --as WHO        who runs the recipe (both set up as root):
#     root-without-sudo  root, with no `sudo` anywhere on PATH (a container,
#                        a root shell): PATH is one directory of links to
#                        every command on this PATH but sudo, whether or not
#                        the machine has it
#     user-with-sudo     the user tbrecipe (created when missing), not root,
#                        with passwordless sudo (the sudo package installed
#                        when missing), in a directory it owns
#                   without --as: whoever runs this, with their PATH
#   TINYBROKER_BIN  the binary (default target/debug/tinybroker)
#   TB_NATS_SERVER  nats-server >= 2.10 (default: scripts/install-nats.sh's)
#
# A stand-in on PATH, so that the block runs as a reader copies it: `cargo`
# does nothing (the binary is TINYBROKER_BIN, already built). There is no
# stand-in `sudo`: the recipe must work with the machine's, or without one.
set -euo pipefail
usage() {
    echo "usage: $0 [--as root-without-sudo|user-with-sudo] RECIPE FILE LINE" >&2
    exit 2
}
as=""
if [ "${1:-}" = --as ]; then
    [ $# -ge 2 ] || usage
    as=$2
    shift 2
fi
case $as in "" | root-without-sudo | user-with-sudo) ;; *) usage ;; esac
[ $# -eq 3 ] || usage
name=$1 expected_file=$2 expected_line=$3
user=tbrecipe
cd "$(dirname "$0")/.."
bin=$(realpath "${TINYBROKER_BIN:-target/debug/tinybroker}")
nats=${TB_NATS_SERVER:-$(bash scripts/install-nats.sh | tail -n1)}
[ -x "$bin" ] || { echo "no tinybroker binary at $bin (cargo build first)" >&2; exit 1; }
if [ -n "$as" ] && [ "$(id -u)" != 0 ]; then
    echo "--as $as sets the run up as root; this is uid $(id -u)" >&2
    exit 2
fi
recipe=$(awk -v name="$name" '$0 == "<!-- recipe: " name " -->" {on=1; next}
              on && /^```sh/ {inside=1; next}
              inside && /^```/ {exit}
              inside {print}' README.md)
[ -n "$recipe" ] || { echo "README.md has no recipe $name" >&2; exit 1; }
work=$(mktemp -d)
mkdir -p "$work/bin"
printf '#!/bin/sh\nexit 0\n' > "$work/bin/cargo"
chmod +x "$work/bin/cargo"
printf '%s\n' "$recipe" > "$work/recipe.sh"
mkdir "$work/tmp" # TMPDIR: what the recipe makes with mktemp goes with the rest
path="$work/bin:$PATH"
run_as=()
case $as in
"")
    ln -s "$bin" "$work/bin/tinybroker"
    ln -s "$(realpath "$nats")" "$work/bin/nats-server"
    ln -s "$PWD/scripts" "$work/scripts"
    ;;
root-without-sudo)
    ln -s "$bin" "$work/bin/tinybroker"
    ln -s "$PWD/scripts" "$work/scripts"
    # Every command on PATH but sudo (and sudoedit), the first of each name.
    mkdir "$work/system-bin"
    links=()
    declare -A seen=([sudo]=1 [sudoedit]=1)
    IFS=: read -ra dirs <<< "$PATH"
    for dir in "${dirs[@]}"; do
        for cmd in "$dir"/*; do
            [ -f "$cmd" ] && [ -x "$cmd" ] && [ -z "${seen[${cmd##*/}]:-}" ] || continue
            seen[${cmd##*/}]=1
            links+=("$cmd")
        done
    done
    ln -s -t "$work/system-bin" "${links[@]}"
    path="$work/bin:$work/system-bin"
    if found=$(PATH=$path bash -c 'command -v sudo'); then
        echo "sudo is still on the recipe's PATH ($found)" >&2
        exit 1
    fi
    ;;
user-with-sudo)
    if ! command -v sudo > /dev/null; then
        echo "installing sudo (apt-get)"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sudo > /dev/null
    fi
    id -u "$user" > /dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
    if [ ! -f "/etc/sudoers.d/$user" ]; then
        printf '%s ALL=(ALL) NOPASSWD: ALL\n' "$user" > "/etc/sudoers.d/.$user"
        chmod 0440 "/etc/sudoers.d/.$user"
        visudo -cqf "/etc/sudoers.d/.$user"
        mv "/etc/sudoers.d/.$user" "/etc/sudoers.d/$user"
    fi
    # Copies, not links: the user may not read the paths they come from.
    cp "$bin" "$work/bin/tinybroker"
    cp -r scripts "$work/scripts"
    chown -R "$user:" "$work"
    run_as=(runuser -u "$user" --)
    [ "$("${run_as[@]}" id -u)" != 0 ] || { echo "$user is root" >&2; exit 1; }
    "${run_as[@]}" sudo -n true || { echo "$user has no passwordless sudo" >&2; exit 1; }
    ;;
esac
# The recipe's fixed ports (the addresses it names, and the broker's
# defaults set below) must be free when it starts. An outgoing connection
# the kernel gives one of them as its source port (the ephemeral range is
# 32768-60999, which holds 50051 and 50052) takes it from the recipe: CI
# failed once with r2's "cannot listen on TINYBROKER_GRPC_ADDR=
# 127.0.0.1:50052", most likely r1's own connection to NATS. As root the
# ports are reserved (net.ipv4.ip_local_reserved_ports) for the run, and the
# old value put back after; in any case a port still held by a socket that
# is not in TIME-WAIT is waited for (10 s), then named with its holder.
ports=$( (printf '%s\n' "$recipe" | grep -oE '(127\.0\.0\.1|localhost)?:[0-9]{4,5}\b' | grep -oE '[0-9]+$'
    echo 50051; echo 9090) | sort -un | paste -sd, -)
reserved_before=""
reserved_file=/proc/sys/net/ipv4/ip_local_reserved_ports
if [ "$(id -u)" = 0 ] && [ -w "$reserved_file" ]; then
    reserved_before=$(cat "$reserved_file")
    if echo "${reserved_before:+$reserved_before,}$ports" > "$reserved_file" 2> /dev/null; then
        trap 'echo "$reserved_before" > "$reserved_file"' EXIT
    else
        reserved_before=""
    fi
fi
port_holder() { # port_holder PORT: the sockets (not in TIME-WAIT) whose local port is PORT
    ss -Htanp state all "( sport = :$1 )" 2> /dev/null | grep -v '^TIME-WAIT' || true
}
for port in ${ports//,/ }; do
    for _ in $(seq 50); do
        [ -n "$(port_holder "$port")" ] || break
        sleep 0.2
    done
    if [ -n "$(port_holder "$port")" ]; then
        echo "README's recipe $name needs port $port on 127.0.0.1, and it is held:" >&2
        port_holder "$port" >&2
        exit 1
    fi
done
who=${as:-$(id -un)}
echo "--- README's recipe $name, as $who:"; cat "$work/recipe.sh"; echo "---"
status=0
started=$(date +%s%N)
cd "$work"
# setsid: the recipe and what it starts in the background are one process
# group, stopped as one when it is done (or after 60 s).
setsid "${run_as[@]}" env -u TINYBROKER_BIN PATH="$path" TMPDIR="$work/tmp" RUST_LOG=warn \
    TINYBROKER_GRPC_ADDR=127.0.0.1:50051 TINYBROKER_METRICS_ADDR=127.0.0.1:9090 \
    TB_NATS_SERVER="$nats" \
    bash -e recipe.sh > out.txt 2> err.txt &
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
took=$((($(date +%s%N) - started) / 100000000))
took="$((took / 10)).$((took % 10)) s"
kill -TERM -- "-$pid" 2>/dev/null || true
sleep 0.5
kill -KILL -- "-$pid" 2>/dev/null || true
cd - > /dev/null
echo "--- its output:"; cat "$work/out.txt"
echo "--- its stderr (last 20 lines):"; tail -n 20 "$work/err.txt"
failed() {
    local log
    for log in "$work"/*.log; do
        [ -f "$log" ] || continue
        echo "--- ${log##*/} (last 20 lines):"
        tail -n 20 "$log"
    done
    echo "README's recipe $name, as $who: $* (after $took; its directory is kept: $work)" >&2
    exit 1
}
if [ "$status" -eq 124 ]; then
    failed "still running after 60 s, stopped"
elif [ "$status" -ne 0 ]; then
    failed "failed (exit $status)"
fi
if ! grep -qxF -- "$expected_line" "$work/$expected_file"; then
    failed "did not write the line '$expected_line' to $expected_file"
fi
rm -rf "$work"
echo "README's recipe $name, as $who: ok in $took"
