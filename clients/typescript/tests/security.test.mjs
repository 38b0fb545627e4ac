// Bearer tokens (good, bad, from the environment) and TLS with a CA file.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { connect, Status, TinybrokerError } from "../dist/index.js";
import { starter } from "./broker.mjs";

const TOKEN = "s3cret-token";

test("token: good, bad, and from the environment", { timeout: 45_000 }, async (t) => {
  const broker = await starter(t)({ TINYBROKER_AUTH_TOKEN: TOKEN });
  const clients = [];
  t.after(() => Promise.all(clients.map((c) => c.close()))); // a client not closed keeps trying its session
  let client = await connect(broker.addr, { token: TOKEN });
  clients.push(client);
  const sub = await client.subscribe("s.>");
  await client.publishConfirmed("s.1", "ok");
  assert.equal((await sub.next({ timeout: 5000 })).string(), "ok");
  assert.equal((await client.admin.info()).authEnabled, true);
  await client.close();

  client = await connect(broker.addr, { token: "wrong" });
  clients.push(client);
  for (const call of [
    () => client.publishConfirmed("s.1", "no"),
    () => client.subscribe("s.>", { timeout: 5000 }),
    () => client.admin.info(),
  ]) {
    await assert.rejects(call(), (e) => e instanceof TinybrokerError && e.code === Status.UNAUTHENTICATED);
  }
  await client.close();

  const saved = process.env.TINYBROKER_AUTH_TOKEN;
  process.env.TINYBROKER_AUTH_TOKEN = TOKEN;
  try {
    client = await connect(broker.addr);
    clients.push(client);
    await client.publishConfirmed("s.1", "env");
    await client.close();
  } finally {
    if (saved === undefined) delete process.env.TINYBROKER_AUTH_TOKEN;
    else process.env.TINYBROKER_AUTH_TOKEN = saved;
  }
});

/** A CA and a certificate for localhost/127.0.0.1 it signed, made with the openssl CLI. */
function makeCerts(dir) {
  const ssl = (...args) => execFileSync("openssl", args, { cwd: dir, stdio: ["ignore", "ignore", "pipe"] });
  ssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key");
  ssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=tinybroker test CA", "-days", "1", "-out", "ca.pem",
    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign");
  ssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "leaf.key");
  ssl("pkcs8", "-topk8", "-nocrypt", "-in", "leaf.key", "-out", "key.pem");
  ssl("req", "-new", "-key", "key.pem", "-subj", "/CN=localhost", "-out", "leaf.csr");
  writeFileSync(join(dir, "ext.cnf"), "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n");
  ssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
    "-extfile", "ext.cnf", "-out", "cert.pem");
  return { ca: join(dir, "ca.pem"), cert: join(dir, "cert.pem"), key: join(dir, "key.pem") };
}

test("TLS with a CA file", { timeout: 45_000 }, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "tinybroker-tls-"));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const { ca, cert, key } = makeCerts(dir);
  const broker = await starter(t)({ TINYBROKER_TLS_CERT: cert, TINYBROKER_TLS_KEY: key });
  const client = await connect(`https://${broker.addr}`, { caFile: ca });
  const sub = await client.subscribe("t.>");
  await client.publishConfirmed("t.1", "secure");
  assert.equal((await sub.next({ timeout: 5000 })).string(), "secure");
  assert.equal((await client.admin.info()).tlsEnabled, true);
  await client.close();
  // Without the CA (system roots) the handshake fails; plaintext too.
  for (const addr of [`https://${broker.addr}`, broker.addr]) {
    await assert.rejects(
      connect(addr, { timeout: 3000 }),
      (e) => e instanceof TinybrokerError && e.code === Status.UNAVAILABLE,
    );
  }
});
