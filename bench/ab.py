#!/usr/bin/env python3
"""A/B of two ubiqfs builds on the namespace hot paths (create and remove of N empty files in
one folder) or, with --workload durability, on the fsync paths (create + 4 KiB write + fsync +
close of N/10 files, N/10 appends of 4 KiB each followed by fdatasync, N/40 atomic saves), the
two builds measured in turn in every round (which goes first alternates), medians printed. For a change to
one path, on a machine whose disk speed drifts from minute to minute (the full bench compares
systems, this compares builds).

    bench/ab.py BEFORE_BIN AFTER_BIN [--files 10000] [--rounds 5] [--root /var/tmp] [--workload durability]

--root /dev/shm keeps the disk out of it (the state folder and cache on tmpfs), which shows
what the daemon's own work costs. Each round mounts each build on a fresh state folder and
embedded cloud (uploads after 200 ms, as in bench.py), and unmounts it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
from pathlib import Path

from common import timed
from group_durability import append_fdatasync, atomic_saves, create_files
from group_metadata import create_empty


NAMESPACE = ("create", "remove")
DURABILITY = ("create+fsync", "append+fdatasync", "atomic save")


def measure(binary: str, root: Path, files: int, workload: str) -> dict[str, float]:
    """On a fresh mount of `binary`: creates, then removes, `files` empty files in a folder, or
    runs the durability workloads (rates per second)."""
    shutil.rmtree(root, ignore_errors=True)
    mnt = root / "mnt"
    mnt.mkdir(parents=True)
    env = dict(os.environ, UBIQFS_STATE_DIR=str(root / "state"), UBIQFS_CLOUD_DIR=str(root / "cloud"))
    subprocess.run([binary, "mount", "iCloud.default", str(mnt), "--upload-delay-ms", "200"], env=env, check=True,
                   capture_output=True)
    try:
        d = mnt / "d"
        d.mkdir()
        if workload == "durability":
            n = max(1, files // 10)
            for sub in ("c", "a", "s"):
                (d / sub).mkdir()
            r = {"create+fsync": n / sum(create_files(d / "c", n, fsync=True)),
                 "append+fdatasync": n / append_fdatasync(d / "a", n),
                 "atomic save": max(1, files // 40) / atomic_saves(d / "s", max(1, files // 40))}
        else:
            r = {"create": files / timed(lambda: create_empty(d, files)),
                 "remove": files / timed(lambda: [os.unlink(d / f"f{i}") for i in range(files)])}
    finally:
        subprocess.run([binary, "unmount", str(mnt)], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--workload", choices=["namespace", "durability"], default="namespace")
    a = ap.parse_args()
    keys = DURABILITY if a.workload == "durability" else NAMESPACE
    builds = {"before": a.before, "after": a.after}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for r in range(a.rounds):
        order = list(builds.items()) if r % 2 == 0 else list(reversed(builds.items()))
        for name, binary in order:
            runs[name].append(measure(binary, a.root / f"ubiqfs-ab-{name}", a.files, a.workload))
        print(f"round {r + 1}: " + "; ".join(
            f"{name} " + " ".join(f"{k} {v[-1][k]:.0f}/s" for k in keys) for name, v in runs.items()), flush=True)
    med = {name: {k: statistics.median(x[k] for x in v) for k in keys} for name, v in runs.items()}
    for name in builds:
        print(f"{name}: " + ", ".join(f"{k} {med[name][k]:.0f}/s" for k in keys) + f" (medians of {a.rounds})")
    for k in keys:
        print(f"after / before, {k}: {med['after'][k] / med['before'][k]:.2f}x")


if __name__ == "__main__":
    main()
