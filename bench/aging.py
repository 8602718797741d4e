#!/usr/bin/env python3
"""Does a mount get slower as it lives? Create and remove N empty files in a new folder, round
after round, on one long-lived mount ("aged") and, in the same round, on a mount made fresh for
that round ("fresh"); both drained (`sync --wait`) after each step, as bench.py's groups do.
Prints each round's rates and what the aged mount's index holds (rows per table, WAL size), so
a slowdown can be matched with what grew.

    bench/aging.py BIN [--files 10000] [--rounds 5] [--root /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
from pathlib import Path

from common import timed
from group_metadata import create_empty


class Mount:
    def __init__(self, binary: str, root: Path):
        self.binary = binary
        self.root = root
        self.mnt = root / "mnt"
        self.env = dict(os.environ, UBIQFS_STATE_DIR=str(root / "state"), UBIQFS_CLOUD_DIR=str(root / "cloud"))

    def run(self, *args, timeout=600):
        return subprocess.run([self.binary, *map(str, args)], env=self.env, check=True, capture_output=True,
                              timeout=timeout)

    def __enter__(self):
        shutil.rmtree(self.root, ignore_errors=True)
        self.mnt.mkdir(parents=True)
        self.run("mount", "iCloud.default", self.mnt, "--upload-delay-ms", "200")
        return self

    def __exit__(self, *exc):
        subprocess.run([self.binary, "unmount", str(self.mnt)], env=self.env, capture_output=True, timeout=120)
        shutil.rmtree(self.root, ignore_errors=True)

    def drain(self):
        self.run("sync", "--wait", self.mnt, "--timeout", "600")

    def cycle(self, name: str, files: int) -> dict[str, float]:
        """Creates `files` empty files in a new folder, drains, removes them, drains."""
        d = self.mnt / name
        d.mkdir()
        create = files / timed(lambda: create_empty(d, files))
        self.drain()
        remove = files / timed(lambda: [os.unlink(d / f"f{i}") for i in range(files)])
        d.rmdir()
        self.drain()
        return {"create": create, "remove": remove}

    def index_sizes(self) -> str:
        """Rows of the index's tables that can grow, and the WAL's size."""
        found = list((self.root / "state").rglob("index.sqlite"))
        if not found:
            return "index not found"
        db = found[0]
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            counts = {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        finally:
            con.close()
        wal = Path(str(db) + "-wal")
        sizes = ", ".join(f"{t} {n}" for t, n in sorted(counts.items()) if n)
        return f"{sizes}; db {db.stat().st_size >> 10} KiB, wal {wal.stat().st_size >> 10 if wal.exists() else 0} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    a = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"aged": [], "fresh": []}
    with Mount(a.binary, a.root / "ubiqfs-aging-aged") as aged:
        for r in range(a.rounds):
            runs["aged"].append(aged.cycle(f"d{r}", a.files))
            with Mount(a.binary, a.root / "ubiqfs-aging-fresh") as fresh:
                runs["fresh"].append(fresh.cycle("d", a.files))
            print(f"round {r + 1}: " + "; ".join(
                f"{name} create {v[-1]['create']:.0f}/s remove {v[-1]['remove']:.0f}/s" for name, v in runs.items()),
                flush=True)
            print(f"  aged index: {aged.index_sizes()}", flush=True)
    for k in ("create", "remove"):
        ratios = [x[k] / y[k] for x, y in zip(runs["aged"], runs["fresh"])]
        print(f"aged / fresh, {k}, by round: " + " ".join(f"{q:.2f}" for q in ratios)
              + f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
