"""What scripts/check-image.sh needs to run the image the way the chart does.

    python chart_facts.py DEFAULT_RENDER EXEC_PROBES_RENDER OUT_DIR

Reads two `helm template` outputs (chart defaults, and the same with
probes.type=exec), writes OUT_DIR/env.list (the broker container's literal
env, for `docker run --env-file`) and prints bash assignments (shlex-quoted)
for the script to eval: the image, args, securityContext, memory limit,
terminationGracePeriodSeconds, the exec probe commands and the `helm test`
pod. Fails (non-zero, with the reason) when the rendered objects are not
shaped as expected, so a chart change cannot silently turn a check off.
"""

import shlex
import sys
from pathlib import Path

import yaml


def docs(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def one(items, what):
    if len(items) != 1:
        sys.exit(f"expected exactly one {what}, found {len(items)}")
    return items[0]


def deployment(path):
    return one([d for d in docs(path) if d["kind"] == "Deployment"], f"Deployment in {path}")


def test_pod(path):
    pods = [
        d for d in docs(path)
        if d["kind"] == "Pod" and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    return one(pods, f"helm test Pod in {path}")


def memory_bytes(quantity):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def main():
    default_render, exec_render, out_dir = sys.argv[1:]
    out = Path(out_dir)
    facts = {}
    arrays = {}

    dep = deployment(default_render)
    pod = dep["spec"]["template"]["spec"]
    container = one(pod["containers"], "broker container")
    pod_sc = pod["securityContext"]
    sc = container["securityContext"]

    env = []
    for var in container["env"]:
        if "value" not in var:
            sys.exit(f"env {var['name']} is not a literal value (valueFrom): not expected with the chart's defaults")
        if "\n" in var["value"]:
            sys.exit(f"env {var['name']} has a newline: docker --env-file cannot carry it")
        env.append(f"{var['name']}={var['value']}\n")
    (out / "env.list").write_text("".join(env))

    facts["CHART_IMAGE"] = container["image"]
    arrays["CHART_ARGS"] = container.get("args", [])
    facts["CHART_GRACE"] = pod["terminationGracePeriodSeconds"]
    facts["CHART_RUN_AS_NON_ROOT"] = str(pod_sc.get("runAsNonRoot", False)).lower()
    facts["CHART_RUN_AS_USER"] = sc.get("runAsUser", pod_sc.get("runAsUser", ""))
    facts["CHART_RUN_AS_GROUP"] = sc.get("runAsGroup", pod_sc.get("runAsGroup", ""))
    facts["CHART_SECCOMP"] = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type", "")

    # The docker equivalents of the container securityContext. Each one the
    # chart sets becomes a flag; check-image.sh requires all three.
    flags = []
    if sc.get("readOnlyRootFilesystem") is True:
        flags.append("--read-only")
    if sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"):
        flags += ["--cap-drop", "ALL"]
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    if sc.get("privileged"):
        sys.exit("the chart runs the broker privileged")
    arrays["CHART_SECURITY_FLAGS"] = flags

    limits = (container.get("resources") or {}).get("limits") or {}
    facts["CHART_MEMORY_LIMIT"] = memory_bytes(str(limits["memory"])) if "memory" in limits else ""

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    facts["CHART_GRPC_PORT"] = ports["grpc"]
    facts["CHART_METRICS_PORT"] = ports["metrics"]

    exec_container = one(deployment(exec_render)["spec"]["template"]["spec"]["containers"], "broker container")
    for kind in ("liveness", "readiness"):
        probe = exec_container[f"{kind}Probe"]
        if "exec" not in probe:
            sys.exit(f"probes.type=exec rendered no exec {kind} probe")
        arrays[f"CHART_{kind.upper()}_CMD"] = probe["exec"]["command"]
        facts[f"CHART_{kind.upper()}_TIMEOUT"] = probe.get("timeoutSeconds", 1)

    test = test_pod(default_render)
    init = one(test["spec"]["initContainers"], "test init container")
    runner = one(test["spec"]["containers"], "test container")
    if runner["image"] != container["image"]:
        sys.exit(f"the test pod runs {runner['image']}, not the broker image {container['image']}")
    arrays["TEST_INIT_CMD"] = init["command"]
    facts["TEST_TOOLS_IMAGE"] = init["image"]
    command = runner["command"]
    if len(command) != 3 or command[1] != "-euc":
        sys.exit(f"unexpected test command shape: {command[:2]}")
    facts["TEST_SHELL"] = command[0]
    (out / "test-script.sh").write_text(command[2])
    facts["TEST_PATH"] = one([e["value"] for e in runner["env"] if e["name"] == "PATH"], "PATH in the test container")
    facts["TEST_DEADLINE"] = test["spec"].get("activeDeadlineSeconds", 120)
    mounts = {m["name"]: m["mountPath"] for m in runner["volumeMounts"]}
    facts["TEST_TOOLS_MOUNT"] = mounts["tools"]
    facts["TEST_WORK_MOUNT"] = mounts["work"]
    addr = one([line.split("=", 1)[1] for line in command[2].splitlines() if line.strip().startswith("addr=")],
               "addr= line in the test script")
    facts["TEST_SERVICE_HOST"], facts["TEST_SERVICE_PORT"] = addr.rsplit(":", 1)

    for name, value in facts.items():
        print(f"{name}={shlex.quote(str(value))}")
    for name, values in arrays.items():
        print(f"{name}=({' '.join(shlex.quote(str(v)) for v in values)})")


if __name__ == "__main__":
    main()
