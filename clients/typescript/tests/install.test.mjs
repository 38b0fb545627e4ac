// The README's install line: the packed client installed in a fresh
// project keeps working after a later plain `npm install` of another
// package (a folder installed with --install-links does not: npm replaces
// it by a symlink without its dependencies). Needs the npm registry; skipped
// when it cannot be reached.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { cpSync, mkdtempSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const run = promisify(execFile);
const CLIENT = fileURLToPath(new URL("..", import.meta.url));
const NPM = ["--no-audit", "--no-fund", "--loglevel=error"];

test("readme_install_line_survives_a_later_npm_install", { timeout: 120_000 }, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "tinybroker-install-"));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  // A copy of the client as a checkout has it (no node_modules).
  const source = join(dir, "client");
  for (const entry of ["package.json", "README.md", "dist", "src"]) cpSync(join(CLIENT, entry), join(source, entry), { recursive: true });
  const app = join(dir, "app");
  mkdirSync(app);
  writeFileSync(join(app, "package.json"), JSON.stringify({ name: "app", version: "1.0.0", type: "module", private: true }));
  // The README's line: npm pack, then install the tarball.
  const { stdout } = await run("npm", ["pack", "--silent", "--pack-destination", app], { cwd: source });
  const tarball = stdout.trim().split("\n").pop();
  try {
    await run("npm", ["install", ...NPM, `./${tarball}`], { cwd: app });
  } catch (e) {
    if (/ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ETIMEDOUT/.test(String(e.stderr))) return t.skip("no npm registry");
    throw e;
  }
  await run("npm", ["install", ...NPM, "is-number@7.0.0"], { cwd: app });
  const check = `import { connect, Status } from "@tinybroker/client"; console.log(typeof connect, Status.UNAVAILABLE);`;
  const out = await run(process.execPath, ["--input-type=module", "-e", check], { cwd: app });
  assert.equal(out.stdout.trim(), "function 14");
});
