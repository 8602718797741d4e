#!/usr/bin/env python3
"""Upload drain of many small items: N empty files are created through a mount whose uploads
wait (a long upload delay), then `ubiqfs sync --wait` makes them all due and returns when the
cloud has every one. Then the same for their deletes: `rm -rf` of the folders, and `sync
--wait` again. Reports items per second of each drain, to the embedded cloud and to `ubiqfs
serve` (embedded engine) on loopback; each build and cloud is measured in turn, round after
round, and the medians are printed.

    bench/drain.py [--files 20000] [--rounds 3] [--cloud embedded,serve] [--root /var/tmp]
                   [BIN ...]

With several binaries (e.g. a build before and after a change) each is measured in every
round. UBIQFS_BIN (default .build/release/ubiqfs) is used when none is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import propagation
from common import BIN, timed

DELAY_MS = 24 * 3600 * 1000


def create_files(d: Path, n: int, per_folder: int = 5000):
    """n empty files, in folders of `per_folder` (as an unpacked tree has them)."""
    for i in range(n):
        if i % per_folder == 0:
            (d / f"d{i // per_folder}").mkdir()
        open(d / f"d{i // per_folder}" / f"f{i}", "wb").close()


def measure(binary: str, root: Path, cloud: str, files: int) -> tuple[float, float]:
    """Items per second of the drain of `files` empty files (and their folders), then of their
    deletes."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    mnt = root / "mnt"
    mnt.mkdir()
    env = dict(os.environ, UBIQFS_STATE_DIR=str(root / "state"), UBIQFS_CLOUD_DIR=str(root / "cloud"))
    server = None
    try:
        if cloud == "serve":
            server, url, token = propagation.start_server(binary, root / "server")
            subprocess.run([binary, "account", "login", "--server", url, "--token", token, "--device", "a"],
                           env=env, check=True, capture_output=True)
        subprocess.run([binary, "mount", "iCloud.default", str(mnt), "--upload-delay-ms", str(DELAY_MS)], env=env,
                       check=True, capture_output=True)
        create_files(mnt / "Documents", files)
        items = files + (files + 4999) // 5000

        def drain() -> float:
            return timed(lambda: subprocess.run([binary, "sync", "--wait", str(mnt), "--timeout", "3600"], env=env,
                                                check=True, capture_output=True))

        created = items / drain()
        for folder in (mnt / "Documents").iterdir():
            shutil.rmtree(folder)
        return created, items / drain()
    finally:
        subprocess.run([binary, "unmount", str(mnt)], env=env, capture_output=True, timeout=600)
        if server:
            propagation.stop(server)
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="*")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cloud", default="embedded,serve")
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    a = ap.parse_args()
    binaries = a.binaries or [str(BIN)]
    clouds = a.cloud.split(",")
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {(b, c): [] for b in binaries for c in clouds}
    for r in range(a.rounds):
        for (binary, cloud), values in runs.items():
            values.append(measure(binary, a.root / "ubiqfs-drain", cloud, a.files))
            created, deleted = values[-1]
            print(f"round {r + 1}: {binary} to {cloud}: created {created:.0f} items/s, deleted {deleted:.0f} items/s",
                  flush=True)
    print(f"\nmedians of {a.rounds} rounds, {a.files} empty files:")
    for (binary, cloud), values in runs.items():
        created = statistics.median(v[0] for v in values)
        deleted = statistics.median(v[1] for v in values)
        print(f"  {binary} to {cloud}: created {created:.0f} items/s, deleted {deleted:.0f} items/s")


if __name__ == "__main__":
    main()
