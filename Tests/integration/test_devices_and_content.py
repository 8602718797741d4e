"""Two devices on one embedded cloud, on-demand content (evict / download / pin), crash
durability and delta uploads, all through real mounts of the real binary."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Ubiq, another_device, ubiq_mounts
from helpers import sha256, sha256_file


def wait_for(predicate, timeout=10.0, interval=0.05, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def device2(ubiq, tmp_path_factory):
    """A second device: its own state folder and mount, the first device's cloud."""
    with another_device(ubiq, tmp_path_factory, "device2") as d2:
        d2.mount_args = ["--upload-delay-ms", "100", "--pull-interval-ms", "100"]
        d2.mount()
        yield d2


def test_busy_reader_on_second_device_ends_on_the_newest_content(ubiq, device2):
    """A reader that keeps re-reading a file while it changes remotely must end on the newest
    bytes: a read through a handle opened before the change must not leave the old bytes in the
    kernel's page cache, and a download racing the change must not be thrown away."""
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "0")
    for i in range(25):
        a, b = ubiq.docs / f"poll{i}.txt", device2.docs / f"poll{i}.txt"
        a.write_text("one\n")
        wait_for(lambda: b.read_text() == "one\n", timeout=15, interval=0.002, what=f"poll{i}.txt = one on device 2")
        a.write_text("two\n")
        wait_for(lambda: b.read_text() == "two\n", timeout=15, interval=0.002, what=f"poll{i}.txt = two on device 2")


def test_a_slow_reader_of_a_replaced_file_leaves_no_old_pages_behind(ubiq, device2):
    """A handle opened before another device replaced the file keeps reading the old bytes
    (POSIX: it has the version it opened), and its reads go through the kernel's page cache,
    which every later open shares. However long after that reader has finished, an open of the
    file must read the new version, not a mix of old and new pages; and an edit made from
    what it reads must not send that mix to the cloud."""
    old, new = os.urandom(4 * 1024 * 1024), os.urandom(4 * 1024 * 1024)
    a, b = ubiq.docs / "replaced.bin", device2.docs / "replaced.bin"
    a.write_bytes(old)
    ubiq.sync()
    wait_for(lambda: b.exists() and b.stat().st_size == len(old), timeout=30, what="replaced.bin on device 2")
    device2.run("download", b)
    with open(b, "rb") as reader:
        assert reader.read(256 * 1024) == old[: 256 * 1024]
        a.write_bytes(new)
        ubiq.sync()
        etag = Ubiq.xattr(a, "user.ubiq.etag")
        wait_for(lambda: Ubiq.xattr(b, "user.ubiq.etag") == etag, timeout=30, what="the new version on device 2")
        # The old handle reads on, slowly: each of its reads may put old pages into the cache.
        rest = b""
        while chunk := reader.read(256 * 1024):
            rest += chunk
            time.sleep(0.05)
        assert rest == old[256 * 1024:], "a handle keeps the version it opened"
    time.sleep(4)  # well after the reader's last read
    assert sha256_file(b) == sha256(new), "an open after the old reader is done reads the new version"
    expected = bytearray(new)
    expected[0] ^= 0xFF
    with open(b, "r+b") as edit:
        data = bytearray(edit.read())
        data[0] ^= 0xFF
        edit.seek(0)
        edit.write(data)
    device2.sync()
    wait_for(lambda: sha256_file(a) == sha256(expected), timeout=30, what="device 2's edit on device 1")


def test_garbage_collection_frees_replaced_and_deleted_content_and_keeps_what_is_current(ubiq, device2):
    doc, gone = ubiq.docs / "doc.bin", ubiq.docs / "gone.bin"
    old, new, removed = os.urandom(300_000), os.urandom(300_000), os.urandom(200_000)
    doc.write_bytes(old)
    gone.write_bytes(removed)
    ubiq.sync()
    doc.write_bytes(new)
    gone.unlink()
    ubiq.sync()
    before = ubiq.stored_chunks()
    time.sleep(1.1)  # grace 0 keeps chunks used within the current second

    freed = ubiq.collect_garbage()

    assert freed["bytes"] == len(old) + len(removed), freed
    after = ubiq.stored_chunks()
    assert sum(after.values()) == sum(before.values()) - freed["bytes"] == len(new)
    # The current content is whole: read back after eviction, and on the second device.
    ubiq.run("evict", doc)
    assert doc.read_bytes() == new
    wait_for(lambda: (device2.docs / "doc.bin").exists() and (device2.docs / "doc.bin").read_bytes() == new,
             timeout=30, what="doc.bin on device 2")
    assert not (device2.docs / "gone.bin").exists()
    # New uploads of the collected bytes work: they are simply missing again.
    (ubiq.docs / "again.bin").write_bytes(old)
    ubiq.sync()
    assert ubiq.status()[0]["queue"]["failing"] == []
    assert ubiq.cloud_content(ubiq.item_id(ubiq.docs / "again.bin")) == old


def test_second_device_sees_creates_edits_moves_and_deletes(ubiq, device2):
    data = os.urandom(3 * 1024 * 1024 + 17)
    (ubiq.docs / "photo.bin").write_bytes(data)
    (ubiq.docs / "notes").mkdir()
    (ubiq.docs / "notes" / "a.txt").write_text("first\n")
    os.setxattr(ubiq.docs / "notes" / "a.txt", "user.color", b"blue")
    ubiq.sync()

    remote = device2.docs / "photo.bin"
    wait_for(lambda: remote.exists(), what="photo.bin on device 2")
    wait_for(lambda: (device2.docs / "notes" / "a.txt").exists(), what="notes/a.txt on device 2")
    st = os.stat(remote)
    # Arrives as metadata only: true size, nothing allocated, not downloaded by stat/ls.
    assert st.st_size == len(data) and st.st_blocks == 0
    assert Ubiq.xattr(remote, "user.ubiq.status") == "not_downloaded"
    subprocess.run(["ls", "-lR", str(device2.docs)], check=True, capture_output=True)
    assert Ubiq.xattr(remote, "user.ubiq.status") == "not_downloaded"
    assert sha256_file(remote) == sha256(data)  # read downloads on demand
    assert Ubiq.xattr(remote, "user.ubiq.status") == "current"
    assert os.stat(remote).st_blocks > 0
    assert os.getxattr(device2.docs / "notes" / "a.txt", "user.color") == b"blue"

    # Edit, move and delete on device 2; device 1 follows.
    (device2.docs / "notes" / "a.txt").write_text("second\n")
    os.rename(device2.docs / "photo.bin", device2.docs / "notes" / "photo.bin")
    device2.sync()
    wait_for(lambda: (ubiq.docs / "notes" / "photo.bin").exists(), what="move on device 1")
    assert not (ubiq.docs / "photo.bin").exists()
    wait_for(lambda: (ubiq.docs / "notes" / "a.txt").read_text() == "second\n", what="edit on device 1")
    assert sha256_file(ubiq.docs / "notes" / "photo.bin") == sha256(data)
    # Same item, not a copy.
    assert ubiq.item_id(ubiq.docs / "notes" / "photo.bin") == device2.item_id(device2.docs / "notes" / "photo.bin")

    os.unlink(device2.docs / "notes" / "a.txt")
    device2.sync()
    wait_for(lambda: not (ubiq.docs / "notes" / "a.txt").exists(), what="delete on device 1")


def test_a_folder_whose_entries_change_on_another_device_gets_a_new_mtime_here(ubiq, device2):
    """As on ext4, a folder's mtime and ctime move when an entry is added, removed or renamed in
    it, also when another device did it: tools that skip a folder whose mtime has not moved
    (git's untracked cache, Python's import cache, make) see the change."""
    here, there = ubiq.docs / "dm", device2.docs / "dm"
    here.mkdir()
    (here / "a").write_text("a")
    wait_for(lambda: (there / "a").exists(), timeout=15, what="dm/a on device 2")
    steps = [
        ("created", lambda: (there / "new").write_text("n"), lambda: (here / "new").exists()),
        ("removed", lambda: (there / "a").unlink(), lambda: not (here / "a").exists()),
        ("renamed", lambda: (there / "new").rename(there / "renamed"), lambda: (here / "renamed").exists()),
        ("moved out", lambda: (there / "renamed").rename(device2.docs / "out"), lambda: not (here / "renamed").exists()),
    ]
    for what, change, arrived in steps:
        before = os.stat(here)
        time.sleep(0.05)
        change()
        wait_for(arrived, timeout=15, what=f"an entry {what} on device 2 to arrive")
        after = os.stat(here)
        assert after.st_mtime_ns > before.st_mtime_ns, f"{what}: mtime stayed {before.st_mtime_ns}"
        assert after.st_ctime_ns > before.st_ctime_ns, f"{what}: ctime stayed {before.st_ctime_ns}"
    # The folder moved out of gets it too; a content edit moves no folder's time.
    out_before = os.stat(ubiq.docs).st_mtime_ns
    wait_for(lambda: (ubiq.docs / "out").exists(), timeout=15, what="out on device 1")
    assert os.stat(ubiq.docs).st_mtime_ns >= out_before
    settled = os.stat(ubiq.docs).st_mtime_ns
    (device2.docs / "out").write_text("edited")
    wait_for(lambda: (ubiq.docs / "out").read_text() == "edited", timeout=15, what="the edit on device 1")
    assert os.stat(ubiq.docs).st_mtime_ns == settled


def test_an_empty_file_from_another_device_renamed_before_it_is_opened_uploads(ubiq, device2):
    """`touch` on one device, `mv` on the other: an empty file arrives with no cache file, and
    the rename's upload must not wait for one."""
    (ubiq.docs / "empty").touch()
    ubiq.sync()
    wait_for(lambda: (device2.docs / "empty").exists(), timeout=15, what="the empty file on device 2")
    os.rename(device2.docs / "empty", device2.docs / "renamed")
    device2.sync(timeout=20)
    wait_for(lambda: (ubiq.docs / "renamed").exists() and not (ubiq.docs / "empty").exists(), timeout=15,
             what="the rename on device 1")
    assert (ubiq.docs / "renamed").read_bytes() == b"" == (device2.docs / "renamed").read_bytes()


def test_fresh_device_rebuilds_tree_from_cloud(ubiq, device2):
    for i in range(20):
        (ubiq.docs / f"f{i:02}.txt").write_text(f"file {i}\n")
    ubiq.sync()
    wait_for(lambda: len(os.listdir(device2.docs)) == 20, what="20 files on device 2")
    assert sorted(os.listdir(device2.docs)) == sorted(os.listdir(ubiq.docs))
    for i in range(20):
        assert (device2.docs / f"f{i:02}.txt").read_text() == f"file {i}\n"


def test_evict_download_and_pin(ubiq):
    data = os.urandom(2 * 1024 * 1024)
    f = ubiq.docs / "doc.bin"
    f.write_bytes(data)
    # Not yet uploaded: eviction is refused (it would lose data), the file stays intact.
    cp = ubiq.run("evict", f, check=False)
    if cp.returncode != 0:
        assert "busy" in cp.stderr.lower() or "resource" in cp.stderr.lower()
    ubiq.sync()
    ubiq.run("evict", f)
    st = os.stat(f)
    assert st.st_size == len(data) and st.st_blocks == 0
    assert Ubiq.xattr(f, "user.ubiq.status") == "not_downloaded"
    assert sha256_file(f) == sha256(data)
    assert Ubiq.xattr(f, "user.ubiq.status") == "current"

    # Through the xattr too, and recursively on directories.
    os.setxattr(f, "user.ubiq.action", b"evict")
    assert os.stat(f).st_blocks == 0
    ubiq.run("download", ubiq.docs)
    assert Ubiq.xattr(f, "user.ubiq.status") == "current"

    # Pinned content is kept: eviction fails with EBUSY.
    ubiq.run("pin", f)
    assert Ubiq.xattr(f, "user.ubiq.pinned") == "1"
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.ubiq.action", b"evict")
    assert e.value.errno == errno.EBUSY
    ubiq.run("unpin", f)
    ubiq.run("evict", f)
    assert os.stat(f).st_blocks == 0

    # Evicted content survives a remount as metadata and downloads again.
    ubiq.remount()
    assert os.stat(f).st_blocks == 0 and os.stat(f).st_size == len(data)
    assert sha256_file(f) == sha256(data)

    # Bad values are refused with EINVAL.
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.ubiq.action", b"explode")
    assert e.value.errno == errno.EINVAL


def test_open_file_cannot_be_evicted(ubiq):
    f = ubiq.docs / "open.txt"
    f.write_text("keep me\n")
    ubiq.sync()
    with open(f) as handle:
        with pytest.raises(OSError) as e:
            os.setxattr(f, "user.ubiq.action", b"evict")
        assert e.value.errno == errno.EBUSY
        assert handle.read() == "keep me\n"


def test_kill_9_loses_no_closed_write(ubiq):
    """Close a batch of files, SIGKILL the daemon before it uploads, remount: all arrive."""
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "3000")
    contents = {f"k{i}.bin": os.urandom(100_000 + i) for i in range(12)}
    for name, data in contents.items():
        with open(ubiq.docs / name, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    pid = int(ubiq.daemon_record()["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="daemon to die")
    subprocess.run(["fusermount3", "-uz", str(ubiq.mnt)], capture_output=True)
    assert str(ubiq.mnt) not in ubiq_mounts()
    # Nothing reached the cloud yet...
    names = {i["name"] for i in ubiq.cloud_items(include_deleted=False)}
    assert not (names & set(contents)), "uploads should still be queued when the daemon died"
    # ...and everything does after the remount.
    ubiq.mount()
    ubiq.sync()
    for name, data in contents.items():
        path = ubiq.docs / name
        assert sha256_file(path) == sha256(data)
        assert sha256(ubiq.cloud_content(ubiq.item_id(path))) == sha256(data)


def test_small_edit_in_large_file_uploads_few_bytes(ubiq):
    # Seeded bytes: how far chunk boundaries run out of step after an edit depends on the
    # content (its spread over many files is ChunkerTests' testASmallEditReChunksLittleEvenInTheTail).
    rng = random.Random(48)
    f = ubiq.docs / "big.bin"
    data = bytearray(rng.randbytes(48 * 1024 * 1024))
    f.write_bytes(data)
    ubiq.sync()
    # What was closed is what the cloud has once the sync returns.
    first = ubiq.cloud_item(ubiq.item_id(f))
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(bytes(data))
    blobs_before = ubiq.stored_chunks()
    with open(f, "r+b") as fh:
        fh.seek(20 * 1024 * 1024)
        fh.write(rng.randbytes(1024 * 1024))
    ubiq.sync()
    blobs_after = ubiq.stored_chunks()
    new = {name: size for name, size in blobs_after.items() if name not in blobs_before}
    new_bytes = sum(new.values())
    second = ubiq.cloud_item(ubiq.item_id(f))
    offsets, at = [], 0
    for chunk in second["chunks"]:
        if chunk["hash"] in new:
            offsets.append(at)
        at += chunk["length"]
    assert new_bytes < 0.2 * len(data), (
        f"re-uploaded {new_bytes} bytes in {len(new)} chunks for a 1 MiB edit at 20 MiB: new chunks at offsets "
        f"{offsets} of the new version ({len(second['chunks'])} chunks; {len(first['chunks'])} before the edit); "
        f"{len(blobs_before)} chunks stored before, {len(blobs_after)} after"
    )
    with open(f, "rb") as fh:
        local = fh.read()
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(local)


def test_upload_waits_for_close_consistent_snapshot(ubiq):
    """A file held open with unflushed writes is not uploaded until it is closed."""
    f = ubiq.docs / "log.txt"
    fh = open(f, "wb")
    try:
        fh.write(b"part one\n")
        fh.flush()  # reaches the daemon as a write, but no close/fsync yet
        time.sleep(1.0)
        assert all(i["name"] != "log.txt" or i["size"] == 0 for i in ubiq.cloud_items(include_deleted=False))
        fh.write(b"part two\n")
    finally:
        fh.close()
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(f)) == b"part one\npart two\n"


def test_cache_budget_evicts_lru_but_never_pinned_open_or_unuploaded(ubiq):
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "100", "--cache-budget", "3M")
    mib = 1024 * 1024
    files = {f"b{i}.bin": os.urandom(mib) for i in range(6)}
    for name, data in files.items():
        (ubiq.docs / name).write_bytes(data)
    (ubiq.docs / "local.nosync").write_bytes(os.urandom(mib))  # never uploaded: must stay
    # Pin one and hold one open before the uploads finish (only uploaded files are eligible).
    ubiq.run("pin", ubiq.docs / "b0.bin")
    held = open(ubiq.docs / "b1.bin", "rb")
    try:
        ubiq.sync()
        wait_for(
            lambda: sum(os.stat(ubiq.docs / n).st_blocks == 0 for n in files) >= 3,
            timeout=15,
            what="budget eviction",
        )
        assert os.stat(ubiq.docs / "b0.bin").st_blocks > 0, "pinned file was evicted"
        assert os.stat(ubiq.docs / "b1.bin").st_blocks > 0, "open file was evicted"
        assert os.stat(ubiq.docs / "local.nosync").st_blocks > 0, "local-only file was evicted"
        assert held.read() == files["b1.bin"]
    finally:
        held.close()
    # Evicted files read back byte-exact.
    for name, data in files.items():
        assert sha256_file(ubiq.docs / name) == sha256(data)


def allocated_cache_bytes(ubiq: Ubiq, path: Path) -> int:
    """Bytes the cache file of a file on the mount occupies on disk (0 if it has none)."""
    try:
        return (ubiq.container_dir() / "content" / str(os.stat(path).st_ino)).stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def test_a_small_read_of_an_evicted_file_downloads_about_one_window(ubiq):
    """`head -c1`, `file` or a thumbnailer over evicted files fetches the read-ahead window of
    its first read, not the whole file; the partial download goes with the last close."""
    files = [ubiq.docs / f"big{i}.bin" for i in range(6)]
    for f in files:
        f.write_bytes(os.urandom(8 * 1024 * 1024))
    ubiq.sync()
    allowed = {}
    for f in files:
        ubiq.run("evict", f)
        # The chunks a first small read may bring: its own (the kernel reads up to 256 KiB at
        # the start of a file) and those inside the 1 MiB window after it.
        offset, allowed[f] = 0, 0
        for chunk in ubiq.cloud_item_for(f)["chunks"]:
            if offset < (256 + 1024) * 1024:
                allowed[f] += chunk["length"]
            offset += chunk["length"]
    handles = [open(f, "rb") for f in files]
    try:
        for h in handles:
            assert len(h.read(1)) == 1
        # A download that were not bounded would go on meanwhile (the embedded cloud gives
        # hundreds of MiB/s); a bounded one stops after its window.
        time.sleep(2)
        for f in files:
            used = allocated_cache_bytes(ubiq, f)
            # Each chunk written may round up to whole blocks.
            assert 0 < used <= allowed[f] + 64 * 1024, f"{f.name}: {used} bytes cached, the window allows {allowed[f]}"
            assert Ubiq.xattr(f, "user.ubiq.status") == "not_downloaded"
    finally:
        for h in handles:
            h.close()
    for f in files:
        wait_for(lambda: allocated_cache_bytes(ubiq, f) == 0, what=f"the partial download of {f.name} to go")
        assert Ubiq.xattr(f, "user.ubiq.downloading") == "0"
        assert os.stat(f).st_blocks == 0


def test_a_signal_ends_an_open_that_waits_for_a_download(ubiq):
    """An editor opening a big evicted file for writing waits for its download. A signal (Ctrl-C)
    ends the wait with EINTR, other files stay usable meanwhile, and the file is unchanged."""
    ubiq.unmount()
    ubiq.mount("--download-limit", "1K")
    f = ubiq.docs / "big.bin"
    data = os.urandom(4 * 1024 * 1024)
    f.write_bytes(data)
    other = ubiq.docs / "other.txt"
    other.write_text("usable\n")
    ubiq.sync()
    ubiq.run("evict", f)
    opener = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_OPEN, str(f)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert opener.stdout.readline().strip() == "opening"
        wait_for(lambda: Ubiq.xattr(f, "user.ubiq.downloading") == "1", what="the download to start")
        assert other.read_text() == "usable\n"
        with open(other, "a") as fh:
            fh.write("and writable\n")
        opener.send_signal(signal.SIGUSR1)
        # At 1 KiB/s the download takes over an hour: only the signal can end the open now.
        opener.wait(timeout=10)
        out, err = opener.stdout.read(), opener.stderr.read()
    finally:
        if opener.poll() is None:
            opener.kill()
            opener.wait()
    assert out.strip() == "interrupted", (out, err)
    assert os.stat(f).st_size == len(data)
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(data)
    assert other.read_text() == "usable\nand writable\n"


def test_more_waits_for_downloads_than_fuse_threads_leave_the_mount_usable(ubiq):
    """More opens wait for downloads than the FUSE loop has threads (16). The mount still
    answers everything else (a listing, a read, a write, a status xattr), and each wait still
    ends on its own signal: no wait ever holds one of the loop's threads."""
    ubiq.unmount()
    ubiq.mount("--download-limit", "1K")
    files = [ubiq.docs / f"big{i}.bin" for i in range(24)]
    for f in files:
        f.write_bytes(os.urandom(4 * 1024 * 1024))
    other = ubiq.docs / "other.txt"
    other.write_text("usable\n")
    ubiq.sync()
    for f in files:
        ubiq.run("evict", f)
    openers = [
        subprocess.Popen(
            [sys.executable, "-c", INTERRUPTED_OPEN, str(f)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for f in files
    ]
    try:
        for opener in openers:
            assert opener.stdout.readline().strip() == "opening"
        time.sleep(1)  # every open is in its wait now (at 1 KiB/s no file arrives for minutes)
        # Each check runs in a child with a deadline well under the 15 s stall deadline, after
        # which waits would end by themselves and free the threads.
        check = subprocess.run(
            ["sh", "-c", 'ls "$1" >/dev/null && cat "$2" && echo more >> "$2" && getfattr --only-values -n user.ubiq.downloading "$3"',
             "sh", str(ubiq.docs), str(other), str(files[0])],
            capture_output=True, text=True, timeout=8,
        )
        assert check.returncode == 0, check.stderr
        assert check.stdout == "usable\n1", check.stdout
        for opener in openers:
            opener.send_signal(signal.SIGUSR1)
        for opener in openers:
            opener.wait(timeout=8)
        # Read through the text streams: `readline` above may have buffered more than its line
        # (a child whose open ended before the signal), which `communicate` would not return.
        outcomes = [" ".join([opener.stdout.read(), opener.stderr.read()]).strip() for opener in openers]
    finally:
        for opener in openers:
            if opener.poll() is None:
                opener.kill()
                opener.wait()
    assert outcomes == ["interrupted"] * len(files)
    assert other.read_text() == "usable\nmore\n"
    assert all(os.stat(f).st_size == 4 * 1024 * 1024 for f in files)


# Opens argv[1] for writing; a SIGUSR1 handler raises, which Python lets through only when the
# open(2) itself returned EINTR.
INTERRUPTED_OPEN = """
import os, signal, sys
class Interrupted(Exception):
    pass
def on_signal(*_):
    raise Interrupted()
signal.signal(signal.SIGUSR1, on_signal)
print("opening", flush=True)
try:
    os.close(os.open(sys.argv[1], os.O_RDWR))
    print("opened")
except Interrupted:
    print("interrupted")
except OSError as e:
    print("error", e.errno)
"""


def test_no_download_programs_get_eacces(ubiq, tmp_path):
    f = ubiq.docs / "movie.bin"
    data = os.urandom(300_000)
    f.write_bytes(data)
    ubiq.sync()
    ubiq.run("evict", f)
    indexer = tmp_path / "updatedb"  # a default no-download program name
    indexer.write_bytes(Path("/bin/cat").read_bytes())
    indexer.chmod(0o755)
    cp = subprocess.run([str(indexer), str(f)], capture_output=True)
    assert cp.returncode != 0 and b"Permission denied" in cp.stderr
    assert os.stat(f).st_blocks == 0, "the indexer's read must not download"
    assert Ubiq.xattr(f, "user.ubiq.status") == "not_downloaded"
    assert sha256_file(f) == sha256(data)  # an ordinary program downloads
    # Cached content is fine for everyone.
    assert subprocess.run([str(indexer), str(f)], capture_output=True).stdout == data


def test_partial_read_of_evicted_file_streams(ubiq):
    """With downloads capped at 8 MiB/s a 64 MiB evicted file takes ~8 s to arrive; reads near
    the start, and a read far into the file, return long before that, byte-exact. Only what is
    read (plus its read-ahead) is fetched; a file read in part stays evicted."""
    data = os.urandom(64 * 1024 * 1024)
    f = ubiq.docs / "large.bin"
    f.write_bytes(data)
    ubiq.sync()
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "100", "--download-limit", "8M")
    ubiq.run("evict", f)
    assert os.stat(f).st_blocks == 0

    t0 = time.monotonic()
    with open(f, "rb") as fh:
        head = fh.read(64 * 1024)
        t_head = time.monotonic() - t0
        fh.seek(40 * 1024 * 1024)
        middle = fh.read(64 * 1024)
        t_middle = time.monotonic() - t0
        assert head == data[: 64 * 1024]
        assert middle == data[40 * 1024 * 1024 : 40 * 1024 * 1024 + 64 * 1024]
        # The whole file is not there yet.
        assert Ubiq.xattr(f, "user.ubiq.status") == "not_downloaded"
        assert int(Ubiq.xattr(f, "user.ubiq.percent_downloaded")) < 100
        # A second reader shares the same download.
        with open(f, "rb") as other:
            assert other.read(1024) == data[:1024]
        rest = fh.read()
    total = time.monotonic() - t0
    assert t_head < 2.5, f"first 64 KiB took {t_head:.2f}s"
    assert t_middle < 3.5, f"a read at 40 MiB took {t_middle:.2f}s"
    # The 24 MiB from 40 MiB on take about 3 s at 8 MiB/s (unlimited, well under 1 s).
    assert total > 2.5, f"the download was not rate-limited ({total:.2f}s)"
    assert rest == data[40 * 1024 * 1024 + 64 * 1024 :]
    # Read in part: the partial download went with the last close, the file is still evicted.
    wait_for(lambda: Ubiq.xattr(f, "user.ubiq.downloading") == "0", what="the partial download to stop")
    assert Ubiq.xattr(f, "user.ubiq.status") == "not_downloaded"
    assert os.stat(f).st_blocks == 0
    # Its bytes are all there to read (some from the kernel's page cache, which is why a read
    # is no way to keep a file: `ubiqfs download` is).
    assert sha256_file(f) == sha256(data)
    ubiq.run("download", f)
    assert Ubiq.xattr(f, "user.ubiq.status") == "current"
    assert sha256_file(f) == sha256(data)


def test_content_state_xattr_follows_a_file_through_its_states(ubiq):
    """`user.ubiq.content_state` on the real mount: dirty while a writer holds bytes not yet
    uploaded, uploading while they are sent, cached once the cloud has them, dataless when
    evicted, downloading while a reader streams it (and dataless again when the reader leaves
    early), error while its upload is refused (the bytes stay readable), cached after the retry."""
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "100", "--download-limit", "64K", "--upload-limit", "512K")
    f = ubiq.docs / "states.bin"

    def state() -> str:
        return Ubiq.xattr(f, "user.ubiq.content_state")

    # Larger than the largest chunk (4 MiB), so the file has at least two chunks and a read of
    # its first bytes cannot bring the whole file (the bandwidth cap delays the chunk after).
    data = os.urandom(5 * 1024 * 1024)
    with open(f, "wb") as fh:
        fh.write(data)
        fh.flush()
        assert state() == "dirty"
    # 5 MiB at 512 KiB/s: about 10 s of sending.
    wait_for(lambda: state() == "uploading", timeout=10, what="the upload to start")
    ubiq.sync(f, timeout=60)
    assert state() == "cached"
    ubiq.run("evict", f)
    assert state() == "dataless"
    with open(f, "rb") as fh:
        # 64 KiB/s: the read-ahead keeps the download running for far longer than this test.
        assert fh.read(10) == data[:10]
        assert state() == "downloading"
    wait_for(lambda: state() == "dataless", what="the early reader's download to stop")
    ubiq.set_quota(1024)
    new = os.urandom(512 * 1024)
    f.write_bytes(new)
    wait_for(lambda: state() == "error", timeout=15, what="the refused upload")
    assert "EDQUOT" in Ubiq.xattr(f, "user.ubiq.upload_error")
    assert sha256_file(f) == sha256(new)
    ubiq.set_quota(0)
    ubiq.sync(f, timeout=60)
    assert state() == "cached"
    assert sha256(ubiq.cloud_content(ubiq.item_id(f))) == sha256(new)


def test_a_pinned_file_changed_on_another_device_is_downloaded_again(ubiq, device2):
    """`ubiqfs pin` keeps a file available offline: a new version written on another device is
    downloaded at once, without anyone reading it."""
    f1 = ubiq.docs / "kept.bin"
    f1.write_bytes(os.urandom(300_000))
    ubiq.sync()
    f2 = device2.docs / "kept.bin"
    wait_for(lambda: f2.exists() and f2.stat().st_size == 300_000, timeout=15, what="the file on device 2")
    device2.run("pin", f2)
    assert Ubiq.xattr(f2, "user.ubiq.content_state") == "cached"
    new = os.urandom(400_000)
    f1.write_bytes(new)
    ubiq.sync()
    wait_for(lambda: f2.stat().st_size == 400_000, timeout=15, what="the new version's size on device 2")
    wait_for(lambda: Ubiq.xattr(f2, "user.ubiq.content_state") == "cached", timeout=15,
             what="the new version downloaded on device 2")
    assert f2.stat().st_blocks > 0
    assert Ubiq.xattr(f2, "user.ubiq.pinned") == "1"
    assert sha256_file(f2) == sha256(new)


def test_a_file_deleted_on_another_device_stays_readable_through_an_open_descriptor(ubiq, device2):
    """A player or `less` here keeps reading a file another device deletes, as after a local `rm`
    (POSIX): the name goes, the descriptor reads and fstat answers until it is closed, and then
    the local copy is freed (not left until the next mount)."""
    data = os.urandom(200_000)
    f1 = ubiq.docs / "talk.bin"
    f1.write_bytes(data)
    ubiq.sync()
    f2 = device2.docs / "talk.bin"
    wait_for(lambda: f2.exists() and f2.stat().st_size == len(data), timeout=15, what="the file on device 2")
    cache_file = device2.container_dir() / "content" / str(os.stat(f2).st_ino)
    with open(f2, "rb") as reader:
        assert reader.read(1000) == data[:1000]
        f1.unlink()
        ubiq.sync()
        wait_for(lambda: not f2.exists(), timeout=15, what="the delete on device 2")
        assert os.fstat(reader.fileno()).st_size == len(data)
        assert reader.read() == data[1000:]
        assert cache_file.exists()
    wait_for(lambda: not cache_file.exists(), timeout=15, what="the cache file freed after the last close")


def test_a_new_version_from_another_device_shows_its_size_while_a_reader_holds_the_old_one(ubiq, device2):
    """`less f` on this device keeps the old version open while another device saves a longer
    one: `stat` and a new `cat` show the new version whole (a reader's descriptor of the old
    bytes must not decide the size the kernel reads up to)."""
    f1 = ubiq.docs / "notes.txt"
    f1.write_text("old\n")
    ubiq.sync()
    f2 = device2.docs / "notes.txt"
    wait_for(lambda: f2.exists() and f2.read_text() == "old\n", timeout=15, what="the file on device 2")
    new = "a much longer new version\n" * 10
    with open(f1, "rb") as reader:
        assert reader.read() == b"old\n"
        f2.write_text(new)
        device2.sync()
        wait_for(lambda: f1.stat().st_size == len(new), timeout=15, what="the new version's size on device 1")
        assert f1.read_text() == new


def test_a_log_rotated_while_it_is_written_syncs_before_the_writer_closes(ubiq, device2):
    """logrotate's default: the log a process keeps writing is renamed, a new log takes its name.
    The rename and the new file reach the other device while the writer still holds the old
    log; its unflushed lines follow when it closes."""
    log = ubiq.docs / "app.log"
    log.write_bytes(b"line 1\n")
    ubiq.sync()
    wait_for(lambda: (device2.docs / "app.log").exists(), timeout=15, what="the log on device 2")
    with open(log, "ab") as writer:
        writer.write(b"line 2\n")
        writer.flush()  # reaches the daemon as a write; no close or fsync yet
        os.rename(log, ubiq.docs / "app.log.1")
        log.write_bytes(b"new\n")
        wait_for(
            lambda: (device2.docs / "app.log").read_bytes() == b"new\n"
            and (device2.docs / "app.log.1").read_bytes() == b"line 1\n",
            timeout=15,
            what="the rotation on device 2 while the writer is open",
        )
        assert Ubiq.xattr(log, "user.ubiq.content_state") == "cached"
        assert Ubiq.xattr(ubiq.docs / "app.log.1", "user.ubiq.content_state") == "dirty"
    ubiq.sync()
    wait_for(
        lambda: (device2.docs / "app.log.1").read_bytes() == b"line 1\nline 2\n",
        timeout=15,
        what="the writer's lines on device 2 after its close",
    )
    assert sorted(p.name for p in device2.docs.iterdir()) == ["app.log", "app.log.1"]
