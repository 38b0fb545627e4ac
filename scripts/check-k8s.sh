#!/usr/bin/env bash
# Checks the Kubernetes packaging (issue 5) with real tools, on a fresh Debian
# 12 machine as root (it installs what it needs, cached under target/):
#
#   1. helm lint --strict on helm/tinybroker with every ci/*-values.yaml
#      (single-node and cluster mode)
#   2. helm template of each, and `kubectl kustomize` of deploy/ and
#      deploy/cluster/, every document validated against the Kubernetes
#      schemas bundled with kubernetes-validate (strict: unknown fields fail),
#      at the oldest supported and the current Kubernetes version; the
#      Prometheus Operator kinds against the subset of their CRD schemas the
#      chart uses (scripts/k8s/k8scheck.py)
#   3. hadolint on the Dockerfile
#   4. `promtool check rules` and `promtool test rules` on deploy/monitoring/
#      (Debian's prometheus package, installed when promtool is missing)
#   5. the chart's contract (scripts/k8s/test_chart_contract.py, pytest):
#      replicas, strategy, probes, env from values, grace period, security
#      context, optional kinds, auth/TLS wiring, cluster mode (NATS env,
#      replicaCount > 1 refused without nats.url, RollingUpdate, budget,
#      spread, liveness), appVersion, deploy/ and deploy/cluster/ in step with
#      the chart, deploy/monitoring/ copies identical, group gauges read with
#      max by (consumer_group), Dockerfile facts
#
# No Docker engine and no Kubernetes cluster are needed (or used): nothing is
# built, installed into a cluster or run. Prints one line per check and a final
# "N passed, M failed"; exits non-zero when anything failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/k8s/tools.sh
source "$ROOT/scripts/k8s/tools.sh"
# No __pycache__ in the work tree.
export PYTHONDONTWRITEBYTECODE=1

CHART="helm/tinybroker"
RENDER_DIR="$ROOT/target/k8s-render"
LOG_DIR="$ROOT/target/k8s-logs"
passed=0
failed=0
failures=()
started=$SECONDS

# check NAME COMMAND...: runs one check, quietly unless it fails.
check() {
    local name="$1"
    shift
    local log
    log="$LOG_DIR/$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_').log"
    if "$@" >"$log" 2>&1; then
        passed=$((passed + 1))
        printf 'ok    %s\n' "$name"
    else
        failed=$((failed + 1))
        failures+=("$name")
        printf 'FAIL  %s\n' "$name"
        sed 's/^/      /' "$log" | tail -n 60
    fi
}

echo "== tools"
ensure_helm_kubectl
ensure_venv
PY="$K8S_VENV/bin/python"
echo "helm $("$HELM" version --template '{{.Version}}'), kubectl $("$KUBECTL" version --client -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), $("$K8S_VENV/bin/hadolint" --version), kubernetes-validate $("$PY" -c 'import kubernetes_validate.version as v; print(v.__version__)')"
rm -rf "$RENDER_DIR" "$LOG_DIR"
mkdir -p "$RENDER_DIR" "$LOG_DIR"

render() { # render VALUES_FILE OUT
    "$HELM" template tinybroker "$CHART" --namespace tinybroker -f "$1" >"$2"
}

echo "== helm lint and template"
values_files=("$CHART"/ci/*-values.yaml)
check "helm lint --strict (chart defaults)" "$HELM" lint --strict "$CHART"
for values in "${values_files[@]}"; do
    name="$(basename "$values" .yaml)"
    check "helm lint --strict -f ci/$name.yaml" "$HELM" lint --strict "$CHART" -f "$values"
    check "helm template -f ci/$name.yaml" render "$values" "$RENDER_DIR/$name.yaml"
done

echo "== kustomize builds"
kustomize_build() { # kustomize_build DIR OUT
    "$KUBECTL" kustomize "$1" >"$2"
}
check "kubectl kustomize deploy/" kustomize_build deploy "$RENDER_DIR/kustomize-deploy.yaml"
check "kubectl kustomize deploy/cluster/" kustomize_build deploy/cluster "$RENDER_DIR/kustomize-deploy-cluster.yaml"

echo "== schema validation of every rendered document"
rendered=("$RENDER_DIR"/*.yaml)
check "kubernetes-validate --strict + Prometheus Operator CR check (${#rendered[@]} renders and builds)" \
    "$PY" scripts/k8s/k8scheck.py validate "${rendered[@]}"
cat "$LOG_DIR"/kubernetes-validate*.log | grep '^validated' || true

echo "== Dockerfile"
check "hadolint Dockerfile" "$K8S_VENV/bin/hadolint" --no-color Dockerfile

echo "== alert rules (promtool)"
command -v promtool >/dev/null || apt_install prometheus
promtool_rules() {
    promtool check rules deploy/monitoring/alerts.yaml &&
        (cd deploy/monitoring && promtool test rules alerts_test.yaml)
}
check "promtool check rules + test rules deploy/monitoring/alerts_test.yaml" promtool_rules

echo "== chart contract (pytest)"
contract() {
    (cd scripts/k8s && "$PY" -m pytest -q -p no:cacheprovider -rs .)
}
check "contract tests (scripts/k8s/test_chart_contract.py)" contract
grep -E '^[0-9]+ passed|SKIPPED' "$LOG_DIR"/contract*.log || true

echo
echo "k8s checks took $((SECONDS - started))s; logs in ${LOG_DIR#"$ROOT"/}"
if ((failed > 0)); then
    printf 'failed: %s\n' "${failures[@]}"
fi
echo "$passed passed, $failed failed"
((failed == 0))
