#!/usr/bin/env python3
"""A/B of two ubiqfs builds on the namespace hot paths: create and remove of N empty files in
one folder, the two builds measured in turn in every round, medians printed. For a change to
one path, on a machine whose disk speed drifts from minute to minute (the full bench compares
systems, this compares builds).

    bench/ab.py BEFORE_BIN AFTER_BIN [--files 10000] [--rounds 5] [--root /var/tmp]

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
from group_metadata import create_empty


def measure(binary: str, root: Path, files: int) -> dict[str, float]:
    """Creates, then removes, `files` empty files in a folder of a fresh mount of `binary`."""
    shutil.rmtree(root, ignore_errors=True)
    mnt = root / "mnt"
    mnt.mkdir(parents=True)
    env = dict(os.environ, UBIQFS_STATE_DIR=str(root / "state"), UBIQFS_CLOUD_DIR=str(root / "cloud"))
    subprocess.run([binary, "mount", "iCloud.default", str(mnt), "--upload-delay-ms", "200"], env=env, check=True,
                   capture_output=True)
    try:
        d = mnt / "d"
        d.mkdir()
        create = files / timed(lambda: create_empty(d, files))
        remove = files / timed(lambda: [os.unlink(d / f"f{i}") for i in range(files)])
    finally:
        subprocess.run([binary, "unmount", str(mnt)], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
    return {"create": create, "remove": remove}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    a = ap.parse_args()
    builds = {"before": a.before, "after": a.after}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for r in range(a.rounds):
        for name, binary in builds.items():
            runs[name].append(measure(binary, a.root / f"ubiqfs-ab-{name}", a.files))
        print(f"round {r + 1}: " + "; ".join(
            f"{name} create {v[-1]['create']:.0f}/s remove {v[-1]['remove']:.0f}/s" for name, v in runs.items()),
            flush=True)
    med = {name: {k: statistics.median(x[k] for x in v) for k in ("create", "remove")} for name, v in runs.items()}
    for name in builds:
        print(f"{name}: create {med[name]['create']:.0f}/s, remove {med[name]['remove']:.0f}/s (medians of {a.rounds})")
    for k in ("create", "remove"):
        print(f"after / before, {k}: {med['after'][k] / med['before'][k]:.2f}x")


if __name__ == "__main__":
    main()
