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

from k8scheck import (
    CHART,
    CLUSTER_VALUES,
    DEPLOY,
    HAND_WRITTEN,
    ROOT,
    load_docs,
    render,
    render_deploy,
    render_fails,
)

# === the contract's sources ===
#
# docs/operations.md is the operator's reference: its Configuration table
# (and the Cluster mode table below it) names every setting the broker reads,
# and its Metrics section every metric. The chart is checked against them.

OPERATIONS_MD = ROOT / "docs" / "operations.md"


def operations_section(pattern: str, what: str) -> str:
    """The text of docs/operations.md under the heading `pattern` matches, up
    to the next heading of the same or a higher level."""
    m = re.search(pattern, OPERATIONS_MD.read_text(), flags=re.M | re.S)
    assert m, f"docs/operations.md has no {what} section"
    return m.group(1)


def _table_rows(section: str) -> list[list[str]]:
    """The cells of each row of the tables in a section, header and separator aside."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("variable", "metric"):
            continue
        rows.append(cells)
    return rows


def _table_vars(section: str) -> list[str]:
    """Environment variables in the first column of a section's table."""
    names = []
    for cells in _table_rows(section):
        names += re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0])
    return names


def configuration_section() -> str:
    """docs/operations.md's Configuration table (single-node and cluster mode
    alike), without the Cluster mode table below it."""
    return operations_section(r"^## Configuration$(.*?)(?=^##)", "Configuration")


def documented_env_vars_all() -> list[str]:
    """Every variable of docs/operations.md's Configuration table."""
    names = _table_vars(configuration_section())
    assert names, "no variables found in docs/operations.md's Configuration table"
    return names


def cluster_env_vars() -> list[str]:
    """Environment variables of docs/operations.md's "Cluster mode" table."""
    names = _table_vars(operations_section(r"^### Cluster mode$(.*?)(?=^##)", "Cluster mode"))
    assert names, "no variables found in docs/operations.md's Cluster mode table"
    return names


# Variables of the Configuration table the chart does not set, each with why:
# the broker's default holds in a pod. Kept honest by
# test_variables_the_chart_leaves_alone_are_documented_and_not_set.
NOT_SET_BY_CHART: dict[str, str] = {
    "TINYBROKER_MAX_SUBSCRIPTIONS_PER_SESSION": "no value for it yet: the broker's default holds",
    "TOKIO_WORKER_THREADS": "the broker takes one per CPU the pod's CPU limit allows",
    "OTEL_RESOURCE_ATTRIBUTES": "the chart names the service (otel.serviceName) and nothing more",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "only grpc, the default, is accepted",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "only grpc, the default, is accepted",
}


def documented_env_vars() -> list[str]:
    """The Configuration table's variables the chart sets (NOT_SET_BY_CHART aside)."""
    return [n for n in documented_env_vars_all() if n not in NOT_SET_BY_CHART]


def documented_defaults() -> dict[str, str]:
    """Variable to default, for each row of the Configuration table that names
    one variable and gives its default as one literal."""
    defaults = {}
    for cells in _table_rows(configuration_section()):
        name = re.fullmatch(r"`([A-Z][A-Z0-9_]+)`", cells[0])
        default = re.fullmatch(r"`([^`]+)`", cells[1])
        if name and default:
            defaults[name.group(1)] = default.group(1)
    assert defaults, "no defaults found in docs/operations.md's Configuration table"
    return defaults


def documented_metric_names() -> set[str]:
    """Metrics in the first column of the operator's Metrics table
    (docs/operations.md), cluster mode's included."""
    section = operations_section(r"^### Metrics$(.*?)(?=^###? )", "Metrics")
    names = set()
    for cells in _table_rows(section):
        names.update(re.findall(r"`(tinybroker_[a-z0-9_]+)`", cells[0]))
    assert names, "no metrics found in docs/operations.md's Metrics section"
    return names


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


def _cluster_mode(values_file: str) -> bool:
    return bool((yaml.safe_load(Path(values_file).read_text()) or {}).get("nats", {}).get("url"))


SINGLE_NODE_CI_VALUES = [f for f in CI_VALUES if not _cluster_mode(f)]
CLUSTER_CI_VALUES = [f for f in CI_VALUES if _cluster_mode(f)]
CLUSTER_ENV = {"TINYBROKER_NATS_URL", "TINYBROKER_NATS_PREFIX", "TINYBROKER_NATS_REPLICAS", "TINYBROKER_NATS_TOKEN",
               "TINYBROKER_NATS_CREDS", "TINYBROKER_NATS_CA", "TINYBROKER_REPLICA_ID"}


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


# === the Deployment ===


@pytest.mark.parametrize("values_file", SINGLE_NODE_CI_VALUES, ids=lambda p: Path(p).name)
def test_single_node_one_replica_recreated_never_rolled(values_file):
    deployment = one(render(values_files=(values_file,)), "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("values_file", SINGLE_NODE_CI_VALUES, ids=lambda p: Path(p).name)
def test_single_node_has_no_cluster_parts(values_file):
    """Without nats.url nothing of cluster mode is rendered: no NATS variables
    (the broker refuses TINYBROKER_NATS_* without TINYBROKER_NATS_URL), no
    replica id, no budget, no spread, liveness on gRPC health as before.
    (deploy/base/, compared below, pins the default rendering byte for byte.)"""
    docs = render(values_files=(values_file,))
    assert not of_kind(docs, "PodDisruptionBudget")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in pod
    container = broker_container(docs)
    assert not CLUSTER_ENV & set(env_of(container))
    assert "httpGet" not in container["livenessProbe"]
    assert not [v for v in pod.get("volumes", []) if v["name"].startswith("nats")]


@pytest.mark.parametrize("replicas", [2, 3, 10])
def test_more_than_one_replica_needs_nats_url(replicas):
    """replicaCount > 1 without nats.url stops the render with the chart's own
    message, which says what to set: not a schema bound's "maximum: got 3,
    want 1", which reads as if 1 replica were the chart's limit."""
    error = render_fails({"replicaCount": replicas})
    assert "replicaCount > 1 needs nats.url (cluster mode)" in error
    assert "maximum: got" not in error


def test_one_replica_in_cluster_mode_and_many_are_allowed():
    for replicas in (1, 2, 7):
        deployment = one(render({"replicaCount": replicas, "nats": {"url": "nats://nats:4222"}}), "Deployment")
        assert deployment["spec"]["replicas"] == replicas


@pytest.mark.parametrize("bad", [
    {"replicaCount": 0},
    {"nats": {"url": "nats:4222"}},
    {"nats": {"url": "http://nats:4222"}},
    {"nats": {"url": "nats://nats"}},
    {"nats": {"url": "nats://a:4222,"}},
    {"nats": {"url": "nats://nats:4222", "prefix": "a.b"}},
    {"nats": {"url": "nats://nats:4222", "prefix": "x" * 33}},
    {"nats": {"url": "nats://nats:4222", "replicas": 6}},
    {"nats": {"url": "nats://nats:4222", "tokenSecret": {"name": "s", "key": ""}}},
    {"nats": {"url": "nats://nats:4222"}, "podDisruptionBudget": {"maxUnavailable": 0}},
    {"nats": {"url": "nats://nats:4222"}, "topologySpread": {"zone": "Never"}},
], ids=lambda v: json.dumps(v, sort_keys=True))
def test_cluster_values_are_checked_by_the_schema(bad):
    assert "values don't meet the specifications of the schema" in render_fails(bad)


def test_nats_auth_without_nats_url_is_rejected():
    for key in ("tokenSecret", "credsSecret", "caSecret"):
        error = render_fails({"nats": {key: {"name": "s"}}})
        assert "need nats.url (cluster mode)" in error, key


# === cluster mode ===


CLUSTER_AUTH = {
    "replicaCount": 3,
    "nats": {
        "url": "tls://nats-0.nats:4222,tls://nats-1.nats:4222",
        "prefix": "tb_prod-1",
        "replicas": 1,
        "tokenSecret": {"name": "nats-auth", "key": "broker-token"},
        "credsSecret": {"name": "nats-user", "key": "user.creds"},
        "caSecret": {"name": "nats-ca", "key": "root.pem"},
    },
}


def test_cluster_values_render_the_nats_env():
    env = env_of(broker_container(render(CLUSTER_VALUES)))
    assert env["TINYBROKER_NATS_URL"] == {"name": "TINYBROKER_NATS_URL", "value": "nats://nats:4222"}
    assert env["TINYBROKER_NATS_PREFIX"]["value"] == "tinybroker"
    assert env["TINYBROKER_NATS_REPLICAS"]["value"] == "3"
    # Each replica is named by its pod, through the downward API.
    assert env["TINYBROKER_REPLICA_ID"] == {
        "name": "TINYBROKER_REPLICA_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    # No auth asked for, none set.
    assert not {"TINYBROKER_NATS_TOKEN", "TINYBROKER_NATS_CREDS", "TINYBROKER_NATS_CA"} & set(env)


def test_cluster_mode_leaves_the_default_message_limit_to_nats():
    """docs/operations.md, Cluster mode: with TINYBROKER_MAX_MESSAGE_BYTES unset a replica takes the largest
    message the NATS max_payload carries, so the chart's default is not set in cluster mode;
    any other value is."""
    env = env_of(broker_container(render(CLUSTER_VALUES)))
    assert "TINYBROKER_MAX_MESSAGE_BYTES" not in env
    bigger = {**CLUSTER_VALUES, "config": {"maxMessageBytes": 4194304}}
    env = env_of(broker_container(render(bigger)))
    assert env["TINYBROKER_MAX_MESSAGE_BYTES"]["value"] == "4194304"


def test_every_documented_cluster_variable_can_be_set_from_values():
    docs = render(CLUSTER_AUTH)
    container = broker_container(docs)
    env = env_of(container)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}

    def mounted_file(path: str) -> tuple[str, str]:
        """(Secret, key) whose file `path` is in the container."""
        directory, file = path.rsplit("/", 1)
        mount = mounts[directory]
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["defaultMode"] == 0o440  # the pod's fsGroup reads it, nobody else
        item = next(i for i in secret["items"] if i["path"] == file)
        return secret["secretName"], item["key"]

    expected_values = {
        "TINYBROKER_NATS_URL": "tls://nats-0.nats:4222,tls://nats-1.nats:4222",
        "TINYBROKER_NATS_PREFIX": "tb_prod-1",
        "TINYBROKER_NATS_REPLICAS": "1",
    }
    for name in cluster_env_vars():
        assert name in env, f"{name} (docs/operations.md, Cluster mode) is not set on the broker container"
        if name == "TINYBROKER_NATS_TOKEN":
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "nats-auth", "key": "broker-token"}
        elif name == "TINYBROKER_NATS_CREDS":
            assert mounted_file(env[name]["value"]) == ("nats-user", "user.creds")
        elif name == "TINYBROKER_NATS_CA":
            assert mounted_file(env[name]["value"]) == ("nats-ca", "root.pem")
        elif name == "TINYBROKER_REPLICA_ID":
            assert env[name]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        else:
            assert env[name].get("value") == expected_values[name], name
    # Nothing else new, and the Secrets are the user's: the chart creates none.
    known = set(documented_env_vars()) | set(cluster_env_vars())
    unknown = {n for n in env if n.startswith("TINYBROKER_")} - known
    assert not unknown, f"TINYBROKER_* variables not in docs/operations.md: {unknown}"
    assert not of_kind(docs, "Secret")


@pytest.mark.parametrize("values", [CLUSTER_VALUES, CLUSTER_AUTH, {"nats": {"url": "nats://nats:4222"}}],
                         ids=["3 replicas", "3 replicas, auth", "1 replica"])
def test_cluster_mode_rolls_one_replica_at_a_time(values):
    deployment = one(render(values), "Deployment")
    assert deployment["spec"]["replicas"] == values.get("replicaCount", 1)
    # A new replica first, an old one stopped only once it is ready: never
    # fewer than replicaCount serve during an upgrade.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def test_cluster_mode_has_a_disruption_budget_when_replicated():
    docs = render(CLUSTER_VALUES)
    pdb = one(docs, "PodDisruptionBudget")
    deployment = one(docs, "Deployment")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # It selects exactly the broker's pods.
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= one(docs, "Pod")["metadata"]["labels"].items()
    percent = one(render({**CLUSTER_VALUES, "podDisruptionBudget": {"maxUnavailable": "34%"}}), "PodDisruptionBudget")
    assert percent["spec"]["maxUnavailable"] == "34%"
    # One replica (nothing to keep), or switched off: no budget.
    assert not of_kind(render({"nats": {"url": "nats://nats:4222"}}), "PodDisruptionBudget")
    assert not of_kind(render({**CLUSTER_VALUES, "podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget")


def test_cluster_mode_spreads_over_nodes_and_zones():
    deployment = one(render(CLUSTER_VALUES), "Deployment")
    pod = deployment["spec"]["template"]
    constraints = {c["topologyKey"]: c for c in pod["spec"]["topologySpreadConstraints"]}
    assert sorted(constraints) == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    for c in constraints.values():
        assert c["maxSkew"] == 1
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"
        # The chart's selector labels: the broker's pods, and only them.
        assert c["labelSelector"] == {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
        assert c["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        # Spread each revision's pods among themselves during a rollout.
        assert c["matchLabelKeys"] == ["pod-template-hash"]
    hard = one(render({**CLUSTER_VALUES, "topologySpread": {"hostname": "DoNotSchedule"}}), "Deployment")
    when = {c["topologyKey"]: c["whenUnsatisfiable"] for c in hard["spec"]["template"]["spec"]["topologySpreadConstraints"]}
    assert when == {"kubernetes.io/hostname": "DoNotSchedule", "topology.kubernetes.io/zone": "ScheduleAnyway"}
    off = one(render({**CLUSTER_VALUES, "topologySpread": {"enabled": False}}), "Deployment")
    assert "topologySpreadConstraints" not in off["spec"]["template"]["spec"]


@pytest.mark.parametrize("values", [CLUSTER_VALUES, {**CLUSTER_AUTH, "tls": {"enabled": True, "existingSecret": "t"},
                                                      "probes": {"type": "exec"}}], ids=["grpc probes", "tls, exec probes"])
def test_cluster_liveness_survives_a_nats_outage(values):
    """gRPC health follows the NATS connection in cluster mode, so liveness
    asks /healthz (the process runs): a NATS outage must not restart every
    replica. Readiness still asks tinybroker.v1.Broker."""
    container = broker_container(render(values))
    liveness = container["livenessProbe"]
    assert liveness["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert "grpc" not in liveness and "exec" not in liveness
    assert liveness["periodSeconds"] == 10 and liveness["failureThreshold"] == 3
    readiness = container["readinessProbe"]
    if values.get("probes", {}).get("type") == "exec":
        assert "-service=tinybroker.v1.Broker" in readiness["exec"]["command"]
    else:
        assert readiness["grpc"]["service"] == "tinybroker.v1.Broker"


@pytest.mark.parametrize("values_file", CLUSTER_CI_VALUES, ids=lambda p: Path(p).name)
def test_cluster_ci_values_render_cluster_mode(values_file):
    docs = render(values_files=(values_file,))
    values = yaml.safe_load(Path(values_file).read_text())
    assert one(docs, "Deployment")["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert env_of(broker_container(docs))["TINYBROKER_NATS_URL"]["value"] == values["nats"]["url"]
    assert len(of_kind(docs, "PodDisruptionBudget")) == (1 if values.get("replicaCount", 1) > 1 else 0)


def test_cluster_test_hook_waits_for_delivery_not_matched_subscriptions():
    """matched_subscriptions counts the publishing replica's subscribers only,
    and the Service may send the publish elsewhere: the cluster round trip
    publishes until the subscriber has received."""
    script = one(render(CLUSTER_VALUES), "Pod")["spec"]["containers"][0]["command"][-1]
    assert "matched_subscriptions" not in script
    assert 'while kill -0 "$subscriber"' in script
    assert "tinybroker subscribe" in script and "tinybroker publish" in script


def test_cluster_notes_name_the_mode():
    result = subprocess.run(
        [os.environ["HELM"], "install", "rel", str(CHART), "--dry-run=client", "--namespace", "messaging",
         "--set", "nats.url=nats://nats:4222,replicaCount=3"],
        capture_output=True, text=True, env={**os.environ, "KUBECONFIG": os.devnull}, check=True,
    )
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "(cluster mode: 3 replicas over NATS at nats://nats:4222)" in notes
    assert "one replica, in-memory" not in notes


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


def test_every_documented_variable_can_be_set_from_values():
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
            "maxBatchMessages": 26,
            "shutdownGraceSeconds": 19,
            "metricsPerSubscription": False,
            "logFormat": "json",
            "rustLog": "debug,h2=info",
            "keepaliveIntervalSeconds": 21,
            "keepaliveTimeoutSeconds": 22,
            "maxStreamsPerConnection": 23,
            # The resource limits (docs/operations.md, Limits).
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
        "TINYBROKER_MAX_BATCH_MESSAGES": "26",
        "TINYBROKER_SHUTDOWN_GRACE_SECONDS": "19",
        "TINYBROKER_METRICS_PER_SUBSCRIPTION": "false",
        "TINYBROKER_LOG_FORMAT": "json",
        "RUST_LOG": "debug,h2=info",
        "TINYBROKER_TLS_CERT": "/etc/tinybroker/tls/tls.crt",
        "TINYBROKER_TLS_KEY": "/etc/tinybroker/tls/tls.key",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_SERVICE_NAME": "broker-under-test",
        "TINYBROKER_KEEPALIVE_INTERVAL_SECONDS": "21",
        "TINYBROKER_KEEPALIVE_TIMEOUT_SECONDS": "22",
        "TINYBROKER_MAX_STREAMS_PER_CONNECTION": "23",
        "TINYBROKER_CONSUMER_MAX_BYTES": "67108865",
        "TINYBROKER_GROUP_MAX_BYTES": "134217729",
        "TINYBROKER_MAX_MEMORY_BYTES": "402653184",
        "TINYBROKER_MAX_CONNECTIONS": "24",
        "TINYBROKER_HANDSHAKE_TIMEOUT_SECONDS": "25",
    }
    for name in documented_env_vars():
        assert name in env, f"{name} (docs/operations.md, Configuration) is not set on the broker container"
        if name == "TINYBROKER_AUTH_TOKEN":
            ref = env[name]["valueFrom"]["secretKeyRef"]
            secret = next(s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == ref["name"])
            assert base64.b64decode(secret["data"][ref["key"]]).decode() == "t0ken"
        else:
            assert env[name].get("value") == expected_values[name], name
    # Every variable the chart sets is documented, and every one documented is checked above.
    unknown = set(env) - set(documented_env_vars())
    assert not unknown, f"variables not in docs/operations.md's Configuration table: {unknown}"
    assert set(expected_values) | {"TINYBROKER_AUTH_TOKEN"} == set(documented_env_vars())


def test_variables_the_chart_leaves_alone_are_documented_and_not_set(default_docs):
    """A NOT_SET_BY_CHART entry is in docs/operations.md's Configuration table
    (else it is stale: remove it) and the chart does not set it."""
    for name, why in NOT_SET_BY_CHART.items():
        assert name in documented_env_vars_all(), \
            f"{name} is no longer in docs/operations.md: remove it from NOT_SET_BY_CHART ({why})"
    env = env_of(broker_container(default_docs))
    for name in NOT_SET_BY_CHART:
        assert name not in env, f"{name} is set by the chart, which NOT_SET_BY_CHART says it leaves alone"


def test_defaults_match_the_documented_ones(default_docs):
    """With default values the env carries docs/operations.md's defaults."""
    env = {n: e.get("value") for n, e in env_of(broker_container(default_docs)).items()}
    for name, default in documented_defaults().items():
        if name not in NOT_SET_BY_CHART:
            assert env[name] == default, name
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
    cluster_kinds = sorted(d["kind"] for d in render(CLUSTER_VALUES))
    assert cluster_kinds == ["Deployment", "Pod", "PodDisruptionBudget", "Service", "ServiceAccount"]


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
        if p.is_file() and str(p.relative_to(DEPLOY)) not in HAND_WRITTEN
    }
    assert sorted(actual) == sorted(expected), "deploy/ has other files than scripts/render-deploy.sh writes"
    stale = [name for name in expected if actual[name] != expected[name]]
    assert not stale, f"deploy/ is stale, run scripts/render-deploy.sh: {stale}"


def _kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([os.environ["KUBECTL"], "kustomize", str(directory)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return load_docs(result.stdout)


def _by_kind_and_name(docs: list[dict]) -> list[dict]:
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


def test_kustomize_build_equals_helm_template():
    assert _by_kind_and_name(_kustomize(DEPLOY)) == _by_kind_and_name(render(skip_tests=True))


def test_cluster_overlay_equals_helm_template():
    """deploy/cluster/ (hand-written patches over deploy/base/) is exactly the
    chart with nats.url=nats://nats:4222 and replicaCount=3."""
    overlay = _kustomize(DEPLOY / "cluster")
    assert _by_kind_and_name(overlay) == _by_kind_and_name(render(CLUSTER_VALUES, skip_tests=True))
    deployment = one(overlay, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert env_of(broker_container(overlay))["TINYBROKER_NATS_URL"]["value"] == "nats://nats:4222"


def test_monitoring_copies_are_identical():
    for name in ("alerts.yaml", "dashboard.json"):
        assert (DEPLOY / "monitoring" / name).read_bytes() == (CHART / "files" / name).read_bytes(), name


def _metric_names(text: str) -> set[str]:
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\btinybroker_[a-z0-9_]+", text)}


def test_alerts_and_dashboard_use_documented_metrics():
    known = documented_metric_names()
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    exprs = " ".join(r["expr"] for g in alerts["groups"] for r in g["rules"])
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    queries += " " + " ".join(json.dumps(v.get("query", "")) for v in dashboard["templating"]["list"])
    for where, text in (("alerts.yaml", exprs), ("dashboard.json", queries)):
        unknown = _metric_names(text) - known
        assert not unknown, f"{where} uses metrics docs/operations.md does not document: {unknown}"
    dashboard_metrics = _metric_names(queries)
    for wanted in (
        "tinybroker_messages_published_total", "tinybroker_messages_delivered_total",
        "tinybroker_subscription_queue_depth", "tinybroker_queue_fill_ratio", "tinybroker_evictions_total",
        "tinybroker_consumer_group_backlog", "tinybroker_consumer_group_in_flight",
        "tinybroker_consumer_group_oldest_unacked_age_seconds", "tinybroker_delivery_lag_seconds",
    ):
        assert wanted in dashboard_metrics, f"the dashboard has no panel for {wanted}"


# Gauges of a consumer group's state: in cluster mode every replica reports
# the cluster-wide value (docs/operations.md, Metrics: "aggregate with
# `max by (consumer_group)`, never `sum`").
GROUP_GAUGES = (
    "tinybroker_consumer_group_members", "tinybroker_consumer_group_backlog", "tinybroker_consumer_group_in_flight",
    "tinybroker_consumer_group_oldest_unacked_age_seconds", "tinybroker_consumer_group_stalled_seconds",
    "tinybroker_consumer_group_memberless_seconds",
)
# Functions a gauge may pass through inside the max by (...).
_PER_SERIES_FUNCTIONS = ("deriv",)


def _shipped_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every alert rule and dashboard target."""
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in alerts["groups"] for r in g["rules"]] + [
        (f'panel "{p["title"]}" {t["refId"]}', t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])
    ]


def _enclosing_aggregation(expr: str, at: int) -> str | None:
    """The text of the innermost aggregation around position `at` ("max by
    (job, consumer_group)"), climbing out of the per-series functions; None
    when the series is read bare."""
    depth, i = 0, at
    while i > 0:
        i -= 1
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth:
                depth -= 1
                continue
            before = expr[:i].rstrip()
            m = re.search(r"\b(sum|max|min|avg|count|topk|bottomk)\s+(by|without)\s*\([^()]*\)$", before)
            if m:
                return before[m.start():]
            if re.search(rf"\b({'|'.join(_PER_SERIES_FUNCTIONS)})$", before):
                continue
            return None
    return None


def test_group_gauges_are_read_with_max_by_consumer_group():
    """Never summed, never read per instance: one value per group, whichever
    replicas report it (and the same in single-node mode)."""
    problems, checked = [], 0
    for where, expr in _shipped_queries():
        for m in re.finditer(rf"\b({'|'.join(GROUP_GAUGES)})\b", expr):
            checked += 1
            aggregation = _enclosing_aggregation(expr, m.start())
            grouping = re.search(r"by\s*\(([^)]*)\)", aggregation or "")
            labels = {label.strip() for label in grouping.group(1).split(",")} if grouping else set()
            if not (aggregation and aggregation.startswith("max by") and "consumer_group" in labels
                    and "instance" not in labels):
                problems.append(f"{where}: {m.group(1)} read with {aggregation or 'no aggregation'}")
        for join in re.findall(r"\bon\s*\(([^)]*)\)", expr):
            # (Subscriptions are per replica: their joins may name the instance.)
            if re.search(rf"\b({'|'.join(GROUP_GAUGES)})\b", expr) and "instance" in join:
                problems.append(f"{where}: joins groups per instance: on ({join})")
    assert checked >= 15, f"only {checked} group gauge reads found"
    assert not problems, "\n".join(problems)


def test_nats_disconnected_alert_names_the_replica():
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    rule = next(r for g in alerts["groups"] for r in g["rules"] if r.get("alert") == "TinybrokerNatsDisconnected")
    assert rule["expr"] == "tinybroker_nats_connected == 0"
    assert rule["for"] == "1m"
    assert rule["labels"]["severity"] == "critical"
    for text in (rule["annotations"]["summary"], rule["annotations"]["description"]):
        assert "$labels.instance" in text and "$labels.pod" in text


def test_dashboard_shows_nats_connected_per_replica():
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == "NATS connected per replica")
    (target,) = panel["targets"]
    # One series per replica, not aggregated away.
    assert target["expr"].startswith('tinybroker_nats_connected{job=~"$job", instance=~"$instance"}')
    assert target["legendFormat"] == "{{instance}}"
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in steps] == ["red", "green"] and steps[1]["value"] == 1


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
