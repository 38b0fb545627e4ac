#!/usr/bin/env bash
# Regenerates deploy/ from the Helm chart: the manifests `helm template
# tinybroker helm/tinybroker --skip-tests` renders with default values, one file
# per template, a kustomization.yaml listing them, and deploy/monitoring/'s
# copies of the chart's files/alerts.yaml and files/dashboard.json.
# deploy/monitoring/alerts_test.yaml is hand-written and left alone.
# scripts/check-k8s.sh fails when deploy/ differs from what this writes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/k8s/tools.sh
source "$ROOT/scripts/k8s/tools.sh"
# No __pycache__ in the work tree.
export PYTHONDONTWRITEBYTECODE=1
ensure_helm_kubectl
ensure_venv
rm -f "$ROOT"/deploy/*.yaml "$ROOT/deploy/monitoring/alerts.yaml" "$ROOT/deploy/monitoring/dashboard.json"
"$K8S_VENV/bin/python" "$ROOT/scripts/k8s/k8scheck.py" render-deploy "$ROOT/deploy"
