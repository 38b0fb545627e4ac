// Regenerates src/gen/ from the repository's proto/ (tinybroker.v1) with
// ts-proto (outputServices=grpc-js), compiled by the buf CLI: both come from
// npm (package-lock.json pins them), so no protoc is needed.
//
//     npm ci && npm run generate
//
// CI runs it and fails when `git diff` shows a difference in src/gen (or a
// file there that git does not track).
import { execFileSync } from "node:child_process";
import { rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const pkg = join(here, "..");
const repo = join(pkg, "..", "..");
const buf = join(pkg, "node_modules", ".bin", "buf");
const plugin = join(pkg, "node_modules", ".bin", "protoc-gen-ts_proto");
const out = join(pkg, "src", "gen");

const template = {
  version: "v2",
  plugins: [
    {
      local: plugin,
      out,
      opt: [
        "outputServices=grpc-js",
        "esModuleInterop=true",
        "importSuffix=.js",
        "forceLong=number",
        "useDate=false",
        "env=node",
        "useOptionals=none",
        "oneof=unions-value",
        "outputTypeRegistry=false",
        "outputJsonMethods=false",
        "outputPartialMethods=false",
        "initializeFieldsAsUndefined=false",
      ],
    },
  ],
};

rmSync(out, { recursive: true, force: true });
execFileSync(buf, ["generate", "--template", JSON.stringify(template), "--path", "proto/tinybroker/v1", "."], {
  cwd: repo,
  stdio: "inherit",
  env: { ...process.env, BUF_CACHE_DIR: join(pkg, "node_modules", ".cache", "buf") },
});
console.log(`generated ${out}`);
