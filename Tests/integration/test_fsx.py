"""fsx-style content test: random operations on one file in the mount and on the same file in
a local directory (the reference: ext4 here), the whole content and size compared after every
operation, and the errno of every system call. The operations are those that move bytes in
ways the kernel's caches and the daemon's content cache must agree on: writes at any offset
(holes included), appends, truncates up and down, writes through mmap, copy_file_range within
the file, posix_fallocate, O_TRUNC rewrites, two handles (one truncating under the other),
atomic saves (temp + fsync + rename over), and, on the mount only, upload and evict (the next
read downloads the bytes).

Seeded: a failure names the seed and the operations so far. UBIQ_FSX_SEEDS and UBIQ_FSX_OPS
set how many seeds run and how many operations each (a small budget by default)."""

from __future__ import annotations

import errno
import mmap
import os
import random

import pytest

SEEDS = int(os.environ.get("UBIQ_FSX_SEEDS", "3"))
OPS = int(os.environ.get("UBIQ_FSX_OPS", "250"))
MAX_OFFSET = 300_000
KINDS = ["write", "append", "truncate", "mapwrite", "copyrange", "fallocate", "rewrite", "two_handles",
         "atomic_save", "upload_evict"]
WEIGHTS = [5, 2, 2, 2, 1, 1, 1, 1, 1, 2]


def _bytes(rng: random.Random, most: int) -> bytes:
    return rng.randbytes(rng.randrange(1, most))


def _apply(path: str, kind: str, args: dict) -> None:
    if kind in ("write", "append"):
        fd = os.open(path, os.O_WRONLY | (os.O_APPEND if kind == "append" else 0))
        try:
            if kind == "append":
                os.write(fd, args["data"])
            else:
                os.pwrite(fd, args["data"], args["offset"])
        finally:
            os.close(fd)
    elif kind == "truncate":
        os.truncate(path, args["size"])
    elif kind == "mapwrite":
        fd = os.open(path, os.O_RDWR)
        try:
            with mmap.mmap(fd, args["length"]) as m:
                m[args["offset"]:args["offset"] + len(args["data"])] = args["data"]
                m.flush()
        finally:
            os.close(fd)
    elif kind == "copyrange":
        fd = os.open(path, os.O_RDWR)
        try:
            left, src, dst = args["length"], args["src"], args["dst"]
            while left > 0:
                n = os.copy_file_range(fd, fd, left, src, dst)
                if n == 0:
                    break
                left, src, dst = left - n, src + n, dst + n
        finally:
            os.close(fd)
    elif kind == "fallocate":
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, args["offset"], args["length"])
        finally:
            os.close(fd)
    elif kind == "rewrite":
        with open(path, "wb") as f:
            f.write(args["data"])
    elif kind == "two_handles":
        a, b = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
        try:
            os.pwrite(a, args["data"], args["offset"])
            os.ftruncate(b, args["offset"] // 2)
            os.pwrite(a, args["data"][:100], args["offset"])
        finally:
            os.close(b)
            os.close(a)
    elif kind == "atomic_save":
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(args["data"])
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)


def _draw(rng: random.Random, kind: str, size: int) -> dict | None:
    """The arguments of one operation on a file of `size` bytes (None: not possible now)."""
    if kind in ("write", "two_handles"):
        return {"offset": rng.randrange(MAX_OFFSET), "data": _bytes(rng, 20_000)}
    if kind == "append":
        return {"data": _bytes(rng, 20_000)}
    if kind == "truncate":
        return {"size": rng.randrange(MAX_OFFSET)}
    if kind == "mapwrite":
        if size == 0:
            return None
        offset = rng.randrange(size)
        return {"length": size, "offset": offset, "data": _bytes(rng, min(10_000, size - offset) + 1)[: size - offset]}
    if kind == "copyrange":
        if size == 0:
            return None
        src, length = rng.randrange(size), rng.randrange(1, 20_000)
        return {"src": src, "length": length, "dst": rng.randrange(MAX_OFFSET)}
    if kind == "fallocate":
        return {"offset": rng.randrange(MAX_OFFSET), "length": rng.randrange(1, 50_000)}
    if kind in ("rewrite", "atomic_save"):
        return {"data": _bytes(rng, 30_000)}
    return {}


@pytest.mark.parametrize("seed", range(SEEDS))
def test_file_content_matches_ext4_under_random_operations(ubiq, tmp_path, seed):
    rng = random.Random(seed)
    mounted, reference = str(ubiq.docs / "fsx.bin"), str(tmp_path / "fsx.bin")
    for p in (mounted, reference):
        open(p, "wb").close()
    done: list[str] = []
    for i in range(OPS):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        size = os.stat(reference).st_size
        args = _draw(rng, kind, size)
        if args is None:
            continue
        if kind == "upload_evict":
            ubiq.sync(mounted)
            ubiq.run("evict", mounted)
        else:
            results = []
            for p in (mounted, reference):
                try:
                    _apply(p, kind, args)
                    results.append("ok")
                except OSError as e:
                    results.append(errno.errorcode.get(e.errno, str(e.errno)))
            assert results[0] == results[1], f"seed {seed}, op {i} {kind}: mount {results[0]}, ext4 {results[1]}"
        done.append(f"{kind} {({k: (len(v) if isinstance(v, bytes) else v) for k, v in args.items()})}")
        with open(mounted, "rb") as f:
            got = f.read()
        with open(reference, "rb") as f:
            want = f.read()
        if got != want or os.stat(mounted).st_size != len(want):
            first = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
            pytest.fail(
                f"seed {seed}: after op {i} the mount has {len(got)} bytes, ext4 {len(want)}; first difference at "
                f"byte {first}; operations:\n" + "\n".join(done[-30:]))
    ubiq.sync()
    with open(reference, "rb") as f:
        assert ubiq.cloud_content(ubiq.item_id(mounted)) == f.read(), f"seed {seed}: the cloud's bytes differ"
