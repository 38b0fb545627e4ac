#!/usr/bin/env python3
"""Checks that every file of src/ imports only from its own layer and the
layers below it, as ARCHITECTURE.md's "Layers" table draws them.

The table is read from ARCHITECTURE.md itself (the rows between the
`<!-- layers -->` and `<!-- /layers -->` markers), top layer first; its
second column names the layer's rooms, each a file or folder of src/ in
backquotes. A file belongs to the room that names the longest prefix of its
path. Which file names which is scripts/module-cycles.py's graph (`use`
paths, inline paths, re-exports followed to the item's home; a child naming
its enclosing module is not an edge), of the library as compiled:
`#[cfg(test)]` code is left out, since a test may assemble any layers.

Fails (exit 1) when a file imports from a layer above its own, when a file
of src/ is in no layer, or when a room names nothing in src/. Prints each
upward import with the two layers. `--layers` prints which layer each file
is in.

Usage: scripts/layers.py [--layers] [SRC_DIR [ARCHITECTURE_MD]]
Python 3 standard library only.
"""

import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_graph_builder():
    spec = importlib.util.spec_from_file_location("module_cycles", os.path.join(HERE, "module-cycles.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_layers(architecture):
    """[(layer name, [room paths relative to src/])], top layer first."""
    with open(architecture, encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S)
    if not found:
        raise SystemExit(f"{architecture}: no <!-- layers --> ... <!-- /layers --> table")
    layers = []
    for line in found.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[1].startswith("`"):
            continue  # the header, its rule, or prose
        name = re.sub(r"[*`]", "", cells[0])
        rooms = re.findall(r"`([^`]+)`", cells[1])
        layers.append((name, [r.rstrip("/") for r in rooms]))
    if not layers:
        raise SystemExit(f"{architecture}: the layers table has no rows")
    return layers


def layer_of(path, src, layers):
    """(index, room) of the room naming the longest prefix of `path`."""
    rel = os.path.relpath(path, src)
    best = None
    for index, (_name, rooms) in enumerate(layers):
        for room in rooms:
            if rel == room or rel.startswith(room + "/"):
                if best is None or len(room) > len(best[1]):
                    best = (index, room)
    return best


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    flags = {a for a in argv if a.startswith("--")}
    if flags - {"--layers"} or len(args) > 2:
        print(__doc__.strip().split("\n\n")[-2], file=sys.stderr)
        return 2
    src = os.path.relpath(args[0] if args else os.path.join(HERE, "..", "src"))
    architecture = args[1] if len(args) > 1 else os.path.join(HERE, "..", "ARCHITECTURE.md")
    layers = read_layers(architecture)
    nodes, edges = load_graph_builder().build_graph(src, True)
    failures = 0
    where = {}
    for path in sorted(nodes):
        found = layer_of(path, src, layers)
        if found is None:
            print(f"{path}: in no layer of ARCHITECTURE.md's table")
            failures += 1
        else:
            where[path] = found
    used_rooms = {room for _index, room in where.values()}
    for name, rooms in layers:
        for room in rooms:
            if room not in used_rooms and not os.path.exists(os.path.join(src, room)):
                print(f"ARCHITECTURE.md: layer {name!r} names `{room}`, which is not in {src}")
                failures += 1
    if "--layers" in flags:
        for path in sorted(where):
            print(f"{layers[where[path][0]][0]}: {path}")
    upward = 0
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a in where and b in where and where[b][0] < where[a][0]:
                print(f"{a} ({layers[where[a][0]][0]}) imports {b} ({layers[where[b][0]][0]}), a layer above")
                upward += 1
    print(f"{upward} import(s) from a layer above, {len(nodes)} files in {len(layers)} layers of {src}")
    return 1 if upward or failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
