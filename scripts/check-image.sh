#!/usr/bin/env bash
# Builds the container image from the repository's Dockerfile and runs it the
# way the Helm chart runs it (issue 13), on a Debian 12 machine as root that
# reaches only the package registries. Exits non-zero when any check fails.
#
#   bash scripts/check-image.sh
#   DOCKER_DATA_ROOT=$(mktemp -d) bash scripts/check-image.sh   # as on a fresh machine
#
# 1. engine: apt-get installs Debian's docker.io (20.10, BuildKit built in) if
#    missing; the script starts its own dockerd on a private socket and stops
#    it by PID at the end (trap, also on failure). /usr/bin/docker with
#    DOCKER_BUILDKIT=1: a newer CLI without the buildx plugin would fall back
#    to the legacy builder.
# 2. chart: `helm template` (defaults, and probes.type=exec) gives the env,
#    args, securityContext, memory limit, grace period, exec probe commands and
#    the `helm test` pod (scripts/image/chart_facts.py).
# 3. stand-ins, since no container registry and no GitHub download is
#    reachable here, tagged with the names the Dockerfile and chart use:
#      rust:<RUST_VERSION>-slim-bookworm  mmdebstrap'd bookworm with what the
#        real image has (gcc, libc6-dev, ca-certificates; no make), this host's
#        Rust toolchain of that version in the official image's layout, and
#        this host's extra CA certificates (outbound TLS is re-signed here);
#      gcr.io/distroless/cc-debian12:nonroot  the files of distroless cc's
#        Debian packages, passwd/group with nonroot 65532, no shell, USER 65532;
#      the chart's tests.toolsImage (busybox)  Debian's static busybox;
#      grpc_health_probe  scripts/image/standin-health-probe, a work-alike of
#        the flags and exit codes the chart uses, served on 127.0.0.1.
#    The Dockerfile is built as it is, except for what only this machine
#    needs, in a copy (target/image-check/Dockerfile.ci; the diff is printed):
#    the probe's GitHub URL becomes the local one, its amd64 digest the
#    stand-in's.
# 4. run: the image's own USER (no --user), the chart's env and args,
#    --read-only --cap-drop ALL --security-opt no-new-privileges (from the
#    rendered securityContext), its memory limit, ports on 127.0.0.1 only.
#    Checks uid/gid 65532, no capabilities, no-new-privileges, the read-only
#    root, gRPC health SERVING for "" and tinybroker.v1.Broker (grpcurl from
#    the host), a publish -> subscribe round trip from the host (the CLI
#    copied out of the image), /metrics, the chart's exec probe commands run
#    inside the container, the chart's `helm test` pod, and SIGTERM -> exit 0
#    within terminationGracePeriodSeconds. Prints the image size.
#
# Cached between runs (a fresh machine just takes longer): the docker data
# root (stand-in images and BuildKit's cache, $TB_IMAGE_CACHE/docker unless
# DOCKER_DATA_ROOT is set) and the stand-in probe's build.
# Logs: target/image-check/logs/. One line per check, then "N passed, M failed".
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
# shellcheck source=scripts/k8s/tools.sh
source "$ROOT/scripts/k8s/tools.sh"
export PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive

TB_IMAGE_CACHE=${TB_IMAGE_CACHE:-/var/cache/tinybroker-image-check}
DATA_ROOT=${DOCKER_DATA_ROOT:-$TB_IMAGE_CACHE/docker}
WORK="$ROOT/target/image-check"
LOG="$WORK/logs"
DOCKER=/usr/bin/docker
MIRROR=${MIRROR:-http://deb.debian.org/debian}
STANDIN_RECIPE=1 # bump when a stand-in's recipe changes: they are rebuilt
T0=$(date +%s.%N)

rm -rf "$WORK"
mkdir -p "$LOG" "$TB_IMAGE_CACHE"
RESULTS="$WORK/results.txt"
PHASES="$WORK/phases.txt"
: >"$RESULTS"
: >"$PHASES"
BG_PIDS=()
DOCKERD_PID=""
RUN_DIR=""
NET=tbic-net

elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }
say() { printf '[%6ss] %s\n' "$(elapsed "$T0")" "$*"; }
PHASE_NAME=""
PHASE_T=""
phase() { # NAME: ends the running phase (its time goes to the summary), starts NAME
    if [[ -n "$PHASE_NAME" ]]; then printf '%-28s %6ss\n' "$PHASE_NAME" "$(elapsed "$PHASE_T")" >>"$PHASES"; fi
    PHASE_NAME="$1"
    PHASE_T=$(date +%s.%N)
    [[ -n "$1" ]] && say "== $1"
}
record() { # STATUS NAME SECONDS EVIDENCE
    printf '%-5s %-26s %6ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$RESULTS"
}
# check NAME FUNCTION: runs FUNCTION, which sets EV (evidence) and returns
# 0 for PASS; records it with its time.
check() {
    local name=$1 fn=$2 t
    t=$(date +%s.%N)
    EV=""
    if "$fn"; then record PASS "$name" "$(elapsed "$t")" "$EV"; return 0; fi
    record FAIL "$name" "$(elapsed "$t")" "$EV"
    return 1
}
summary() {
    phase ""
    echo
    echo "==== image check: $(elapsed "$T0")s in all ===="
    cat "$PHASES"
    echo
    cat "$RESULTS"
    local npass nfail
    npass=$(grep -c '^PASS' "$RESULTS")
    nfail=$(grep -c '^FAIL' "$RESULTS")
    echo "$npass passed, $nfail failed"
    [[ "$nfail" == 0 ]]
}
# fatal NAME SECONDS EVIDENCE: a failure the rest cannot run without.
fatal() {
    record FAIL "$1" "$2" "$3"
    summary
    exit 1
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# wait_for SECONDS COMMAND...: polls COMMAND until it succeeds; 1 on timeout.
wait_for() {
    local deadline=$(($(date +%s) + $1))
    shift
    until "$@"; do
        (($(date +%s) < deadline)) || return 1
        sleep 0.2
    done
}

cleanup() {
    set +e
    if [[ -n "$DOCKERD_PID" ]]; then
        for c in tbic-broker tbic-helm-test tbic-extract; do "$DOCKER" rm -f "$c" >/dev/null 2>&1; done
        "$DOCKER" network rm "$NET" >/dev/null 2>&1
    fi
    for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null; done
    if [[ -n "$DOCKERD_PID" ]]; then
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        local _
        for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$DOCKERD_PID" 2>/dev/null; then
            kill -KILL "$DOCKERD_PID"
            # dockerd's own containerd would outlive it.
            local cpid
            cpid=$(cat "$RUN_DIR/exec/containerd/containerd.pid" 2>/dev/null)
            [[ -n "$cpid" ]] && kill -TERM "$cpid" 2>/dev/null
            say "dockerd (pid $DOCKERD_PID) did not stop in 30 s: killed"
        else
            say "dockerd (pid $DOCKERD_PID) stopped"
        fi
    fi
    [[ -n "$RUN_DIR" ]] && rm -rf "$RUN_DIR"
}
trap cleanup EXIT
# So that an interrupted run also stops its dockerd.
trap 'exit 130' INT
trap 'exit 143' TERM

# ------------------------------------------------------------- 1. engine ---
phase "packages"
t=$(date +%s.%N)
pkgs=(docker.io containerd runc iptables mmdebstrap busybox-static curl ca-certificates python3 binutils file)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
    apt_install --no-install-recommends "${pkgs[@]}" >"$LOG/apt.log" 2>&1 || fatal packages "$(elapsed "$t")" "apt-get install ${pkgs[*]} failed"
fi
ensure_helm_kubectl >"$LOG/tools.log" 2>&1 || fatal packages "$(elapsed "$t")" "helm: see $LOG/tools.log"
ensure_venv >>"$LOG/tools.log" 2>&1 || fatal packages "$(elapsed "$t")" "python venv: see $LOG/tools.log"
PY="$K8S_VENV/bin/python"

phase "engine"
t=$(date +%s.%N)
if other=$(pidof dockerd); then
    fatal engine "$(elapsed "$t")" "another dockerd is running (pid $other); this script starts and stops its own"
fi
RUN_DIR=$(mktemp -d /run/tbic.XXXXXX)
export DOCKER_HOST="unix://$RUN_DIR/docker.sock" DOCKER_BUILDKIT=1
unset DOCKER_CONTEXT DOCKER_TLS_VERIFY DOCKER_CERT_PATH
mkdir -p "$DATA_ROOT"
start_dockerd() { # STORAGE_DRIVER
    /usr/sbin/dockerd --host "$DOCKER_HOST" --pidfile "$RUN_DIR/dockerd.pid" --exec-root "$RUN_DIR/exec" \
        --data-root "$DATA_ROOT" --storage-driver "$1" >"$LOG/dockerd-$1.log" 2>&1 &
    DOCKERD_PID=$!
    if wait_for 60 "$DOCKER" version >/dev/null 2>&1; then return 0; fi
    kill "$DOCKERD_PID" 2>/dev/null
    wait "$DOCKERD_PID" 2>/dev/null
    DOCKERD_PID=""
    return 1
}
start_dockerd overlay2 || start_dockerd vfs || fatal engine "$(elapsed "$t")" "dockerd did not start; see $LOG/dockerd-*.log"
record PASS engine "$(elapsed "$t")" "dockerd $("$DOCKER" version -f '{{.Server.Version}}') pid $DOCKERD_PID, $("$DOCKER" info -f '{{.Driver}}'), data root $DATA_ROOT"

# --------------------------------------------------------------- 2. chart ---
phase "chart render"
t=$(date +%s.%N)
RENDER="$WORK/render"
mkdir -p "$RENDER"
if ! { "$HELM" template tinybroker helm/tinybroker >"$RENDER/default.yaml" 2>"$LOG/helm.log" &&
    "$HELM" template tinybroker helm/tinybroker --set probes.type=exec >"$RENDER/exec.yaml" 2>>"$LOG/helm.log" &&
    "$PY" scripts/image/chart_facts.py "$RENDER/default.yaml" "$RENDER/exec.yaml" "$RENDER" >"$RENDER/facts.sh" 2>>"$LOG/helm.log"; }; then
    fatal chart-render "$(elapsed "$t")" "$(tail -3 "$LOG/helm.log")"
fi
# shellcheck source=/dev/null
source "$RENDER/facts.sh"
record PASS chart-render "$(elapsed "$t")" "image $CHART_IMAGE, args ${CHART_ARGS[*]}, $(wc -l <"$RENDER/env.list") env vars, ${CHART_SECURITY_FLAGS[*]}, grace ${CHART_GRACE}s"

# ----------------------------------------------------------- 3. stand-ins ---
phase "stand-in images"
ARCH=$(dpkg --print-architecture)
RUST_VERSION=$(sed -n 's/^ARG RUST_VERSION=//p' Dockerfile)
RUST_IMAGE="rust:${RUST_VERSION}-slim-bookworm"
grep -q "^FROM rust:\${RUST_VERSION}-slim-bookworm " Dockerfile || fatal standin-rust 0 "the Dockerfile no longer builds FROM rust:\${RUST_VERSION}-slim-bookworm: adapt the stand-in"
CC_IMAGE=$(sed -n 's/^FROM \(gcr\.io\/distroless\/[^ ]*\) .*/\1/p' Dockerfile)
[[ -n "$CC_IMAGE" ]] || fatal standin-distroless 0 "no FROM gcr.io/distroless/... in the Dockerfile"

standin_ok() { # IMAGE KEY: the image exists and was made by this recipe
    [[ "$("$DOCKER" image inspect -f '{{index .Config.Labels "tinybroker.standin"}}' "$1" 2>/dev/null)" == "$2" ]]
}

# The host toolchain whose rustc is RUST_VERSION.x.
TOOLCHAIN=""
for d in "${RUSTUP_HOME:-$HOME/.rustup}"/toolchains/*; do
    if [[ -x "$d/bin/rustc" ]] && "$d/bin/rustc" --version 2>/dev/null | grep -q "^rustc ${RUST_VERSION}[. ]"; then
        TOOLCHAIN=$(readlink -f "$d")
        break
    fi
done
[[ -n "$TOOLCHAIN" ]] || fatal standin-rust 0 "no host toolchain with rustc $RUST_VERSION under ${RUSTUP_HOME:-$HOME/.rustup}/toolchains"
RUSTC_FULL=$("$TOOLCHAIN/bin/rustc" --version | awk '{print $2}')
HOST_TRIPLE=$("$TOOLCHAIN/bin/rustc" -vV | sed -n 's/^host: //p')
EXTRA_CA=(/usr/local/share/ca-certificates/*.crt)
[[ -e "${EXTRA_CA[0]}" ]] || EXTRA_CA=()
RUST_KEY="$STANDIN_RECIPE rustc-$RUSTC_FULL ca-$(cat "${EXTRA_CA[@]}" /dev/null | sha256sum | cut -c1-12)"

build_rust_standin() {
    local r="$WORK/rootfs-rust" tc
    rm -rf "$r"
    # The packages of the real image (the official slim recipe), no more.
    # force-unsafe-io: dpkg's fsyncs were most of debootstrap's 4 minutes.
    timeout 900 mmdebstrap --variant=minbase --include=ca-certificates,gcc,libc6-dev --dpkgopt=force-unsafe-io \
        bookworm "$r" "$MIRROR" >"$LOG/mmdebstrap.log" 2>&1 || { EV="mmdebstrap failed, see $LOG/mmdebstrap.log"; return 1; }
    tc="$r/usr/local/rustup/toolchains/$RUSTC_FULL-$HOST_TRIPLE"
    mkdir -p "$tc" "$r/usr/local/cargo/bin"
    tar -C "$TOOLCHAIN" --exclude=./share/doc -cf - . | tar -C "$tc" -xf -
    printf 'version = "12"\ndefault_toolchain = "%s-%s"\nprofile = "minimal"\nauto_self_update = "disable"\n' \
        "$RUSTC_FULL" "$HOST_TRIPLE" >"$r/usr/local/rustup/settings.toml"
    cp "$(readlink -f "$(command -v rustup)")" "$r/usr/local/cargo/bin/rustup"
    local p
    for p in cargo cargo-clippy cargo-fmt clippy-driver rustc rustdoc rustfmt; do ln -sf rustup "$r/usr/local/cargo/bin/$p"; done
    if ((${#EXTRA_CA[@]})); then
        cp "${EXTRA_CA[@]}" "$r/usr/local/share/ca-certificates/"
        chroot "$r" update-ca-certificates >>"$LOG/mmdebstrap.log" 2>&1
    fi
    rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/*
    tar -C "$r" --numeric-owner -cf - . | "$DOCKER" import \
        --change 'ENV RUSTUP_HOME=/usr/local/rustup' --change 'ENV CARGO_HOME=/usr/local/cargo' \
        --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change "ENV RUST_VERSION=$RUSTC_FULL" --change "LABEL tinybroker.standin=\"$RUST_KEY\"" \
        --change 'CMD ["bash"]' - "$RUST_IMAGE" >"$LOG/import-rust.log" 2>&1 || { EV="docker import failed"; return 1; }
    rm -rf "$r"
}
standin_rust() {
    local how=cached
    if ! standin_ok "$RUST_IMAGE" "$RUST_KEY"; then build_rust_standin || return 1; how=built; fi
    local v
    v=$("$DOCKER" run --rm "$RUST_IMAGE" sh -c 'cargo --version; command -v make || echo "no make"' 2>&1 | tr '\n' ' ')
    EV="$RUST_IMAGE $how: $v"
    [[ "$v" == cargo\ "$RUST_VERSION"* ]]
}

CC_PKGS=(base-files netbase tzdata libc6 libgcc-s1 libgomp1 libstdc++6 libssl3 ca-certificates)
CC_KEY="$STANDIN_RECIPE ${CC_PKGS[*]}"
build_distroless_standin() {
    local d="$WORK/rootfs-cc" debs="$WORK/debs-cc"
    rm -rf "$d" "$debs"
    mkdir -p "$debs" "$d/usr/bin" "$d/usr/sbin" "$d/usr/lib" "$d/usr/lib64"
    (cd "$debs" && apt-get download "${CC_PKGS[@]}") >"$LOG/distroless.log" 2>&1 || { EV="apt-get download failed, see $LOG/distroless.log"; return 1; }
    local l f
    for l in bin sbin lib lib64; do ln -s "usr/$l" "$d/$l"; done
    for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$d"; done
    rm -rf "$d"/usr/share/{man,info,lintian,locale,doc}
    # What ca-certificates' postinst would generate: the bundle of the Mozilla set.
    mkdir -p "$d/etc/ssl/certs"
    cat "$d"/usr/share/ca-certificates/mozilla/*.crt >"$d/etc/ssl/certs/ca-certificates.crt"
    mkdir -p "$d/tmp" "$d/home/nonroot" "$d/root" "$d/var/lib" "$d/proc" "$d/sys" "$d/dev"
    chmod 1777 "$d/tmp"
    chmod 700 "$d/root" "$d/home/nonroot"
    chown 65532:65532 "$d/home/nonroot"
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$d/etc/passwd"
    printf 'root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n' >"$d/etc/group"
    echo 'hosts: files dns' >"$d/etc/nsswitch.conf"
    # distroless has no shell; dash is no package of the list, but make sure.
    rm -f "$d/bin/sh" "$d/usr/bin/sh"
    tar -C "$d" --numeric-owner -cf - . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'USER 65532' --change 'WORKDIR /home/nonroot' \
        --change "LABEL tinybroker.standin=\"$CC_KEY\"" - "$CC_IMAGE" >>"$LOG/distroless.log" 2>&1 || { EV="docker import failed"; return 1; }
    rm -rf "$d" "$debs"
}
standin_distroless() {
    local how=cached
    if ! standin_ok "$CC_IMAGE" "$CC_KEY"; then build_distroless_standin || return 1; how=built; fi
    local user size shrc
    user=$("$DOCKER" image inspect -f '{{.Config.User}}' "$CC_IMAGE")
    size=$("$DOCKER" image inspect -f '{{.Size}}' "$CC_IMAGE")
    "$DOCKER" run --rm --entrypoint /bin/sh "$CC_IMAGE" -c true >/dev/null 2>&1
    shrc=$?
    EV="$CC_IMAGE $how: user $user, $((size / 1000000)) MB, /bin/sh: $([[ $shrc != 0 ]] && echo none || echo present)"
    [[ "$user" == 65532 && $shrc != 0 ]]
}

TOOLS_KEY="$STANDIN_RECIPE busybox-static $(dpkg-query -W -f '${Version}' busybox-static)"
standin_tools() {
    local how=cached bb="$WORK/rootfs-busybox"
    if ! standin_ok "$TEST_TOOLS_IMAGE" "$TOOLS_KEY"; then
        rm -rf "$bb"
        mkdir -p "$bb/bin"
        cp /bin/busybox "$bb/bin/busybox"
        ln -s busybox "$bb/bin/sh"
        tar -C "$bb" -cf - . | "$DOCKER" import --change "LABEL tinybroker.standin=\"$TOOLS_KEY\"" - "$TEST_TOOLS_IMAGE" >/dev/null ||
            { EV="docker import failed"; return 1; }
        rm -rf "$bb"
        how=built
    fi
    EV="$TEST_TOOLS_IMAGE $how: Debian's busybox-static $(dpkg-query -W -f '${Version}' busybox-static)"
}

PROBE_BIN="$TB_IMAGE_CACHE/standin-health-probe/grpc_health_probe"
standin_probe() {
    local src="$TB_IMAGE_CACHE/standin-health-probe/src-copy" key how=cached
    key=$(cat scripts/image/standin-health-probe/Cargo.toml scripts/image/standin-health-probe/src/main.rs Cargo.lock | sha256sum | cut -c1-16)
    if [[ ! -x "$PROBE_BIN" || "$(cat "$PROBE_BIN.key" 2>/dev/null)" != "$key" ]]; then
        rm -rf "$src"
        mkdir -p "$src"
        cp -r scripts/image/standin-health-probe/. "$src/"
        # The project's lock file: the same tonic and tokio the broker uses.
        cp Cargo.lock "$src/"
        (cd "$src" && RUSTFLAGS='-C target-feature=+crt-static' CARGO_TARGET_DIR="$TB_IMAGE_CACHE/standin-health-probe/target" \
            timeout 1200 cargo build --release --target "$HOST_TRIPLE") >"$LOG/standin-probe.log" 2>&1 ||
            { EV="cargo build failed, see $LOG/standin-probe.log"; return 1; }
        cp "$TB_IMAGE_CACHE/standin-health-probe/target/$HOST_TRIPLE/release/grpc_health_probe" "$PROBE_BIN"
        echo "$key" >"$PROBE_BIN.key"
        how=built
    fi
    EV="grpc_health_probe stand-in $how: $(file -b "$PROBE_BIN" | grep -o -E 'static[a-z-]* linked'), $(stat -c %s "$PROBE_BIN") bytes"
    file -b "$PROBE_BIN" | grep -q 'static'
}

# mmdebstrap is the long part on a fresh machine: the stand-in probe (a host
# cargo build) is built meanwhile.
t=$(date +%s.%N)
(RESULTS="$WORK/probe.result" check standin-health-probe standin_probe >/dev/null 2>&1) &
probe_job=$!
BG_PIDS+=("$probe_job")
check standin-rust standin_rust || fatal image-build 0 "no $RUST_IMAGE stand-in"
wait "$probe_job"
probe_rc=$?
tee -a "$RESULTS" <"$WORK/probe.result"
((probe_rc == 0)) || fatal image-build 0 "no grpc_health_probe stand-in"
check standin-distroless standin_distroless || fatal image-build 0 "no $CC_IMAGE stand-in"
check standin-tools-image standin_tools

# ------------------------------------------------------------- 4. build ---
phase "image build"
t=$(date +%s.%N)
P_HTTP=$(free_port)
SERVE="$WORK/serve"
mkdir -p "$SERVE"
cp "$PROBE_BIN" "$SERVE/grpc_health_probe-linux-$ARCH"
python3 -m http.server "$P_HTTP" --bind 127.0.0.1 --directory "$SERVE" >"$LOG/http.log" 2>&1 &
BG_PIDS+=("$!")
wait_for 10 curl -fs -o /dev/null "http://127.0.0.1:$P_HTTP/grpc_health_probe-linux-$ARCH" ||
    fatal image-build "$(elapsed "$t")" "the local file server did not answer"
"$PY" - Dockerfile "$WORK/Dockerfile.ci" "$ARCH" "$(sha256sum "$PROBE_BIN" | cut -d' ' -f1)" "http://127.0.0.1:$P_HTTP/" <<'EOF' >"$LOG/Dockerfile.ci.log" 2>&1 ||
import re, sys
src, dst, arch, digest, base = sys.argv[1:]
text = open(src).read()
if text.startswith("# syntax="):
    sys.exit("the Dockerfile has a syntax line: its frontend image cannot be pulled here")
text, n = re.subn(r"https://github\.com/grpc-ecosystem/grpc-health-probe/releases/download/[^/\s]+/", base, text)
assert n == 1, f"{n} grpc_health_probe URLs"
text, n = re.subn(r"(\b%s\) sha256=)[0-9a-f]{64}" % arch, r"\g<1>" + digest, text)
assert n == 1, f"{n} {arch} digests of grpc_health_probe"
open(dst, "w").write(text)
EOF
    fatal image-build "$(elapsed "$t")" "Dockerfile.ci: $(tail -1 "$LOG/Dockerfile.ci.log")"
echo "Dockerfile.ci = the repository's Dockerfile except (this machine reaches no GitHub):"
diff Dockerfile "$WORK/Dockerfile.ci" | grep '^[<>]' | sed 's/^/    /'
REVISION=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
timeout 2700 "$DOCKER" build --progress=plain -f "$WORK/Dockerfile.ci" --build-arg REVISION="$REVISION" -t "$CHART_IMAGE" . >"$LOG/build.log" 2>&1
brc=$?
BUILD_S=$(elapsed "$t")
if ((brc != 0)); then
    grep -E '^#[0-9]+ .*(error|ERROR)|^(error|ERROR|failed)' "$LOG/build.log" | tail -5
    fatal image-build "$BUILD_S" "docker build rc=$brc, see $LOG/build.log"
fi
cached=$(grep -c '^#[0-9]* CACHED' "$LOG/build.log")
record PASS image-build "$BUILD_S" "$CHART_IMAGE, $cached steps from cache; log $LOG/build.log"

# ------------------------------------------------------ 5. image facts ---
phase "image facts"
CLI="$WORK/tinybroker"
image_size() {
    local size
    size=$("$DOCKER" image inspect -f '{{.Size}}' "$CHART_IMAGE")
    IMAGE_MB=$(python3 -c "print(round($size / 1e6, 1))")
    EV="$CHART_IMAGE: $IMAGE_MB MB ($size bytes); layers: $("$DOCKER" history --format '{{.Size}} {{.CreatedBy}}' "$CHART_IMAGE" |
        grep -E 'COPY|ADD|import' | sed -E 's/ *(\/bin\/sh -c )?#\(nop\) */ /; s/ in .*//' | cut -c1-60 | tr '\n' ';')"
}
check image-size image_size
# The binary, copied out: the host's CLI for the checks below (the image is
# bookworm, like this host).
"$DOCKER" rm -f tbic-extract >/dev/null 2>&1
{ "$DOCKER" create --name tbic-extract "$CHART_IMAGE" >/dev/null &&
    "$DOCKER" cp tbic-extract:/usr/local/bin/tinybroker "$CLI" &&
    "$DOCKER" rm tbic-extract >/dev/null; } || fatal cli 0 "could not copy /usr/local/bin/tinybroker out of the image"
binary_stripped() {
    local debug sections
    sections=$(readelf -S -W "$CLI")
    # .debug_gdb_scripts is no debug info: rustc's pointer to gdb's pretty printers.
    debug=$(grep -E ' \.debug_' <<<"$sections" | grep -c -v ' \.debug_gdb_scripts ')
    EV="/usr/local/bin/tinybroker $(stat -c %s "$CLI") bytes, $debug .debug_* sections (DWARF), .symtab: $(grep -q ' \.symtab ' <<<"$sections" && echo yes || echo no), .gnu_debuglink: $(grep -q ' \.gnu_debuglink ' <<<"$sections" && echo yes || echo no)"
    [[ "$debug" == 0 ]]
}
check binary-without-debug-info binary_stripped

# --------------------------------------------------- 6. run like the chart ---
phase "run like the chart"
P_GRPC=$(free_port)
P_METRICS=$(free_port)
ADDR="127.0.0.1:$P_GRPC"
for c in tbic-broker tbic-helm-test; do "$DOCKER" rm -f "$c" >/dev/null 2>&1; done
"$DOCKER" network rm "$NET" >/dev/null 2>&1
"$DOCKER" network create "$NET" >/dev/null
RUN_ARGS=(--name tbic-broker --network "$NET" --network-alias "$TEST_SERVICE_HOST" --env-file "$RENDER/env.list"
    "${CHART_SECURITY_FLAGS[@]}" -p "127.0.0.1:$P_GRPC:$CHART_GRPC_PORT" -p "127.0.0.1:$P_METRICS:$CHART_METRICS_PORT")
[[ -n "$CHART_MEMORY_LIMIT" ]] && RUN_ARGS+=(--memory "$CHART_MEMORY_LIMIT")
ready() { [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$P_METRICS/readyz")" == 200 ]]; }
running() { [[ "$("$DOCKER" inspect -f '{{.State.Running}}' tbic-broker 2>/dev/null)" == true ]]; }
ready_or_exited() { ready || ! running; }
container_start() {
    echo "docker run ${RUN_ARGS[*]} $CHART_IMAGE ${CHART_ARGS[*]}" >"$LOG/run.cmd"
    "$DOCKER" run -d "${RUN_ARGS[@]}" "$CHART_IMAGE" "${CHART_ARGS[@]}" >/dev/null 2>"$LOG/run.err" ||
        { EV="docker run failed: $(tail -1 "$LOG/run.err")"; return 1; }
    wait_for 30 ready_or_exited
    if ! ready; then EV="not ready in 30 s (running=$(running && echo yes || echo no)): $("$DOCKER" logs tbic-broker 2>&1 | tail -3 | tr '\n' ' ')"; return 1; fi
    EV="/readyz 200; ${CHART_SECURITY_FLAGS[*]} --memory ${CHART_MEMORY_LIMIT:-none}, no --user; ports 127.0.0.1:$P_GRPC, 127.0.0.1:$P_METRICS"
}
check container-start container_start || fatal container-start 0 "the broker is not running"

PID=$("$DOCKER" inspect -f '{{.State.Pid}}' tbic-broker)
status_field() { awk -v k="$1:" '$1 == k { $1 = ""; sub(/^ /, ""); print }' "/proc/$PID/status"; }
uid_65532() {
    local uids gids want="$CHART_RUN_AS_USER $CHART_RUN_AS_USER $CHART_RUN_AS_USER $CHART_RUN_AS_USER"
    uids=$(status_field Uid | tr -s '\t ' ' ')
    gids=$(status_field Gid | tr -s '\t ' ' ')
    EV="image USER $("$DOCKER" image inspect -f '{{.Config.User}}' "$CHART_IMAGE"); /proc/$PID/status Uid: $uids, Gid: $gids, Groups: $(status_field Groups); chart runAsUser $CHART_RUN_AS_USER runAsGroup $CHART_RUN_AS_GROUP"
    [[ "$uids" == "$want" && "$gids" == "$CHART_RUN_AS_GROUP $CHART_RUN_AS_GROUP $CHART_RUN_AS_GROUP $CHART_RUN_AS_GROUP" && "$CHART_RUN_AS_USER" == 65532 ]]
}
check runs-as-uid-65532 uid_65532
no_capabilities() {
    local eff prm bnd inh amb
    eff=$(status_field CapEff) prm=$(status_field CapPrm) bnd=$(status_field CapBnd) inh=$(status_field CapInh) amb=$(status_field CapAmb)
    EV="CapEff $eff CapPrm $prm CapBnd $bnd CapInh $inh CapAmb $amb; CapDrop $("$DOCKER" inspect -f '{{.HostConfig.CapDrop}}' tbic-broker)"
    [[ "$eff$prm$bnd$inh$amb" =~ ^0+$ ]]
}
check no-capabilities no_capabilities
no_new_privs() {
    EV="NoNewPrivs $(status_field NoNewPrivs), Seccomp $(status_field Seccomp) (2 = filter, docker's default profile; chart: $CHART_SECCOMP); SecurityOpt $("$DOCKER" inspect -f '{{.HostConfig.SecurityOpt}}' tbic-broker)"
    [[ "$(status_field NoNewPrivs)" == 1 && "$(status_field Seccomp)" == 2 ]]
}
check no-new-privileges no_new_privs

health() { # SERVICE
    local out
    if command -v grpcurl >/dev/null; then
        out=$(timeout 10 grpcurl -plaintext -max-time 5 -d "{\"service\": \"$1\"}" "$ADDR" grpc.health.v1.Health/Check 2>&1)
        EV="grpcurl from the host: $(echo "$out" | tr -d '\n ' | cut -c1-80)"
        [[ "$out" == *'"status": "SERVING"'* ]]
    else
        out=$(timeout 10 "$PROBE_BIN" -addr "$ADDR" -service "$1" -connect-timeout 5s -rpc-timeout 5s 2>&1)
        local rc=$?
        EV="grpcurl not installed; the stand-in grpc_health_probe from the host: rc=$rc $out"
        [[ $rc == 0 ]]
    fi
}
health_overall() { health ""; }
health_broker() { health tinybroker.v1.Broker; }
check 'health ""' health_overall
check health-tinybroker.v1.Broker health_broker

# publish TOPIC PAYLOAD: 0 once a publish reached a subscription.
PUB_OUT=""
publish_matched() {
    PUB_OUT=$(timeout 10 "$CLI" publish "$1" "$2" --addr "http://$ADDR" 2>&1)
    [[ "$PUB_OUT" =~ matched_subscriptions=[1-9] ]]
}
pubsub() {
    local topic="image-check.round-trip.$$" payload sub rc
    payload="round trip $(date +%s.%N)"
    timeout 30 "$CLI" subscribe "$topic" --count 1 --addr "http://$ADDR" >"$WORK/sub.out" 2>"$WORK/sub.err" &
    sub=$!
    # Publishes before the subscription is registered match nothing.
    if ! wait_for 15 publish_matched "$topic" "$payload"; then
        kill "$sub" 2>/dev/null
        EV="no publish matched the subscriber in 15 s: $PUB_OUT; $(head -c 200 "$WORK/sub.err")"
        return 1
    fi
    wait "$sub"
    rc=$?
    EV="publish: $PUB_OUT; subscriber (rc $rc) printed '$(cat "$WORK/sub.out")'"
    [[ $rc == 0 && "$(cat "$WORK/sub.out")" == "$payload" ]]
}
check publish-subscribe pubsub

metrics() {
    local m published
    m=$(curl -fsS --max-time 5 "http://127.0.0.1:$P_METRICS/metrics" 2>&1) || { EV="GET /metrics failed: $m"; return 1; }
    published=$(echo "$m" | awk '/^tinybroker_messages_published_total/ { s += $NF } END { print s + 0 }')
    EV="$(echo "$m" | grep -c '^tinybroker_') tinybroker_ samples; messages_published_total $published; $(echo "$m" | grep -m1 '^tinybroker_build_info' | cut -c1-100)"
    ((published >= 1)) && echo "$m" | grep -q '^tinybroker_build_info'
}
check metrics metrics

exec_probe() { # TIMEOUT COMMAND...
    local to=$1 out rc
    shift
    out=$(timeout $((to + 5)) "$DOCKER" exec tbic-broker "$@" 2>&1)
    rc=$?
    EV="docker exec tbic-broker $*: rc $rc, $out"
    [[ $rc == 0 ]]
}
exec_liveness() { exec_probe "$CHART_LIVENESS_TIMEOUT" "${CHART_LIVENESS_CMD[@]}"; }
exec_readiness() { exec_probe "$CHART_READINESS_TIMEOUT" "${CHART_READINESS_CMD[@]}"; }
check exec-probe-liveness exec_liveness
check exec-probe-readiness exec_readiness

# What `kubectl exec deploy/tinybroker -- tinybroker top --once` runs: the
# image has no shell, so the binary is exec'd directly.
exec_top() {
    exec_probe 15 /usr/local/bin/tinybroker top --once --addr "http://127.0.0.1:$CHART_GRPC_PORT" &&
        [[ "$EV" == *"published "* && "$EV" == *"delivered "* ]]
}
check exec-top-once exec_top

helm_test_pod() {
    local tools="$WORK/emptydir-tools" rc
    if [[ "$TEST_SERVICE_PORT" != "$CHART_GRPC_PORT" ]]; then
        EV="the test talks to Service port $TEST_SERVICE_PORT, the container listens on $CHART_GRPC_PORT: no Service here to map them"
        return 1
    fi
    rm -rf "$tools"
    mkdir -p "$tools"
    chmod 0777 "$tools" # an emptyDir
    timeout 60 "$DOCKER" run --rm "${CHART_SECURITY_FLAGS[@]}" --user "$CHART_RUN_AS_USER:$CHART_RUN_AS_GROUP" \
        -v "$tools:$TEST_TOOLS_MOUNT" "$TEST_TOOLS_IMAGE" "${TEST_INIT_CMD[@]}" >"$LOG/helm-test-init.log" 2>&1 ||
        { EV="init container failed: $(tail -2 "$LOG/helm-test-init.log" | tr '\n' ' ')"; return 1; }
    timeout "$TEST_DEADLINE" "$DOCKER" run --rm --name tbic-helm-test --network "$NET" "${CHART_SECURITY_FLAGS[@]}" \
        --user "$CHART_RUN_AS_USER:$CHART_RUN_AS_GROUP" -v "$tools:$TEST_TOOLS_MOUNT:ro" \
        --tmpfs "$TEST_WORK_MOUNT:rw,size=1m,mode=1777" -e PATH="$TEST_PATH" --entrypoint "$TEST_SHELL" \
        "$CHART_IMAGE" -euc "$(cat "$RENDER/test-script.sh")" >"$LOG/helm-test.log" 2>&1
    rc=$?
    EV="test container rc $rc (deadline ${TEST_DEADLINE}s): $(tail -1 "$LOG/helm-test.log")"
    [[ $rc == 0 ]]
}
check helm-test-pod helm_test_pod

read_only_root() {
    local ro diff errors
    ro=$("$DOCKER" inspect -f '{{.HostConfig.ReadonlyRootfs}}' tbic-broker)
    diff=$("$DOCKER" diff tbic-broker 2>&1 | tr '\n' ' ')
    errors=$("$DOCKER" logs tbic-broker 2>&1 | grep -c -i -E 'read-only file system|EROFS|permission denied|ERROR')
    EV="ReadonlyRootfs $ro; docker diff: '${diff}'; $errors error lines in the log; still running: $(running && echo yes || echo no)"
    [[ "$ro" == true && -z "$diff" && "$errors" == 0 ]] && running
}
check read-only-root read_only_root

sigterm() {
    local sub t1 stop_s code oom
    # A subscriber still connected, so the drain has something to do.
    "$CLI" subscribe 'image-check.drain.>' --addr "http://$ADDR" >/dev/null 2>"$WORK/sub-drain.err" &
    sub=$!
    BG_PIDS+=("$sub")
    wait_for 15 publish_matched image-check.drain.x "before SIGTERM" || { EV="the drain subscriber never registered: $PUB_OUT"; return 1; }
    t1=$(date +%s.%N)
    timeout $((CHART_GRACE + 15)) "$DOCKER" stop -t "$CHART_GRACE" tbic-broker >/dev/null
    stop_s=$(elapsed "$t1")
    code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' tbic-broker)
    oom=$("$DOCKER" inspect -f '{{.State.OOMKilled}}' tbic-broker)
    kill "$sub" 2>/dev/null
    "$DOCKER" logs tbic-broker >"$LOG/broker.log" 2>&1
    EV="docker stop -t $CHART_GRACE (terminationGracePeriodSeconds): exit code $code after ${stop_s}s, OOMKilled $oom; log: $(grep -c 'shutdown requested' "$LOG/broker.log") 'shutdown requested', last: $(tail -1 "$LOG/broker.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-90)"
    [[ "$code" == 0 && "$oom" == false ]] && python3 -c "import sys; sys.exit(0 if $stop_s < $CHART_GRACE else 1)"
}
check sigterm-exit-0-within-grace sigterm

# The cache lives on between runs: keep it from growing without bound.
"$DOCKER" image prune -f >/dev/null 2>&1
"$DOCKER" builder prune -f --filter until=168h >/dev/null 2>&1
say "docker data root $DATA_ROOT: $(du -sh "$DATA_ROOT" 2>/dev/null | cut -f1)"

summary
