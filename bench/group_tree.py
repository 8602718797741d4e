"""The tree group: untar of a source tree (with symlinks and hard links), ls -lR, cold find,
git add + commit, git status cold and warm, rm -rf, and a make -j2 build of a small C project."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import time
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


LINKS = 100  # symlinks in the tree, and as many files in hard-linked pairs


def build_tree_tarball(out: Path, max_files: int, max_bytes: int):
    """Tars up to max_files small files (max_bytes in all) from tree_sources(), plus a folder
    `links/` of LINKS relative symlinks into the tree and LINKS / 2 pairs of hard-linked files,
    as source archives have; returns (files, bytes). Made locally, no network."""
    picked, total = [], 0
    for p, size in small_files(tree_sources()):
        if len(picked) >= max_files or total + size > max_bytes:
            break
        picked.append(str(p).lstrip("/"))
        total += size
    listing = out.with_suffix(".list")
    listing.write_text("\n".join(picked) + "\n")
    sh("tar", "cf", out, "-C", "/", "--no-recursion", "-T", listing)
    staging = out.parent / "tree-links"
    links = staging / "links"
    links.mkdir(parents=True)
    for i in range(LINKS):
        (links / f"s{i}").symlink_to(Path("..") / picked[i % len(picked)])
    for i in range(LINKS // 2):
        (links / f"h{i}").write_text(f"hard-linked file {i}\n")
        os.link(links / f"h{i}", links / f"h{i}.same")
    sh("tar", "rf", out, "-C", staging, "links")
    shutil.rmtree(staging)
    return len(picked) + LINKS * 2, total


def untar(tarball: Path, d: Path) -> dict:
    """tar xmf into d (mtimes not restored: passthrough_hp refuses utime on some entries with
    EOPNOTSUPP); the time and how many entries the target refused (tar carries on past them: a
    symlink or hard link a filesystem does not support)."""
    t0 = time.perf_counter()
    p = subprocess.run(["tar", "xmf", tarball, "--no-same-owner", "-C", d], capture_output=True, text=True)
    secs = time.perf_counter() - t0
    refused = [line for line in p.stderr.splitlines() if line.startswith("tar: ") and "Exiting" not in line]
    if p.returncode not in (0, 2) or (p.returncode == 2 and not refused):
        raise RuntimeError(f"tar xf failed ({p.returncode}): {p.stderr[-500:]}")
    return {"untar": secs, "refused": len(refused),
            "refused_kinds": sorted({"hard link" if "hard link" in line else "symlink" if "symlink" in line
                                     else "other" for line in refused})}


def c_project(d: Path, files: int = 48, functions: int = 40):
    """A small C project: `files` sources of `functions` functions each, one header, a Makefile
    that compiles every source to an object and links them."""
    d.mkdir()
    (d / "lib.h").write_text("".join(f"int f{i}_{j}(int x);\n" for i in range(files) for j in range(functions)))
    for i in range(files):
        body = "".join(
            f"int f{i}_{j}(int x) {{ int s = 0; for (int k = 0; k < x; k++) s += (k * {j + 1}) ^ {i}; return s; }}\n"
            for j in range(functions))
        (d / f"m{i}.c").write_text('#include "lib.h"\n' + body)
    (d / "main.c").write_text('#include "lib.h"\nint main(void) { return f0_0(3) == 0 ? 1 : 0; }\n')
    objs = " ".join([f"m{i}.o" for i in range(files)] + ["main.o"])
    (d / "Makefile").write_text(f"prog: {objs}\n\tcc -o $@ $^\n%.o: %.c lib.h\n\tcc -O1 -c $< -o $@\n")


GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "-c", "safe.directory=*",
       "-c", "gc.auto=0", "-c", "init.defaultBranch=main"]


def tree_on(t: Target, tarball: Path):
    """tar xmf; upload drain; ls -lR (warm); find -type f (caches dropped); git init+add+commit;
    git status (caches dropped, then warm); rm -rf; make -j2 of a small C project."""
    d = t.path / "tree"
    d.mkdir()
    r = untar(tarball, d)
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
    build = t.path / "build"
    c_project(build)
    r["make"] = timed(lambda: sh("make", "-s", "-j2", cwd=build))
    t.drain()
    remove_tree(build)
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
    rec.row("untar", f"untar tree ({what}), tar xmf only", "s", pick("untar"), higher_is_better=False)
    rec.row("untar_refused", f"untar tree: entries refused ({LINKS} symlinks, {LINKS} hard-linked files)",
            "entries", pick("refused"), higher_is_better=False)
    for n, r in res.items():
        if r["refused"]:
            print(f"  {n} refused {r['refused']} entries: {', '.join(r['refused_kinds'])}", flush=True)
    rec.row("untar_drain", "untar tree: upload drain after tar xmf (separate)", "s",
            pick("drain", ("ubiqfs",)), higher_is_better=False)
    rec.row("ls_lr_tree", "tree: ls -lR (warm)", "s", pick("lslr"), higher_is_better=False)
    rec.row("find_tree_cold", "tree: find -type f (caches dropped)", "s", pick("find_cold"), higher_is_better=False)
    rec.row("git_commit", "tree: git init + add -A + commit", "s", pick("commit"), higher_is_better=False)
    rec.row("git_status_cold", "tree: git status (caches dropped)", "s", pick("status_cold"), higher_is_better=False)
    rec.row("git_status_warm", "tree: git status (warm, 2nd run)", "s", pick("status_warm"), higher_is_better=False)
    rec.row("rm_tree", "tree: rm -rf (files + .git)", "s", pick("rm"), higher_is_better=False)
    rec.row("make_build", "build: make -j2 of a C project (49 sources)", "s", pick("make"), higher_is_better=False)
