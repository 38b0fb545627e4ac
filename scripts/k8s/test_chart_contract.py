"""The Helm chart's contract (issue 5), checked on `helm template` output.

Run by scripts/check-k8s.sh (`pytest scripts/k8s`), with HELM and KUBECTL
pointing at the binaries it installed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from k8scheck import CHART, DEPLOY, ROOT, load_docs, render, render_deploy, render_fails

# === the contract's sources ===


def find_api_md() -> Path | None:
    """shared/API.md: beside the repository (as CI lays it out), or TINYBROKER_API_MD."""
    for candidate in (os.environ.get("TINYBROKER_API_MD"), ROOT.parent / "shared" / "API.md"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


API_MD = find_api_md()

# API.md's Configuration table, for when API.md is not beside the repository.
# When it is, test_fallback_env_list_matches_api_md keeps this list honest.
FALLBACK_ENV_VARS = [
    "TINYBROKER_GRPC_ADDR", "TINYBROKER_METRICS_ADDR", "TINYBROKER_CONSUMER_CAPACITY",
    "TINYBROKER_GROUP_CAPACITY", "TINYBROKER_DEFAULT_MAX_IN_FLIGHT", "TINYBROKER_DEFAULT_ACK_DEADLINE_MS",
    "TINYBROKER_MAX_DELIVERY_ATTEMPTS", "TINYBROKER_GROUP_IDLE_TTL_SECONDS", "TINYBROKER_MAX_MESSAGE_BYTES",
    "TINYBROKER_MAX_SUBSCRIPTIONS", "TINYBROKER_SHUTDOWN_GRACE_SECONDS", "TINYBROKER_AUTH_TOKEN",
    "TINYBROKER_TLS_CERT", "TINYBROKER_TLS_KEY", "TINYBROKER_METRICS_PER_SUBSCRIPTION",
    "TINYBROKER_LOG_FORMAT", "RUST_LOG", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME",
]


def api_section(title: str) -> str:
    text = API_MD.read_text()
    m = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## )", text, flags=re.M | re.S)
    assert m, f"API.md has no section {title!r}"
    return m.group(1)


def api_env_vars() -> list[str]:
    """Environment variables in the first column of API.md's Configuration table."""
    if API_MD is None:
        return FALLBACK_ENV_VARS
    names = []
    for line in api_section("Configuration").splitlines():
        if line.startswith("|") and not line.startswith("|--") and "variable" not in line:
            first_cell = line.split("|")[1]
            names += re.findall(r"`([A-Z][A-Z0-9_]+)`", first_cell)
    assert names, "no variables found in API.md's Configuration table"
    return names


def readme_env_vars() -> set[str]:
    """Variables in README.md's Configuration table: API.md's, plus the
    settings tinybroker adds where API.md is silent (keepalive, streams per
    connection)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Configuration$(.*?)(?=^## )", text, flags=re.M | re.S)
    assert m, "README.md has no Configuration section"
    names = set()
    for line in m.group(1).splitlines():
        if line.startswith("|") and not line.startswith("|--") and "variable" not in line:
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def api_metric_names() -> set[str]:
    section = api_section("Metrics")
    return set(re.findall(r"^\| `(tinybroker_[a-z0-9_]+)`", section, flags=re.M))


def readme_metric_names() -> set[str]:
    """Metrics in README.md's Metrics table: the ones tinybroker adds where
    API.md is silent (peaks, stalled groups, recent incidents)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^### Metrics$(.*?)(?=^### )", text, flags=re.M | re.S)
    assert m, "README.md has no Metrics section"
    return set(re.findall(r"`(tinybroker_[a-z0-9_]+)[`{]", m.group(1)))


def cargo_version() -> str:
    """The crate version: the `version =` line of Cargo.toml's [package] table."""
    text = (ROOT / "Cargo.toml").read_text()
    package = re.search(r"^\[package\]\s*$(.*?)(?=^\[|\Z)", text, flags=re.M | re.S).group(1)
    return re.search(r'^version\s*=\s*"([^"]+)"', package, flags=re.M).group(1)


# === rendered objects ===


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def broker_container(docs: list[dict]) -> dict:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "tinybroker")


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def port_named(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


CI_VALUES = sorted(str(p) for p in (CHART / "ci").glob("*-values.yaml"))


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


# === the Deployment ===


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: Path(p).name)
def test_one_replica_recreated_never_rolled(values_file):
    deployment = one(render(values_files=(values_file,)), "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_replicas_cannot_be_set_from_values():
    # values.schema.json is closed: a replicaCount (or replicas) key is an error.
    assert "replicaCount" in render_fails({"replicaCount": 2})


def test_native_grpc_probes_ask_the_health_service_on_the_grpc_port(default_docs):
    container = broker_container(default_docs)
    grpc_port = port_named(container, "grpc")
    assert grpc_port == 50051
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port, "service": ""}
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "tinybroker.v1.Broker"}


def test_probes_follow_a_changed_grpc_port():
    container = broker_container(render({"ports": {"grpc": 7000, "metrics": 7001}}))
    assert port_named(container, "grpc") == 7000
    assert container["livenessProbe"]["grpc"]["port"] == 7000
    assert container["readinessProbe"]["grpc"]["port"] == 7000
    assert env_of(container)["TINYBROKER_GRPC_ADDR"]["value"] == "0.0.0.0:7000"
    assert env_of(container)["TINYBROKER_METRICS_ADDR"]["value"] == "0.0.0.0:7001"


def test_exec_probes_run_grpc_health_probe_against_the_grpc_port():
    container = broker_container(render({"probes": {"type": "exec"}}))
    for probe, service in (("livenessProbe", None), ("readinessProbe", "tinybroker.v1.Broker")):
        assert "grpc" not in container[probe]
        command = container[probe]["exec"]["command"]
        assert command[0] == "/usr/local/bin/grpc_health_probe"
        assert "-addr=127.0.0.1:50051" in command
        services = [a for a in command if a.startswith("-service=")]
        assert services == ([f"-service={service}"] if service else [])
        assert "-tls" not in command


def test_the_memory_limit_is_left_to_the_container_limit_by_default():
    """maxMemoryBytes 0 (the default) sets no TINYBROKER_MAX_MEMORY_BYTES, so the
    broker takes 75 % of the memory limit of resources.limits.memory."""
    env = env_of(broker_container(render({})))
    assert "TINYBROKER_MAX_MEMORY_BYTES" not in env


def test_every_api_md_variable_can_be_set_from_values():
    values = {
        "ports": {"grpc": 6001, "metrics": 6002},
        "config": {
            "bindAddress": "[::]",
            "consumerCapacity": 11,
            "groupCapacity": 12,
            "defaultMaxInFlight": 13,
            "defaultAckDeadlineMs": 14,
            "maxDeliveryAttempts": 15,
            "groupIdleTtlSeconds": 16,
            "maxMessageBytes": 4194304,
            "maxSubscriptions": 18,
            "shutdownGraceSeconds": 19,
            "metricsPerSubscription": False,
            "logFormat": "json",
            "rustLog": "debug,h2=info",
            "keepaliveIntervalSeconds": 21,
            "keepaliveTimeoutSeconds": 22,
            "maxStreamsPerConnection": 23,
            # API.md's Resource limits table.
            "consumerMaxBytes": 67108865,
            "groupMaxBytes": 134217729,
            "maxMemoryBytes": 402653184,
            "maxConnections": 24,
            "handshakeTimeoutSeconds": 25,
        },
        "auth": {"enabled": True, "token": "t0ken"},
        "tls": {"enabled": True, "cert": "CERT", "key": "KEY"},
        "probes": {"type": "exec"},
        "otel": {"endpoint": "http://collector:4317", "serviceName": "broker-under-test"},
    }
    docs = render(values)
    env = env_of(broker_container(docs))
    expected_values = {
        "TINYBROKER_GRPC_ADDR": "[::]:6001",
        "TINYBROKER_METRICS_ADDR": "[::]:6002",
        "TINYBROKER_CONSUMER_CAPACITY": "11",
        "TINYBROKER_GROUP_CAPACITY": "12",
        "TINYBROKER_DEFAULT_MAX_IN_FLIGHT": "13",
        "TINYBROKER_DEFAULT_ACK_DEADLINE_MS": "14",
        "TINYBROKER_MAX_DELIVERY_ATTEMPTS": "15",
        "TINYBROKER_GROUP_IDLE_TTL_SECONDS": "16",
        # Large numbers must not turn into 4.194304e+06.
        "TINYBROKER_MAX_MESSAGE_BYTES": "4194304",
        "TINYBROKER_MAX_SUBSCRIPTIONS": "18",
        "TINYBROKER_SHUTDOWN_GRACE_SECONDS": "19",
        "TINYBROKER_METRICS_PER_SUBSCRIPTION": "false",
        "TINYBROKER_LOG_FORMAT": "json",
        "RUST_LOG": "debug,h2=info",
        "TINYBROKER_TLS_CERT": "/etc/tinybroker/tls/tls.crt",
        "TINYBROKER_TLS_KEY": "/etc/tinybroker/tls/tls.key",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_SERVICE_NAME": "broker-under-test",
    }
    for name in api_env_vars():
        assert name in env, f"{name} (API.md) is not set on the broker container"
        if name == "TINYBROKER_AUTH_TOKEN":
            ref = env[name]["valueFrom"]["secretKeyRef"]
            secret = next(s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == ref["name"])
            assert base64.b64decode(secret["data"][ref["key"]]).decode() == "t0ken"
        else:
            assert env[name].get("value") == expected_values[name], name
    extensions = {
        "TINYBROKER_KEEPALIVE_INTERVAL_SECONDS": "21",
        "TINYBROKER_KEEPALIVE_TIMEOUT_SECONDS": "22",
        "TINYBROKER_MAX_STREAMS_PER_CONNECTION": "23",
        "TINYBROKER_CONSUMER_MAX_BYTES": "67108865",
        "TINYBROKER_GROUP_MAX_BYTES": "134217729",
        "TINYBROKER_MAX_MEMORY_BYTES": "402653184",
        "TINYBROKER_MAX_CONNECTIONS": "24",
        "TINYBROKER_HANDSHAKE_TIMEOUT_SECONDS": "25",
    }
    for name, value in extensions.items():
        assert name in readme_env_vars(), f"{name} is not documented in README.md's Configuration table"
        assert env[name].get("value") == value, name
    known = set(api_env_vars()) | set(extensions)
    unknown = {n for n in env if n.startswith("TINYBROKER_")} - known
    assert not unknown, f"TINYBROKER_* variables in neither API.md nor README.md: {unknown}"


def test_fallback_env_list_matches_api_md():
    if API_MD is None:
        pytest.skip("shared/API.md is not beside the repository; set TINYBROKER_API_MD")
    assert api_env_vars() == FALLBACK_ENV_VARS


def test_defaults_match_api_md(default_docs):
    """With default values the env carries API.md's defaults."""
    env = {n: e.get("value") for n, e in env_of(broker_container(default_docs)).items()}
    if API_MD is not None:
        for line in api_section("Configuration").splitlines():
            m = re.match(r"^\| `(TINYBROKER_[A-Z_]+)` \| `([^`]+)` \|", line)
            if m:
                assert env[m.group(1)] == m.group(2), m.group(1)
    assert "TINYBROKER_AUTH_TOKEN" not in env and "TINYBROKER_TLS_CERT" not in env
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert env["RUST_LOG"] == "info"


@pytest.mark.parametrize("grace", [0, 1, 10, 30, 299, 3600])
@pytest.mark.parametrize("margin", [None, 1, 30])
def test_termination_grace_period_outlasts_the_drain(grace, margin):
    values: dict = {"config": {"shutdownGraceSeconds": grace}}
    if margin is not None:
        values["terminationGraceMarginSeconds"] = margin
    deployment = one(render(values), "Deployment")
    period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert isinstance(period, int) and period > grace
    env = env_of(broker_container([deployment]))
    assert env["TINYBROKER_SHUTDOWN_GRACE_SECONDS"]["value"] == str(grace)


def test_zero_margin_is_rejected():
    assert "terminationGraceMarginSeconds" in render_fails({"terminationGraceMarginSeconds": 0})


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: Path(p).name)
def test_restricted_security_context(values_file):
    docs = render(values_files=(values_file,))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    test_pods = of_kind(docs, "Pod")
    for spec in [pod] + [p["spec"] for p in test_pods]:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["enableServiceLinks"] is False


def test_root_user_is_rejected():
    assert "runAsUser" in render_fails({"securityContext": {"runAsUser": 0, "runAsGroup": 0, "fsGroup": 0}})


def test_resources_and_scheduling_come_from_values():
    spec = one(
        render({
            "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}},
            "nodeSelector": {"disk": "ssd"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "affinity": {"podAffinity": {}},
        }),
        "Deployment",
    )["spec"]["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "1" and resources["limits"]["memory"] == "1Gi"
    assert spec["nodeSelector"] == {"disk": "ssd"}
    assert spec["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert spec["affinity"] == {"podAffinity": {}}


def test_pod_scrape_annotations(default_docs):
    annotations = one(default_docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9090"
    assert annotations["prometheus.io/path"] == "/metrics"
    off = one(render({"metrics": {"podAnnotations": False}}), "Deployment")["spec"]["template"]["metadata"]
    assert "prometheus.io/scrape" not in (off.get("annotations") or {})


def test_image_defaults_to_app_version(default_docs):
    assert broker_container(default_docs)["image"] == f"tinybroker:{cargo_version()}"
    digest = "sha256:" + "a" * 64
    assert broker_container(render({"image": {"repository": "r/t", "digest": digest}}))["image"] == f"r/t@{digest}"


# === Service ===


def test_service_exposes_grpc_and_metrics(default_docs):
    service = one(default_docs, "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["grpc"]["appProtocol"] == "grpc"
    assert ports["metrics"]["port"] == 9090 and ports["metrics"]["targetPort"] == "metrics"
    pod_labels = one(default_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


# === optional resources ===

OPTIONAL = {
    "NetworkPolicy": {"networkPolicy": {"enabled": True}},
    "ServiceMonitor": {"serviceMonitor": {"enabled": True}},
    "PrometheusRule": {"prometheusRule": {"enabled": True}},
    "ConfigMap": {"grafanaDashboard": {"enabled": True}},
    "Secret": {"auth": {"enabled": True, "token": "x"}},
}


def test_default_render_has_only_the_core_kinds(default_docs):
    kinds = sorted(d["kind"] for d in default_docs)
    assert kinds == ["Deployment", "Pod", "Service", "ServiceAccount"]


@pytest.mark.parametrize("kind", sorted(OPTIONAL))
def test_optional_kind_appears_only_when_enabled(kind, default_docs):
    assert not of_kind(default_docs, kind)
    docs = render(OPTIONAL[kind])
    assert len(of_kind(docs, kind)) == 1
    others = set(OPTIONAL) - {kind}
    assert not [d for d in docs if d["kind"] in others]


def test_service_monitor_scrapes_the_metrics_port():
    docs = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}, release="rel")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service")["metadata"]["labels"].items()


def test_prometheus_rule_carries_the_alerts_file():
    rule = one(render({"prometheusRule": {"enabled": True}}), "PrometheusRule")
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_grafana_dashboard_configmap_carries_the_dashboard():
    configmap = one(render({"grafanaDashboard": {"enabled": True}}), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["tinybroker.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())


def test_network_policy_lets_the_test_pod_and_scrapers_in():
    docs = render({"networkPolicy": {"enabled": True}})
    policy = one(docs, "NetworkPolicy")
    grpc_rule, metrics_rule = policy["spec"]["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    selector = grpc_rule["from"][0]["podSelector"]["matchLabels"]
    test_pod_labels = one(docs, "Pod")["metadata"]["labels"]
    assert selector.items() <= test_pod_labels.items()
    assert metrics_rule == {"ports": [{"port": "metrics", "protocol": "TCP"}]}  # any source may scrape
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )
    open_policy = one(render({"networkPolicy": {"enabled": True, "allowExternal": True}}), "NetworkPolicy")
    assert "from" not in open_policy["spec"]["ingress"][0]


# === auth and TLS wiring ===


def test_auth_with_a_created_secret():
    docs = render({"auth": {"enabled": True, "token": "s3cret"}}, release="rel")
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == "rel-tinybroker-auth"
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret"
    ref = {"name": "rel-tinybroker-auth", "key": "token"}
    assert env_of(broker_container(docs))["TINYBROKER_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    # The test pod's CLI authenticates with the same token.
    test_container = one(docs, "Pod")["spec"]["containers"][0]
    assert env_of(test_container)["TINYBROKER_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    # Changing the token restarts the broker.
    pod_annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/auth" in pod_annotations


def test_auth_with_an_existing_secret():
    docs = render({"auth": {"enabled": True, "existingSecret": "creds", "existingSecretKey": "broker-token"}})
    assert not of_kind(docs, "Secret")
    ref = {"name": "creds", "key": "broker-token"}
    assert env_of(broker_container(docs))["TINYBROKER_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == ref


def test_auth_without_a_token_is_rejected():
    error = render_fails({"auth": {"enabled": True}})
    assert "auth.token" in error and "auth.existingSecret" in error


def test_tls_with_an_existing_secret():
    docs = render({"tls": {"enabled": True, "existingSecret": "broker-tls"}, "probes": {"type": "exec"}})
    assert not of_kind(docs, "Secret")
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "tls", "secret": {"secretName": "broker-tls", "defaultMode": 0o440}}]
    container = broker_container(docs)
    assert {"name": "tls", "mountPath": "/etc/tinybroker/tls", "readOnly": True} in container["volumeMounts"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert {"-tls", "-tls-no-verify"} <= set(container[probe]["exec"]["command"])


def test_tls_with_a_created_secret():
    docs = render({"tls": {"enabled": True, "cert": "C", "key": "K"}, "probes": {"type": "exec"}}, release="rel")
    secret = one(docs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["tls.crt"]) == b"C"
    assert base64.b64decode(secret["data"]["tls.key"]) == b"K"
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["volumes"][0]["secret"]["secretName"] == secret["metadata"]["name"]


def test_tls_with_native_grpc_probes_is_rejected():
    assert "probes.type=exec" in render_fails({"tls": {"enabled": True, "existingSecret": "x"}})


# === helm test hook ===


def test_test_hook_does_health_and_a_round_trip(default_docs):
    pod = one(default_docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    script = pod["spec"]["containers"][0]["command"][-1]
    assert "grpc_health_probe" in script and "-service=tinybroker.v1.Broker" in script
    assert "tinybroker subscribe" in script and "tinybroker publish" in script
    assert pod["spec"]["containers"][0]["image"] == broker_container(default_docs)["image"]
    # The script's address is the release's Service.
    service = one(default_docs, "Service")
    assert f"addr={service['metadata']['name']}:50051" in script


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: Path(p).name)
def test_test_pod_is_not_selected_by_the_service_or_the_deployment(values_file):
    docs = render(values_files=(values_file,))
    test_labels = one(docs, "Pod")["metadata"]["labels"]
    service_selector = one(docs, "Service")["spec"]["selector"]
    deployment_selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    for selector in (service_selector, deployment_selector):
        assert not selector.items() <= test_labels.items(), f"{selector} selects the test pod"


def test_test_hook_skips_the_round_trip_with_tls():
    docs = render({"tls": {"enabled": True, "existingSecret": "x"}, "probes": {"type": "exec"}})
    pod = one(docs, "Pod")
    script = pod["spec"]["containers"][0]["command"][-1]
    assert "tinybroker publish" not in script
    assert "-service=tinybroker.v1.Broker -connect-timeout=5s -rpc-timeout=5s -tls -tls-no-verify" in script


# === chart metadata, values documentation, NOTES ===


def test_app_version_is_the_crate_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == cargo_version()


def test_every_values_key_has_a_comment_above_it():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z_][\w.-]*:", line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#"), f"values.yaml:{i + 1}: {line.strip()!r} has no comment above it"


def test_schema_describes_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value, node, path):
        assert "description" in node, f"{path or '<root>'} has no description in values.schema.json"
        if isinstance(value, dict) and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} is not closed"
            for key, child in value.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(child, node["properties"][key], f"{path}.{key}".lstrip("."))

    for key, child in values.items():
        walk(child, schema["properties"][key], key)


def test_notes_print_the_commands_for_this_release():
    result = subprocess.run(
        [os.environ["HELM"], "install", "rel", str(CHART), "--dry-run=client", "--namespace", "messaging",
         "--set", "auth.enabled=true,auth.token=x"],
        capture_output=True, text=True, env={**os.environ, "KUBECONFIG": os.devnull}, check=True,
    )
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl --namespace messaging port-forward svc/rel-tinybroker 50051:50051 9090:9090" in notes
    assert "grpcurl -plaintext localhost:50051 list" in notes
    assert "tinybroker.v1.Broker/Publish" in notes and "tinybroker.v1.Broker/OpenSubscription" in notes
    assert "authorization: Bearer" in notes
    assert "grpc_health_probe -addr=localhost:50051 -service=tinybroker.v1.Broker" in notes
    assert "helm test rel --namespace messaging" in notes


# === deploy/ and the monitoring files ===


def test_deploy_dir_is_the_rendered_default_chart():
    with tempfile.TemporaryDirectory() as tmp:
        written = render_deploy(Path(tmp))
        expected = {name: (Path(tmp) / name).read_text() for name in written}
    actual = {
        str(p.relative_to(DEPLOY)): p.read_text()
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.name != "alerts_test.yaml"
    }
    assert sorted(actual) == sorted(expected), "deploy/ has other files than scripts/render-deploy.sh writes"
    stale = [name for name in expected if actual[name] != expected[name]]
    assert not stale, f"deploy/ is stale, run scripts/render-deploy.sh: {stale}"


def test_kustomize_build_equals_helm_template():
    kustomized = subprocess.run(
        [os.environ["KUBECTL"], "kustomize", str(DEPLOY)], capture_output=True, text=True, check=True
    ).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(load_docs(kustomized), key=key) == sorted(render(skip_tests=True), key=key)


def test_monitoring_copies_are_identical():
    for name in ("alerts.yaml", "dashboard.json"):
        assert (DEPLOY / "monitoring" / name).read_bytes() == (CHART / "files" / name).read_bytes(), name


def _metric_names(text: str) -> set[str]:
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\btinybroker_[a-z0-9_]+", text)}


def test_alerts_and_dashboard_use_metrics_api_md_defines():
    if API_MD is None:
        pytest.skip("shared/API.md is not beside the repository; set TINYBROKER_API_MD")
    known = api_metric_names() | readme_metric_names()
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    exprs = " ".join(r["expr"] for g in alerts["groups"] for r in g["rules"])
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    queries += " " + " ".join(json.dumps(v.get("query", "")) for v in dashboard["templating"]["list"])
    for where, text in (("alerts.yaml", exprs), ("dashboard.json", queries)):
        unknown = _metric_names(text) - known
        assert not unknown, f"{where} uses metrics API.md does not define: {unknown}"
    dashboard_metrics = _metric_names(queries)
    for wanted in (
        "tinybroker_messages_published_total", "tinybroker_messages_delivered_total",
        "tinybroker_subscription_queue_depth", "tinybroker_queue_fill_ratio", "tinybroker_evictions_total",
        "tinybroker_consumer_group_backlog", "tinybroker_consumer_group_in_flight",
        "tinybroker_consumer_group_oldest_unacked_age_seconds", "tinybroker_delivery_lag_seconds",
    ):
        assert wanted in dashboard_metrics, f"the dashboard has no panel for {wanted}"


# === Dockerfile, as far as it can be checked without a Docker engine ===


def test_dockerfile_agrees_with_the_chart():
    dockerfile = (ROOT / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert re.search(r"^ARG VERSION=(\S+)$", dockerfile, flags=re.M).group(1) == cargo_version()
    exposed = re.search(r"^EXPOSE (.+)$", dockerfile, flags=re.M).group(1).split()
    assert exposed == [str(values["ports"]["grpc"]), str(values["ports"]["metrics"])]
    assert re.search(r"^USER (\d+):(\d+)$", dockerfile, flags=re.M).groups() == (
        str(values["securityContext"]["runAsUser"]), str(values["securityContext"]["runAsGroup"]))
    assert "/usr/local/bin/grpc_health_probe" in dockerfile
    assert "cargo build --release --locked --bin tinybroker" in dockerfile
    assert re.search(r"^FROM gcr\.io/distroless/cc-debian12:nonroot", dockerfile, flags=re.M)
    # Every downloaded file is pinned by checksum: ADD --checksum, or the form
    # Docker 20.10's frontend also builds (a plain ADD, then `sha256sum -c`
    # against a digest for each architecture).
    for add in re.findall(r"^ADD .*?(?<!\\)$", dockerfile, flags=re.M | re.S):
        if "--checksum=sha256:" in add:
            continue
        assert "sha256sum -c" in dockerfile, add
        for arch in ("amd64", "arm64"):
            assert re.search(rf"\b{arch}\) sha256=[0-9a-f]{{64}} ", dockerfile), (arch, add)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "target/" in ignored
