#!/usr/bin/env python3
"""ubiqfs benchmarks, side by side in one run: native ext4, ubiqfs, rclone mount
(--vfs-cache-mode full over a local folder). Not part of the test suite.

    python3 bench/bench.py [--quick] [--out docs/benchmarks.md]

Needs: a release build (`swift build -c release`), fio, rclone (apt). Every mount it makes is
unmounted at the end, even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("UBIQFS_BIN", ROOT / ".build" / "release" / "ubiqfs"))
MIB = 1024 * 1024


def sh(*args, check=True, env=None, cwd=None, capture=True):
    return subprocess.run([str(a) for a in args], check=check, env=env, cwd=cwd, capture_output=capture, text=True)


def drop_caches():
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Target:
    """A directory to run workloads in, and how to make its uploads complete."""

    def __init__(self, name, path, drain=None):
        self.name = name
        self.path = Path(path)
        self.drain = drain or (lambda: None)


class World:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.env = dict(os.environ)
        self.env["UBIQFS_STATE_DIR"] = str(tmp / "ubiq-state")
        self.env["UBIQFS_CLOUD_DIR"] = str(tmp / "ubiq-cloud")
        self.ubiq_mnt = tmp / "ubiq-mnt"
        self.rclone_src = tmp / "rclone-src"
        self.rclone_mnt = tmp / "rclone-mnt"
        self.rclone_proc = None
        self.native = tmp / "native"
        for d in (self.ubiq_mnt, self.rclone_src, self.rclone_mnt, self.native):
            d.mkdir(parents=True, exist_ok=True)

    def ubiq(self, *args, check=True):
        return sh(BIN, *args, env=self.env, check=check)

    def mount_ubiq(self, *extra):
        self.ubiq("mount", "iCloud.default", self.ubiq_mnt, "--upload-delay-ms", "200", *extra)

    def unmount_ubiq(self):
        if str(self.ubiq_mnt) in Path("/proc/mounts").read_text():
            self.ubiq("unmount", self.ubiq_mnt, check=False)

    def mount_rclone(self):
        self.rclone_proc = subprocess.Popen(
            ["rclone", "mount", str(self.rclone_src), str(self.rclone_mnt), "--vfs-cache-mode", "full",
             "--cache-dir", str(self.tmp / "rclone-cache"), "--config", "/dev/null"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline and str(self.rclone_mnt) not in Path("/proc/mounts").read_text():
            time.sleep(0.1)

    def unmount_rclone(self):
        if str(self.rclone_mnt) in Path("/proc/mounts").read_text():
            subprocess.run(["fusermount3", "-u", str(self.rclone_mnt)], check=False)
        if self.rclone_proc:
            self.rclone_proc.send_signal(signal.SIGTERM)
            try:
                self.rclone_proc.wait(20)
            except subprocess.TimeoutExpired:
                self.rclone_proc.kill()

    def targets(self):
        return [
            Target("ext4", self.native),
            Target("ubiqfs", self.ubiq_mnt / "Documents", lambda: self.ubiq("sync", "--wait", self.ubiq_mnt)),
            Target("rclone", self.rclone_mnt),
        ]


def fio(path: Path, name: str, rw: str, size: str, bs: str, jobs=1, extra=()):
    out = sh("fio", "--name", name, "--directory", path, "--rw", rw, "--bs", bs, "--size", size,
             "--numjobs", jobs, "--group_reporting", "--output-format=json", "--ioengine=psync",
             "--end_fsync=1" if "write" in rw else "--invalidate=0", *extra).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return side["bw_bytes"] / MIB  # MiB/s


def read_all(path):
    """Reads a file sequentially in 1 MiB blocks, discarding the bytes."""
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none"], check=True)


def many_files(path: Path, n: int):
    d = path / f"many-{n}"
    d.mkdir()
    t_create = timed(lambda: [open(d / f"f{i}", "wb").close() for i in range(n)])
    t_stat = timed(lambda: [os.stat(d / f"f{i}") for i in range(n)])
    t_ls = timed(lambda: sh("ls", "-l", d))
    t_rm = timed(lambda: [os.unlink(d / f"f{i}") for i in range(n)])
    d.rmdir()
    return {"create/s": n / t_create, "stat/s": n / t_stat, "ls -l s": t_ls, "remove/s": n / t_rm}


def small_files_copy(src: Path, dst: Path, drain):
    t = timed(lambda: (sh("cp", "-r", src, dst / "small"), drain()))
    shutil.rmtree(dst / "small")
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (256 MiB instead of 1 GiB)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--only", choices=["io", "metadata", "content"], action="append",
                    help="run only these groups (default: all)")
    args = ap.parse_args()
    if not BIN.exists():
        sys.exit(f"build first: swift build -c release ({BIN} missing)")
    big = "256M" if args.quick else "1G"
    big_bytes = (256 if args.quick else 1024) * MIB
    tmp = Path(tempfile.mkdtemp(prefix="ubiq-bench-", dir="/var/tmp"))
    w = World(tmp)
    rows = []  # (workload, unit, ext4, ubiqfs, rclone, better)
    try:
        w.mount_ubiq()
        w.mount_rclone()
        targets = w.targets()

        def row(name, unit, values, higher_is_better=True):
            rows.append((name, unit, values, higher_is_better))
            print(f"{name:40} " + "  ".join(f"{k}={v:.2f}" for k, v in values.items()), flush=True)

        groups = set(args.only or ["io", "metadata", "content"])
        for jobs in ((1, 4) if "io" in groups else ()):
            row(f"seq write {big} ({jobs} job)", "MiB/s",
                {t.name: fio(t.path, f"w{jobs}", "write", big if jobs == 1 else f"{big_bytes // 4 // MIB}M", "1M", jobs) for t in targets})
            for t in targets:
                t.drain()
            row(f"seq read {big} ({jobs} job, re-read)", "MiB/s",
                {t.name: fio(t.path, f"w{jobs}", "read", big if jobs == 1 else f"{big_bytes // 4 // MIB}M", "1M", jobs) for t in targets})
        if "io" in groups:
            row("random 4k read (256 MiB file)", "MiB/s",
                {t.name: fio(t.path, "r4k", "randread", "256M", "4k", 1, ("--runtime=10", "--time_based")) for t in targets})
            for t in targets:
                for f in t.path.glob("*.0"):
                    f.unlink()
                t.drain()

        if "metadata" in groups:
            res = {t.name: many_files(t.path, 10000) for t in targets}
            for k in ("create/s", "stat/s", "remove/s"):
                row(f"10k files: {k}", "ops/s", {n: r[k] for n, r in res.items()})
            row("ls -l of 10k entries", "s", {n: r["ls -l s"] for n, r in res.items()}, higher_is_better=False)

        if "content" in groups:
            content_rows(w, tmp, targets, big, big_bytes, row)
    finally:
        w.unmount_ubiq()
        w.unmount_rclone()
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(rows, Path(args.out), big)


def content_rows(w, tmp, targets, big, big_bytes, row):
    """Upload drain (small files, one big file), delta upload, evicted TTFB and streaming."""
    if True:
        # 6400 small files (4 KiB): copy in + upload drain.
        src = tmp / "small-src"
        src.mkdir()
        for i in range(6400):
            (src / f"s{i:04}").write_bytes(os.urandom(4096))
        row("cp -r 6400 small files + drain", "s",
            {t.name: small_files_copy(src, t.path, t.drain) for t in targets}, higher_is_better=False)

        # Upload drain of one big file: close -> everything in the cloud.
        data_file = tmp / "big.bin"
        with open(data_file, "wb") as fh:
            for _ in range(big_bytes // (64 * MIB)):
                fh.write(os.urandom(64 * MIB))
        ubiq_file = w.ubiq_mnt / "Documents" / "big.bin"
        t_copy = timed(lambda: sh("cp", data_file, ubiq_file))
        t_drain = timed(lambda: w.ubiq("sync", "--wait", w.ubiq_mnt))
        t_raw = timed(lambda: (sh("cp", data_file, tmp / "raw-copy.bin"), os.sync()))
        row(f"upload drain {big} (after close)", "s", {"ext4": t_raw, "ubiqfs": t_drain}, higher_is_better=False)

        # 1 MiB edit inside the big file re-uploads a few chunks.
        blobs = w.tmp / "ubiq-cloud" / "blobs"
        before = sum(p.stat().st_size for p in blobs.rglob("*") if p.is_file())
        with open(ubiq_file, "r+b") as fh:
            fh.seek(big_bytes // 2)
            fh.write(os.urandom(MIB))
        w.ubiq("sync", "--wait", w.ubiq_mnt)
        after = sum(p.stat().st_size for p in blobs.rglob("*") if p.is_file())
        edit_pct = 100 * (after - before) / big_bytes
        row("1 MiB edit: bytes re-uploaded", "% of file", {"ubiqfs": edit_pct}, higher_is_better=False)

        # Evicted file: time to first byte and streaming, against a raw cold read of the same bytes.
        w.ubiq("evict", ubiq_file)
        drop_caches()
        t0 = time.perf_counter()
        with open(ubiq_file, "rb") as fh:
            fh.read(4096)
            ttfb = time.perf_counter() - t0
        w.ubiq("download", ubiq_file)  # let the first download finish, then evict again
        w.ubiq("evict", ubiq_file)
        drop_caches()
        t_stream = timed(lambda: read_all(ubiq_file))
        drop_caches()
        t_raw_read = timed(lambda: read_all(data_file))
        row("evicted file: time to first byte", "ms", {"ubiqfs": ttfb * 1000}, higher_is_better=False)
        row(f"evicted file: streaming {big}", "MiB/s",
            {"ext4": big_bytes / MIB / t_raw_read, "ubiqfs": big_bytes / MIB / t_stream})


def write_report(rows, out: Path, big: str):
    lines = [
        "# Benchmarks",
        "",
        f"Measured by `python3 bench/bench.py` in one run on this machine (2 cores, virtio disk), release build,",
        "embedded cloud on the same disk, rclone mount `--vfs-cache-mode full` over a local folder.",
        f"Run: {time.strftime('%Y-%m-%d %H:%M')} UTC. Ratios are ubiqfs / ext4 and ubiqfs / rclone",
        "(for times, lower is better, so a ratio < 1 means ubiqfs was faster).",
        "",
        "| workload | unit | ext4 | ubiqfs | rclone | ubiqfs/ext4 | ubiqfs/rclone |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, unit, v, _ in rows:
        def f(k):
            return f"{v[k]:.2f}" if k in v else "–"
        def ratio(a, b):
            return f"{v[a] / v[b]:.2f}x" if a in v and b in v and v[b] else "–"
        lines.append(f"| {name} | {unit} | {f('ext4')} | {f('ubiqfs')} | {f('rclone')} | {ratio('ubiqfs','ext4')} | {ratio('ubiqfs','rclone')} |")
    lines.append("")
    existing = out.read_text() if out.exists() else ""
    notes = existing.split("<!-- notes -->", 1)[1] if "<!-- notes -->" in existing else "\n"
    out.write_text("\n".join(lines) + "\n<!-- notes -->" + notes)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
