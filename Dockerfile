# syntax=docker/dockerfile:1.7
#
# tinybroker container image: a release build of the `tinybroker` binary on
# distroless cc-debian12 (glibc, no shell, uid 65532), with grpc_health_probe
# for exec probes and `kubectl exec`.
#
#   docker build -t tinybroker:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9090:9090 tinybroker:0.1.0
#
# Needs BuildKit (the default builder of current Docker): cache mounts,
# ADD --checksum and per-architecture stages. Builds for linux/amd64 and
# linux/arm64 (docker buildx build --platform linux/amd64,linux/arm64 .).

ARG RUST_VERSION=1.95
ARG CARGO_CHEF_VERSION=0.1.78
# Set by BuildKit to the architecture being built (amd64, arm64); declared
# here, before the first FROM, so that a FROM line can use it.
ARG TARGETARCH

# --- grpc_health_probe: a pinned release, its sha256 checked by BuildKit -----
# Bump the version and both digests together (digests of the release assets
# grpc_health_probe-linux-amd64 and grpc_health_probe-linux-arm64).
FROM scratch AS health-probe-amd64
ADD --checksum=sha256:3ddaf85583613c97693e9b8aaa251dac07e73e366e159a7ccadbcf553117fcef \
    --chmod=0755 \
    https://github.com/grpc-ecosystem/grpc-health-probe/releases/download/v0.4.34/grpc_health_probe-linux-amd64 \
    /grpc_health_probe

FROM scratch AS health-probe-arm64
ADD --checksum=sha256:5e17ff4c055f075b58a1cd7ec37843d989cd0072340222a4fd0730773382027e \
    --chmod=0755 \
    https://github.com/grpc-ecosystem/grpc-health-probe/releases/download/v0.4.34/grpc_health_probe-linux-arm64 \
    /grpc_health_probe

# DL3006 (tag every image) does not apply: this names one of the two local
# stages above, which hadolint cannot see through the variable.
# hadolint ignore=DL3006
FROM health-probe-${TARGETARCH} AS health-probe

# --- Rust toolchain with cargo-chef ------------------------------------------
# Debian 12 (bookworm), like the runtime image, so the binary's glibc matches.
FROM rust:${RUST_VERSION}-slim-bookworm AS chef
ARG CARGO_CHEF_VERSION
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    cargo install cargo-chef --locked --version "${CARGO_CHEF_VERSION}"
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
    && install -D -m 0755 target/release/tinybroker /out/tinybroker

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
COPY --from=health-probe /grpc_health_probe /usr/local/bin/grpc_health_probe
# Numeric, so that Kubernetes' runAsNonRoot can verify it (distroless "nonroot").
USER 65532:65532
# gRPC (Broker, Admin, health, reflection) and HTTP (/metrics, /healthz, /readyz).
EXPOSE 50051 9090
ENTRYPOINT ["/usr/local/bin/tinybroker"]
CMD ["serve"]
