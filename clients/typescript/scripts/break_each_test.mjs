// Breaks the client once for each test and checks that the test then fails
// (a mutation check, run by hand, with TINYBROKER_BIN set):
//
//     node scripts/break_each_test.mjs [part of a description]
//
// Each break is applied to src/, dist/ rebuilt, the test run, and the file
// restored (dist/ rebuilt again at the end).
import { spawnSync } from "node:child_process";
import { cpSync, existsSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const pkg = join(dirname(fileURLToPath(import.meta.url)), "..");
const gateway = join(pkg, "..", "..", "examples", "ws-gateway", "test", "gateway.test.mjs");
const T = (name) => join(pkg, "tests", name);

const S = T("scenarios.test.mjs");
const breaks = [
  ["round trip: publish drops the headers", "client.ts",
    "const headers = this._tracing ? inject(opts?.headers) : (opts?.headers ?? {});",
    "const headers = {};",
    T("round_trip.test.mjs"), "round trip delivers"],
  ["publisher: the stream's error is swallowed at end", "publisher.ts",
    "if (s.error !== undefined) throw s.error;\n    const r", "const r",
    T("round_trip.test.mjs"), "first error typed"],
  ["publisher: never waits for drain", "publisher.ts",
    "if (room) return Promise.resolve();", "return Promise.resolve();",
    T("round_trip.test.mjs"), "broker is behind"],
  ["publisher: accepted counts what the client wrote", "errors.ts",
    "this.accepted = m ? Number(m[1]) : undefined;", "this.accepted = m ? Number(m[1]) + 2 : undefined;",
    S, "publish_error_counts_what_the_broker_accepted"],
  ["address list: only the first address is used", "connection.ts",
    "targets.push({ address: item, tls });", "targets.push({ address: item, tls });\n    break;",
    T("round_trip.test.mjs"), "address list"],
  ["AbortSignal: an aborted call is not cancelled", "admin.ts",
    "onAbort = () => call.cancel();", "onAbort = () => undefined;",
    T("round_trip.test.mjs"), "broker is behind"],
  ["connect: an AbortSignal does not stop the wait for an address", "connection.ts",
    'signal?.addEventListener("abort", () => resolve("aborted"), { once: true });', "",
    T("round_trip.test.mjs"), "address list"],
  ["buffer: publish waits for the broker's answer", "buffer.ts",
    "      this.schedule();\n      return RESOLVED;", "      this.schedule();\n      return this.flush().then(() => undefined);",
    S, "publish_returns_at_once_and_flush_reports"],
  ["buffer: a rejection's index is the batch's, not the client's", "buffer.ts",
    "index: batch!.first + r.index,", "index: r.index,",
    S, "flush_reports_each_rejection"],
  ["buffer: publish never waits (unbounded)", "buffer.ts",
    "if (this.waitingHead === this.waiting.length && this.bytes < this.limit) {",
    "if (this.waitingHead === this.waiting.length) {",
    S, "publish_waits_when_the_buffer_is_full"],
  ["buffer: one message per batch", "buffer.ts",
    "end - start < this.batchMessages &&", "end - start < 1 &&",
    S, "publishers_share_one_clients_batches"],
  ["buffer: the buffer is dropped when the session is lost", "session.ts",
    "    this.buffer.onLost();\n    this.conn.failover();", "    this.buffer.close();\n    this.conn.failover();",
    S, "buffered_publishes_go_out_after_a_restart"],
  ["buffer: unanswered batches are forgotten", "buffer.ts",
    "      this.unconfirmed += count;\n", "",
    S, "unanswered_batches_are_unconfirmed"],
  ["deliveries: batched deliveries not asked for", "session.ts",
    'metadata.set("tinybroker-batch", "1");', "",
    S, "deliveries_come_in_batches"],
  ["deliveries: only the first of a batch is handed over", "session.ts",
    "for (const d of e.value.deliveries) this.deliver(d);", "this.deliver(e.value.deliveries[0]!);",
    S, "deliveries_come_in_batches"],
  ["acks: one SessionAck per ack", "session.ts",
    "if (acks.length > 0) this.write({ request: { $case: \"ack\", value: { handle, sequences: acks } } });",
    "for (const a of acks) this.write({ request: { $case: \"ack\", value: { handle, sequences: [a] } } });",
    S, "acks_are_coalesced"],
  ["groups: nack sent as an ack", "session.ts",
    "(nack ? this.nacks : this.acks).push(message.sequence);", "this.acks.push(message.sequence);",
    T("groups.test.mjs"), ""],
  ["credit isolation: credit never given back", "session.ts",
    "if (this._taken >= this.topUp) {", "if (false) {",
    T("flow_control.test.mjs"), "evicted alone"],
  ["credit isolation: subscriptions opened without a credit limit", "session.ts",
    "const credit = sub.window - sub.pending;", "const credit = 0;",
    T("flow_control.test.mjs"), "evicted alone"],
  ["window: re-opened with credit 1 when the window is full (the old bug)", "session.ts",
    "if (this.state !== \"OPEN\" || sub._state !== \"WAITING\" || sub.pending >= sub.window) return;",
    "if (this.state !== \"OPEN\" || sub._state !== \"WAITING\") return;",
    S, "window_holds_through_evictions"],
  ["gaps: a range across instances", "session.ts",
    'else if (origin.instance !== this.lastOrigin.instance) reason = "instance_changed";\n', "",
    S, "gap_is_unknown_across_a_restart"],
  ["gaps: no gap reported after an eviction", "session.ts",
    "      this.resuming = { cause: reason, dropped: ended.dropped };\n", "",
    S, "gap_is_a_range_on_one_instance"],
  ["reconnect: grpc-js's default backoff", "connection.ts",
    '"grpc.max_reconnect_backoff_ms": 250,', '"grpc.max_reconnect_backoff_ms": 5000,',
    S, "back_within_half_a_second_of_a_restart"],
  ["connection events: one per subscription", "session.ts",
    "    for (const sub of opened) sub._onLost(code, reason);",
    "    for (const sub of opened) {\n      sub._onLost(code, reason);\n      this.emit({ type: \"disconnected\", reason, code });\n    }",
    S, "connection_events_once_per_connection"],
  ["stats: reconnects not counted", "session.ts",
    "      this.reconnects += 1;\n", "",
    S, "stats_count_what_went_in_and_out"],
  ["close: publishers are left open (the old bug: 20 s more on their socket)", "client.ts",
    "      ...[...this.publishers].map((p) => p._end(Math.min(left, 2000))),\n", "",
    S, "closed_means_closed"],
  ["close: admin calls after close reach grpc-js", "admin.ts",
    "if (this.isClosed()) return Promise.reject(new ClientClosed());", "",
    S, "closed_means_closed"],
  ["next: a second next() is queued instead of refused", "session.ts",
    'if (this.waiter !== undefined) throw new UsageError("only one next() at a time on a subscription");', "",
    S, "one_next_at_a_time"],
  ["status OK: an OK end is not a lost session", "session.ts",
    'if (status.code === Status.OK) this.lost(call, Status.OK, "closed by the broker");', "",
    S, "status_ok_end_is_not_an_error"],
  ["restart: subscriptions dropped when the session is lost", "session.ts",
    "    for (const sub of opened) sub._onLost(code, reason);", "    for (const sub of opened) sub._finish(new Error(reason));",
    T("reconnect.test.mjs"), "killed and restarted"],
  ["restart: no session started again after the first", "session.ts",
    'if (this.state === "WAITING") this.start();', "",
    T("reconnect.test.mjs"), "killed and restarted"],
  ["shutdown: a shutdown end is not re-subscribed", "session.ts",
    'const again = this.resubscribe && (reason === "evicted" || reason === "shutdown");',
    'const again = this.resubscribe && reason === "evicted";',
    T("reconnect.test.mjs"), "graceful shutdown"],
  ["resubscribe off: the flag is ignored on a lost connection", "session.ts",
    "    if (!this.resubscribe) {\n      const event: EndedEvent = {", "    if (false) {\n      const event: EndedEvent = {",
    T("reconnect.test.mjs"), "turned off"],
  ["admin: a subscription closed by an admin comes back", "session.ts",
    'const again = this.resubscribe && (reason === "evicted" || reason === "shutdown");', "const again = this.resubscribe;",
    T("admin.test.mjs"), ""],
  ["token: the authorization header is not sent", "connection.ts",
    "if (opts.token) this.metadata.set(", "if (false) this.metadata.set(",
    T("security.test.mjs"), "token"],
  ["TLS: the CA file is not used", "connection.ts",
    "grpc.credentials.createSsl(this.ca ?? null)", "grpc.credentials.createSsl(null)",
    T("security.test.mjs"), "TLS"],
  ["cluster: no failover to the next address", "connection.ts",
    "if (this.targets.length < 2) return;\n    const old", "return;\n    const old",
    T("cluster.test.mjs"), "killed"],
  ["cluster: an UNAVAILABLE open does not move to the next address", "session.ts",
    "if (call !== undefined) {\n            this.lost(", "if (false) {\n            this.lost(",
    T("cluster.test.mjs"), "cannot serve"],
  ["tracing: nothing injected", "tracing.ts",
    "api.propagation.inject(api.context.active(), carrier);", "",
    T("tracing.test.mjs"), ""],
  ["tracing: the context is not extracted", "tracing.ts",
    "return api ? api.propagation.extract(api.ROOT_CONTEXT, headers) : undefined;", "return undefined;",
    T("tracing.test.mjs"), ""],
  ["gateway: a delivery for several handles reaches only the first", "session.ts",
    "for (const handle of d.handles) {", "for (const handle of d.handles.slice(0, 1)) {",
    gateway, ""],
  ["gateway: an aborted signal does not close the subscription", "client.ts",
    'signal.addEventListener("abort", () => void sub.close(), { once: true });', "",
    gateway, ""],
];

// The gateway example uses a packed copy of the client (install-links).
const gatewayCopy = join(pkg, "..", "..", "examples", "ws-gateway", "node_modules", "@tinybroker", "client", "dist");
// tsc emits dist/ even when a break does not type-check (unreachable code).
const build = (strict = false) => {
  const r = spawnSync(join(pkg, "node_modules", ".bin", "tsc"), ["-p", "tsconfig.json"], { cwd: pkg, encoding: "utf8" });
  if (strict && r.status !== 0) throw new Error(`tsc failed:\n${r.stdout}${r.stderr}`);
  if (existsSync(gatewayCopy)) cpSync(join(pkg, "dist"), gatewayCopy, { recursive: true });
};
// An argument keeps only the breaks whose description contains it.
const only = process.argv[2];
let failures = 0;
for (const [what, file, from, to, testFile, name] of breaks) {
  if (only && !what.includes(only)) continue;
  const path = join(pkg, "src", file);
  const original = readFileSync(path, "utf8");
  if (original.split(from).length !== 2) {
    console.log(`NOT APPLIED (text not found once): ${what}`);
    failures += 1;
    continue;
  }
  writeFileSync(path, original.replace(from, to));
  try {
    build();
    const args = ["--test", "--test-reporter=tap", ...(name ? ["--test-name-pattern", name] : []), testFile];
    const r = spawnSync(process.execPath, args, { cwd: pkg, encoding: "utf8", timeout: 180_000 });
    const ran = /^# (pass|fail|cancelled) [1-9]/m.test(r.stdout ?? ""); // a test that times out is "cancelled"
    const failed = r.status !== 0;
    console.log(`${!ran ? "TEST NOT RUN      " : failed ? "fails as it should" : "STILL PASSES     "}: ${what}`);
    if (!failed || !ran) failures += 1;
  } finally {
    writeFileSync(path, original);
  }
}
build(true);
console.log(failures ? `${failures} break(s) not caught` : `every break was caught (${breaks.length})`);
process.exit(failures ? 1 : 0);
