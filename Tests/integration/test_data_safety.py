"""Ordinary commands must never lose data: renames of evicted files, extreme timestamps,
truncating a file while it downloads, and writes that were still open when the daemon died.
Every test runs on real mounts of the real binary, against each cloud mode."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import CLOUD_MODE, Ubiq, another_device, ubiq_mounts
from helpers import RENAME_EXCHANGE, RENAME_NOREPLACE, assert_errno, renameat2, sha256, sha256_file
from test_devices_and_content import device2, wait_for  # noqa: F401  (device2 is a fixture)


def _evicted_pair(ubiq, src_data: bytes, dst_data: bytes, evict: tuple[str, ...]):
    src, dst = ubiq.docs / "d", ubiq.docs / "f"
    src.write_bytes(src_data)
    dst.write_bytes(dst_data)
    ubiq.sync()
    for name in evict:
        ubiq.run("evict", ubiq.docs / name)
        assert os.stat(ubiq.docs / name).st_blocks == 0
    return src, dst


@pytest.mark.parametrize("evict", [("d",), ("f",), ("d", "f")], ids=["src", "dst", "both"])
def test_rename_over_keeps_the_moved_files_content(ubiq, device2, evict):
    """`mv d f` with d or f evicted: f shows d's bytes, here, in the cloud and on device 2."""
    src, dst = _evicted_pair(ubiq, b"draft\n", b"old\n", evict)
    os.rename(src, dst)
    assert dst.read_bytes() == b"draft\n"
    assert not src.exists()
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(dst)) == b"draft\n"
    wait_for(
        lambda: not (device2.docs / "d").exists() and (device2.docs / "f").read_bytes() == b"draft\n",
        timeout=15,
        what="device 2 to show f = draft and no d",
    )
    ubiq.remount()
    assert dst.read_bytes() == b"draft\n"


@pytest.mark.parametrize("evict", [("d",), ("f",), ("d", "f")], ids=["src", "dst", "both"])
def test_rename_exchange_of_evicted_files_swaps_contents(ubiq, device2, evict):
    src, dst = _evicted_pair(ubiq, b"draft\n", b"old\n", evict)
    renameat2(src, dst, RENAME_EXCHANGE)
    assert src.read_bytes() == b"old\n" and dst.read_bytes() == b"draft\n"
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(dst)) == b"draft\n"
    assert ubiq.cloud_content(ubiq.item_id(src)) == b"old\n"
    try:
        wait_for(
            lambda: (device2.docs / "f").read_bytes() == b"draft\n" and (device2.docs / "d").read_bytes() == b"old\n",
            timeout=15,
            what="device 2 to show the exchanged contents",
        )
    except AssertionError:
        shown = {p.name: p.read_bytes() for p in device2.docs.iterdir()}
        raise AssertionError(f"device 2 shows {shown}")


@pytest.mark.parametrize("how", ["move", "exclude"])
def test_an_evicted_folder_made_local_only_keeps_its_files_bytes(ubiq, device2, how):
    """A folder with an evicted file, moved into a `.nosync` folder or marked excluded, leaves
    the cloud; the file's bytes are downloaded first, so the cloud's garbage collection cannot
    take them."""
    data = os.urandom(300_000)
    (ubiq.docs / "d").mkdir()
    (ubiq.docs / "d" / "f").write_bytes(data)
    ubiq.sync()
    ubiq.run("evict", ubiq.docs / "d" / "f")
    assert os.stat(ubiq.docs / "d" / "f").st_blocks == 0
    if how == "move":
        (ubiq.docs / "kept.nosync").mkdir()
        os.rename(ubiq.docs / "d", ubiq.docs / "kept.nosync" / "d")
        kept = ubiq.docs / "kept.nosync" / "d" / "f"
    else:
        os.setxattr(ubiq.docs / "d", "user.ubiq.excluded", b"1")
        kept = ubiq.docs / "d" / "f"
    ubiq.sync()
    wait_for(lambda: not (device2.docs / "d").exists(), timeout=15, what="d to leave device 2")
    time.sleep(1.1)  # the collection takes chunks unused before the current second
    assert ubiq.collect_garbage()["chunks"] >= 1, "the file's chunks are no cloud item's"
    ubiq.remount()
    assert sha256_file(kept) == sha256(data)


def test_rename_noreplace_of_evicted_file(ubiq):
    src, dst = _evicted_pair(ubiq, b"draft\n", b"old\n", ("d",))
    assert_errno(errno.EEXIST, renameat2, src, dst, RENAME_NOREPLACE)
    renameat2(src, ubiq.docs / "g", RENAME_NOREPLACE)
    assert (ubiq.docs / "g").read_bytes() == b"draft\n" and dst.read_bytes() == b"old\n"
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(ubiq.docs / "g")) == b"draft\n"


def test_rename_exchange_checks_like_plain_rename(ubiq):
    """EXCHANGE of a directory with a file is fine, but not of a directory into itself."""
    d = ubiq.docs / "dir"
    (d / "sub").mkdir(parents=True)
    assert_errno(errno.EINVAL, renameat2, d, d / "sub", RENAME_EXCHANGE)
    assert_errno(errno.ENOENT, renameat2, ubiq.docs / "missing", d, RENAME_EXCHANGE)
    assert (d / "sub").is_dir()


@pytest.mark.parametrize(
    "when",
    ["2300-01-01 00:00:00", "1969-07-20 20:17:40.5", "1901-12-14 00:00:00", "2262-04-11 23:47:16"],
)
def test_touch_with_extreme_dates_keeps_the_daemon_alive(ubiq, when):
    """Any time the kernel passes is stored exactly or refused with EOVERFLOW; the daemon lives."""
    f = ubiq.docs / "t.txt"
    f.write_text("x\n")
    cp = subprocess.run(["touch", "-d", when, str(f)], capture_output=True, text=True)
    assert str(ubiq.mnt) in ubiq_mounts()
    assert f.read_text() == "x\n", "the mount must still answer"
    ref = ubiq.root / "ref"
    ref.write_text("")
    subprocess.run(["touch", "-d", when, str(ref)], check=True)
    want = os.stat(ref).st_mtime_ns
    if cp.returncode == 0:
        assert os.stat(f).st_mtime_ns == want
        ubiq.remount()
        assert os.stat(f).st_mtime_ns == want
    else:
        assert "Value too large" in cp.stderr or "Invalid argument" in cp.stderr, cp.stderr


def test_utime_omit_and_now(ubiq):
    f = ubiq.docs / "u.txt"
    f.write_text("x\n")
    os.utime(f, ns=(-1_500_000_000, 1_000_000_000))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (-1_500_000_000, 1_000_000_000)
    # UTIME_OMIT for atime, UTIME_NOW for mtime through utimensat.
    import ctypes

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
    libc = ctypes.CDLL(None, use_errno=True)
    times = (Timespec * 2)(Timespec(0, UTIME_OMIT), Timespec(0, UTIME_NOW))
    before = time.time_ns()
    assert libc.utimensat(-100, os.fsencode(str(f)), times, 0) == 0, os.strerror(ctypes.get_errno())
    st = os.stat(f)
    assert st.st_atime_ns == -1_500_000_000
    assert st.st_mtime_ns >= before - 2_000_000_000


@pytest.mark.parametrize("how", ["echo", "truncate", "cp"])
def test_truncate_while_downloading_never_lets_old_bytes_in(ubiq, device2, tmp_path, how):
    """An evicted 8 MiB file starts downloading (a small read), then is replaced whole: the
    result is the new content here, in the cloud and on device 2; no old chunk lands later."""
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "100", "--download-limit", "2M")
    f = ubiq.docs / "big.bin"
    f.write_bytes(os.urandom(8 * 1024 * 1024))
    ubiq.sync()
    ubiq.run("evict", f)
    # The reader stays open, so its download (of its read-ahead window) keeps running.
    with open(f, "rb") as reader:
        assert len(reader.read(100)) == 100
        assert Ubiq.xattr(f, "user.ubiq.downloading") == "1"
        assert int(Ubiq.xattr(f, "user.ubiq.percent_downloaded")) < 100, "the download finished too early"
        if how == "echo":
            with open(f, "w") as fh:
                fh.write("NEW\n")
            want = b"NEW\n"
        elif how == "truncate":
            os.truncate(f, 0)
            with open(f, "ab") as fh:
                fh.write(b"NEW\n")
            want = b"NEW\n"
        else:
            other = tmp_path / "other.bin"
            other.write_bytes(b"copied over\n" * 1000)
            subprocess.run(["cp", str(other), str(f)], check=True)
            want = other.read_bytes()
    # Give a download that was not stopped time to write more old chunks (2 MiB/s).
    time.sleep(1.5)
    assert f.read_bytes() == want
    assert os.stat(f).st_size == len(want)
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(f)) == want
    wait_for(lambda: (device2.docs / "big.bin").read_bytes() == want, timeout=15, what="device 2 to get the new bytes")
    time.sleep(1.0)
    assert f.read_bytes() == want


def test_open_writer_at_crash_is_recovered_and_uploaded(ubiq, device2):
    """Write 300,000 bytes, keep the file open, kill -9 the daemon. After remount the mount,
    the index and the cloud agree on the written bytes, and device 2 gets them."""
    f = ubiq.docs / "open.bin"
    data = os.urandom(300_000)
    fh = open(f, "wb")
    try:
        fh.write(data)
        fh.flush()  # to the mount (a write(2)), no fsync
        pid = int(ubiq.daemon_record()["pid"])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="daemon to die")
    finally:
        try:
            fh.close()
        except OSError:
            pass
    subprocess.run(["fusermount3", "-uz", str(ubiq.mnt)], capture_output=True)
    ubiq.mount()
    ubiq.sync()
    assert os.stat(f).st_size == len(data)
    assert sha256_file(f) == sha256(data)
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(data)
    assert Ubiq.xattr(f, "user.ubiq.uploaded") == "1"
    wait_for(lambda: (device2.docs / "open.bin").stat().st_size == len(data), timeout=15, what="device 2 size")
    assert sha256_file(device2.docs / "open.bin") == sha256(data)


@pytest.mark.parametrize("how", ["temporary name", "exchange"])
def test_swapped_folder_names_upload_and_reach_other_devices(ubiq, device2, how):
    """Two folders swap names. The cloud allows one live name per folder, so neither move can be
    committed first as is; the uploads must still finish and every device end on the swap."""
    for name in ("a", "b"):
        (ubiq.docs / name).mkdir()
        (ubiq.docs / name / "inside.txt").write_text(f"was {name}\n")
    ubiq.sync()
    if how == "temporary name":
        os.rename(ubiq.docs / "a", ubiq.docs / "t")
        os.rename(ubiq.docs / "b", ubiq.docs / "a")
        os.rename(ubiq.docs / "t", ubiq.docs / "b")
    else:
        renameat2(ubiq.docs / "a", ubiq.docs / "b", RENAME_EXCHANGE)
    ubiq.sync()
    assert (ubiq.docs / "a" / "inside.txt").read_text() == "was b\n"
    try:
        wait_for(
            lambda: (device2.docs / "a" / "inside.txt").read_text() == "was b\n"
            and (device2.docs / "b" / "inside.txt").read_text() == "was a\n"
            and sorted(os.listdir(device2.docs)) == ["a", "b"],
            timeout=15,
            what="device 2 to show the swapped folders",
        )
    except AssertionError:
        shown = {str(p.relative_to(device2.docs)): p.is_dir() or p.read_text() for p in device2.docs.rglob("*")}
        cloud = sorted((i["name"], i.get("parentID")) for i in ubiq.cloud_items(include_deleted=False))
        raise AssertionError(f"device 2 shows {shown}; the cloud has {cloud}")


def test_o_trunc_truncates_what_another_handle_wrote(ubiq):
    """A handle empties the file and writes 48 bytes (not closed: the index still says 0 bytes);
    then `open(O_TRUNC)` and 30 bytes through a second handle. As on ext4 the file is those 30
    bytes, not 30 bytes followed by the first handle's tail."""
    f = ubiq.docs / "two-handles.txt"
    f.write_bytes(b"first version\n")
    first = os.open(f, os.O_WRONLY)
    try:
        os.ftruncate(first, 0)
        os.write(first, b"A" * 47 + b"\n")
        with open(f, "wb") as second:
            second.write(b"B" * 29 + b"\n")
    finally:
        os.close(first)
    assert f.read_bytes() == b"B" * 29 + b"\n"
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(f)) == b"B" * 29 + b"\n"


def _store_unchecked(ubiq: Ubiq, record: dict) -> None:
    """Stores `record` in the embedded cloud's database as a new change, bypassing every rule
    the cloud checks: what a cloud that checks nothing could send."""
    db = ubiq._cloud_db()
    try:
        with db:
            (seq,) = db.execute(
                "UPDATE containers SET lastSeq = lastSeq + 1 WHERE account = 'local' AND container = ? RETURNING lastSeq",
                (ubiq.container,),
            ).fetchone()
            record = dict(record, changeSeq=seq, etag=str(seq))
            db.execute(
                """INSERT INTO items(account, container, itemID, changeSeq, etag, deleted, record, parentID, name)
                   VALUES ('local', ?, ?, ?, ?, 0, ?, ?, ?)
                   ON CONFLICT(account, container, itemID) DO UPDATE SET changeSeq = excluded.changeSeq,
                     etag = excluded.etag, record = excluded.record, parentID = excluded.parentID,
                     name = excluded.name""",
                (ubiq.container, record["itemID"], seq, str(seq), json.dumps(record).encode(), record["parentID"],
                 record["name"]),
            )
    finally:
        db.close()


@pytest.mark.skipif(CLOUD_MODE != "embedded", reason="writes a record no server stores into the embedded cloud's database")
def test_a_record_that_breaks_a_rule_is_refused_and_sync_goes_on(ubiq, tmp_path_factory):
    """The cloud renames a synced file to a name with '/' and adds a folder named `x.nosync`:
    records `ubiqfs serve` refuses, which a cloud that checks nothing could send. Each device
    refuses them (the file stays as it was; the folder does not appear), says so in `ubiqfs
    status`, and goes on syncing everything else."""
    kept = ubiq.docs / "kept.txt"
    kept.write_text("kept\n")
    ubiq.sync()
    record = ubiq.cloud_item_for(kept)
    ubiq.unmount()
    _store_unchecked(ubiq, dict(record, name="bad/name"))
    _store_unchecked(ubiq, dict(record, itemID="nosync-folder-1", name="x.nosync", kind=2, size=0, chunks=[]))
    ubiq.mount()
    after = ubiq.docs / "after.txt"
    after.write_text("after\n")
    ubiq.sync()
    assert sorted(os.listdir(ubiq.docs)) == ["after.txt", "kept.txt"]
    assert kept.read_text() == "kept\n"
    refused = ubiq.status()[0]["queue"]["refusedRecords"]
    assert sorted(r["name"] for r in refused) == ["bad/name", "x.nosync"], refused
    assert any(".nosync" in r["reason"] for r in refused), refused
    text = ubiq.run("status").stdout
    assert "refused a change from the cloud: item nosync-folder-1" in text, text
    # A new device gets every valid record and refuses the same two.
    with another_device(ubiq, tmp_path_factory, "fresh") as fresh:
        fresh.mount()
        assert sorted(os.listdir(fresh.docs)) == ["after.txt"]
        assert (fresh.docs / "after.txt").read_text() == "after\n"
        assert len(fresh.status()[0]["queue"]["refusedRecords"]) == 2
        fresh.unmount()


def _tree(root) -> dict[str, tuple]:
    """Every entry under root: a folder, a file (bytes, mode, user.note) or a symlink (target)."""
    found: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                found[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                found[rel] = ("dir",)
            else:
                try:
                    note = os.getxattr(path, "user.note")
                except OSError:
                    note = None
                with open(path, "rb") as fh:
                    found[rel] = ("file", fh.read(), os.stat(path).st_mode & 0o777, note)
    return found


def test_changes_answered_just_before_a_kill_9_are_all_there_after_the_remount(ubiq):
    """The mount's namespace changes and content records share index transactions committed a
    few milliseconds apart; each is in the index's redo log before its reply. Bursts of
    ordinary commands (create and write, mkdir, rename, unlink, chmod, setxattr, symlink), the
    daemon SIGKILLed right after the last one returned, a remount: the tree is exactly what
    the commands left, every round."""
    import random

    rng = random.Random(20261202)
    expected: dict[str, tuple] = {}
    for round_ in range(6):
        top = f"round{round_}"
        (ubiq.docs / top).mkdir()
        expected[top] = ("dir",)
        folders = [top]
        files: list[str] = []
        for i in range(rng.randint(80, 160)):
            op = rng.random()
            if op < 0.4 or not files:
                rel = f"{rng.choice(folders)}/f{i}"
                data = os.urandom(rng.choice([0, 10, 5000]))
                (ubiq.docs / rel).write_bytes(data)
                expected[rel] = ("file", data, 0o644, None)
                files.append(rel)
            elif op < 0.5:
                rel = f"{rng.choice(folders)}/d{i}"
                (ubiq.docs / rel).mkdir()
                expected[rel] = ("dir",)
                folders.append(rel)
            elif op < 0.65:
                old = rng.choice(files)
                new = f"{rng.choice(folders)}/m{i}"
                os.rename(ubiq.docs / old, ubiq.docs / new)
                expected[new] = expected.pop(old)
                files[files.index(old)] = new
            elif op < 0.75:
                gone = files.pop(rng.randrange(len(files)))
                os.unlink(ubiq.docs / gone)
                del expected[gone]
            elif op < 0.85:
                rel = rng.choice(files)
                os.chmod(ubiq.docs / rel, 0o600)
                kind, data, _, note = expected[rel]
                expected[rel] = (kind, data, 0o600, note)
            elif op < 0.95:
                rel = rng.choice(files)
                os.setxattr(ubiq.docs / rel, "user.note", f"n{i}".encode())
                kind, data, mode, _ = expected[rel]
                expected[rel] = (kind, data, mode, f"n{i}".encode())
            else:
                rel = f"{rng.choice(folders)}/l{i}"
                os.symlink(f"target-{i}", ubiq.docs / rel)
                expected[rel] = ("link", f"target-{i}")
        ubiq.kill_daemon()
        ubiq.mount()
        found = {k: v for k, v in _tree(ubiq.docs).items() if k.split("/")[0].startswith("round")}
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        changed = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
        assert not (missing or extra or changed), f"round {round_}: missing {missing}, extra {extra}, changed {changed}"
    ubiq.sync(timeout=120)
