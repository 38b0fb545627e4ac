# tinybroker container image: a release build of the `tinybroker` binary on
# distroless cc-debian12 (glibc, no shell, uid 65532), with grpc_health_probe
# for exec probes and `kubectl exec`.
#
#   docker build -t tinybroker:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9090:9090 tinybroker:0.1.0
#
# Needs BuildKit (cache mounts): the default builder of Docker 23 and later;
# with Docker 20.10 to 22, set DOCKER_BUILDKIT=1 (the legacy builder stops at
# the first RUN --mount: "the --mount option requires BuildKit"). There is no
# `# syntax=` line on purpose: the file uses only what the Dockerfile frontend
# built into Docker 20.10 understands, so no frontend image is pulled, and
# scripts/check-image.sh builds it with exactly that frontend. Builds for
# linux/amd64 and linux/arm64 (docker buildx build --platform ...).
#
# The binary ships without its DWARF (the release profile's line tables: 53 MB
# with them, 11.5 MB without); the symbol table stays, so a backtrace still
# names functions. The debug info (compressed, 13 MB) is the `debug-info`
# stage, matched to the binary by .gnu_debuglink:
#   docker build --target debug-info -o type=local,dest=debug-info .

ARG RUST_VERSION=1.95
ARG CARGO_CHEF_VERSION=0.1.78

# --- Rust toolchain with cargo-chef ------------------------------------------
# Debian 12 (bookworm), like the runtime image, so the binary's glibc matches.
FROM rust:${RUST_VERSION}-slim-bookworm AS chef
ARG CARGO_CHEF_VERSION
# tikv-jemalloc-sys builds jemalloc with make, which the slim image lacks (it
# has gcc and libc6-dev only). Not pinned (DL3008): Debian's archive keeps only
# the current version of a package, so a pin breaks at the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
# --debug: cargo-chef only reads manifests and runs cargo; an optimised build
# of it took 451 s on 2 busy cores, this one 99 s.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    cargo install cargo-chef --locked --debug --version "${CARGO_CHEF_VERSION}"
WORKDIR /src

# --- planner: reduce the workspace to a dependency recipe --------------------
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# --- builder: dependencies in their own layer, then the app ------------------
FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
# This layer only changes when Cargo.toml/Cargo.lock change, so editing the
# source rebuilds just the tinybroker crate. The registry is a cache mount so
# downloaded crates are shared between builds and kept out of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    cargo chef cook --release --locked --recipe-path recipe.json --bin tinybroker
COPY . .
# build.rs compiles proto/ with protox (pure Rust): no protoc needed.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    cargo build --release --locked --bin tinybroker \
    && mkdir -p /out \
    && objcopy --only-keep-debug --compress-debug-sections target/release/tinybroker /out/tinybroker.debug \
    && objcopy --strip-debug --add-gnu-debuglink=/out/tinybroker.debug target/release/tinybroker /out/tinybroker.stripped \
    && install -m 0755 /out/tinybroker.stripped /out/tinybroker \
    && rm /out/tinybroker.stripped

# --- grpc_health_probe: a pinned release, checked against its sha256 -------
# A plain ADD: `ADD --checksum` is unknown to older frontends (Docker 20.10's)
# and they ignore `--chmod` on a URL (the file lands as 0600, which uid 65532
# cannot run), so the next stage checks the digest and sets the mode.
FROM scratch AS health-probe-download
ARG TARGETARCH
ADD https://github.com/grpc-ecosystem/grpc-health-probe/releases/download/v0.4.34/grpc_health_probe-linux-${TARGETARCH} /grpc_health_probe

FROM rust:${RUST_VERSION}-slim-bookworm AS health-probe
ARG TARGETARCH
COPY --from=health-probe-download /grpc_health_probe /tmp/grpc_health_probe
# Bump the version in the URL above and both digests together (sha256 of the
# release assets grpc_health_probe-linux-amd64 and grpc_health_probe-linux-arm64).
RUN case "${TARGETARCH}" in \
      amd64) sha256=3ddaf85583613c97693e9b8aaa251dac07e73e366e159a7ccadbcf553117fcef ;; \
      arm64) sha256=5e17ff4c055f075b58a1cd7ec37843d989cd0072340222a4fd0730773382027e ;; \
      *) echo "no grpc_health_probe digest for TARGETARCH=\"${TARGETARCH}\"" >&2; exit 1 ;; \
    esac \
    && echo "${sha256}  /tmp/grpc_health_probe" > /tmp/grpc_health_probe.sha256 \
    && sha256sum -c /tmp/grpc_health_probe.sha256 \
    && install -D -m 0755 /tmp/grpc_health_probe /out/grpc_health_probe

# --- debug info of the shipped binary (not in the runtime image) ------------
FROM scratch AS debug-info
COPY --from=builder /out/tinybroker.debug /tinybroker.debug

# --- runtime ------------------------------------------------------------------
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tinybroker" \
      org.opencontainers.image.description="A single-node, in-memory publish/subscribe broker served over gRPC" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"
COPY --from=builder /out/tinybroker /usr/local/bin/tinybroker
COPY --from=health-probe /out/grpc_health_probe /usr/local/bin/grpc_health_probe
# Numeric, so that Kubernetes' runAsNonRoot can verify it (distroless "nonroot").
USER 65532:65532
# gRPC (Broker, Admin, health, reflection) and HTTP (/metrics, /healthz, /readyz).
EXPOSE 50051 9090
ENTRYPOINT ["/usr/local/bin/tinybroker"]
CMD ["serve"]
