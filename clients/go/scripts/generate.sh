#!/usr/bin/env bash
# Regenerates tinybrokerpb/ (the Go code of proto/tinybroker/v1) with pinned
# generators, no protoc needed:
#   - protoc-gen-go from google.golang.org/protobuf at the version go.mod
#     requires (so the runtime and its generator always match);
#   - protoc-gen-go-grpc at PROTOC_GEN_GO_GRPC below;
#   - the buf CLI that scripts/check-proto.sh installs from npm (pinned in
#     scripts/buf/package-lock.json), or $BUF.
# CI runs it and fails when the result differs from what is committed.
set -euo pipefail
PROTOC_GEN_GO_GRPC=v1.6.2
cd "$(dirname "$0")/.."
root=$(cd ../.. && pwd)
mkdir -p .bin
go build -o .bin/protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go
GOBIN="$PWD/.bin" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"
buf=${BUF:-$root/target/buf/node_modules/@bufbuild/buf-linux-x64/bin/buf}
if [ ! -x "$buf" ]; then
    tools="$root/target/buf"
    mkdir -p "$tools"
    cp "$root/scripts/buf/package.json" "$root/scripts/buf/package-lock.json" "$tools/"
    (cd "$tools" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi
rm -rf tinybrokerpb
"$buf" generate --template buf.gen.yaml
echo "generated: $(ls tinybrokerpb | tr '\n' ' ')(buf $("$buf" --version), protoc-gen-go $(.bin/protoc-gen-go --version | awk '{print $2}'), protoc-gen-go-grpc $PROTOC_GEN_GO_GRPC)"
