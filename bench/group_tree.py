"""The tree group: untar of a source tree, git add + commit, git status, rm -rf."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from common import MIB, Recorder, Sizes, Target, World, drop_caches, remove_tree, sh, timed


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
    """tar xf; upload drain; ls -lR (warm); find -type f (caches dropped); git init+add+commit;
    git status (caches dropped, then warm); rm -rf."""
    d = t.path / "tree"
    d.mkdir()
    r = {"untar": timed(lambda: sh("tar", "xf", tarball, "--no-same-owner", "-C", d))}
    r["drain"] = timed(t.drain)
    sh("ls", "-lR", d, capture=False)  # untimed: warms the caches
    r["lslr"] = timed(lambda: sh("ls", "-lR", d, capture=False))
    drop_caches()
    r["find_cold"] = timed(lambda: sh("find", d, "-type", "f", capture=False))
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
    rec.row("ls_lr_tree", "tree: ls -lR (warm)", "s", pick("lslr"), higher_is_better=False)
    rec.row("find_tree_cold", "tree: find -type f (caches dropped)", "s", pick("find_cold"), higher_is_better=False)
    rec.row("git_commit", "tree: git init + add -A + commit", "s", pick("commit"), higher_is_better=False)
    rec.row("git_status_cold", "tree: git status (caches dropped)", "s", pick("status_cold"), higher_is_better=False)
    rec.row("git_status_warm", "tree: git status (warm, 2nd run)", "s", pick("status_warm"), higher_is_better=False)
    rec.row("rm_tree", "tree: rm -rf (files + .git)", "s", pick("rm"), higher_is_better=False)
