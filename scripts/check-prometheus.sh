#!/usr/bin/env bash
# Checks tinybroker's Prometheus side (issue 4) with real Prometheus tools, on a
# fresh Debian 12 machine as root (it installs Debian's prometheus package,
# which gives promtool and the server, when they are missing):
#
#   1. starts the broker ($BROKER_BIN, default target/debug/tinybroker) on
#      127.0.0.1 ephemeral ports, opens a broadcast subscriber and a
#      manual-ack consumer group member (group "g") with the CLI, publishes $CHECK_PUBLISH_COUNT
#      (default 25) messages with the CLI
#   2. scrapes /metrics: `promtool check metrics` must be silent, the counters
#      show what was published and delivered, and every metric name, label
#      name and label value the shipped dashboard and alert rules use exists
#      in the real exposition
#   3. `promtool check rules` and `promtool test rules` on deploy/monitoring/,
#      whose files must be identical to the chart's files/; every dashboard
#      panel has thresholds
#   4. runs a Prometheus server on 127.0.0.1 scraping the broker every second
#      with the alert rules loaded (evaluated every second), and asserts through its HTTP API that
#      up{job="tinybroker"} == 1, that tinybroker_messages_published_total
#      shows the published count, that every alert rule is loaded and
#      evaluates, that none fires against the healthy broker, and that every
#      dashboard query evaluates and returns data (except the incident-only
#      series below, absent while the broker is healthy)
#   5. stops Prometheus by its PID and the broker with SIGTERM (exit 0)
#
# The series that name an incident (tinybroker_recent_*: a recent eviction, a
# group removed with its backlog) exist only after one; the names and
# "returns data" checks accept their absence here, and tests/monitoring/
# (scripts/check-alerts-live.sh) creates the incidents and checks them live.
#
# Everything started is stopped by PID in an EXIT trap, also on failure. The
# run uses a copy of the binary, so a rebuild meanwhile does not disturb it.
# Prints one line per check and a final "N passed, M failed"; exits non-zero
# when anything failed. Logs and data are kept in a temporary directory when
# something failed (removed otherwise).
#
# Environment:
#   BROKER_BIN         broker binary (default target/debug/tinybroker)
#   CHECK_PUBLISH_COUNT    messages to publish (default 25)
#   CHECK_EXPECT_PUBLISHED the published count Prometheus must show (default:
#                          CHECK_PUBLISH_COUNT; set it wrong to see the check fail)
#   CHECK_PROMETHEUS_TIMEOUT seconds to wait for Prometheus (default 60)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BROKER_BIN:-$ROOT/target/debug/tinybroker}"
# A relative BROKER_BIN is relative to where the script was started.
[[ "$BIN" == /* ]] || BIN="$PWD/$BIN"
cd "$ROOT"

PUBLISH_COUNT="${CHECK_PUBLISH_COUNT:-25}"
EXPECT_PUBLISHED="${CHECK_EXPECT_PUBLISHED:-$PUBLISH_COUNT}"
PROM_TIMEOUT="${CHECK_PROMETHEUS_TIMEOUT:-60}"
ALERTS="$ROOT/deploy/monitoring/alerts.yaml"
ALERTS_TEST="$ROOT/deploy/monitoring/alerts_test.yaml"
DASHBOARD="$ROOT/deploy/monitoring/dashboard.json"
GROUP="g"
SHUTDOWN_GRACE=5

passed=0
failed=0
failures=()
started=$SECONDS

pass() {
    passed=$((passed + 1))
    printf 'ok    %s\n' "$1"
}

# fail NAME [DETAIL...]: DETAIL lines (or stdin when none) are printed indented.
fail() {
    local name="$1"
    shift
    failed=$((failed + 1))
    failures+=("$name")
    printf 'FAIL  %s\n' "$name"
    if (($# > 0)); then
        printf '%s\n' "$@" | sed 's/^/      /'
    fi
}

summary() {
    echo
    echo "prometheus checks took $((SECONDS - started))s"
    if ((failed > 0)); then
        printf 'failed: %s\n' "${failures[@]}"
    fi
    echo "$passed passed, $failed failed"
}

# abort NAME DETAIL...: a check whose failure makes the rest meaningless.
abort() {
    fail "$@"
    summary
    exit 1
}

# === tools ===

if [[ ! -f "$BIN" || ! -x "$BIN" ]]; then
    echo "tinybroker binary not found or not executable: $BIN" >&2
    echo "build it (cargo build) or point BROKER_BIN at one" >&2
    exit 2
fi
if ! [[ "$PUBLISH_COUNT" =~ ^[1-9][0-9]*$ && "$EXPECT_PUBLISHED" =~ ^[0-9]+$ && "$PROM_TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
    echo "CHECK_PUBLISH_COUNT, CHECK_EXPECT_PUBLISHED and CHECK_PROMETHEUS_TIMEOUT must be whole numbers" >&2
    exit 2
fi

# Debian packages for the commands used here; apt-get update only when the
# install fails without it (a fresh machine's package lists may be stale).
declare -A PACKAGE_OF=([promtool]=prometheus [prometheus]=prometheus [curl]=curl [python3]=python3)
missing=()
for cmd in promtool prometheus curl python3; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("${PACKAGE_OF[$cmd]}")
done
if ((${#missing[@]} > 0)); then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    echo "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    hash -r
fi
echo "== $(promtool --version 2>&1 | head -n 1)"

# === scratch space and cleanup ===

TMP="$(mktemp -d "${TMPDIR:-/tmp}/tinybroker-prometheus.XXXXXX")"
BROKER_PID=""
PROM_PID=""
CLIENT_PIDS=()

# stop_pid PID SECONDS: SIGTERM, wait up to SECONDS, then SIGKILL. Sets
# STOP_RC to the exit status (or "killed" / "not ours").
stop_pid() {
    local pid="$1" limit="$2" i
    STOP_RC=""
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < limit * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        STOP_RC="killed"
        return 0
    fi
    STOP_RC=0
    wait "$pid" 2>/dev/null || STOP_RC=$?
}

cleanup() {
    local rc=$? pid
    for pid in "${CLIENT_PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null && stop_pid "$pid" 2
    done
    [[ -n "$PROM_PID" ]] && kill -0 "$PROM_PID" 2>/dev/null && stop_pid "$PROM_PID" 10
    [[ -n "$BROKER_PID" ]] && kill -0 "$BROKER_PID" 2>/dev/null && stop_pid "$BROKER_PID" $((SHUTDOWN_GRACE + 5))
    if ((rc == 0 && failed == 0)); then
        rm -rf "$TMP"
    else
        echo "logs and data kept in $TMP"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The run uses a snapshot of the binary: the broker and the CLI calls are
# then the same build even when target/ is rebuilt during the run.
cp "$BIN" "$TMP/tinybroker"
TB="$TMP/tinybroker"

# Python helpers (standard library only): exposition parsing, Prometheus API
# answers, the dashboard's queries.
cat >"$TMP/helper.py" <<'PY'
import json
import re
import socket
import sys
import urllib.parse
import urllib.request


def parse_exposition(path):
    """(types by family, [(sample name, labels, value)]) of a text exposition."""
    types, samples = {}, []
    for line in open(path, encoding="utf-8"):
        line = line.rstrip("\n")
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)", line)
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        samples.append((m.group(1), labels, float(m.group(3))))
    return types, samples


def selector_labels(selector):
    return dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', selector))


def cmd_value(path, selector):
    """Value of the one sample NAME{labels} (exact label set) in a scrape."""
    name = selector.split("{", 1)[0]
    want = selector_labels(selector[len(name):])
    for sample, labels, value in parse_exposition(path)[1]:
        if sample == name and labels == want:
            print(f"{value:g}")
            return 0
    print("absent")
    return 1


def prometheus_get(base, path, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.load(answer)


def cmd_query(base, query):
    """Values of an instant query's result, one line each ("" when empty)."""
    data = prometheus_get(base, "/api/v1/query", query=query)["data"]
    for series in data["result"]:
        print(f"{float(series['value'][1]):g}")
    return 0


# Metrics (and the labels only they carry) that exist only after an incident:
# absent from a healthy broker's exposition; tests/monitoring/ checks them.
INCIDENT_ONLY = {
    "tinybroker_recent_eviction_timestamp_seconds",
    "tinybroker_recent_group_removal_timestamp_seconds",
    "tinybroker_recent_group_removal_dropped_messages",
}
INCIDENT_LABELS = {"peer", "topic_patterns"}
# Metrics a broker reports in cluster mode only (TINYBROKER_NATS_URL set):
# absent from this single-node broker's exposition; tests/cluster/ checks them.
CLUSTER_ONLY = {"tinybroker_nats_connected", "tinybroker_nats_reconnects_total"}


def incident_only(query):
    names = set(re.findall(r"\b(?:tinybroker|process)_[a-z0-9_]+\b", query))
    return bool(names) and names <= INCIDENT_ONLY | CLUSTER_ONLY


def dashboard_queries(path, job, instance):
    """(where, PromQL) of every dashboard target and template variable, with
    the Grafana variables replaced as Grafana would for one job and instance."""
    dashboard = json.load(open(path, encoding="utf-8"))
    replace = [("$__rate_interval", "1m"), ("$__interval", "1m"), ("$__range", "5m"),
               ("$job", job), ("$instance", instance)]

    def fill(expr):
        for var, value in replace:
            expr = expr.replace(var, value)
        return expr

    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f'panel "{panel["title"]}" {target["refId"]}', fill(target["expr"])))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if isinstance(query, str) and query.startswith("label_values("):
            m = re.fullmatch(r"label_values\((.*),\s*([a-zA-Z_]+)\)", query)
            out.append((f"variable ${var['name']}", fill(m.group(1)) + f" @label {m.group(2)}"))
    return out


def cmd_dashboard(base, path, job, instance):
    """Every dashboard query evaluates in Prometheus and returns data."""
    problems, queries, empty = [], dashboard_queries(path, job, instance), 0
    for where, query in queries:
        label = None
        if " @label " in query:
            query, label = query.split(" @label ")
        try:
            answer = prometheus_get(base, "/api/v1/query", query=query)
        except Exception as error:  # an HTTP 400 carries the PromQL error
            body = getattr(error, "read", lambda: b"")().decode(errors="replace")
            problems.append(f"{where}: {error} {body}\n    {query}")
            continue
        result = answer["data"]["result"]
        if not result and incident_only(query):
            empty += 1
        elif not result:
            problems.append(f"{where}: no data\n    {query}")
        elif label and not any(label in s["metric"] for s in result):
            problems.append(f"{where}: no series has label {label}\n    {query}")
    print(f"{len(queries)} queries, {empty} of incident-only series empty while healthy")
    print("\n".join(problems))
    return 1 if problems else 0


def cmd_thresholds(path):
    """Every panel (rows aside) has a threshold step above its base colour, in
    its defaults or in a field override."""
    def steps(t):
        return len((t or {}).get("steps") or [])

    missing = []
    panels = [p for p in json.load(open(path, encoding="utf-8"))["panels"] if p["type"] != "row"]
    for panel in panels:
        config = panel.get("fieldConfig", {})
        overridden = any(prop.get("id") == "thresholds" and steps(prop.get("value")) >= 2
                         for o in config.get("overrides", []) for prop in o.get("properties", []))
        if steps(config.get("defaults", {}).get("thresholds")) < 2 and not overridden:
            missing.append(panel["title"])
    print(f"{len(panels)} panels")
    print("\n".join(f"no thresholds: {t}" for t in missing))
    return 1 if missing else 0


def cmd_rules(base, *names):
    """Every named alert rule is loaded and has been evaluated without error."""
    rules = {r["name"]: r for g in prometheus_get(base, "/api/v1/rules")["data"]["groups"] for r in g["rules"]}
    problems = [f"{n}: not loaded" for n in names if n not in rules]
    problems += [f"{n}: health {rules[n].get('health')} {rules[n].get('lastError', '')}".rstrip()
                 for n in names if n in rules and rules[n].get("health") != "ok"]
    print(f"{len(rules)} rules loaded: {', '.join(sorted(rules))}")
    print("\n".join(problems))
    return 1 if problems else 0


def cmd_firing(base):
    alerts = prometheus_get(base, "/api/v1/alerts")["data"]["alerts"]
    firing = [a for a in alerts if a["state"] == "firing"]
    for a in firing:
        print(json.dumps(a["labels"], sort_keys=True))
    return 1 if firing else 0


def cmd_rule_dump(base, out):
    json.dump(prometheus_get(base, "/api/v1/rules"), open(out, "w", encoding="utf-8"))
    return 0


METRIC = re.compile(r"\b(?:tinybroker|process)_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b((?:tinybroker|process)_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
LITERAL_ALTERNATIVES = re.compile(r"[A-Za-z0-9_.:+-]+(\|[A-Za-z0-9_.:+-]+)*")
# Label names that come from the scrape target, not from the exposition.
TARGET_LABELS = {"job", "instance"}
# Label names Kubernetes service discovery adds to the target (the Prometheus
# Operator's ServiceMonitor, the usual kubernetes-pods job); alerts may name them.
KUBERNETES_TARGET_LABELS = {"pod"}


def cmd_names(scrape, dashboard_path, rules_path):
    """Every metric, label name and label value the dashboard and the loaded
    alert rules use exists in the scrape."""
    _, samples = parse_exposition(scrape)
    sample_names = {s for s, _, _ in samples}
    label_names = {k for _, labels, _ in samples for k in labels} | TARGET_LABELS | INCIDENT_LABELS
    label_names |= KUBERNETES_TARGET_LABELS
    sample_names |= INCIDENT_ONLY | CLUSTER_ONLY
    values = {}
    for sample, labels, _ in samples:
        for k, v in labels.items():
            values.setdefault((sample, k), set()).add(v)

    texts = []  # (where, PromQL, [label names used by templates])
    dashboard = json.load(open(dashboard_path, encoding="utf-8"))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            legend = re.findall(r"\{\{\s*([a-zA-Z_]+)\s*\}\}", target.get("legendFormat", ""))
            texts.append((f'dashboard "{panel["title"]}"', target["expr"], legend))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if isinstance(query, str) and query:
            m = re.fullmatch(r"label_values\((.*),\s*([a-zA-Z_]+)\)", query)
            texts.append((f"dashboard variable ${var['name']}", m.group(1) if m else query,
                          [m.group(2)] if m else []))
    rules = json.load(open(rules_path, encoding="utf-8"))["data"]["groups"]
    for group in rules:
        for rule in group["rules"]:
            templates = " ".join(list(rule.get("annotations", {}).values()) + list(rule.get("labels", {}).values()))
            texts.append((f"alert {rule['name']}", rule["query"], re.findall(r"\$labels\.([a-zA-Z_]+)", templates)))

    problems, checked_names, checked_values, checked_labels = [], set(), 0, set()
    for where, expr, template_labels in texts:
        for name in METRIC.findall(expr):
            checked_names.add(name)
            if name not in sample_names:
                problems.append(f"{where}: metric {name} is not in the exposition")
        for name, matchers in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(matchers):
                checked_labels.add(label)
                if label not in label_names:
                    problems.append(f"{where}: label {label} (on {name}) is not in the exposition")
                if label in TARGET_LABELS or op not in ("=", "=~") or "$" in value:
                    continue
                if op == "=~" and not LITERAL_ALTERNATIVES.fullmatch(value):
                    continue
                seen = values.get((name, label), set())
                for literal in value.split("|") if op == "=~" else [value]:
                    checked_values += 1
                    if literal not in seen:
                        problems.append(f'{where}: {name}{{{label}="{literal}"}} is not in the exposition'
                                        f" (values there: {', '.join(sorted(seen)) or 'none'})")
        grouping = re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in [l.strip() for g in grouping for l in g.split(",") if l.strip()] + template_labels:
            checked_labels.add(label)
            if label not in label_names:
                problems.append(f"{where}: label {label} is not in the exposition")
    print(f"{len(checked_names)} metric names, {len(checked_labels)} label names, "
          f"{checked_values} label values checked")
    print("\n".join(sorted(set(problems))))
    return 1 if problems else 0


def cmd_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        print(s.getsockname()[1])
    return 0


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    sys.exit(globals()[f"cmd_{command.replace('-', '_')}"](*args))
PY
helper() { python3 "$TMP/helper.py" "$@"; }

# wait_for SECONDS COMMAND...: retries COMMAND every 0.2 s until it succeeds.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

# === 1. broker, subscribers, publishes ===
echo "== broker"

strip_ansi() { sed 's/\x1b\[[0-9;]*m//g' "$@"; }
started_line() { strip_ansi "$TMP/broker.log" | grep -m 1 'tinybroker started'; }

env -u TINYBROKER_AUTH_TOKEN -u TINYBROKER_TLS_CERT -u TINYBROKER_TLS_KEY -u OTEL_EXPORTER_OTLP_ENDPOINT \
    RUST_LOG=info TINYBROKER_LOG_FORMAT=text \
    TINYBROKER_GRPC_ADDR=127.0.0.1:0 TINYBROKER_METRICS_ADDR=127.0.0.1:0 \
    TINYBROKER_METRICS_PER_SUBSCRIPTION=true TINYBROKER_SHUTDOWN_GRACE_SECONDS=$SHUTDOWN_GRACE \
    "$TB" serve >"$TMP/broker.out" 2>"$TMP/broker.log" &
BROKER_PID=$!
broker_up() { started_line >/dev/null || ! kill -0 "$BROKER_PID" 2>/dev/null; }
wait_for 30 broker_up || true
if ! line="$(started_line)"; then
    abort "broker starts and logs its addresses" "$(tail -n 20 "$TMP/broker.log")"
fi
GRPC_ADDR="$(sed -nE 's/.*grpc_addr="?([0-9.]+:[0-9]+).*/\1/p' <<<"$line")"
METRICS_ADDR="$(sed -nE 's/.*metrics_addr="?([0-9.]+:[0-9]+).*/\1/p' <<<"$line")"
if [[ -z "$GRPC_ADDR" || -z "$METRICS_ADDR" ]]; then
    abort "broker starts and logs its addresses" "no grpc_addr/metrics_addr in: $line"
fi
GRPC_URL="http://$GRPC_ADDR"
METRICS_URL="http://$METRICS_ADDR"
pass "broker started (pid $BROKER_PID, grpc $GRPC_ADDR, metrics $METRICS_ADDR)"

if wait_for 10 curl -fsS "$METRICS_URL/readyz" && curl -fsS "$METRICS_URL/healthz" >/dev/null; then
    pass "/healthz and /readyz answer 200"
else
    fail "/healthz and /readyz answer 200" "$(curl -sS -i "$METRICS_URL/readyz" 2>&1 | head -n 5)"
fi

# Both subscribers take every message published (and one more at the end, so
# that they are still connected, with their series, while Prometheus scrapes).
# The member acks each message (--manual-ack), so the per-member series of a
# manual-ack member (tinybroker_subscription_stalled_seconds, ...) that the
# alerts read are in the exposition.
TOTAL=$((PUBLISH_COUNT + 1))
"$TB" subscribe 'check.>' --addr "$GRPC_URL" --id check-broadcast --count "$TOTAL" \
    >"$TMP/sub-broadcast.out" 2>"$TMP/sub-broadcast.err" &
SUB_BROADCAST=$!
CLIENT_PIDS+=("$SUB_BROADCAST")
"$TB" subscribe 'check.>' --addr "$GRPC_URL" --group "$GROUP" --manual-ack --count "$TOTAL" \
    >"$TMP/sub-group.out" 2>"$TMP/sub-group.err" &
SUB_GROUP=$!
CLIENT_PIDS+=("$SUB_GROUP")

scrape() { curl -fsS --max-time 5 "$METRICS_URL/metrics" -o "$TMP/$1"; }
# metric_is FILE SERIES VALUE: the scrape FILE has SERIES (exact labels) = VALUE.
metric_is() { [[ "$(helper value "$TMP/$1" "$2")" == "$3" ]]; }
subscribed() {
    scrape subscribed.txt &&
        metric_is subscribed.txt 'tinybroker_subscriptions{mode="multi"}' 1 &&
        metric_is subscribed.txt "tinybroker_consumer_group_members{consumer_group=\"$GROUP\"}" 1
}
if wait_for 20 subscribed; then
    pass "a broadcast subscriber and a member of group $GROUP are connected (metrics show them)"
else
    abort "a broadcast subscriber and a member of group $GROUP are connected (metrics show them)" \
        "$(grep -E 'tinybroker_subscriptions|consumer_group_members' "$TMP/subscribed.txt" 2>/dev/null)" \
        "$(cat "$TMP"/sub-*.err)"
fi

bad_publishes=()
for ((i = 1; i <= PUBLISH_COUNT; i++)); do
    if ! out="$("$TB" publish check.messages "message $i" --addr "$GRPC_URL" 2>&1)" ||
        ! [[ "$out" =~ ^sequence=[0-9]+\ matched_subscriptions=1\ matched_groups=1$ ]]; then
        bad_publishes+=("message $i: $out")
    fi
done
if ((${#bad_publishes[@]} == 0)); then
    pass "published $PUBLISH_COUNT messages with the CLI (each matched 1 subscription and 1 group)"
else
    fail "published $PUBLISH_COUNT messages with the CLI (each matched 1 subscription and 1 group)" \
        "${bad_publishes[@]:0:5}"
fi

delivered() {
    scrape delivered.txt &&
        metric_is delivered.txt 'tinybroker_messages_delivered_total{mode="multi"}' "$PUBLISH_COUNT" &&
        metric_is delivered.txt 'tinybroker_messages_delivered_total{mode="single"}' "$PUBLISH_COUNT"
}
if wait_for 15 delivered; then
    pass "tinybroker_messages_delivered_total is $PUBLISH_COUNT for mode=\"multi\" and mode=\"single\""
else
    fail "tinybroker_messages_delivered_total is $PUBLISH_COUNT for mode=\"multi\" and mode=\"single\"" \
        "$(grep '^tinybroker_messages_delivered_total' "$TMP/delivered.txt" 2>/dev/null)"
fi

# === 2. the exposition ===
echo "== /metrics"

if ! scrape metrics.txt; then
    abort "scrape $METRICS_URL/metrics" "$(curl -sS -i "$METRICS_URL/metrics" 2>&1 | head -n 5)"
fi
pass "scraped /metrics ($(grep -c '^# TYPE' "$TMP/metrics.txt") families, $(grep -vc '^#' "$TMP/metrics.txt") samples)"

lint_rc=0
promtool check metrics <"$TMP/metrics.txt" >"$TMP/promtool-check-metrics.txt" 2>&1 || lint_rc=$?
if ((lint_rc == 0)) && [[ ! -s "$TMP/promtool-check-metrics.txt" ]]; then
    pass "promtool check metrics: no findings"
else
    fail "promtool check metrics (exit $lint_rc)" "$(cat "$TMP/promtool-check-metrics.txt")"
fi

published="$(helper value "$TMP/metrics.txt" tinybroker_messages_published_total || true)"
if [[ "$published" == "$EXPECT_PUBLISHED" ]]; then
    pass "/metrics: tinybroker_messages_published_total $published"
else
    fail "/metrics: tinybroker_messages_published_total is $EXPECT_PUBLISHED" "it is $published"
fi

# === 3. rules ===
echo "== alert rules"

if out="$(cmp "$ALERTS" helm/tinybroker/files/alerts.yaml 2>&1 && cmp "$DASHBOARD" helm/tinybroker/files/dashboard.json 2>&1)"; then
    pass "deploy/monitoring/ alerts.yaml and dashboard.json are the chart's files/ copies"
else
    fail "deploy/monitoring/ alerts.yaml and dashboard.json are the chart's files/ copies" "$out" \
        "run scripts/render-deploy.sh"
fi
if out="$(promtool check rules "$ALERTS" 2>&1)"; then
    pass "promtool check rules deploy/monitoring/alerts.yaml ($(grep -o '[0-9]* rules found' <<<"$out"))"
else
    fail "promtool check rules deploy/monitoring/alerts.yaml" "$out"
fi
if out="$(cd "$(dirname "$ALERTS_TEST")" && promtool test rules "$(basename "$ALERTS_TEST")" 2>&1)"; then
    pass "promtool test rules deploy/monitoring/alerts_test.yaml"
else
    fail "promtool test rules deploy/monitoring/alerts_test.yaml" "$out"
fi
if out="$(helper thresholds "$DASHBOARD" 2>&1)"; then
    pass "every dashboard panel has thresholds ($(head -n 1 <<<"$out"))"
else
    fail "every dashboard panel has thresholds" "$out"
fi
mapfile -t ALERT_NAMES < <(sed -nE 's/^[[:space:]]*-[[:space:]]*alert:[[:space:]]*([A-Za-z0-9_]+).*/\1/p' "$ALERTS")

# === 4. a Prometheus server scraping the broker ===
echo "== prometheus server"

# The shipped rules, evaluated every second like the scrapes (alerts.yaml's
# group interval is 30 s, for the chart's 30 s scrape interval).
if ! grep -q '^    interval: 30s$' "$ALERTS"; then
    abort "alerts.yaml evaluates its group every 30 s" "no '    interval: 30s' line in $ALERTS"
fi
sed 's/^    interval: 30s$/    interval: 1s/' "$ALERTS" >"$TMP/alerts.yaml"
cat >"$TMP/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $TMP/alerts.yaml
scrape_configs:
  - job_name: tinybroker
    static_configs:
      - targets: ["$METRICS_ADDR"]
EOF
if out="$(promtool check config "$TMP/prometheus.yml" 2>&1)"; then
    pass "promtool check config (the generated prometheus.yml)"
else
    fail "promtool check config (the generated prometheus.yml)" "$out"
fi

# A free port can be taken between picking and binding: try a few.
PROM_URL=""
for _ in 1 2 3; do
    port="$(helper free-port)"
    prometheus --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/prometheus-data" \
        --web.listen-address="127.0.0.1:$port" --log.level=warn \
        >"$TMP/prometheus.log" 2>&1 &
    PROM_PID=$!
    prom_ready() { curl -fsS --max-time 2 "http://127.0.0.1:$port/-/ready" || ! kill -0 "$PROM_PID" 2>/dev/null; }
    wait_for 30 prom_ready || true
    if kill -0 "$PROM_PID" 2>/dev/null && curl -fsS --max-time 2 "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1; then
        PROM_URL="http://127.0.0.1:$port"
        break
    fi
    stop_pid "$PROM_PID" 5
    PROM_PID=""
    grep -q 'address already in use' "$TMP/prometheus.log" || break
done
if [[ -z "$PROM_URL" ]]; then
    abort "prometheus starts on 127.0.0.1" "$(tail -n 20 "$TMP/prometheus.log")"
fi
pass "prometheus $(prometheus --version 2>&1 | sed -nE '1s/.*version ([^ ]+).*/\1/p') started (pid $PROM_PID, $PROM_URL)"

query() { helper query "$PROM_URL" "$1" 2>/dev/null; }
last_up="" last_published=""
scraped() {
    last_up="$(query 'up{job="tinybroker"}')"
    last_published="$(query 'tinybroker_messages_published_total{job="tinybroker"}')"
    [[ "$last_up" == 1 && "$last_published" == "$EXPECT_PUBLISHED" ]]
}
wait_for "$PROM_TIMEOUT" scraped || true
if [[ "$last_up" == 1 ]]; then
    pass "prometheus: up{job=\"tinybroker\"} == 1"
else
    fail "prometheus: up{job=\"tinybroker\"} == 1" "up is '${last_up:-no data}' after ${PROM_TIMEOUT}s" \
        "$(tail -n 5 "$TMP/prometheus.log")"
fi
if [[ "$last_published" == "$EXPECT_PUBLISHED" ]]; then
    pass "prometheus: tinybroker_messages_published_total == $EXPECT_PUBLISHED"
else
    fail "prometheus: tinybroker_messages_published_total == $EXPECT_PUBLISHED" \
        "it is '${last_published:-no data}' after ${PROM_TIMEOUT}s"
fi

# Rules have been evaluated once their health is "ok"; the dashboard's rate()
# queries need a few samples in their window.
rules_ok() { helper rules "$PROM_URL" "${ALERT_NAMES[@]}"; }
wait_for 15 rules_ok || true
if out="$(rules_ok 2>&1)"; then
    pass "prometheus: all ${#ALERT_NAMES[@]} alert rules of alerts.yaml loaded and evaluating (health ok)"
else
    fail "prometheus: all ${#ALERT_NAMES[@]} alert rules of alerts.yaml loaded and evaluating (health ok)" "$out"
fi
if out="$(helper firing "$PROM_URL" 2>&1)"; then
    pass "prometheus: no alert fires against the healthy broker"
else
    fail "prometheus: no alert fires against the healthy broker" "$out"
fi

helper rule-dump "$PROM_URL" "$TMP/rules.json" || true
if out="$(helper names "$TMP/metrics.txt" "$DASHBOARD" "$TMP/rules.json" 2>&1)"; then
    pass "dashboard and alerts use only names and label values in the exposition ($(head -n 1 <<<"$out"))"
else
    fail "dashboard and alerts use only names and label values in the exposition" "$out"
fi

enough_samples() { [[ "$(query 'count_over_time(up{job="tinybroker"}[1m])')" -ge 4 ]]; }
wait_for 15 enough_samples || true
dashboard_ok() { helper dashboard "$PROM_URL" "$DASHBOARD" tinybroker "$METRICS_ADDR"; }
wait_for 10 dashboard_ok || true
if out="$(dashboard_ok 2>&1)"; then
    pass "prometheus: every dashboard query evaluates and returns data ($(head -n 1 <<<"$out"))"
else
    fail "prometheus: every dashboard query evaluates and returns data" "$out"
fi

# === 5. shutdown ===
echo "== shutdown"

# One more message ends both subscribers (--count), cleanly.
"$TB" publish check.done "the end" --addr "$GRPC_URL" >/dev/null 2>&1 || true
for pair in "broadcast:$SUB_BROADCAST" "group:$SUB_GROUP"; do
    kind="${pair%%:*}" pid="${pair#*:}"
    wait_for 10 bash -c "! kill -0 $pid 2>/dev/null" || true
    stop_pid "$pid" 1
    lines="$(wc -l <"$TMP/sub-$kind.out")"
    if [[ "$STOP_RC" == 0 && "$lines" == "$TOTAL" ]]; then
        pass "$kind subscriber received all $TOTAL messages and exited 0"
    else
        fail "$kind subscriber received all $TOTAL messages and exited 0" \
            "exit $STOP_RC, $lines lines" "$(tail -n 5 "$TMP/sub-$kind.err")"
    fi
done

stop_pid "$PROM_PID" 10
if [[ "$STOP_RC" == 0 ]]; then
    pass "prometheus stopped by its pid (exit 0)"
else
    fail "prometheus stopped by its pid (exit 0)" "exit $STOP_RC" "$(tail -n 10 "$TMP/prometheus.log")"
fi
PROM_PID=""

t0=$SECONDS
stop_pid "$BROKER_PID" $((SHUTDOWN_GRACE + 5))
if [[ "$STOP_RC" == 0 ]]; then
    pass "broker exited 0 on SIGTERM (in $((SECONDS - t0))s)"
else
    fail "broker exited 0 on SIGTERM" "exit $STOP_RC" "$(tail -n 10 "$TMP/broker.log")"
fi
BROKER_PID=""

summary
((failed == 0))
