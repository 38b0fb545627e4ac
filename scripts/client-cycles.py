#!/usr/bin/env python3
"""Prints the circles between the modules of the Python client
(clients/python/tinybroker/*.py) and between those of the TypeScript client
(clients/typescript/src/**/*.ts): the strongly connected components, of more
than one file, of the graph in which a file points to each file of the same
client that it imports. The Rust equivalent is scripts/module-cycles.py.

Every import counts, wherever it is written: one under `if TYPE_CHECKING:`
or inside a function (Python), `import type` and a type written as
`import("./x.js").T` (TypeScript) are edges too, as the modules are to
depend one way whether or not the import is kept at run time.

Python: the file is parsed with `ast`. `from .x import y`, `from . import
x`, `import tinybroker.x`, `from tinybroker.x import y` name module x (the
file x.py, or the package's __init__.py when x is a name it defines);
`from . import y` where y is no module names __init__.py. The generated
code (_pb/) and other packages are outside the graph.

TypeScript: comments and template literals are blanked, then these name
the file a relative specifier resolves to (`./x.js`, `./x.ts`, `./x` →
x.ts, or x/index.ts): `import ... from "..."` (also `import type`),
`import "..."`, `export ... from "..."` (also `export type`, `export *`),
`import("...")`. Bare specifiers (packages, node:) are outside the graph.

Usage: scripts/client-cycles.py [--edges] [REPO_ROOT]
Each edge printed says the line(s) of the import, "(types only)" when each
of them is for annotations only. `--edges` prints every edge first.
Exits 1 if there is any circle, 0 if none. Python 3 standard library only.
"""

import ast
import importlib.util
import os
import re
import sys
from collections import defaultdict

PY_PACKAGE = os.path.join("clients", "python", "tinybroker")
TS_SRC = os.path.join("clients", "typescript", "src")


class Edge:
    """Where one file imports another: the lines, and whether every one of
    them is for types only."""

    def __init__(self):
        self.lines = []  # (line, types only)

    def add(self, line, types_only):
        self.lines.append((line, types_only))

    def __str__(self):
        lines = sorted(set(n for n, _ in self.lines))
        only = ", types only" if all(t for _, t in self.lines) else ""
        return f"line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))}{only}"


# === Python ===


def is_type_checking(test):
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def python_imports(tree):
    """(line, types only, module named relative to the package, or None for
    the package itself, names imported from it) for each import of the
    package's own modules."""
    out = []

    def visit(node, types_only):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, types_only)
            else:
                visit_stmt(child, types_only)

    def visit_stmt(node, types_only):
        if isinstance(node, ast.ImportFrom):
            if node.level > 1:
                return  # beyond the package
            if node.level == 1:
                module = node.module
            elif node.module == "tinybroker" or (node.module or "").startswith("tinybroker."):
                module = node.module[len("tinybroker."):] if "." in node.module else None
            else:
                return
            names = [a.name for a in node.names]
            out.append((node.lineno, types_only, module, names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tinybroker."):
                    out.append((node.lineno, types_only, alias.name[len("tinybroker."):], []))
        visit(node, types_only)

    visit(tree, False)
    return out


def python_graph(root):
    package = os.path.join(root, PY_PACKAGE)
    files = sorted(n for n in os.listdir(package) if n.endswith(".py"))
    modules = {n[:-3]: os.path.join(PY_PACKAGE, n) for n in files}
    edges = defaultdict(dict)
    for name in files:
        path = os.path.join(PY_PACKAGE, name)
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for line, types_only, module, names in python_imports(tree):
            targets = []
            if module is None:
                # `from . import x`: module x, else a name __init__.py defines
                for n in names:
                    targets.append(modules.get(n, modules.get("__init__")))
            else:
                head = module.split(".")[0]
                targets.append(modules.get(head))  # None: _pb/ or unknown
            for target in targets:
                if target is None or target == path:
                    continue
                edges[path].setdefault(target, Edge()).add(line, types_only)
    return [modules[m] for m in sorted(modules)], edges


# === TypeScript ===


def blank_comments_and_templates(text):
    """Source with comments and template literals blanked out (newlines
    kept); quoted strings kept, as they hold the specifiers."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c in "'\"":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif c == "`":
            j = i + 1
            while j < n and text[j] != "`":
                j += 2 if text[j] == "\\" else 1
            out.append("``" + "\n" * text.count("\n", i, j))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


TS_IMPORT = re.compile(
    # import/export ... from "x": the clause is names, braces, commas, `*`,
    # `as`, `type` (which an expression or a string in it could not be)
    r"(?:^|(?<=[;}\n]))\s*(?P<kw>import|export)\s+(?P<type>type\s+)?"
    r"(?P<clause>[\w$*{},\s]*?)\s*\bfrom\s*(?P<q>['\"])(?P<spec>[^'\"\n]+)(?P=q)"
    # import "x" (for its effects)
    r"|(?:^|(?<=[;}\n]))\s*import\s*(?P<q2>['\"])(?P<spec2>[^'\"\n]+)(?P=q2)"
    # import("x"), in an expression or as a type
    r"|\bimport\s*\(\s*(?P<q3>['\"])(?P<spec3>[^'\"\n]+)(?P=q3)\s*\)(?P<after>\s*\.)?"
)


def ts_imports(text):
    """(line, types only, specifier) for each import or re-export."""
    code = blank_comments_and_templates(text)
    out = []
    for m in TS_IMPORT.finditer(code):
        if m.group("spec"):
            spec = m.group("spec")
            clause = m.group("clause")
            # `import type {…}`, or every name in the braces marked `type`
            names = re.findall(r"[^{},\s][^{},]*", clause.strip("{} \n")) if clause.strip().startswith("{") else []
            types_only = bool(m.group("type")) or (bool(names) and all(n.strip().startswith("type ") for n in names))
            start = m.start("kw")
        elif m.group("spec2"):
            spec, types_only, start = m.group("spec2"), False, m.start("q2")
        else:
            # `import("./x.js").T` in a type position reads as a type
            spec, types_only, start = m.group("spec3"), bool(m.group("after")), m.start()
        out.append((code.count("\n", 0, start) + 1, types_only, spec))
    return out


def ts_resolve(importer, spec, known):
    """A relative specifier → the file it names (relative to the root), or
    None."""
    if not spec.startswith("."):
        return None
    base = os.path.normpath(os.path.join(os.path.dirname(importer), spec))
    stem = re.sub(r"\.(js|mjs|ts|mts)$", "", base)
    for candidate in (stem + ".ts", stem + ".mts", base, os.path.join(base, "index.ts")):
        if candidate in known:
            return candidate
    return None


def ts_graph(root):
    files = []
    for dirpath, _dirs, names in os.walk(os.path.join(root, TS_SRC)):
        for name in names:
            if name.endswith(".ts") and not name.endswith(".d.ts"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    files.sort()
    known = set(files)
    edges = defaultdict(dict)
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            text = handle.read()
        for line, types_only, spec in ts_imports(text):
            target = ts_resolve(path, spec, known)
            if target is None or target == path:
                continue
            edges[path].setdefault(target, Edge()).add(line, types_only)
    return files, edges


# === Circles ===


def strongly_connected(nodes, edges):
    """Tarjan's algorithm, as scripts/module-cycles.py has it (the one copy)."""
    spec = importlib.util.spec_from_file_location(
        "module_cycles", os.path.join(os.path.dirname(os.path.abspath(__file__)), "module-cycles.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.strongly_connected(nodes, edges)


def report(what, nodes, edges, print_edges):
    if print_edges:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{a} -> {b} ({edges[a][b]})")
    circles = sorted(c for c in strongly_connected(nodes, edges) if len(c) > 1)
    for c in circles:
        print(f"circle of {len(c)} files:")
        for a in c:
            for b in sorted(b for b in edges[a] if b in c):
                print(f"  {a} -> {b} ({edges[a][b]})")
    print(f"{len(circles)} circle(s) between the {len(nodes)} files of {what}")
    return len(circles)


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    flags = {a for a in argv if a.startswith("--")}
    if flags - {"--edges"} or len(args) > 1:
        print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
        return 2
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    print_edges = "--edges" in flags
    found = report(PY_PACKAGE, *python_graph(root), print_edges)
    found += report(TS_SRC, *ts_graph(root), print_edges)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
