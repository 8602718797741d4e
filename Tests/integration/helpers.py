"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest



def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sh(*args, cwd=None, check=True, env=None, timeout=120, input=None) -> subprocess.CompletedProcess:
    """Runs a real tool; on failure the assertion shows its output."""
    cp = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout, input=input
    )
    if check and cp.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {cp.returncode}\n"
            f"stdout: {_clip(cp.stdout)}\nstderr: {_clip(cp.stderr)}"
        )
    return cp


def _clip(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def tree_snapshot(top: Path | str, with_inodes: bool = False, with_times: bool = True) -> dict:
    """path -> (kind, mode, size, mtime_ns, content sha / link target, user xattrs[, ino]) for a
    tree, without the virtual user.ubiq.* attributes."""
    top = str(top)
    snap = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, top)
            if os.path.islink(p):
                kind, body = "link", os.readlink(p)
            elif os.path.isdir(p):
                kind, body = "dir", None
            else:
                kind, body = "file", sha256_file(p)
            xattrs = {}
            if kind != "link":
                for n in sorted(os.listxattr(p)):
                    if n.startswith("user.") and not n.startswith("user.ubiq."):
                        xattrs[n] = os.getxattr(p, n)
            entry = [kind, st.st_mode & 0o7777 if kind != "link" else None, st.st_size if kind != "dir" else None]
            if with_times and kind != "dir":
                entry.append(st.st_mtime_ns)
            entry += [body, tuple(sorted(xattrs.items()))]
            if with_inodes:
                entry.append(st.st_ino)
            snap[rel] = tuple(entry)
    return snap


def assert_errno(expected: int, fn, *args, **kwargs) -> None:
    """Calls fn and checks it fails with exactly `expected`."""
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    got = info.value.errno
    assert got == expected, (
        f"{getattr(fn, '__name__', fn)}{args}: expected {errno.errorcode[expected]}, "
        f"got {errno.errorcode.get(got, got)} ({info.value})"
    )


_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(old: Path | str, new: Path | str, flags: int) -> None:
    """renameat2(2) through libc; raises OSError like os.rename."""
    rc = _libc.renameat2(AT_FDCWD, os.fsencode(str(old)), AT_FDCWD, os.fsencode(str(new)), ctypes.c_uint(flags))
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(old), None, str(new))


def write_file(path: Path | str, data: bytes | str, mode: str = "wb") -> None:
    if isinstance(data, str):
        data = data.encode()
    with open(path, mode) as f:
        f.write(data)


def read_file(path: Path | str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
