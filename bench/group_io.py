"""The io group: fio sequential and random reads and writes, re-reads from the page cache."""

from __future__ import annotations

import json
from pathlib import Path

from common import MIB, Recorder, Sizes, Target, World, drop_caches, human_bytes, sh


# --------------------------------------------------------------------------------------------
# io group: fio


def fio(path: Path, name: str, rw: str, size: str, bs: str, jobs=1, extra=()):
    """One fio job (psync); returns MiB/s. Writes end with fsync; reads don't invalidate the
    page cache unless `extra` says so."""
    opts = ["--end_fsync=1"] if "write" in rw else ["--invalidate=0"]
    if "write" in rw:
        sh("sync")  # what the target before left for the disk to write is not this one's time
    out = sh("fio", "--name", name, "--directory", path, "--rw", rw, "--bs", bs, "--size", size,
             "--numjobs", jobs, "--group_reporting", "--output-format=json", "--ioengine=psync",
             *opts, *extra).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return side["bw_bytes"] / MIB


def cold_read(t: Target, name, size, jobs):
    """Seq read of files written earlier, after dropping every cache (page, dentry, inode)."""
    drop_caches()
    return fio(t.path, name, "read", size, "1M", jobs, ("--invalidate=1",))


def io_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """Sequential write, cold read and page-cache re-read (1 and 4 jobs); random 4k read."""
    for jobs in (1, 4):
        per_job = sz.big_bytes // jobs
        size = f"{per_job // MIB}M"
        what = f"{human_bytes(sz.big_bytes)}, 1 job" if jobs == 1 else f"{jobs} jobs x {human_bytes(per_job)}"
        written = {}
        for t in targets:
            written[t.name] = fio(t.path, f"s{jobs}", "write", size, "1M", jobs)
            # ubiqfs uploads what was written into its embedded cloud, on the same disk: done
            # before the next target writes, or that target's time would carry the upload.
            t.drain()
        rec.row(f"seq_write_{jobs}", f"seq write {what} (+fsync)", "MiB/s", written)
        w.drain_all(targets)
        rec.row(f"seq_read_{jobs}", f"seq read {what}, caches dropped", "MiB/s",
                {t.name: cold_read(t, f"s{jobs}", size, jobs) for t in targets})
        reread = {}
        for t in targets:
            # first read fills the page cache (the cold reads of the other targets dropped it)
            fio(t.path, f"s{jobs}", "read", size, "1M", jobs)
            reread[t.name] = fio(t.path, f"s{jobs}", "read", size, "1M", jobs)  # measured
        rec.row(f"seq_reread_{jobs}", f"seq re-read {what}, 2nd read in a row (page cache)", "MiB/s", reread)
        remove_fio_files(targets)
    rec.row("rand_read_4k", "random 4k read, 256 MiB file just written, 10 s", "MiB/s",
            {t.name: fio(t.path, "r4k", "randread", "256M", "4k", 1, ("--runtime=10", "--time_based"))
             for t in targets})
    remove_fio_files(targets)


def remove_fio_files(targets):
    """Deletes fio's data files and waits for ubiqfs to upload the deletions."""
    for t in targets:
        for f in t.path.glob("*.[0-9]*"):
            f.unlink()
        t.drain()
