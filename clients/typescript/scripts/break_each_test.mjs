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

const breaks = [
  ["round trip: publish drops the headers", "client.ts",
    "const headers = this._tracing ? inject(opts?.headers) : (opts?.headers ?? {});",
    "const headers = {};",
    T("round_trip.test.mjs"), "round trip delivers"],
  ["publisher: the stream's error is swallowed at flush", "publisher.ts",
    "if (s.error !== undefined) throw s.error;\n    const r", "const r",
    T("round_trip.test.mjs"), "first error typed"],
  ["publisher: never waits for drain", "publisher.ts",
    "if (room) return Promise.resolve();", "return Promise.resolve();",
    T("round_trip.test.mjs"), "broker is behind"],
  ["address list: only the first address is used", "connection.ts",
    "targets.push({ address: item, tls });", "targets.push({ address: item, tls });\n    break;",
    T("round_trip.test.mjs"), "address list"],
  ["AbortSignal: an aborted call is not cancelled", "admin.ts",
    "onAbort = () => call.cancel();", "onAbort = () => undefined;",
    T("round_trip.test.mjs"), "broker is behind"],
  ["connect: an AbortSignal does not stop the wait for an address", "connection.ts",
    'signal?.addEventListener("abort", () => resolve("aborted"), { once: true });', "",
    T("round_trip.test.mjs"), "address list"],
  ["groups: nack sent as an ack", "session.ts",
    'nack ? { request: { $case: "nack", value } }', 'nack ? { request: { $case: "ack", value } }',
    T("groups.test.mjs"), ""],
  ["credit isolation: credit never given back", "session.ts",
    "if (this._taken >= this.batch) {", "if (false) {",
    T("flow_control.test.mjs"), "evicted alone"],
  ["credit isolation: subscriptions opened without a credit limit", "session.ts",
    "const credit = Math.max(1, sub.window - sub.pending);", "const credit = 0;",
    T("flow_control.test.mjs"), "evicted alone"],
  ["eviction gap: no gap reported after re-subscribing", "session.ts",
    "      this.resuming = event;\n      this.scheduleRetry(undefined);", "      this.scheduleRetry(undefined);",
    T("flow_control.test.mjs"), "gap"],
  ["restart: subscriptions dropped when the session is lost", "session.ts",
    "if (!sub._onLost(failure, starting)) this.subs.delete(handle);",
    "sub._onLost(failure, starting);\n      this.subs.delete(handle);",
    T("reconnect.test.mjs"), "killed and restarted"],
  ["restart: no session started again after the first", "session.ts",
    "if (!waiting) {", "if (this.started > 0 || !waiting) {",
    T("reconnect.test.mjs"), "killed and restarted"],
  ["shutdown: a shutdown end is not re-subscribed", "session.ts",
    'const again = this.resubscribe && reason !== "closed_by_admin";',
    'const again = this.resubscribe && reason !== "closed_by_admin" && reason !== "shutdown";',
    T("reconnect.test.mjs"), "graceful shutdown"],
  ["resubscribe off: the flag is ignored on a lost connection", "session.ts",
    "const retry = this.resubscribe && RETRYABLE.has(failure.code);", "const retry = RETRYABLE.has(failure.code);",
    T("reconnect.test.mjs"), "turned off"],
  ["admin: a subscription closed by an admin comes back", "session.ts",
    'const again = this.resubscribe && reason !== "closed_by_admin";', "const again = this.resubscribe;",
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
    "if (moving) this.conn.failover();", "",
    T("cluster.test.mjs"), "cannot serve"],
  ["tracing: nothing injected", "tracing.ts",
    "api.propagation.inject(api.context.active(), carrier);", "",
    T("tracing.test.mjs"), ""],
  ["tracing: the context is not extracted", "tracing.ts",
    "return api ? api.propagation.extract(api.ROOT_CONTEXT, headers) : undefined;", "return undefined;",
    T("tracing.test.mjs"), ""],
  ["gateway: a delivery for several handles reaches only the first", "session.ts",
    "for (const handle of e.value.handles) subs.get(handle)?._deliver(message, handle);",
    "for (const handle of e.value.handles.slice(0, 1)) subs.get(handle)?._deliver(message, handle);",
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
    const ran = /^# (pass|fail) [1-9]/m.test(r.stdout ?? "");
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
