"""The metadata and bigdir groups: create, stat, ls -l and remove of many files."""

from __future__ import annotations

import os
from pathlib import Path

from common import Recorder, Sizes, Target, World, count, drop_caches, remove_tree, sh, timed


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
    """Creates n empty files in one folder, `ls -l` it warm and cold, then rm -rf. The uploads
    of the creates (ubiqfs, rclone) drain before the listing, so `ls -l` and `rm -rf` are
    measured on their own, not beside an upload of n items."""
    d = t.path / f"huge-{n}"
    d.mkdir()
    r = {"create": n / timed(lambda: create_empty(d, n))}
    t.drain()
    r["ls"] = timed(lambda: ls_l(d))
    drop_caches()
    r["ls_cold"] = timed(lambda: ls_l(d))
    r["rm"] = timed(lambda: remove_tree(d))  # counts any retry wait (rclone)
    t.drain()
    return r


def bigdir_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """One folder of 100k (quick: 20k) entries. A system that cannot hold that many (the FUSE
    limit's passthrough_hp keeps a descriptor open per inode the kernel knows, and stops with
    EBADF at the process's open-files limit, 20,000 on this machine, which it may not raise:
    the container has no CAP_SYS_RESOURCE) is left out of the rows, with a line saying why."""
    c = count(sz.huge)
    res = {}
    for t in targets:
        try:
            res[t.name] = huge_dir(t, sz.huge)
        except OSError as e:
            # Removed from the folder passthrough_hp serves: through the mount, at its limit,
            # the lookups fail too. Dropping the caches makes the kernel forget the inodes.
            print(f"  {t.name}: not measured ({e}); its folder is removed", flush=True)
            remove_tree((w.limit_src if t.name == "fuse_limit" else t.path) / f"huge-{sz.huge}")
            drop_caches()
    pick = lambda k: {name: r[k] for name, r in res.items()}  # noqa: E731
    rec.row("create_huge", f"create {c} empty files (one folder)", "ops/s", pick("create"))
    rec.row("ls_huge", f"ls -l of {c} entries (warm)", "s", pick("ls"), higher_is_better=False)
    rec.row("ls_huge_cold", f"ls -l of {c} entries (caches dropped)", "s", pick("ls_cold"), higher_is_better=False)
    rec.row("rm_huge", f"rm -rf of the {c} files", "s", pick("rm"), higher_is_better=False)
