#!/usr/bin/env python3
"""Checks the module layering of Package.swift (docs/architecture.md, "Modules"): the mount's
modules never link a cloud engine, except the daemon through the embedded default; the daemon
never links the server or the scale-out storage; the client contract depends on nothing but
UbiqCore; the shared SQLite helpers depend on no module of ours. Reads `swift package dump-package` (or a saved copy of its output given as argument);
prints every broken rule and exits 1 if there is one."""

from __future__ import annotations

import json
import subprocess
import sys

# Target -> modules it must not reach, directly or through its dependencies.
FORBIDDEN = {
    "UbiqSQLite": {"UbiqCore", "UbiqCloudAPI", "UbiqIndex", "UbiqCloud", "UbiqCloudScale", "UbiqServer", "UbiqSync",
                   "UbiqFSCore", "UbiqKV"},
    "UbiqCloudAPI": {"UbiqIndex", "UbiqCloud", "UbiqCloudScale", "UbiqServer", "UbiqSync", "UbiqFSCore"},
    "UbiqIndex": {"UbiqCloud", "UbiqCloudScale", "UbiqServer"},
    "UbiqSync": {"UbiqCloud", "UbiqCloudScale", "UbiqServer", "UbiqHTTPClient"},
    "UbiqFSCore": {"UbiqCloud", "UbiqCloudScale", "UbiqServer", "UbiqHTTPClient", "CFuse3"},
    "UbiqFS": {"UbiqCloud", "UbiqCloudScale", "UbiqServer", "UbiqHTTPClient"},
    "UbiqKV": {"UbiqCloud", "UbiqCloudScale", "UbiqServer"},
    "UbiqHTTPClient": {"UbiqCloud", "UbiqCloudScale", "UbiqServer", "UbiqIndex"},
    "UbiqDaemon": {"UbiqCloudScale", "UbiqServer"},
    "UbiqCloud": {"UbiqIndex", "UbiqSync", "UbiqFSCore", "UbiqHTTPClient", "UbiqCloudScale", "UbiqServer"},
    "UbiqCloudScale": {"UbiqIndex", "UbiqSync", "UbiqFSCore", "UbiqHTTPClient", "UbiqServer"},
    "UbiqServer": {"UbiqIndex", "UbiqSync", "UbiqFSCore", "UbiqFS", "UbiqDaemon", "CFuse3"},
}


def load(argv: list[str]) -> dict:
    if len(argv) > 1:
        with open(argv[1]) as f:
            return json.load(f)
    out = subprocess.run(["swift", "package", "dump-package"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def target_deps(package: dict) -> dict[str, set[str]]:
    names = {t["name"] for t in package["targets"]}
    graph = {}
    for t in package["targets"]:
        deps = set()
        for d in t["dependencies"]:
            for kind in ("byName", "target"):
                if kind in d and d[kind][0] in names:
                    deps.add(d[kind][0])
        graph[t["name"]] = deps
    return graph


def reach(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module reachable from `start`, with one path to it."""
    paths, todo = {start: [start]}, [start]
    while todo:
        here = todo.pop()
        for d in sorted(graph.get(here, ())):
            if d not in paths:
                paths[d] = paths[here] + [d]
                todo.append(d)
    return paths


def main() -> int:
    graph = target_deps(load(sys.argv))
    broken = []
    for target, forbidden in FORBIDDEN.items():
        if target not in graph:
            broken.append(f"{target}: no such target (update scripts/check-layers.py)")
            continue
        paths = reach(graph, target)
        for bad in sorted(forbidden & paths.keys()):
            broken.append(f"{target} must not depend on {bad}: {' -> '.join(paths[bad])}")
    for line in broken:
        print(f"check-layers: {line}")
    if not broken:
        print(f"check-layers: {len(FORBIDDEN)} modules keep their layers")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
