"""Random operation sequences on the real mount, compared with the same sequence on a local
directory (the reference: whatever /tmp is, ext4 or tmpfs). The steps are those of the core's
model test (Tests/UbiqFSCoreTests/ModelTests.swift), issued as real system calls: results and
errnos must match after every step, and the trees (names, kinds, sizes, contents) at the end.
Evicting (mount only) and remounting must not change anything a command sees.

Seeded: a failure names its seed and step list; UBIQ_MOUNT_MODEL_SEEDS sets how many seeds run
(a small budget by default; scripts/soak.sh runs the core's model test for hours)."""

from __future__ import annotations

import errno
import os
import random
import shutil

import pytest

from helpers import RENAME_EXCHANGE, RENAME_NOREPLACE, renameat2

PATHS = ["a", "b", "c", "a/a", "a/b", "b/a", "b/c", "c/b", "a/b/c"]
KINDS = ["create", "write", "truncate", "read", "rename", "unlink", "mkdir", "rmdir", "utime", "evict", "remount"]
WEIGHTS = [4, 4, 1, 2, 4, 2, 2, 1, 1, 2, 1]
SEEDS = int(os.environ.get("UBIQ_MOUNT_MODEL_SEEDS", "30"))
STEPS = 40


def outcome(fn, *args):
    """('ok', value) or ('err', errno name) of one system call."""
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno, e.errno))


def brief(result: tuple) -> str:
    kind, value = result
    return value if kind == "err" else ("ok" if not isinstance(value, bytes) else f"{len(value)} bytes")


def payload(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))


def do_step(root: str, step: tuple) -> tuple:
    kind, p, q, n, data = step
    P, Q = os.path.join(root, p), os.path.join(root, q)
    if kind == "create":
        return outcome(lambda: os.close(os.open(P, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)))
    if kind == "write":

        def w():
            fd = os.open(P, os.O_WRONLY)
            try:
                os.pwrite(fd, data, n % 5000)
            finally:
                os.close(fd)

        return outcome(w)
    if kind == "truncate":
        return outcome(os.truncate, P, n % 6000)
    if kind == "read":

        def r():
            with open(P, "rb") as f:
                return f.read()

        return outcome(r)
    if kind == "rename":
        flags = n % 3
        if flags == 0:
            return outcome(os.rename, P, Q)
        return outcome(renameat2, P, Q, RENAME_NOREPLACE if flags == 1 else RENAME_EXCHANGE)
    if kind == "unlink":
        return outcome(os.unlink, P)
    if kind == "mkdir":
        return outcome(os.mkdir, P, 0o755)
    if kind == "rmdir":
        return outcome(os.rmdir, P)
    if kind == "utime":
        t = [-1_500_000_000, 0, 4_102_444_800_123_456_789][n % 3]
        return outcome(lambda: os.utime(P, ns=(t, t)))
    raise AssertionError(kind)


def tree(root: str) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                body = fh.read()
            st = os.stat(path)
            assert st.st_size == len(body), f"{path}: st_size {st.st_size} but {len(body)} bytes read"
            out[os.path.relpath(path, root)] = body
    return out


def evict_all(ubiq) -> None:
    ubiq.sync()
    for dirpath, _, filenames in os.walk(ubiq.docs):
        for f in filenames:
            ubiq.run("evict", os.path.join(dirpath, f))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_mount_matches_a_local_directory(ubiq, tmp_path, seed):
    rng = random.Random(seed)
    ref = str(tmp_path / "reference")
    os.mkdir(ref)
    log = []
    for _ in range(STEPS):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        step = (kind, rng.choice(PATHS), rng.choice(PATHS), rng.randrange(10000), payload(rng))
        log.append(step[:4])
        try:
            if kind == "evict":
                evict_all(ubiq)
                continue
            if kind == "remount":
                ubiq.remount()
                continue
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {kind} failed after steps {log}") from e
        want = do_step(ref, step)
        got = do_step(str(ubiq.docs), step)
        assert got == want, f"seed {seed}: {step[:4]} gave {brief(got)}, the local directory {brief(want)}; steps {log}"
        if kind == "utime" and want[0] == "ok":
            assert os.stat(os.path.join(ubiq.docs, step[1])).st_mtime_ns == os.stat(os.path.join(ref, step[1])).st_mtime_ns
    assert tree(str(ubiq.docs)) == tree(ref), f"seed {seed}: trees differ after {log}"
    try:
        ubiq.sync()
        ubiq.remount()
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: the final sync failed after steps {log}") from e
    assert tree(str(ubiq.docs)) == tree(ref), f"seed {seed}: trees differ after a remount; steps {log}"
    shutil.rmtree(ref)
