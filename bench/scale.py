#!/usr/bin/env python3
"""How ubiqfs grows with the size of a container: 10k, 100k and 1M items.

For each size, a fresh `ubiqfs serve` (embedded engine, loopback) is filled through its HTTP API
(`POST /v1/containers/{c}/items`, 1,000 records a request): folders of 1,000 empty files named
`file0000000.txt`, `file0000001.txt`, ... A new device then signs in and mounts the container,
and the script measures:

* mount ready: `ubiqfs mount` until it returns (the mount answers), with an empty index;
* catch-up: until the device has pulled every record (the last one is visible in the mount);
* the daemon's memory (VmRSS) after the catch-up, and its peak (VmHWM);
* `ubiqfs find` by a name prefix and by a name suffix (`*99.txt`), the CLI timed whole;
* `ls -l` of one folder of 1,000 entries, and `find -type f` of the whole mount (counts checked);
* mount ready again, unmounted and mounted over the full index, and its memory after that.

Each timed step runs three times where it can be repeated, and the median is kept. Results go
to bench/scale-results.json and a plot to docs/benchmarks-scale.png.

    bench/scale.py [--sizes 10000,100000,1000000] [--root /var/tmp] [--out bench/scale-results.json]
                   [--report-only]

UBIQFS_BIN (default .build/release/ubiqfs) is the build measured. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "Tests" / "server"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("UBIQFS_BIN", str(ROOT / ".build" / "release" / "ubiqfs"))

import ubiqstack  # noqa: E402
from common import drop_caches, now_utc  # noqa: E402
from ubiqstack import Api, EmbeddedStorage, ServerProcess, create_account  # noqa: E402

CONTAINER = "iCloud.default"
PER_FOLDER = 1000
PER_REQUEST = 1000
MARKER = "zz-last.txt"


def record(item_id: str, parent: str, name: str, kind: int) -> dict:
    return {"itemID": item_id, "parentID": parent, "name": name, "kind": kind, "mode": 0o755 if kind == 2 else 0o644,
            "size": 0, "mtimeNs": 1_790_000_000_000_000_000, "xattrs": {}, "chunks": [], "etag": "",
            "deleted": False, "changeSeq": 0, "deviceID": "scale"}


def fill(api: Api, n: int) -> float:
    """n empty files in folders of PER_FOLDER, then the marker file; returns items per second."""
    path = f"/v1/containers/{Api.q(CONTAINER)}/items"
    folders = (n + PER_FOLDER - 1) // PER_FOLDER
    items = [record(f"d{k}", "documents", f"dir{k:04d}", 2) for k in range(folders)]
    items += [record(f"f{i}", f"d{i // PER_FOLDER}", f"file{i:07d}.txt", 1) for i in range(n)]
    items.append(record("marker", "documents", MARKER, 1))
    t0 = time.perf_counter()
    for start in range(0, len(items), PER_REQUEST):
        body = {"puts": [{"item": r, "ifMatch": None} for r in items[start:start + PER_REQUEST]]}
        r = api.post(path, body, timeout=600)
        answer = r.json()
        if r.status != 200 or answer.get("refused") or len(answer["committed"]) != len(body["puts"]):
            raise RuntimeError(f"batch at {start} not committed: {r.status} {str(answer)[:300]}")
    return len(items) / (time.perf_counter() - t0)


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def timed_run(args: list, env: dict, repeat: int = 3) -> tuple[float, str]:
    """Median seconds of `repeat` runs of a command, and its last output."""
    times, out = [], ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run(args, env=env, check=True, capture_output=True, text=True, timeout=3600).stdout
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def daemon_pid(mnt: Path) -> int:
    return int(subprocess.run(["pgrep", "-n", "-f", f"ubiqfs.*{mnt}"], check=True, capture_output=True,
                              text=True).stdout.split()[0])


def measure(binary: str, root: Path, n: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    mnt = root / "mnt"
    mnt.mkdir()
    env = dict(os.environ, UBIQFS_STATE_DIR=str(root / "state"), UBIQFS_CLOUD_DIR=str(root / "cloud"))
    storage = EmbeddedStorage(root / "server")
    server = ServerProcess(storage, root / "serve.log").start()
    mounted = False
    res: dict = {"items": n}
    try:
        token = create_account(storage, "scale")
        api = Api(server.url, token)
        api.ensure_container(CONTAINER)
        res["fill_per_s"] = fill(api, n)
        print(f"  {n}: filled at {res['fill_per_s']:.0f} items/s", flush=True)
        subprocess.run([binary, "account", "login", "--server", server.url, "--token", token, "--device", "a"],
                       env=env, check=True, capture_output=True)
        t0 = time.perf_counter()
        subprocess.run([binary, "mount", CONTAINER, str(mnt)], env=env, check=True, capture_output=True)
        mounted = True
        res["mount_ready_empty_s"] = time.perf_counter() - t0
        marker = mnt / "Documents" / MARKER
        while not marker.exists():
            time.sleep(0.05)
        res["catch_up_s"] = time.perf_counter() - t0
        res["catch_up_per_s"] = (n + 1) / res["catch_up_s"]
        pid = daemon_pid(mnt)
        res["rss_after_catch_up_kib"], res["hwm_after_catch_up_kib"] = memory_kib(pid)
        print(f"  {n}: caught up in {res['catch_up_s']:.1f} s", flush=True)
        prefix = f"file{max(n // 10 - 1, 0):07d}"[:-1] + "*"  # ten names (one with n = 10k)
        res["find_prefix_s"], out = timed_run([binary, "find", prefix, "--container", CONTAINER], env)
        res["find_prefix_results"] = len(out.splitlines())
        res["find_suffix_s"], out = timed_run([binary, "find", "*99.txt", "--container", CONTAINER], env)
        res["find_suffix_results"] = len(out.splitlines())
        folder = mnt / "Documents" / "dir0000"
        subprocess.run(["ls", "-l", folder], check=True, capture_output=True)  # warms the caches
        res["ls_l_folder_s"], out = timed_run(["ls", "-l", folder], env)
        if len(out.splitlines()) != min(n, PER_FOLDER) + 1:
            raise RuntimeError(f"ls -l of {folder} listed {len(out.splitlines()) - 1} entries")
        drop_caches()
        res["find_tree_cold_s"], out = timed_run(["find", mnt / "Documents", "-type", "f"], env, repeat=1)
        if len(out.splitlines()) != n + 1:
            raise RuntimeError(f"find -type f listed {len(out.splitlines())} files, not {n + 1}")
        res["rss_after_find_kib"], _ = memory_kib(pid)
        subprocess.run([binary, "unmount", str(mnt)], env=env, check=True, capture_output=True, timeout=600)
        mounted = False
        ready = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([binary, "mount", CONTAINER, str(mnt)], env=env, check=True, capture_output=True)
            mounted = True
            os.listdir(mnt / "Documents")
            ready.append(time.perf_counter() - t0)
            res["rss_after_remount_kib"], _ = memory_kib(daemon_pid(mnt))
            subprocess.run([binary, "unmount", str(mnt)], env=env, check=True, capture_output=True, timeout=600)
            mounted = False
        res["mount_ready_full_s"] = statistics.median(ready)
        res["index_bytes"] = sum(f.stat().st_size for f in (root / "state").rglob("index.sqlite*") if f.is_file())
        return res
    finally:
        if mounted:
            subprocess.run([binary, "unmount", str(mnt)], env=env, capture_output=True, timeout=600)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


ROWS = [  # key, label, unit, scale, goal
    ("fill_per_s", "server fill through the HTTP API", "items/s", 1, None),
    ("mount_ready_empty_s", "mount ready, new device (empty index)", "ms", 1000, None),
    ("catch_up_s", "new device: every record pulled", "s", 1, None),
    ("catch_up_per_s", "new device: pull rate", "items/s", 1, None),
    ("rss_after_catch_up_kib", "daemon RSS after the catch-up", "MiB", 1 / 1024, "<= 200 MB"),
    ("hwm_after_catch_up_kib", "daemon peak RSS during the catch-up", "MiB", 1 / 1024, "<= 200 MB"),
    ("find_prefix_s", "`ubiqfs find` by a name prefix (10 results)", "ms", 1000, "<= 100 ms"),
    ("find_suffix_s", "`ubiqfs find '*99.txt'` (up to 1,000 results)", "ms", 1000, "<= 100 ms"),
    ("ls_l_folder_s", "`ls -l` of a folder of 1,000 (warm)", "ms", 1000, None),
    ("find_tree_cold_s", "`find -type f` of the whole mount (caches dropped)", "s", 1, None),
    ("rss_after_find_kib", "daemon RSS after that find", "MiB", 1 / 1024, "<= 200 MB"),
    ("mount_ready_full_s", "mount ready over the full index (+ ls Documents)", "ms", 1000, "<= 1 s"),
    ("rss_after_remount_kib", "daemon RSS after that mount", "MiB", 1 / 1024, "<= 200 MB"),
    ("index_bytes", "index size on disk", "MiB", 1 / 1048576, None),
]


def table(results: list[dict]) -> str:
    head = "| measure | unit | " + " | ".join(f"{r['items']:,} items" for r in results) + " | goal |"
    lines = [head, "|" + "---|" * (len(results) + 3)]
    for key, label, unit, scale, goal in ROWS:
        cells = [f"{r[key] * scale:,.0f}" if r[key] * scale >= 100 else f"{r[key] * scale:.3g}" for r in results]
        lines.append(f"| {label} | {unit} | " + " | ".join(cells) + f" | {goal or '–'} |")
    return "\n".join(lines)


def plot(results: list[dict], png: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [r["items"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, label in (("find_prefix_s", "find by prefix"), ("find_suffix_s", "find *99.txt"),
                       ("mount_ready_full_s", "mount ready (full index)"), ("ls_l_folder_s", "ls -l of 1,000")):
        axes[0].plot(sizes, [r[key] * 1000 for r in results], marker="o", label=label)
    axes[0].axhline(100, color="grey", linestyle=":", label="find goal (100 ms)")
    axes[0].set_ylabel("ms")
    for key, label in (("rss_after_catch_up_kib", "after catch-up"), ("hwm_after_catch_up_kib", "peak during catch-up"),
                       ("rss_after_find_kib", "after find -type f of everything"),
                       ("rss_after_remount_kib", "after remount")):
        axes[1].plot(sizes, [r[key] / 1024 for r in results], marker="o", label=label)
    axes[1].axhline(200, color="grey", linestyle=":", label="goal (200 MB)")
    axes[1].set_ylabel("daemon RSS, MiB")
    for key, label in (("catch_up_s", "new device catch-up"), ("find_tree_cold_s", "find -type f, cold")):
        axes[2].plot(sizes, [r[key] for r in results], marker="o", label=label)
    axes[2].set_ylabel("s")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("items in the container")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("ubiqfs at 10k, 100k and 1M items (release build, ubiqfs serve on loopback)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "scale-results.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks-scale.png")
    ap.add_argument("--report-only", action="store_true", help="measure nothing; table and plot from --out")
    a = ap.parse_args()
    if a.report_only:
        results = json.loads(a.out.read_text())["results"]
        print(table(results))
        plot(results, a.plot)
        return
    binary = os.environ["UBIQFS_BIN"]
    ubiqstack.UBIQFS_BIN = binary
    results = []
    for n in (int(s) for s in a.sizes.split(",")):
        results.append(measure(binary, a.root / "ubiqfs-scale", n))
        print(json.dumps(results[-1]), flush=True)
    a.out.write_text(json.dumps({"measured": now_utc(), "binary": binary, "results": results}, indent=1) + "\n")
    print(table(results))
    try:
        plot(results, a.plot)
    except ImportError as e:
        print(f"no plot ({e})")


if __name__ == "__main__":
    main()
