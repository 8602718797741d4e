#!/usr/bin/env python3
"""Upload drain of many small items: N empty files are created through a mount whose uploads
wait (a long upload delay), then `ubiqfs sync --wait` makes them all due and returns when the
cloud has every one. Then the same for their deletes: `rm -rf` of the folders, and `sync
--wait` again. Reports items per second of each drain, to the embedded cloud and to `ubiqfs
serve` (embedded engine) on loopback, and the CPU time each drain cost the daemon and the
server per 1,000 items (steadier than the rate on a loaded machine: the drain waits on fsyncs
and the network as much as on CPU); each build and cloud is measured in turn, round after
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


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(binary: str, root: Path, cloud: str, files: int) -> tuple[float, float, float, float, float, float]:
    """Items per second of the drain of `files` empty files (and their folders), then of their
    deletes; then the daemon's and the server's CPU milliseconds per 1,000 items of each."""
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
        daemon = int(subprocess.run(["pgrep", "-n", "-f", f"ubiqfs.*{mnt}"], check=True,
                                    capture_output=True, text=True).stdout.split()[0])
        create_files(mnt / "Documents", files)
        items = files + (files + 4999) // 5000

        def drain() -> tuple[float, float, float]:
            before = (cpu_seconds(daemon), cpu_seconds(server.pid) if server else 0.0)
            rate = items / timed(lambda: subprocess.run([binary, "sync", "--wait", str(mnt), "--timeout", "3600"],
                                                        env=env, check=True, capture_output=True))
            per_thousand = [(cpu_seconds(p) - b) * 1e6 / items if p else 0.0
                            for p, b in zip((daemon, server.pid if server else 0), before)]
            return rate, per_thousand[0], per_thousand[1]

        created = drain()
        for folder in (mnt / "Documents").iterdir():
            shutil.rmtree(folder)
        deleted = drain()
        return created[0], deleted[0], created[1], created[2], deleted[1], deleted[2]
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
    runs: dict[tuple[str, str], list[tuple[float, ...]]] = {(b, c): [] for b in binaries for c in clouds}

    def line(v) -> str:
        cpu = f"CPU ms per 1k items: creates daemon {v[2]:.0f} server {v[3]:.0f}, deletes daemon {v[4]:.0f} server {v[5]:.0f}"
        return f"created {v[0]:.0f} items/s, deleted {v[1]:.0f} items/s; {cpu}"

    for r in range(a.rounds):
        for (binary, cloud), values in runs.items():
            values.append(measure(binary, a.root / "ubiqfs-drain", cloud, a.files))
            print(f"round {r + 1}: {binary} to {cloud}: {line(values[-1])}", flush=True)
    print(f"\nmedians of {a.rounds} rounds, {a.files} empty files:")
    for (binary, cloud), values in runs.items():
        print(f"  {binary} to {cloud}: {line([statistics.median(v[i] for v in values) for i in range(6)])}")


if __name__ == "__main__":
    main()
