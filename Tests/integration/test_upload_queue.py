"""The durable upload queue as a user sees it: progress, quota errors that keep data local,
coalesced saves, and sync --wait."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
import threading
import time

import pytest

from conftest import Ubiq, daemons_for_state, ubiq_mounts
from helpers import sha256, sha256_file, write_file
from test_devices_and_content import wait_for

# renameat2(2), for saves that exchange a new file with the old one.
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_EXCHANGE = 2


def set_quota(u: Ubiq, quota: int) -> None:
    """What a cloud operator does: change the account's quota (through the cloud's own admin path)."""
    u.set_quota(quota)


def test_status_watch_shows_progress_bar_and_xattr_percent(ubiq):
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "100", "--upload-limit", "8M")
    f = ubiq.docs / "video.bin"
    data = os.urandom(40 * 1024 * 1024)
    f.write_bytes(data)
    wait_for(lambda: ubiq.status()[0]["uploading"], timeout=10, what="upload to start")
    out = ubiq.run("status", "--watch", "--iterations", "2").stdout
    assert "uploading Documents/video.bin [" in out and "%" in out
    pct = int(Ubiq.xattr(f, "user.ubiq.percent_uploaded"))
    assert 0 <= pct < 100
    assert Ubiq.xattr(f, "user.ubiq.uploading") == "1"
    report = ubiq.status()[0]
    assert report["queue"]["pendingItems"] >= 1 and report["queue"]["pendingBytes"] >= len(data)
    ubiq.sync(timeout=60)
    assert Ubiq.xattr(f, "user.ubiq.percent_uploaded") == "100"
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(data)


def test_quota_exceeded_keeps_write_local_then_uploads(ubiq):
    set_quota(ubiq, 1024 * 1024)
    f = ubiq.docs / "too-big.bin"
    data = os.urandom(3 * 1024 * 1024)
    f.write_bytes(data)
    wait_for(
        lambda: "EDQUOT" in ubiq.status()[0]["queue"]["failing"][0]["error"] if ubiq.status()[0]["queue"]["failing"] else False,
        timeout=15,
        what="EDQUOT in status",
    )
    assert "EDQUOT" in Ubiq.xattr(f, "user.ubiq.upload_error")
    assert Ubiq.xattr(f, "user.ubiq.uploaded") == "0"
    assert sha256_file(f) == sha256(data)  # still local and readable
    text = ubiq.run("status").stdout
    assert "too-big.bin" in text and "EDQUOT" in text
    cp = ubiq.run("sync", "--wait", f, "--timeout", "2", check=False)
    assert cp.returncode != 0 and "EDQUOT" in cp.stderr
    set_quota(ubiq, 0)  # space freed
    ubiq.sync(f)
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(data)
    assert Ubiq.xattr(f, "user.ubiq.uploaded") == "1"
    try:
        Ubiq.xattr(f, "user.ubiq.upload_error")
        raise AssertionError("upload_error should be gone")
    except OSError:
        pass


def test_metadata_past_the_quota_keeps_the_change_local_then_uploads(ubiq):
    """Item records count against the quota: 20 KB of extended attributes on a synced file,
    with the account at its quota, stay local (readable, EDQUOT in status and xattrs) and go up
    once space is freed."""
    f = ubiq.docs / "tagged.txt"
    f.write_bytes(b"small")
    ubiq.sync(f)
    set_quota(ubiq, 1)  # at or past the quota already: any growth is refused
    note = os.urandom(20_000)
    os.setxattr(f, "user.note", note)
    wait_for(lambda: "EDQUOT" in (ubiq.status()[0]["queue"]["failing"] or [{"error": ""}])[0]["error"],
             timeout=15, what="EDQUOT in status")
    assert "EDQUOT" in Ubiq.xattr(f, "user.ubiq.upload_error")
    assert "quota exceeded" in Ubiq.xattr(f, "user.ubiq.upload_error")
    assert os.getxattr(f, "user.note") == note  # still here, on the mount
    assert "user.note" not in (ubiq.cloud_item_for(f) or {}).get("xattrs", {})
    set_quota(ubiq, 0)
    ubiq.sync(f)
    assert "user.note" in ubiq.cloud_item_for(f)["xattrs"]
    assert f.read_bytes() == b"small"


def test_a_new_folder_changed_after_its_files_were_made_uploads_before_them(ubiq):
    """rsync -a makes a folder, fills it, then sets the folder's times: the change of a folder
    not yet in the cloud must not send it behind its files, which the cloud would refuse until
    it arrives (`bad parent`, retried with backoff)."""
    ubiq.remount("--upload-delay-ms", "1500")
    start = len(ubiq.daemon_log())
    (ubiq.docs / "tree").mkdir()
    for i in range(3):
        (ubiq.docs / "tree" / f"f{i}").write_text(f"f{i}")
    time.sleep(0.7)
    os.utime(ubiq.docs / "tree", (1_000_000_000, 1_000_000_000))
    os.chmod(ubiq.docs / "tree", 0o750)
    # The files are due now, the folder (changed since) not yet.
    time.sleep(1.2)
    cp = ubiq.run("sync", "--wait", "--timeout", "60")
    assert "bad parent" not in cp.stderr, cp.stderr
    log = ubiq.daemon_log()[start:]
    assert "bad parent" not in log, log[-2000:]
    assert ubiq.xattr(ubiq.docs / "tree" / "f0", "user.ubiq.uploaded") == "1"
    assert os.stat(ubiq.docs / "tree").st_mtime == 1_000_000_000


@pytest.mark.parametrize("how", ["append", "atomic save", "exchange save"])
def test_a_file_closed_again_and_again_is_uploaded_while_it_goes_on(ubiq, how):
    """Each close of a log written by open-append-close waits the upload delay again, so that
    changes in quick succession go as one; but not for ever: a file that keeps changing is
    uploaded every few seconds, so the cloud (and every other device) is never far behind.
    The same for a file an editor saves atomically again and again (a new file renamed over
    it each time, which becomes the next version of the same item)."""
    ubiq.remount("--upload-delay-ms", "1000")
    log = ubiq.docs / "app.log"
    log.write_text("start\n")
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            if how == "append":
                with open(log, "a") as f:
                    f.write(f"line {i}\n")
            elif how == "atomic save":
                tmp = ubiq.docs / "app.log.tmp"
                tmp.write_text(f"version {i}\n")
                os.rename(tmp, log)
            else:
                # renameat2(RENAME_EXCHANGE) of a new file with it, then the old one goes.
                tmp = ubiq.docs / "app.log.tmp"
                tmp.write_text(f"version {i}\n")
                if libc.renameat2(AT_FDCWD, bytes(tmp), AT_FDCWD, bytes(log), RENAME_EXCHANGE) != 0:
                    raise OSError(ctypes.get_errno(), "renameat2")
                os.unlink(tmp)
            i += 1
            time.sleep(0.2)

    t = threading.Thread(target=writer)
    t.start()
    try:
        etags = set()
        deadline = time.time() + 20
        while len(etags) < 2:
            assert time.time() < deadline, f"uploaded versions while writing: {etags}"
            try:
                etag = ubiq.xattr(log, "user.ubiq.etag")
            except OSError:
                etag = ""
            if etag:
                etags.add(etag)
            time.sleep(0.1)
    finally:
        stop.set()
        t.join()
    ubiq.sync()
    assert ubiq.xattr(log, "user.ubiq.uploaded") == "1"


def test_repeated_saves_coalesce_into_newest(ubiq):
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "1500")
    f = ubiq.docs / "draft.txt"
    versions = [f"version {i}\n".encode() * 100 for i in range(10)]
    for v in versions:
        with open(f, "wb") as fh:
            fh.write(v)
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(f)) == versions[-1]
    hashes = set(ubiq.stored_chunks())
    assert sha256(versions[-1]) in hashes
    # Only the newest content travelled.
    assert not any(sha256(v) in hashes for v in versions[:-1])


def test_crash_kill_loop_loses_no_closed_write(ubiq):
    """Rounds of: write files (closed, some fsynced, some large enough to be mid-upload),
    SIGKILL the daemon at a random moment, clean the stale mount, remount. At the end every
    closed file is in the cloud with the right bytes."""
    import random

    rng = random.Random(1234)
    expected: dict[str, bytes] = {}
    for round_ in range(8):
        for i in range(rng.randint(3, 8)):
            name = f"r{round_}-{i}.bin"
            data = os.urandom(rng.choice([1000, 300_000, 3_000_000]))
            with open(ubiq.docs / name, "wb") as fh:
                fh.write(data)
                if rng.random() < 0.5:
                    fh.flush()
                    os.fsync(fh.fileno())
            expected[name] = data
        # Overwrite an earlier file now and then: the newest closed version must win.
        if expected and rng.random() < 0.7:
            name = rng.choice(sorted(expected))
            data = os.urandom(rng.choice([2000, 500_000]))
            (ubiq.docs / name).write_bytes(data)
            expected[name] = data
        time.sleep(rng.uniform(0.0, 0.8))
        ubiq.kill_daemon()
        ubiq.mount()
        for name, data in expected.items():
            assert sha256_file(ubiq.docs / name) == sha256(data), f"{name} changed after crash round {round_}"
    ubiq.sync(timeout=60)
    for name, data in expected.items():
        path = ubiq.docs / name
        assert sha256(ubiq.cloud_content(ubiq.item_id(path))) == sha256(data), name
    assert ubiq.status()[0]["queue"]["pendingItems"] == 0


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _getxattr(path, name: str, size: int) -> tuple[int, bytes | None]:
    """Calls getxattr(2) directly: size 0 asks for the length. Returns (length, bytes or None)."""
    ctypes, libc = _libc()
    buf = ctypes.create_string_buffer(size) if size else None
    n = libc.getxattr(os.fsencode(str(path)), name.encode(), buf, ctypes.c_size_t(size))
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return n, (buf.raw[:n] if buf is not None else None)


def _listxattr(path, size: int) -> tuple[int, bytes | None]:
    """Calls listxattr(2) directly, like _getxattr."""
    ctypes, libc = _libc()
    buf = ctypes.create_string_buffer(size) if size else None
    n = libc.listxattr(os.fsencode(str(path)), buf, ctypes.c_size_t(size))
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return n, (buf.raw[:n] if buf is not None else None)


def test_status_xattr_that_grows_between_size_query_and_read_is_no_erange(ubiq):
    """rsync -X and getfattr ask for an attribute's size, then read it with a buffer of that size.
    A status value may grow in between (percent_uploaded 0 -> 100 when the upload lands; etag
    appears in the list); the read returns the value the size was given for, never ERANGE."""
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "1500")
    f = ubiq.docs / "racing.txt"
    f.write_text("hello\n")
    size, _ = _getxattr(f, "user.ubiq.percent_uploaded", 0)
    names_size, _ = _listxattr(f, 0)
    assert size == 1  # "0": not uploaded yet
    ubiq.sync(f)
    assert _getxattr(f, "user.ubiq.percent_uploaded", size) == (1, b"0")
    n, names = _listxattr(f, names_size)
    assert n == names_size and b"user.ubiq.etag" not in names
    # A fresh query sees the new values.
    assert _getxattr(f, "user.ubiq.percent_uploaded", 0)[0] == 3
    assert Ubiq.xattr(f, "user.ubiq.percent_uploaded") == "100"
    assert "user.ubiq.etag" in os.listxattr(f)


@contextlib.contextmanager
def state_on_small_disk(u: Ubiq, mount_args: tuple = ()):
    """Mounts `u` again with its container's state folder on a 32 MiB tmpfs (contents carried
    over); yields the folder. Unmounts both at the end."""
    u.unmount()
    cdir = u.container_dir()
    saved = u.root / "saved-container"
    shutil.copytree(cdir, saved)
    shutil.rmtree(cdir)
    cdir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(cdir)], check=True)
    try:
        for entry in saved.iterdir():
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, cdir / entry.name)
        u.mount(*mount_args)
        yield cdir
    finally:
        try:
            u.unmount()
        except Exception:
            subprocess.run(["fusermount3", "-uz", str(u.mnt)], capture_output=True)
        subprocess.run(["umount", "-l", str(cdir)], capture_output=True)


def fill(path) -> None:
    """Writes zeros to `path` until the disk is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def test_a_full_state_disk_pauses_uploads_instead_of_repeating_them(ubiq):
    """The state folder's disk fills up while uploads are queued. The cloud accepts a commit but
    the index cannot record it: the uploader must pause and back off, not commit again and again
    (each repeat is a change every other device pulls). Once there is room again, everything
    uploads and nothing was lost."""
    with state_on_small_disk(ubiq, ("--upload-delay-ms", "3000")) as cdir:
        for i in range(30):
            write_file(ubiq.docs / f"q{i}.txt", f"queued {i}\n")
        fill(cdir / "filler")
        # Let the queued uploads become due and fail to be recorded for a while.
        seq0 = max((i["changeSeq"] for i in ubiq.cloud_items()), default=0)
        time.sleep(8)
        commits = max((i["changeSeq"] for i in ubiq.cloud_items()), default=0) - seq0
        print(f"commits in 8 s with a full state disk: {commits}")
        assert commits <= 80, f"{commits} commits in 8 s with a full state disk: the uploader repeats work it cannot record"
        os.unlink(cdir / "filler")
        ubiq.sync(timeout=120)
        live = {i["name"]: i for i in ubiq.cloud_items(include_deleted=False)}
        for i in range(30):
            assert f"q{i}.txt" in live, f"q{i}.txt never reached the cloud"
            assert ubiq.cloud_content(live[f"q{i}.txt"]["itemID"]) == f"queued {i}\n".encode()
            assert (ubiq.docs / f"q{i}.txt").read_text() == f"queued {i}\n"
        assert ubiq.status()[0]["queue"]["pendingItems"] == 0


def test_writes_whose_close_failed_on_a_full_disk_are_uploaded_once_there_is_room(ubiq):
    """A handle's writes reach the cache file, but its close cannot record them: the state
    folder's disk is full (close fails with ENOSPC, as ext4's may). The bytes stay, marked dirty;
    once there is room again, the mount records and uploads them by itself, without waiting for
    another open of the file or the next mount."""
    with state_on_small_disk(ubiq) as cdir:
        f = ubiq.docs / "a.bin"
        write_file(f, "a" * 100_000)
        ubiq.sync()
        fd = os.open(f, os.O_RDWR)
        os.write(fd, b"B" * 1000)
        fill(cdir / "filler")
        try:
            os.close(fd)
            print("close on a full state disk succeeded")
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            print("close on a full state disk -> ENOSPC")
        os.unlink(cdir / "filler")
        expected = b"B" * 1000 + b"a" * 99_000
        assert f.read_bytes() == expected
        wait_for(lambda: ubiq.cloud_content(ubiq.item_id(f)) == expected, timeout=30,
                 what="the bytes written before the failed close in the cloud")
        ubiq.sync(timeout=60)
        assert ubiq.status()[0]["queue"]["pendingItems"] == 0
        assert Ubiq.xattr(f, "user.ubiq.uploaded") == "1"


def test_a_mount_on_a_full_state_disk_fails_with_one_line_and_leaves_no_mount(ubiq):
    """Mounting while the state folder's disk is full: either the mount works, or it fails with
    one line and a non-zero exit, leaving no mount (live or stale) behind. It never says
    "mounted" and then dies. Once there is room, it mounts and nothing was lost."""
    write_file(ubiq.docs / "kept.txt", "kept\n")
    ubiq.sync()
    with state_on_small_disk(ubiq) as cdir:
        ubiq.unmount()
        fill(cdir / "filler")
        cp = ubiq.run("mount", ubiq.container, ubiq.mnt, check=False)
        print(f"mount on a full state disk: exit {cp.returncode}: {cp.stdout.strip()} {cp.stderr.strip()}")
        time.sleep(2)
        if cp.returncode == 0:
            assert str(ubiq.mnt) in ubiq_mounts(), "mount said it mounted, but nothing is mounted"
            assert (ubiq.docs / "kept.txt").read_text() == "kept\n", "the mount must work"
            ubiq.unmount()
        else:
            err = cp.stderr.strip()
            assert err.startswith("ubiqfs:") and "\n" not in err, cp.stderr
            assert "mounted" not in cp.stdout, cp.stdout
            assert str(ubiq.mnt) not in ubiq_mounts(), "a failed mount left a mount behind"
            assert not daemons_for_state(ubiq.state), "a failed mount left its daemon running"
        os.unlink(cdir / "filler")
        ubiq.mount()
        assert (ubiq.docs / "kept.txt").read_text() == "kept\n"


def test_a_state_disk_filled_through_the_mount_can_be_emptied_through_it(ubiq):
    """A file written through the mount fills the state folder's disk. As on a full ext4, the
    container still mounts, and renaming, truncating and removing still work, so the room can
    be given back through the mount (the state folder keeps a small reserve for them)."""
    write_file(ubiq.docs / "keep.txt", "keep\n")
    write_file(ubiq.docs / "stamp", "some bytes\n")
    ubiq.sync()
    with state_on_small_disk(ubiq) as cdir:
        big = ubiq.docs / "big"
        fd = os.open(big, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                os.write(fd, b"\1" * (1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        try:
            os.close(fd)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        free_when_full = shutil.disk_usage(cdir).free
        print(f"state disk free after filling it through the mount: {free_when_full} bytes")
        ubiq.unmount()
        cp = ubiq.run("mount", ubiq.container, ubiq.mnt, check=False)
        assert cp.returncode == 0, f"mount on the full disk: {cp.stderr.strip()}"
        os.rename(ubiq.docs / "keep.txt", ubiq.docs / "kept.txt")
        os.close(os.open(ubiq.docs / "stamp", os.O_WRONLY | os.O_TRUNC))
        os.unlink(big)
        # The cache file goes once the removal is durable (the daemon's next round, about 2 s).
        wait_for(lambda: shutil.disk_usage(cdir).free > 8 << 20, timeout=15, what="the removed file's room back")
        write_file(ubiq.docs / "kept.txt", "after\n")
        ubiq.sync(timeout=60)
        live = {i["name"]: i for i in ubiq.cloud_items(include_deleted=False)}
        assert "big" not in live and "keep.txt" not in live
        assert ubiq.cloud_content(live["kept.txt"]["itemID"]) == b"after\n"
        assert ubiq.cloud_content(live["stamp"]["itemID"]) == b""
        assert ubiq.status()[0]["queue"]["pendingItems"] == 0


def test_a_full_state_disk_gives_enospc_and_keeps_every_name(ubiq):
    """With the state folder's disk full, operations that need room fail with ENOSPC (as on a
    full ext4), the daemon stays up, nothing existing disappears, and everything works again
    once there is room."""
    with state_on_small_disk(ubiq) as cdir:
        (ubiq.docs / "keep").mkdir()
        write_file(ubiq.docs / "keep" / "a.txt", "a\n")
        write_file(ubiq.docs / "b.txt", "b\n")
        ubiq.sync()
        fill(cdir / "filler")
        # Calls that need room, then renaming and removing existing names: each is done, or
        # fails with ENOSPC; never EIO, never ENOENT as if the name were gone.
        for what, call in [
            ("mkdir", lambda: os.mkdir(ubiq.docs / "new-dir")),
            ("create", lambda: write_file(ubiq.docs / "new.txt", "x" * 100_000)),
            ("symlink", lambda: os.symlink("b.txt", ubiq.docs / "new-link")),
            ("setxattr", lambda: os.setxattr(ubiq.docs / "b.txt", "user.tag", b"v" * 3000)),
            ("rename", lambda: os.rename(ubiq.docs / "b.txt", ubiq.docs / "b2.txt")),
            ("unlink", lambda: os.unlink(ubiq.docs / "keep" / "a.txt")),
        ]:
            try:
                call()
                print(f"full state disk: {what} succeeded")
            except OSError as e:
                assert e.errno == errno.ENOSPC, f"{what}: {e}"
                print(f"full state disk: {what} -> ENOSPC")
        names = set(os.listdir(ubiq.docs))
        assert "keep" in names and ({"b.txt", "b2.txt"} & names), names
        os.unlink(cdir / "filler")
        write_file(ubiq.docs / "after.txt", "room again\n")
        os.mkdir(ubiq.docs / "after-dir")
        ubiq.sync(timeout=60)
        assert (ubiq.docs / "after.txt").read_text() == "room again\n"
        assert ubiq.status()[0]["queue"]["pendingItems"] == 0
