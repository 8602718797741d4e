"""The durability group: what fsync costs. Small-file creates with and without fsync, appends
with fdatasync, atomic saves (write a temp file, fsync it, rename it over the target, fsync the
folder), on every target; with `--baseline BIN` also on a second ubiqfs mount run by an older
build, so the cost of a change is measured in the same run on the same disk."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from common import Recorder, Sizes, Target, World, remove_tree

BLOCK = 4096


def create_files(d: Path, n: int, fsync: bool) -> list[float]:
    """Creates n files of one 4 KiB block; returns each file's seconds (open to close)."""
    data = os.urandom(BLOCK)
    took = []
    for i in range(n):
        t0 = time.perf_counter()
        fd = os.open(d / f"c{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        took.append(time.perf_counter() - t0)
    return took


def append_fdatasync(d: Path, n: int) -> float:
    """n appends of 4 KiB to one file, each followed by fdatasync; returns seconds."""
    data = os.urandom(BLOCK)
    fd = os.open(d / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, data)
            os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def atomic_saves(d: Path, n: int) -> float:
    """n saves of a 16 KiB document the way editors do it; returns seconds."""
    data = os.urandom(4 * BLOCK)
    target = d / "document.txt"
    t0 = time.perf_counter()
    for i in range(n):
        tmp = d / f".document.txt.tmp{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, target)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
    return time.perf_counter() - t0


def one_pass(t: Target, sz: Sizes) -> dict:
    """Every workload once in a fresh folder of `t`; uploads are drained before and after, so
    they never overlap the next pass."""
    d = t.path / "durability"
    d.mkdir()
    n = sz.fsync_n
    r = {"create": n / sum(create_files(d, n, fsync=False))}
    synced = d / "synced"
    synced.mkdir()
    took = create_files(synced, n, fsync=True)
    r["create_fsync"] = n / sum(took)
    r["create_fsync_p99"] = statistics.quantiles(took, n=100)[98] * 1000
    r["append"] = n / append_fdatasync(d, n)
    r["save"] = (n // 4) / atomic_saves(d, n // 4)
    t.drain()
    remove_tree(d)
    t.drain()
    return r


def durability_rows(w: World, targets, sz: Sizes, rec: Recorder):
    measured = list(targets)
    if w.baseline_bin:
        measured.append(w.mount_baseline())
    try:
        res = {}
        for t in measured:
            t.drain()
            res[t.name] = one_pass(t, sz)
    finally:
        w.unmount_baseline()

    def pick(key):  # this pass; the rows of the run's passes become medians
        return {name: r[key] for name, r in res.items()}

    n = sz.fsync_n
    rec.row("fsync_create", f"create + 4 KiB write + close ({n} files)", "files/s", pick("create"))
    rec.row("fsync_create_fsync", f"create + 4 KiB write + fsync + close ({n} files)", "files/s",
            pick("create_fsync"))
    rec.row("fsync_create_fsync_p99", "create + write + fsync + close, p99 latency", "ms",
            pick("create_fsync_p99"), higher_is_better=False)
    rec.row("fsync_append", f"4 KiB append + fdatasync ({n} times, one file)", "ops/s", pick("append"))
    rec.row("fsync_save", f"atomic save: temp + fsync + rename + fsync dir ({n // 4} saves)", "saves/s",
            pick("save"))
