#!/usr/bin/env bash
# Installs nats-server >= 2.10 (the cluster-mode tests need 2.10's
# multi-subject consumer filters) from Debian 13 (trixie)'s package, beside,
# not over, Debian 12's /usr/sbin/nats-server 2.9 (the benchmark's).
#
# Idempotent: a binary already at the target path that reports >= 2.10 is
# kept, and a .deb already in /var/cache/tinybroker-nats/ (checked against
# the checksum stored beside it) is used without going to the network.
# Otherwise the .deb comes from the Debian mirror named in apt's sources,
# checked all the way: gpgv checks trixie's InRelease against the Debian
# archive keyring, InRelease gives the checksum of the Packages index, the
# index gives the .deb's file name and checksum.
#
# The last line on stdout is the path of the binary
# (`bin=$(bash scripts/install-nats.sh | tail -n1)`); progress goes to stderr.
set -euo pipefail

SUITE=trixie
MIN=2.10
PREFIX=/usr/local/lib/tinybroker/nats-server-$MIN
BIN=$PREFIX/nats-server
CACHE=/var/cache/tinybroker-nats
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

die() {
    echo "install-nats.sh: $*" >&2
    exit 1
}

# The version `nats-server --version` prints (2.10.27 of "nats-server:
# v2.10.27"), empty when it does not run.
version_of() {
    "$1" --version 2>/dev/null | sed -n 's/^nats-server: v\([0-9][0-9.]*\).*/\1/p'
}

recent_enough() {
    local v
    v=$(version_of "$1")
    [ -n "$v" ] && dpkg --compare-versions "$v" ge "$MIN"
}

if [ -x "$BIN" ] && recent_enough "$BIN"; then
    echo "nats-server $(version_of "$BIN") already installed" >&2
    echo "$BIN"
    exit 0
fi

ARCH=$(dpkg --print-architecture)
mkdir -p "$CACHE"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The newest cached .deb whose checksum (stored when it was downloaded and
# checked) still matches.
cached_deb() {
    local deb
    for deb in $(find "$CACHE" -maxdepth 1 -name "nats-server_*_$ARCH.deb" | sort -rV); do
        if [ -f "$deb.sha256" ] && echo "$(cat "$deb.sha256")  $deb" | sha256sum -c --quiet - >/dev/null 2>&1; then
            echo "$deb"
            return
        fi
    done
}

# The Debian archive mirror from apt's sources: deb822 .sources files
# (URIs:) and one-line .list files (deb [options] URI SUITE ...); the first
# URI that is the Debian archive itself (.../debian, not .../debian-security).
mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] && sed -E -n 's/\[[^]]*\]//; s/^deb[[:space:]]+([^[:space:]]+).*/\1/p' "$f"
    done
}

fetch() { # URL FILE
    local err
    err=$(curl -fsS --retry 2 --connect-timeout 15 --max-time 300 -o "$2" "$1" 2>&1) ||
        die "cannot download $1 (${err##*$'\n'})"
}

download_deb() {
    local mirror dist index index_sha stanza filename deb_sha deb
    mirror=$(mirror | sed 's:/*$::' | grep -E '^https?://.*/debian$' | head -n1 || true)
    [ -n "$mirror" ] || die "no Debian mirror (a URI ending in /debian) in apt's sources (/etc/apt/sources.list, /etc/apt/sources.list.d/)"
    [ -f "$KEYRING" ] || die "no $KEYRING to check the $SUITE index with (apt-get install debian-archive-keyring)"
    local tool
    for tool in curl gpgv; do
        command -v "$tool" >/dev/null || die "$tool is needed (apt-get install $tool)"
    done
    # The xz index is the smaller; gzip is always there.
    local ext=xz unpack="xz -dc"
    if ! command -v xz >/dev/null; then
        ext=gz unpack="gzip -dc"
    fi
    dist=$mirror/dists/$SUITE
    echo "fetching the $SUITE index from $mirror" >&2
    fetch "$dist/InRelease" "$WORK/InRelease"
    gpgv --keyring "$KEYRING" --output "$WORK/Release" "$WORK/InRelease" 2>"$WORK/gpgv.log" ||
        die "bad signature on $dist/InRelease ($(tail -n1 "$WORK/gpgv.log"))"
    index=main/binary-$ARCH/Packages.$ext
    index_sha=$(awk -v f="$index" '/^SHA256:/ { s = 1; next } /^[^ ]/ { s = 0 } s && $3 == f { print $1 }' "$WORK/Release")
    [ -n "$index_sha" ] || die "$index is not listed in $dist/InRelease"
    fetch "$dist/$index" "$WORK/Packages"
    echo "$index_sha  $WORK/Packages" | sha256sum -c --quiet - >/dev/null 2>&1 || die "checksum mismatch for $dist/$index"
    stanza=$($unpack "$WORK/Packages" | awk '
        /^Package: / { p = ($2 == "nats-server") }
        p { print }
        p && /^$/ { exit }')
    filename=$(sed -n 's/^Filename: //p' <<<"$stanza")
    deb_sha=$(sed -n 's/^SHA256: //p' <<<"$stanza")
    if [ -z "$filename" ] || [ -z "$deb_sha" ]; then
        die "no nats-server package in $dist/$index"
    fi
    deb=$CACHE/$(basename "$filename")
    echo "fetching $mirror/$filename" >&2
    fetch "$mirror/$filename" "$WORK/nats-server.deb"
    echo "$deb_sha  $WORK/nats-server.deb" | sha256sum -c --quiet - >/dev/null 2>&1 || die "checksum mismatch for $mirror/$filename"
    mv "$WORK/nats-server.deb" "$deb"
    echo "$deb_sha" >"$deb.sha256"
    echo "$deb"
}

DEB=$(cached_deb)
if [ -n "$DEB" ]; then
    echo "using the cached $DEB" >&2
else
    DEB=$(download_deb)
fi

dpkg -x "$DEB" "$WORK/root"
NEW=$WORK/root/usr/sbin/nats-server
recent_enough "$NEW" || die "$DEB holds nats-server '$(version_of "$NEW")', not >= $MIN"
mkdir -p "$PREFIX"
install -m 0755 "$NEW" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"
echo "installed nats-server $(version_of "$BIN") at $BIN" >&2
echo "$BIN"
