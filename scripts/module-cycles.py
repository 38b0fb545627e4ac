#!/usr/bin/env python3
"""Prints the circles between the files of src/: the strongly connected
components, of more than one file, of the graph in which a file points to
each file whose items it names.

A file names another through `use crate::…`, `use super::…`, `use self::…`,
a child module's name (`use queue::Queue` in the file that declares
`mod queue;`), or the same paths written inline (`crate::memory::split(…)`).
A path is resolved to the file that defines the module it reaches, and
through a `pub use` in that file to the file the item comes from, so that a
parent module re-exporting a child's type is not taken for the type's home.
Declaring a module (`mod queue;`) is not an edge; re-exporting from it is.
Nor is a file naming a module that encloses it (`super::Broker` in
broker/publish.rs): a child module is part of its parent, sees its private
items, and is how Rust spreads one module's `impl` blocks over files; the
parent naming the child's items is an edge.
Comments, doc comments and string literals are skipped; the paths build.rs
writes into generated code (`"crate::…"`) count as uses of the file that
`include!`s it from OUT_DIR. `#[cfg(test)]`
modules (inline or files) are left out: the graph is the library's as it is
compiled; `--with-tests` counts them as part of their file. `--edges`
prints every edge first.

Usage: scripts/module-cycles.py [--with-tests] [--edges] [SRC_DIR]
Exits 1 if there is any circle, 0 if none. Python 3 standard library only.
"""

import os
import re
import sys
from collections import defaultdict

# === Reading Rust source ===


def strip_comments_and_strings(text):
    """Source with comments, string and char literals blanked out (newlines
    kept), so that braces and paths inside them are not read."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 260]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}', '"') or a lifetime ('a).
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'])'", text[i:i + 12])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_use_tree(tree):
    """Expands a use tree (`a::{b, c::{self, D}}`, without `use` and `;`)
    into (path segments, name bound or None for a glob) pairs."""
    tree = re.sub(r"\s+", "", tree)
    results = []

    def walk(prefix, s):
        # s is one tree: `a::b`, `a::{…}`, `a as b`, `*`
        depth, brace = 0, -1
        for k, ch in enumerate(s):
            if ch == "{" and depth == 0:
                brace = k
                break
        if brace >= 0:
            head = s[:brace].rstrip(":")
            inner = s[brace + 1:s.rindex("}")]
            base = prefix + [p for p in head.split("::") if p]
            for part in split_top(inner):
                if part:
                    walk(base, part)
            return
        segs = prefix + [p for p in s.split("::") if p]
        if segs and segs[-1] == "*":
            results.append((segs[:-1], None))
        elif segs and segs[-1] == "self":
            results.append((segs[:-1], segs[-2] if len(segs) > 1 else None))
        else:
            results.append((segs, segs[-1] if segs else None))

    walk([], tree)
    return results


def split_top(s):
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def drop_aliases(tree):
    """`a::B as C` → `a::B` (the alias names nothing in another file)."""
    return re.sub(r"\s+as\s+[A-Za-z_][A-Za-z0-9_]*", "", tree)


# === The module tree ===


class File:
    def __init__(self, path, module):
        self.path = path  # relative to the repository, e.g. src/broker/mod.rs
        self.module = module  # ("broker",), () for the crate root
        self.children = {}  # child module name → module tuple (file or inline)
        self.uses = []  # (scope module tuple, path segments)
        self.pub_uses = []  # (path segments, name bound or None for a glob)
        self.test_children = set()  # `#[cfg(test)] mod x;`
        self.reexports = {}  # name → absolute path segments (pub use)
        self.glob_reexports = []  # absolute module paths (pub use x::*)


def module_of(rel, src):
    """src/a/b.rs → (a, b); src/a/mod.rs → (a,); src/lib.rs → ()."""
    parts = os.path.relpath(rel, src).split(os.sep)
    name = parts[-1][:-3]
    if parts == ["lib.rs"]:
        return ()
    if name == "mod":
        return tuple(parts[:-1])
    return tuple(parts[:-1] + [name])


def read_file(f, text, no_tests):
    """Fills f.children, f.uses and f.reexports, tracking inline `mod x {`
    blocks so that `super::` inside them resolves from the right module."""
    code = strip_comments_and_strings(text)
    stack = []  # (module tuple, brace depth at which it closes)
    depth = 0
    scope = f.module
    pending_cfg_test = False
    skip_until = None  # brace depth closing a skipped #[cfg(test)] module
    tokens = re.finditer(
        r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]"
        r"|(?P<vis>\bpub(?:\s*\([^)]*\))?\s+)?\buse\b(?P<tree>[^;]*);"
        r"|\bmod\s+(?P<mod>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<modend>[{;])"
        r"|\b(?P<path>(?:crate|super|self)(?:\s*::\s*(?:super|[A-Za-z_][A-Za-z0-9_]*))+)"
        r"|(?P<open>\{)|(?P<close>\})",
        code,
    )
    for m in tokens:
        if m.group("open"):
            depth += 1
            continue
        if m.group("close"):
            depth -= 1
            if skip_until is not None and depth == skip_until:
                skip_until = None
            while stack and stack[-1][1] == depth:
                stack.pop()
                scope = stack[-1][0] if stack else f.module
            continue
        if skip_until is not None:
            continue
        text0 = m.group(0)
        if text0.startswith("#"):
            pending_cfg_test = True
            continue
        if m.group("mod"):
            name = m.group("mod")
            child = scope + (name,)
            if scope == f.module:
                f.children[name] = child
            if pending_cfg_test and no_tests:
                if m.group("modend") == ";":
                    f.test_children.add(child)
                else:
                    skip_until = depth
                    depth += 1
                pending_cfg_test = False
                continue
            if m.group("modend") == "{":
                stack.append((child, depth))
                depth += 1
                scope = child
            pending_cfg_test = False
            continue
        if m.group("tree") is not None:
            tree = drop_aliases(m.group("tree"))
            for segs, name in parse_use_tree(tree):
                f.uses.append((scope, segs))
                if m.group("vis") and scope == f.module and segs:
                    f.pub_uses.append((segs, name))
            pending_cfg_test = False
            continue
        if m.group("path"):
            segs = [s.strip() for s in m.group("path").split("::")]
            f.uses.append((scope, segs))
            continue
        pending_cfg_test = False


def absolute_path(scope, segs, f):
    """A path as written in module `scope` → absolute segments, or None for a
    path into another crate."""
    if not segs:
        return None
    head = segs[0]
    if head == "crate":
        return list(segs[1:])
    if head in ("self", "super"):
        cur = list(scope)
        rest = list(segs)
        while rest and rest[0] in ("self", "super"):
            if rest[0] == "super":
                if not cur:
                    return None
                cur.pop()
            rest.pop(0)
        return cur + rest
    if scope == f.module and head in f.children:
        return list(f.module) + list(segs)
    return None  # another crate (std, tokio, …) or a local item


# === Resolution and the graph ===


def resolve(segs, files_by_module, depth=0):
    """Absolute path segments → the file defining the item they name (through
    `pub use` re-exports), or None when the path leaves src/."""
    best = None
    for k in range(len(segs), -1, -1):
        mod = tuple(segs[:k])
        if mod in files_by_module:
            best = (mod, k)
            break
    if best is None:
        return None
    mod, k = best
    f = files_by_module[mod]
    if k < len(segs) and depth < 8:
        name = segs[k]
        if name in f.reexports:
            target = f.reexports[name] + list(segs[k + 1:])
            resolved = resolve(target, files_by_module, depth + 1)
            if resolved is not None:
                return resolved
    return f


def generated_paths(src):
    """The `crate::…` paths build.rs writes into generated code (tonic's
    `codec_path`, `extern_path`): uses of the file that includes it."""
    build = os.path.join(src, "..", "build.rs")
    if not os.path.exists(build):
        return []
    with open(build, encoding="utf-8") as handle:
        text = handle.read()
    return [p.split("::") for p in re.findall(r'"(crate(?:::[A-Za-z_][A-Za-z0-9_]*)+)"', text)]


def build_graph(src, no_tests):
    files = []
    for root, _dirs, names in os.walk(src):
        for name in sorted(names):
            if name.endswith(".rs") and name != "main.rs":
                path = os.path.join(root, name)
                files.append(File(path, module_of(path, src)))
    by_module = {f.module: f for f in files}
    generated = generated_paths(src)
    for f in files:
        with open(f.path, encoding="utf-8") as handle:
            text = handle.read()
        read_file(f, text, no_tests)
        if 'env!("OUT_DIR")' in text:
            f.uses.extend((f.module, segs) for segs in generated)
    for f in files:
        for segs, name in f.pub_uses:
            absolute = absolute_path(f.module, segs, f)
            if absolute is None:
                continue
            if name is None:
                f.glob_reexports.append(absolute)
            else:
                f.reexports[name] = absolute
    if no_tests:
        # a test-only file, and the files under it
        tests = [c for f in files for c in f.test_children]
        files = [f for f in files if not any(f.module[: len(t)] == t for t in tests)]
        by_module = {f.module: f for f in files}
    edges = defaultdict(set)
    for f in files:
        for scope, segs in f.uses:
            absolute = absolute_path(scope, segs, f)
            if absolute is None:
                continue
            target = resolve(absolute, by_module)
            if target is None or target is f:
                continue
            if f.module[: len(target.module)] == target.module:
                continue  # a child naming its enclosing module: see above
            edges[f.path].add(target.path)
    return [f.path for f in files], edges


def strongly_connected(nodes, edges):
    """Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                out.append(sorted(component))
    return out


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    flags = {a for a in argv if a.startswith("--")}
    unknown = flags - {"--with-tests", "--edges"}
    if unknown or len(args) > 1:
        print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
        return 2
    src = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    src = os.path.relpath(src)
    nodes, edges = build_graph(src, "--with-tests" not in flags)
    if "--edges" in flags:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{a} -> {b}")
    circles = [c for c in strongly_connected(nodes, edges) if len(c) > 1]
    circles.sort()
    for c in circles:
        inside = {a: sorted(b for b in edges[a] if b in c) for a in c}
        print(f"circle of {len(c)} files:")
        for a in c:
            print(f"  {a} -> {', '.join(inside[a])}")
    print(f"{len(circles)} circle(s) between the files of {src}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
