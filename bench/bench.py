#!/usr/bin/env python3
"""ubiqfs benchmarks, side by side: native ext4 (a folder under /var/tmp), ubiqfs (embedded
cloud on the same disk) and rclone mount (--vfs-cache-mode full over a local folder).
Not part of the test suite.

    python3 bench/bench.py [--quick] [--only GROUP ...] [--results bench/results.json]
                           [--out docs/benchmarks.md] [--report-only]

Groups: io, metadata, bigdir, tree, content, propagation (default: all, in one run).
Raw numbers go to a JSON results file; a run of some groups replaces every row of those groups
there and keeps the others, so one group can be re-measured alone. The markdown report (table of
ratios ubiqfs/ext4 and ubiqfs/rclone, DESIGN targets, met?) and a PNG plot next to it are then
regenerated from the whole results file. The report keeps everything after `<!-- notes -->`.

Needs: a release build (`swift build -c release`, or $UBIQFS_BIN), fio, rclone, git (apt),
matplotlib (pip). Every mount and process it starts is stopped at the end, even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import propagation  # noqa: E402  (bench/propagation.py)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("UBIQFS_BIN", ROOT / ".build" / "release" / "ubiqfs"))
MIB = 1024 * 1024
GROUPS = ["io", "metadata", "bigdir", "tree", "content", "propagation"]
TARGET_NAMES = ["ext4", "ubiqfs", "rclone"]
DRAIN_TIMEOUT_S = 3600


# --------------------------------------------------------------------------------------------
# helpers


def sh(*args, check=True, env=None, cwd=None, capture=True):
    """Runs a command; output captured (text) unless capture=False, then it goes to /dev/null."""
    out = None if capture else subprocess.DEVNULL
    return subprocess.run([str(a) for a in args], check=check, env=env, cwd=cwd, text=True,
                          capture_output=capture, stdout=out, stderr=out)


def drop_caches():
    """sync, then drop page cache, dentries and inodes (FUSE mounts get FORGETs)."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn):
    """Seconds `fn()` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def mounted(path: Path) -> bool:
    """Whether `path` is a mount point in /proc/mounts."""
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def remove_tree(path: Path, tries=60):
    """rm -rf, retried for up to ~30 s: rclone answers EIO to rmdir while its write-back of the
    folder's files is still going on."""
    for _ in range(tries):
        if subprocess.run(["rm", "-rf", str(path)], capture_output=True).returncode == 0 and not path.exists():
            return
        time.sleep(0.5)
    raise RuntimeError(f"could not remove {path}")


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Sizes:
    """Workload sizes: full run or --quick."""
    quick: bool

    @property
    def big_bytes(self):  # sequential I/O, upload drain, streaming
        return (256 if self.quick else 1024) * MIB

    @property
    def many(self):  # metadata group
        return 2000 if self.quick else 10000

    @property
    def huge(self):  # bigdir group
        return 20000 if self.quick else 100000

    @property
    def tree_files(self):  # tree group
        return 5000 if self.quick else 30000

    @property
    def tree_bytes(self):
        return (80 if self.quick else 400) * MIB

    @property
    def small_copy(self):  # cp -r of small files
        return 1600 if self.quick else 6400

    @property
    def prop_n(self):  # propagation rounds
        return 10 if self.quick else 30


def human_bytes(n: int) -> str:
    return f"{n // (1024 * MIB)} GiB" if n >= 1024 * MIB and n % (1024 * MIB) == 0 else f"{n // MIB} MiB"


def count(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


# --------------------------------------------------------------------------------------------
# the three targets


class Target:
    """A directory to run workloads in, and how to make its uploads complete."""

    def __init__(self, name, path, drain=None):
        self.name = name
        self.path = Path(path)
        self.drain = drain or (lambda: None)


class World:
    """The temporary folder, the ubiqfs mount (embedded cloud) and the rclone mount."""

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

    def drain_ubiq(self):
        """Returns when everything on the ubiqfs mount is uploaded."""
        self.ubiq("sync", "--wait", self.ubiq_mnt, "--timeout", DRAIN_TIMEOUT_S)

    def unmount_ubiq(self):
        if mounted(self.ubiq_mnt):
            self.ubiq("unmount", self.ubiq_mnt, check=False)
        if mounted(self.ubiq_mnt):  # still busy: detach lazily so the daemon can go
            subprocess.run(["fusermount3", "-uz", str(self.ubiq_mnt)], check=False)

    def mount_rclone(self):
        self.rclone_proc = subprocess.Popen(
            ["rclone", "mount", str(self.rclone_src), str(self.rclone_mnt), "--vfs-cache-mode", "full",
             "--cache-dir", str(self.tmp / "rclone-cache"), "--config", "/dev/null"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 20
        while time.time() < deadline and not mounted(self.rclone_mnt):
            time.sleep(0.1)
        if not mounted(self.rclone_mnt):
            raise RuntimeError("rclone mount did not come up")

    def unmount_rclone(self):
        if mounted(self.rclone_mnt):
            subprocess.run(["fusermount3", "-u", str(self.rclone_mnt)], check=False)
        if self.rclone_proc:
            propagation.stop(self.rclone_proc)
        if mounted(self.rclone_mnt):
            subprocess.run(["fusermount3", "-uz", str(self.rclone_mnt)], check=False)

    def targets(self):
        return [
            Target("ext4", self.native),
            Target("ubiqfs", self.ubiq_mnt / "Documents", self.drain_ubiq),
            Target("rclone", self.rclone_mnt),
        ]

    def drain_all(self, targets):
        for t in targets:
            t.drain()


# --------------------------------------------------------------------------------------------
# results: rows, merged into a JSON file


class Recorder:
    """Collects the rows of one run; each finished group is merged into the results file."""

    def __init__(self, path: Path, run: dict):
        self.path = path
        self.run = run
        self.rows: list[dict] = []
        self.group = None

    def row(self, key, name, unit, values, higher_is_better=True):
        """Records one measured row of the current group and prints it."""
        self.rows.append({
            "key": key, "name": name, "unit": unit, "group": self.group,
            "values": {k: values[k] for k in TARGET_NAMES if k in values},
            "higher_is_better": higher_is_better, "measured_at": now_utc(), "run": self.run["id"],
        })
        print(f"  {name:58} " + "  ".join(f"{k}={v:.2f}" for k, v in values.items()), flush=True)

    def finish_group(self, group, seconds):
        """Merges the rows of `group` into the results file (replacing that group's old rows)."""
        self.run.setdefault("groups", {})[group] = {"seconds": round(seconds, 1), "finished_at": now_utc()}
        data = load_results(self.path)
        data["runs"][self.run["id"]] = self.run
        mine = [r for r in self.rows if r["group"] == group]
        data["rows"] = [r for r in data["rows"] if r["group"] != group] + mine
        data["rows"].sort(key=lambda r: GROUPS.index(r["group"]) if r["group"] in GROUPS else len(GROUPS))
        used = {r["run"] for r in data["rows"]}
        data["runs"] = {k: v for k, v in data["runs"].items() if k in used}
        save_results(self.path, data)


def load_results(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"version": 1, "runs": {}, "rows": []}


def save_results(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# io group: fio


def fio(path: Path, name: str, rw: str, size: str, bs: str, jobs=1, extra=()):
    """One fio job (psync); returns MiB/s. Writes end with fsync; reads don't invalidate the
    page cache unless `extra` says so."""
    opts = ["--end_fsync=1"] if "write" in rw else ["--invalidate=0"]
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
        rec.row(f"seq_write_{jobs}", f"seq write {what} (+fsync)", "MiB/s",
                {t.name: fio(t.path, f"s{jobs}", "write", size, "1M", jobs) for t in targets})
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


# --------------------------------------------------------------------------------------------
# metadata and bigdir groups


def create_empty(d: Path, n: int):
    """Creates n empty files f0..f{n-1} in d."""
    for i in range(n):
        open(d / f"f{i}", "wb").close()


def ls_l(d: Path):
    """`ls -l DIR >/dev/null`."""
    sh("ls", "-l", d, capture=False)


def many_files(path: Path, n: int):
    """create / stat / ls -l (warm, then caches dropped) / remove of n empty files in one dir."""
    d = path / f"many-{n}"
    d.mkdir()
    r = {"create": n / timed(lambda: create_empty(d, n)),
         "stat": n / timed(lambda: [os.stat(d / f"f{i}") for i in range(n)]),
         "ls": timed(lambda: ls_l(d))}
    drop_caches()
    r["ls_cold"] = timed(lambda: ls_l(d))
    r["remove"] = n / timed(lambda: [os.unlink(d / f"f{i}") for i in range(n)])
    remove_tree(d)
    return r


def metadata_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """Rates of create/stat/remove of empty files, `ls -l` of the folder."""
    n, c = sz.many, count(sz.many)
    res = {}
    for t in targets:
        res[t.name] = many_files(t.path, n)
        t.drain()
    pick = lambda k: {name: r[k] for name, r in res.items()}  # noqa: E731
    rec.row("create_many", f"create {c} empty files (one folder)", "ops/s", pick("create"))
    rec.row("stat_many", f"stat {c} files (just created, warm)", "ops/s", pick("stat"))
    rec.row("ls_many", f"ls -l of {c} entries (warm)", "s", pick("ls"), higher_is_better=False)
    rec.row("ls_many_cold", f"ls -l of {c} entries (caches dropped)", "s", pick("ls_cold"), higher_is_better=False)
    rec.row("remove_many", f"remove {c} files", "ops/s", pick("remove"))


def huge_dir(t: Target, n: int):
    """Creates n empty files in one folder, `ls -l` it warm and cold, then rm -rf."""
    d = t.path / f"huge-{n}"
    d.mkdir()
    r = {"create": n / timed(lambda: create_empty(d, n)), "ls": timed(lambda: ls_l(d))}
    drop_caches()
    r["ls_cold"] = timed(lambda: ls_l(d))
    r["rm"] = timed(lambda: remove_tree(d))  # counts any retry wait (rclone)
    t.drain()
    return r


def bigdir_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """One folder of 100k (quick: 20k) entries."""
    c = count(sz.huge)
    res = {t.name: huge_dir(t, sz.huge) for t in targets}
    pick = lambda k: {name: r[k] for name, r in res.items()}  # noqa: E731
    rec.row("create_huge", f"create {c} empty files (one folder)", "ops/s", pick("create"))
    rec.row("ls_huge", f"ls -l of {c} entries (warm)", "s", pick("ls"), higher_is_better=False)
    rec.row("ls_huge_cold", f"ls -l of {c} entries (caches dropped)", "s", pick("ls_cold"), higher_is_better=False)
    rec.row("rm_huge", f"rm -rf of the {c} files", "s", pick("rm"), higher_is_better=False)


# --------------------------------------------------------------------------------------------
# tree group: untar + git


def tree_sources():
    """Local folders of many small files (headers, docs, the Python standard library)."""
    roots = ["/usr/include", "/usr/share/doc", sysconfig.get_paths()["stdlib"], "/usr/lib/python3"]
    return [Path(r) for r in dict.fromkeys(roots) if Path(r).is_dir()]


def small_files(roots, max_size=MIB):
    """Readable regular files of at most max_size bytes under roots, in a stable order
    (no symlinks, no __pycache__); yields (path, size)."""
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                p = Path(dirpath) / f
                try:
                    st = p.lstat()
                except OSError:
                    continue
                if p.is_file() and not p.is_symlink() and st.st_size <= max_size and os.access(p, os.R_OK):
                    yield p, st.st_size


def build_tree_tarball(out: Path, max_files: int, max_bytes: int):
    """Tars up to max_files small files (max_bytes in all) from tree_sources(); returns
    (files, bytes). Made locally, no network."""
    picked, total = [], 0
    for p, size in small_files(tree_sources()):
        if len(picked) >= max_files or total + size > max_bytes:
            break
        picked.append(str(p).lstrip("/"))
        total += size
    listing = out.with_suffix(".list")
    listing.write_text("\n".join(picked) + "\n")
    sh("tar", "cf", out, "-C", "/", "--no-recursion", "-T", listing)
    return len(picked), total


GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "-c", "safe.directory=*",
       "-c", "gc.auto=0", "-c", "init.defaultBranch=main"]


def tree_on(t: Target, tarball: Path):
    """tar xf; upload drain; git init+add+commit; git status (caches dropped, then warm); rm -rf."""
    d = t.path / "tree"
    d.mkdir()
    r = {"untar": timed(lambda: sh("tar", "xf", tarball, "--no-same-owner", "-C", d))}
    r["drain"] = timed(t.drain)
    r["commit"] = timed(lambda: (sh(*GIT, "init", "-q", cwd=d), sh(*GIT, "add", "-A", cwd=d),
                                 sh(*GIT, "commit", "-q", "-m", "tree", cwd=d)))
    t.drain()  # untimed: .git objects go up before status is measured
    drop_caches()
    r["status_cold"] = timed(lambda: sh(*GIT, "status", "--porcelain", cwd=d))
    r["status_warm"] = timed(lambda: sh(*GIT, "status", "--porcelain", cwd=d))
    r["rm"] = timed(lambda: remove_tree(d))  # counts any retry wait (rclone)
    t.drain()
    return r


def tree_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """A source-like tree: untar it, commit it to git, git status."""
    tarball = w.tmp / "tree.tar"
    files, nbytes = build_tree_tarball(tarball, sz.tree_files, sz.tree_bytes)
    what = f"{files} files, {nbytes // MIB} MiB"
    print(f"  tree: {what} (tar of {', '.join(map(str, tree_sources()))})", flush=True)
    res = {t.name: tree_on(t, tarball) for t in targets}
    tarball.unlink()
    pick = lambda k, only=None: {n: r[k] for n, r in res.items() if not only or n in only}  # noqa: E731
    rec.row("untar", f"untar tree ({what}), tar xf only", "s", pick("untar"), higher_is_better=False)
    rec.row("untar_drain", "untar tree: upload drain after tar xf (separate)", "s",
            pick("drain", ("ubiqfs",)), higher_is_better=False)
    rec.row("git_commit", "tree: git init + add -A + commit", "s", pick("commit"), higher_is_better=False)
    rec.row("git_status_cold", "tree: git status (caches dropped)", "s", pick("status_cold"), higher_is_better=False)
    rec.row("git_status_warm", "tree: git status (warm, 2nd run)", "s", pick("status_warm"), higher_is_better=False)
    rec.row("rm_tree", "tree: rm -rf (files + .git)", "s", pick("rm"), higher_is_better=False)


# --------------------------------------------------------------------------------------------
# content group: uploads and evicted files


def small_files_copy(src: Path, t: Target):
    """cp -r of a folder of small files, plus the upload drain; returns seconds."""
    secs = timed(lambda: (sh("cp", "-r", src, t.path / "small"), t.drain()))
    remove_tree(t.path / "small")
    t.drain()
    return secs


def write_random(path: Path, nbytes: int):
    """A file of nbytes random bytes (written 64 MiB at a time)."""
    with open(path, "wb") as fh:
        for _ in range(nbytes // (64 * MIB)):
            fh.write(os.urandom(64 * MIB))


def blob_bytes(w: World):
    """Bytes stored in the embedded cloud's blob store."""
    return sum(p.stat().st_size for p in (w.tmp / "ubiq-cloud" / "blobs").rglob("*") if p.is_file())


def ttfb(path: Path):
    """Seconds from open to the first 4 KiB read returning."""
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        fh.read(4096)
        return time.perf_counter() - t0


def read_all(path):
    """Reads a file sequentially in 1 MiB blocks, discarding the bytes."""
    sh("dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none")


def content_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """Upload drain (small files, one big file), delta upload, evicted TTFB and streaming."""
    big = human_bytes(sz.big_bytes)
    src = w.tmp / "small-src"
    src.mkdir()
    for i in range(sz.small_copy):
        (src / f"s{i:04}").write_bytes(os.urandom(4096))
    rec.row("cp_small", f"cp -r {sz.small_copy} small files (4 KiB) + upload drain", "s",
            {t.name: small_files_copy(src, t) for t in targets}, higher_is_better=False)

    # Upload drain of one big file: close -> everything in the cloud; ext4: cp + sync.
    data_file = w.tmp / "big.bin"
    write_random(data_file, sz.big_bytes)
    ubiq_file = w.ubiq_mnt / "Documents" / "big.bin"
    sh("cp", data_file, ubiq_file)
    t_drain = timed(w.drain_ubiq)
    t_raw = timed(lambda: (sh("cp", data_file, w.tmp / "raw-copy.bin"), os.sync()))
    rec.row("upload_drain", f"upload drain {big} after close (ext4: cp + sync)", "s",
            {"ext4": t_raw, "ubiqfs": t_drain}, higher_is_better=False)

    # 1 MiB edit inside the big file re-uploads a few chunks.
    before = blob_bytes(w)
    with open(ubiq_file, "r+b") as fh:
        fh.seek(sz.big_bytes // 2)
        fh.write(os.urandom(MIB))
    w.drain_ubiq()
    rec.row("edit_delta", f"1 MiB edit in {big}: bytes re-uploaded", "% of file",
            {"ubiqfs": 100 * (blob_bytes(w) - before) / sz.big_bytes}, higher_is_better=False)

    # Evicted file: time to first byte and streaming, against a raw cold read of the same bytes.
    w.ubiq("evict", ubiq_file)
    drop_caches()
    first = ttfb(ubiq_file)
    w.ubiq("download", ubiq_file)  # let the first download finish, then evict again
    w.ubiq("evict", ubiq_file)
    drop_caches()
    t_stream = timed(lambda: read_all(ubiq_file))
    drop_caches()
    t_raw_read = timed(lambda: read_all(data_file))
    rec.row("evicted_ttfb", "evicted file: time to first byte (open + 4 KiB read)", "ms",
            {"ubiqfs": first * 1000}, higher_is_better=False)
    rec.row("evicted_stream", f"evicted file: streaming {big} (ext4: cold read)", "MiB/s",
            {"ext4": sz.big_bytes / MIB / t_raw_read, "ubiqfs": sz.big_bytes / MIB / t_stream})
    ubiq_file.unlink()
    w.drain_ubiq()


# --------------------------------------------------------------------------------------------
# propagation group


def propagation_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """Two daemons of one account on one `ubiqfs serve` (bench/propagation.py). A change not
    visible after propagation.LOST_AFTER_S counts as lost; a percentile that falls on a lost
    change is recorded as that timeout."""
    res = propagation.measure(sz.prop_n, BIN)
    cap = propagation.LOST_AFTER_S
    for kind in ("create", "modify"):
        for p in (50, 99):
            rec.row(f"prop_{kind}_p{p}", f"propagation p{p}, {kind} (n={sz.prop_n}, two mounts, serve)", "ms",
                    {"ubiqfs": min(propagation.pct(res[kind], p), cap) * 1000}, higher_is_better=False)
    rec.row("prop_lost", f"propagation: creates + modifies not visible after {cap:.0f} s", f"of {2 * sz.prop_n}",
            {"ubiqfs": propagation.lost(res["create"]) + propagation.lost(res["modify"])}, higher_is_better=False)


WORKLOADS = {"io": io_rows, "metadata": metadata_rows, "bigdir": bigdir_rows, "tree": tree_rows,
             "content": content_rows, "propagation": propagation_rows}


# --------------------------------------------------------------------------------------------
# DESIGN targets


# row key -> [(kind, reference, bound, text)]. Kinds, on ubiqfs's value u and the reference's r:
# "min_ratio" u/r >= bound, "gt_ratio" u/r > bound (rates); "max_ratio" u/r <= bound (times);
# "max" u <= bound (absolute, in the row's unit).
TARGETS = {}
for _j in (1, 4):
    TARGETS[f"seq_write_{_j}"] = [("min_ratio", "ext4", 0.9, ">= 0.9x ext4")]
    TARGETS[f"seq_read_{_j}"] = [("min_ratio", "ext4", 0.9, ">= 0.9x ext4")]
    TARGETS[f"seq_reread_{_j}"] = [("min_ratio", "ext4", 0.9, "~1.0x ext4 (>= 0.9x)")]
for _k in ("ls_many", "ls_many_cold", "ls_huge", "ls_huge_cold"):
    TARGETS[_k] = [("max_ratio", "ext4", 2.0, "<= 2x ext4 time")]
for _k in ("create_many", "remove_many", "create_huge"):
    TARGETS[_k] = [("gt_ratio", "rclone", 1.0, "> rclone")]
TARGETS["stat_many"] = [("gt_ratio", "rclone", 1.0, "> rclone"), ("min_ratio", "ext4", 0.9, "~ext4 (>= 0.9x)")]
TARGETS["evicted_ttfb"] = [("max", None, 20.0, "<= 20 ms")]
TARGETS["evicted_stream"] = [("min_ratio", "ext4", 0.8, ">= 0.8x raw read*")]
TARGETS["upload_drain"] = [("max_ratio", "ext4", 1.3, "<= 1.3x raw write*")]
TARGETS["edit_delta"] = [("max", None, 3.0, "< 3 %")]
for _kind in ("create", "modify"):
    TARGETS[f"prop_{_kind}_p50"] = [("max", None, 1000.0, "<= 1 s")]
    TARGETS[f"prop_{_kind}_p99"] = [("max", None, 3000.0, "<= 3 s")]
TARGETS["prop_lost"] = [("max", None, 0.0, "none")]


def target_margin(row, target):
    """How far ubiqfs is from one target, normalized so that >= 1 means met (None: no data)."""
    kind, ref, bound, _ = target
    v = row["values"]
    if "ubiqfs" not in v or (ref and not v.get(ref)):
        return None
    u = v["ubiqfs"]
    if kind in ("min_ratio", "gt_ratio"):
        return (u / v[ref]) / bound
    if kind == "max_ratio":
        return bound / (u / v[ref]) if u else float("inf")
    return bound / u if u else float("inf")  # "max"


def target_met(row, target):
    m = target_margin(row, target)
    if m is None:
        return None
    return m > 1 if target[0] == "gt_ratio" else m >= 1


def ratio(row, ref):
    v = row["values"]
    return v["ubiqfs"] / v[ref] if "ubiqfs" in v and v.get(ref) else None


def better_factor(row, ref):
    """ubiqfs against `ref`, normalized so that > 1 means ubiqfs did better."""
    r = ratio(row, ref)
    if r is None or r == 0:
        return None
    return r if row["higher_is_better"] else 1 / r


# --------------------------------------------------------------------------------------------
# report and plot


def shown(path: Path) -> str:
    """path relative to the checkout when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def run_summary(data) -> list[str]:
    """Lines saying which run(s) the rows come from."""
    runs = data["runs"]
    used = list(dict.fromkeys(r["run"] for r in data["rows"]))
    if len(used) == 1:
        run = runs[used[0]]
        all_groups = set(run.get("groups", {})) >= set(GROUPS)
        what = "all groups" if all_groups else "groups " + ", ".join(run.get("groups", {}))
        return [f"All rows were measured in **one run** ({what}), started {run['started']}, "
                f"`{run['command']}`{' (--quick sizes)' if run['quick'] else ''}."]
    lines = [f"Rows come from **{len(used)} runs** (a group re-run replaces only its own rows); "
             "the `measured` column says when:", ""]
    for rid in used:
        run = runs[rid]
        groups = sorted({r["group"] for r in data["rows"] if r["run"] == rid}, key=GROUPS.index)
        lines.append(f"* {run['started']}: `{run['command']}` — {', '.join(groups)}"
                     f"{' (--quick sizes)' if run['quick'] else ''}")
    return lines


def fmt(x):
    if x is None:
        return "–"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def table_lines(data, multi_run: bool) -> list[str]:
    head = "| group | workload | unit | ext4 | ubiqfs | rclone | ubiqfs/ext4 | ubiqfs/rclone | target | met? |"
    sep = "|---|---|---|---|---|---|---|---|---|---|"
    if multi_run:
        head += " measured |"
        sep += "---|"
    lines = [head, sep]
    for row in data["rows"]:
        v = row["values"]
        cells = [row["group"], row["name"], row["unit"], *(fmt(v.get(k)) for k in TARGET_NAMES)]
        cells += [f"{r:.2f}x" if r is not None else "–" for r in (ratio(row, "ext4"), ratio(row, "rclone"))]
        targets = TARGETS.get(row["key"], [])
        met = [target_met(row, t) for t in targets]
        cells.append("; ".join(t[3] for t in targets) or "–")
        cells.append("–" if not targets or None in met else ("yes" if all(met) else "no"))
        if multi_run:
            cells.append(row["measured_at"].replace("T", " ").rstrip("Z"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_report(data, out: Path, png: Path | None, results: Path):
    """docs/benchmarks.md from the results; keeps the notes after the marker."""
    used = {r["run"] for r in data["rows"]}
    lines = [
        "# Benchmarks",
        "",
        "Measured by `python3 bench/bench.py` on this machine (2 cores, virtio disk), release build:",
        "native ext4 (a folder under /var/tmp), ubiqfs (embedded cloud on the same disk, `--upload-delay-ms 200`)",
        f"and rclone mount `--vfs-cache-mode full` over a local folder. Raw numbers: `{shown(results)}`.",
        "",
        *run_summary(data),
        "",
        "Ratios are ubiqfs / ext4 and ubiqfs / rclone of the numbers shown: for rates (MiB/s, ops/s) higher",
        "is better, for times (s, ms) lower is better, so a time ratio < 1 means ubiqfs was faster.",
        "`target` is the DESIGN.md target where one applies, `met?` is computed from the numbers.",
        "\\* proxies: the DESIGN targets for upload drain and streaming are against raw HTTP PUT/GET; here the",
        "reference is a raw copy + sync / cold read of the same bytes on ext4 (the embedded cloud is on that disk).",
        "",
    ]
    if png:
        lines += [f"![ubiqfs against ext4, rclone and the DESIGN targets]({png.name})", ""]
    lines += table_lines(data, len(used) > 1)
    lines.append("")
    existing = out.read_text() if out.exists() else ""
    notes = existing.split("<!-- notes -->", 1)[1] if "<!-- notes -->" in existing else "\n"
    out.write_text("\n".join(lines) + "\n<!-- notes -->" + notes)
    print(f"wrote {out}")


def write_plot(data, png: Path):
    """Two panels of log-scale horizontal bars where > 1 always means ubiqfs did better: against
    ext4 and rclone per row (rate ratio, or inverse time ratio), and against each DESIGN target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if better_factor(r, "ext4") or better_factor(r, "rclone")]
    marks = [(r, t) for r in data["rows"] for t in TARGETS.get(r["key"], [])
             if 0 < (target_margin(r, t) or 0) < float("inf")]  # a "none lost" target has no factor
    bars1 = [(r["name"], [(better_factor(r, ref), color, f"vs {ref}") for ref, color in
                          (("ext4", "tab:blue"), ("rclone", "tab:orange"))]) for r in rows]
    bars2 = [(f"{r['name']}: {t[3]}", [(target_margin(r, t), "tab:green" if target_met(r, t) else "tab:red", None)])
             for r, t in marks]
    n1, n2 = 2 * len(bars1), len(bars2)
    fig, axes = plt.subplots(2, 1, figsize=(13, 0.22 * (n1 + n2) + 3.0),
                             gridspec_kw={"height_ratios": [max(n1, 1), max(n2, 1)]})
    plot_bars(axes[0], bars1, "ubiqfs against ext4 and rclone: > 1 = ubiqfs better "
                              "(rate ratio ubiqfs/x, or time ratio x/ubiqfs)")
    axes[0].legend(*zip(*[(plt.Rectangle((0, 0), 1, 1, color=c), f"vs {k}")
                          for k, c in (("ext4", "tab:blue"), ("rclone", "tab:orange"))]),
                   fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 1.0))
    plot_bars(axes[1], bars2, "ubiqfs against the DESIGN targets: > 1 = met by that factor (green met, red not)")
    fig.suptitle(f"ubiqfs benchmarks (bench/bench.py), log scale; {run_stamp(data)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {png}")


def plot_bars(ax, groups, title):
    """groups: [(label, [(factor or None, color, legend)])]; bars of one label side by side,
    log x axis symmetric around 1, each bar annotated with its factor."""
    from matplotlib.ticker import FixedLocator, NullLocator
    height = 0.8 / max(len(g[1]) for g in groups) if groups else 0.8
    factors = [f for _, bars in groups for f, _, _ in bars if f]
    span = max([max(f, 1 / f) for f in factors] + [2.0]) * 2.5
    for y, (_, bars) in enumerate(groups):
        for i, (f, color, _) in enumerate(bars):
            if not f:
                continue
            yy = y - 0.4 + height * (i + 0.5)
            ax.barh(yy, f - 1, left=1, height=height * 0.9, color=color)  # from 1: right = better
            ax.annotate(f"{f:.2g}x", (f, yy), xytext=(3 if f >= 1 else -3, 0), textcoords="offset points",
                        ha="left" if f >= 1 else "right", va="center", fontsize=6)
    ax.set_yticks(range(len(groups)), [g[0] for g in groups], fontsize=7)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlim(1 / span, span)
    ticks = [t for t in (0.001, 0.01, 0.1, 0.3, 1, 3, 10, 100, 1000) if 1 / span <= t <= span]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}x" for t in ticks], fontsize=7)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)


def run_stamp(data):
    """'one run, <date>' or 'N runs, <first> .. <last>'."""
    used = sorted({r["run"] for r in data["rows"]})
    if len(used) == 1:
        return f"one run, {data['runs'][used[0]]['started']}"
    return f"{len(used)} runs, {used[0]} .. {used[-1]}"


# --------------------------------------------------------------------------------------------
# main


def run_groups(groups, sz: Sizes, rec: Recorder):
    """Mounts ubiqfs and rclone in a fresh folder, runs the groups, unmounts everything."""
    tmp = Path(tempfile.mkdtemp(prefix="ubiq-bench-", dir="/var/tmp"))
    w = World(tmp)
    try:
        w.mount_ubiq()
        w.mount_rclone()
        targets = w.targets()
        for group in groups:
            print(f"[{group}]", flush=True)
            rec.group = group
            t0 = time.perf_counter()
            WORKLOADS[group](w, targets, sz, rec)
            secs = time.perf_counter() - t0
            rec.finish_group(group, secs)
            print(f"[{group}] done in {secs:.0f} s", flush=True)
    finally:
        w.unmount_ubiq()
        w.unmount_rclone()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes, for testing: 256 MiB instead of 1 GiB, 2k/20k files instead of 10k/100k, "
                         "a 5k-file tree instead of 30k, 1600 small files instead of 6400, propagation n=10 not 30")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="markdown report; the plot goes next to it (same name, .png)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results.json"), help="raw results (JSON)")
    ap.add_argument("--only", choices=GROUPS, action="append", help="run only these groups (default: all)")
    ap.add_argument("--report-only", action="store_true", help="measure nothing; regenerate report and plot")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` still unmounts
    out, results = Path(args.out), Path(args.results)
    if not args.report_only:
        if not BIN.exists():
            sys.exit(f"build first: swift build -c release ({BIN} missing)")
        groups = [g for g in GROUPS if g in (args.only or GROUPS)]
        run = {"id": now_utc(), "started": now_utc().replace("T", " ").replace("Z", " UTC"),
               "command": " ".join(["python3 bench/bench.py", *sys.argv[1:]]), "quick": args.quick}
        run_groups(groups, Sizes(args.quick), Recorder(results, run))
    data = load_results(results)
    if not data["rows"]:
        sys.exit(f"no results in {results}")
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    try:
        write_plot(data, png)
    except ImportError as e:
        print(f"no plot ({e})")
        png = None
    write_report(data, out, png, results)


if __name__ == "__main__":
    main()
