"""Conflicts between two devices (two real mounts on one cloud) never lose data: concurrent
edits keep a conflict version, edit beats delete, same-name creations become "name 2.ext",
rename and edit both survive, a file added in a directory deleted elsewhere is kept."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from conftest import Ubiq, another_device
from test_devices_and_content import wait_for

DELAY = ["--upload-delay-ms", "1500", "--pull-interval-ms", "100"]


@pytest.fixture
def pair(ubiq, tmp_path_factory):
    """Two devices of one account whose uploads wait 1.5 s, so edits can really be concurrent."""
    ubiq.unmount()
    ubiq.mount(*DELAY)
    with another_device(ubiq, tmp_path_factory, "peer") as d2:
        d2.mount(*DELAY)
        yield ubiq, d2


def settle(a: Ubiq, b: Ubiq, rounds: int = 2):
    """Both devices uploaded everything and pulled each other's changes."""
    for _ in range(rounds):
        a.sync(timeout=60)
        b.sync(timeout=60)
        time.sleep(0.6)


def read(p):
    with open(p, "rb") as f:
        return f.read()


def tree(u: Ubiq) -> dict:
    """Every path below Documents: None for a folder, the bytes for a file."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(u.docs):
        rel = os.path.relpath(dirpath, u.docs)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            out[os.path.normpath(os.path.join(rel, f))] = read(os.path.join(dirpath, f))
    return out


def versions(u: Ubiq, path):
    return json.loads(u.run("versions", path, "--json").stdout)


def test_concurrent_edits_keep_a_conflict_version(pair):
    a, b = pair
    (a.docs / "plan.txt").write_text("base\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "plan.txt").read_text() == "base\n", what="base on b")
    (a.docs / "plan.txt").write_text("edit from A\n")
    time.sleep(0.05)
    (b.docs / "plan.txt").write_text("edit from B (newer)\n")  # newest mtime wins
    settle(a, b)
    for u in (a, b):
        wait_for(lambda: read(u.docs / "plan.txt") == b"edit from B (newer)\n", what=f"winner on {u.root.name}")
        wait_for(lambda: Ubiq.xattr(u.docs / "plan.txt", "user.ubiq.conflicts") == "1", what="conflict count")
    vs = versions(a, a.docs / "plan.txt")
    assert [v["current"] for v in vs] == [True, False]
    # Each version names the device that wrote its content, whichever device merged them.
    assert vs[0]["device"] != vs[1]["device"]
    assert versions(b, b.docs / "plan.txt")[0]["device"] == vs[0]["device"]
    # Every version is readable.
    assert a.run("versions", a.docs / "plan.txt", "--cat", vs[1]["version"]).stdout == "edit from A\n"
    assert b.run("versions", b.docs / "plan.txt", "--cat", vs[1]["version"]).stdout == "edit from A\n"
    assert a.run("versions", a.docs / "plan.txt", "--cat", "current").stdout == "edit from B (newer)\n"
    assert versions(b, b.docs / "plan.txt")[1]["version"] == vs[1]["version"]
    # Keep the losing version: it becomes current everywhere, the conflict is gone.
    a.run("resolve", a.docs / "plan.txt", "--keep", vs[1]["version"])
    settle(a, b)
    for u in (a, b):
        wait_for(lambda: read(u.docs / "plan.txt") == b"edit from A\n", what=f"kept version on {u.root.name}")
        wait_for(lambda: Ubiq.xattr(u.docs / "plan.txt", "user.ubiq.conflicts") == "0", what="resolved")
    cp = a.run("resolve", a.docs / "plan.txt", "--keep", "v-nonexistent", check=False)
    assert cp.returncode != 0 and cp.stderr.startswith("ubiqfs:")


def test_deleting_a_file_keeps_the_other_devices_conflicting_edit(pair):
    """B's edit wins a concurrent edit (newer mtime), A's becomes a conflict version; B's user,
    who never saw A's edit, deletes the file: A's edit survives on both devices, as an edit
    survives a delete."""
    a, b = pair
    (a.docs / "memo.txt").write_text("base\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "memo.txt").read_text() == "base\n", what="base on b")
    (a.docs / "memo.txt").write_text("edit from A\n")
    time.sleep(0.05)
    (b.docs / "memo.txt").write_text("edit from B (newer)\n")
    settle(a, b)
    wait_for(lambda: Ubiq.xattr(b.docs / "memo.txt", "user.ubiq.conflicts") == "1", what="conflict on b")
    (b.docs / "memo.txt").unlink()
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: (u.docs / "memo.txt").exists() and read(u.docs / "memo.txt") == b"edit from A\n",
                 what=f"A's edit current on {u.root.name}")
        wait_for(lambda: Ubiq.xattr(u.docs / "memo.txt", "user.ubiq.conflicts") == "0", what="no version left")


def test_edit_beats_delete(pair):
    a, b = pair
    (a.docs / "keep.txt").write_text("v1\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "keep.txt").exists(), what="keep.txt on b")
    os.unlink(a.docs / "keep.txt")
    (b.docs / "keep.txt").write_text("edited on B\n")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: (u.docs / "keep.txt").exists() and read(u.docs / "keep.txt") == b"edited on B\n",
                 what=f"edit kept on {u.root.name}")


def test_same_new_name_on_both_devices(pair):
    a, b = pair
    (a.docs / "report.txt").write_text("from A\n")
    (b.docs / "report.txt").write_text("from B\n")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["report 2.txt", "report.txt"], what=f"two names on {u.root.name}")
    # Both devices agree which item has which name.
    assert a.item_id(a.docs / "report.txt") == b.item_id(b.docs / "report.txt")
    assert read(a.docs / "report.txt") == read(b.docs / "report.txt")
    assert read(a.docs / "report 2.txt") == read(b.docs / "report 2.txt")
    assert {read(a.docs / "report.txt"), read(a.docs / "report 2.txt")} == {b"from A\n", b"from B\n"}


@pytest.mark.parametrize("stem", ["x" * 251, "é" * 125 + "a"], ids=["ascii", "two-byte"])
def test_same_new_name_of_the_longest_length_on_both_devices(pair, stem):
    """Both devices create one name of 255 bytes: the later one's name loses characters of its
    stem to take its number (as ext4 would refuse a longer name, so does the cloud), is uploaded,
    and both devices end with both files under the same names."""
    a, b = pair
    name = stem + ".txt"
    assert len(name.encode()) == 255
    (a.docs / name).write_text("from A\n")
    (b.docs / name).write_text("from B\n")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: len(os.listdir(u.docs)) == 2, timeout=20, what=f"two names on {u.root.name}")
        assert u.status()[0]["queue"]["failing"] == [], u.run("status").stdout
    names = sorted(os.listdir(a.docs))
    assert names == sorted(os.listdir(b.docs))
    assert all(len(n.encode()) <= 255 for n in names), names
    other = next(n for n in names if n != name)
    assert other.endswith(" 2.txt") and name.startswith(other[: -len(" 2.txt")]), other
    assert {read(a.docs / n) for n in names} == {b"from A\n", b"from B\n"}
    assert all(read(a.docs / n) == read(b.docs / n) for n in names)


def test_rename_and_edit_both_survive(pair):
    a, b = pair
    (a.docs / "draft.txt").write_text("one\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "draft.txt").exists(), what="draft on b")
    os.rename(a.docs / "draft.txt", a.docs / "final.txt")
    (b.docs / "draft.txt").write_text("two\n")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["final.txt"], what=f"rename on {u.root.name}")
        wait_for(lambda: read(u.docs / "final.txt") == b"two\n", what=f"edit on {u.root.name}")


def test_file_added_in_directory_deleted_elsewhere_is_kept(pair):
    a, b = pair
    (a.docs / "proj").mkdir()
    (a.docs / "proj" / "old.txt").write_text("old\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "proj" / "old.txt").exists(), what="proj on b")
    shutil.rmtree(a.docs / "proj")
    (b.docs / "proj" / "new.txt").write_text("new work\n")
    settle(a, b, rounds=4)
    for u in (a, b):
        wait_for(lambda: (u.docs / "proj" / "new.txt").exists(), timeout=15, what=f"new.txt kept on {u.root.name}")
        assert read(u.docs / "proj" / "new.txt") == b"new work\n"


def test_edit_beats_a_delete_that_waits_to_upload(pair):
    """A deletes (its upload waits 1.5 s); B, which uploads at once, edits. A's pull sees the
    edit while A's delete is still queued; the cloud then refuses the delete. The edit wins,
    and A gets the file back."""
    a, b = pair
    b.unmount()
    b.mount("--upload-delay-ms", "0", "--pull-interval-ms", "100")
    (a.docs / "f.txt").write_text("v1\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "f.txt").exists(), what="f.txt on b")
    os.unlink(a.docs / "f.txt")
    (b.docs / "f.txt").write_text("edited on B\n")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: (u.docs / "f.txt").exists() and read(u.docs / "f.txt") == b"edited on B\n",
                 timeout=15, what=f"edit kept on {u.root.name}")
        assert u.status()[0]["queue"]["pendingItems"] == 0


def test_crossed_folder_moves_lose_nothing(pair):
    """A moves X into Y; 0.3 s later, before A's move arrives, B moves Y into X. Each move is
    valid where it is made; the cloud takes A's first, B's is undone, and every folder and file
    stays visible on both devices."""
    a, b = pair
    for name in ("X", "Y"):
        (a.docs / name).mkdir()
        (a.docs / name / f"in-{name}.txt").write_text(f"inside {name}\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "Y" / "in-Y.txt").exists(), what="folders on b")
    os.rename(a.docs / "X", a.docs / "Y" / "X")
    time.sleep(0.3)
    os.rename(b.docs / "Y", b.docs / "X" / "Y")
    settle(a, b, rounds=4)
    want = {"Y": None, "Y/in-Y.txt": b"inside Y\n", "Y/X": None, "Y/X/in-X.txt": b"inside X\n"}

    for u in (a, b):
        wait_for(lambda: tree(u) == want, timeout=20, what=f"A's move everywhere on {u.root.name}: {tree(u)}")
        status = u.status()[0]
        assert status["queue"]["pendingItems"] == 0 and not status["queue"]["failing"], status


def test_a_process_inside_crossed_moves_moves_a_folder_between_them(pair):
    """A moves X into Y while B, before that arrives, moves Y into X; a process on B that holds
    both folders open moves X/sub into Y through its descriptors, while B's move waits to be
    refused and undone. No request hangs, and both devices end with A's move and sub in Y."""
    import threading

    a, b = pair
    for name in ("X", "Y"):
        (a.docs / name).mkdir()
        (a.docs / name / f"in-{name}.txt").write_text(f"inside {name}\n")
    (a.docs / "X" / "sub").mkdir()
    (a.docs / "X" / "sub" / "deep.txt").write_text("deep\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "X" / "sub" / "deep.txt").exists(), what="folders on b")
    os.rename(a.docs / "X", a.docs / "Y" / "X")
    time.sleep(0.3)
    os.rename(b.docs / "Y", b.docs / "X" / "Y")
    fd_x = os.open(b.docs / "X", os.O_RDONLY | os.O_DIRECTORY)
    fd_y = os.open(b.docs / "X" / "Y", os.O_RDONLY | os.O_DIRECTORY)
    try:
        def move_sub():
            os.rename("sub", "sub", src_dir_fd=fd_x, dst_dir_fd=fd_y)

        mover = threading.Thread(target=move_sub, daemon=True)
        mover.start()
        mover.join(timeout=20)
        assert not mover.is_alive(), "renameat through the folders' descriptors hangs"
        settle(a, b, rounds=4)
        # The descriptors still name the folders, wherever they ended.
        assert sorted(os.listdir(fd_y)) == ["X", "in-Y.txt", "sub"]
    finally:
        os.close(fd_x)
        os.close(fd_y)
    want = {
        "Y": None, "Y/in-Y.txt": b"inside Y\n", "Y/X": None, "Y/X/in-X.txt": b"inside X\n", "Y/sub": None,
        "Y/sub/deep.txt": b"deep\n",
    }
    for u in (a, b):
        wait_for(lambda: tree(u) == want, timeout=20, what=f"A's move and sub in Y on {u.root.name}: {tree(u)}")
        status = u.status()[0]
        assert status["queue"]["pendingItems"] == 0 and not status["queue"]["failing"], status


def test_crossed_moves_that_need_two_moves_undone_converge(pair):
    """A moves d4 below d2/d3/d7; 0.3 s later, before that arrives, B moves d3 into d4 and then
    d2 below d3 (two moves, each valid where it is made). The cloud takes A's move; on B,
    putting d3 back needs d2 put back first. Both devices end with A's tree, every file in it,
    and empty queues."""
    a, b = pair
    (a.docs / "d2" / "d3" / "d7").mkdir(parents=True)
    (a.docs / "d4").mkdir()
    (a.docs / "d2" / "d3" / "d7" / "keep.txt").write_text("keep\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "d2" / "d3" / "d7" / "keep.txt").exists(), what="folders on b")
    os.rename(a.docs / "d4", a.docs / "d2" / "d3" / "d7" / "d4")
    time.sleep(0.3)
    os.rename(b.docs / "d2" / "d3", b.docs / "d4" / "d3")
    os.rename(b.docs / "d2", b.docs / "d4" / "d3" / "d7" / "d2")
    settle(a, b, rounds=4)
    want = {"d2": None, "d2/d3": None, "d2/d3/d7": None, "d2/d3/d7/d4": None, "d2/d3/d7/keep.txt": b"keep\n"}

    for u in (a, b):
        wait_for(lambda: tree(u) == want, timeout=20, what=f"A's move everywhere on {u.root.name}: {tree(u)}")
        status = u.status()[0]
        assert status["queue"]["pendingItems"] == 0 and not status["queue"]["failing"], status


@pytest.mark.parametrize("a_moves", [True, False], ids=["a-moves-b-deletes", "b-moves-a-deletes"])
def test_a_move_beats_a_delete(pair, a_moves):
    """One device moves a file into a folder while the other, which has not seen the move,
    deletes it. A move is an edit of the file's place, and an edit beats a delete: whichever
    reaches the cloud first, the file ends in its new place on both devices, with its bytes."""
    a, b = pair
    (a.docs / "sub").mkdir()
    (a.docs / "m.txt").write_text("moved, not lost\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "m.txt").exists(), what="m.txt on b")
    mover, deleter = (a, b) if a_moves else (b, a)
    os.rename(mover.docs / "m.txt", mover.docs / "sub" / "m.txt")
    os.unlink(deleter.docs / "m.txt")
    settle(a, b, rounds=3)
    want = {"sub": None, "sub/m.txt": b"moved, not lost\n"}
    for u in (a, b):
        wait_for(lambda: tree(u) == want, timeout=20, what=f"the moved file on {u.root.name}: {tree(u)}")
        status = u.status()[0]
        assert status["queue"]["pendingItems"] == 0 and not status["queue"]["failing"], status


def test_two_files_renamed_to_one_name_are_both_kept(pair):
    """Each device renames a different file to the same new name before it sees the other's
    rename. Both files stay: the rename that reaches the cloud later gets "name 2", and both
    devices agree which file has which name."""
    a, b = pair
    (a.docs / "x.txt").write_text("x\n")
    (a.docs / "y.txt").write_text("y\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "y.txt").exists(), what="x and y on b")
    os.rename(a.docs / "x.txt", a.docs / "final.txt")
    os.rename(b.docs / "y.txt", b.docs / "final.txt")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: sorted(tree(u)) == ["final 2.txt", "final.txt"], timeout=20,
                 what=f"two names on {u.root.name}: {tree(u)}")
    assert tree(a) == tree(b)
    assert sorted(tree(a).values()) == [b"x\n", b"y\n"]
    assert a.item_id(a.docs / "final 2.txt") == b.item_id(b.docs / "final 2.txt")


def test_a_folder_moved_up_and_then_removed_with_its_parent_stays_removed(pair):
    """A moves e/d/e up into e and removes e with everything in it before either reaches the
    cloud, deleting e/d first (as rm -r may). The cloud still has e/e inside e/d when e/d's
    delete arrives and refuses it (not empty); the delete waits for e/e's, and nothing comes
    back on either device."""
    a, b = pair
    (a.docs / "e" / "d" / "e").mkdir(parents=True)
    (a.docs / "e" / "d" / "e" / "x.txt").write_text("x\n")
    (a.docs / "keep.txt").write_text("keep\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "e" / "d" / "e" / "x.txt").exists(), what="folders on b")
    os.rename(a.docs / "e" / "d" / "e", a.docs / "e" / "e")
    os.rmdir(a.docs / "e" / "d")
    shutil.rmtree(a.docs / "e")
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: tree(u) == {"keep.txt": b"keep\n"}, timeout=20, what=f"e gone on {u.root.name}: {tree(u)}")
        status = u.status()[0]
        assert status["queue"]["pendingItems"] == 0 and not status["queue"]["failing"], status


def test_a_swap_that_arrives_while_the_moved_file_is_open_for_writing_keeps_its_names(pair):
    """B appends to a every 100 ms while A swaps a and b (mv a t; mv b a; mv t b). Once the
    writer closes and everything syncs, every device shows the swap with all of B's lines in
    the file now called b: no temporary "(moving ...)" name stays."""
    import threading

    a, b = pair
    (a.docs / "a").write_text("a\n")
    (a.docs / "b").write_text("b\n")
    settle(a, b)
    wait_for(lambda: sorted(os.listdir(b.docs)) == ["a", "b"], what="a and b on b")
    assert read(b.docs / "a") == b"a\n"

    def append():
        with open(b.docs / "a", "a") as f:
            for i in range(40):
                f.write(f"line{i}\n")
                f.flush()
                time.sleep(0.1)

    writer = threading.Thread(target=append)
    writer.start()
    time.sleep(1)
    os.rename(a.docs / "a", a.docs / "t")
    os.rename(a.docs / "b", a.docs / "a")
    os.rename(a.docs / "t", a.docs / "b")
    writer.join()
    settle(a, b, rounds=3)
    lines = b"a\n" + b"".join(f"line{i}\n".encode() for i in range(40))
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["a", "b"], timeout=30,
                 what=f"the two names on {u.root.name}: {sorted(os.listdir(u.docs))}")
        wait_for(lambda: read(u.docs / "b") == lines and read(u.docs / "a") == b"b\n", timeout=30,
                 what=f"the swapped files on {u.root.name}")


@pytest.mark.parametrize("how", ["atomic save", "truncate", "truncate, chmod here"])
def test_a_reader_reads_the_whole_version_it_opened_while_another_device_makes_the_file_smaller(pair, how):
    """B reads a file slowly while A saves a smaller version of it (an editor's atomic save, or
    truncate). B's reader reads every byte of the version it opened, with no early end of file
    (the kernel's size of the file stays the one it reads); `ubiqfs status` names the file
    whose newer version waits, which appears on B once the reader has closed."""
    a, b = pair
    old = os.urandom(8 << 20)
    (a.docs / "big.bin").write_bytes(old)
    settle(a, b)
    wait_for(lambda: (b.docs / "big.bin").exists(), what="big.bin on b")
    with open(b.docs / "big.bin", "rb") as reader:
        first = reader.read(1 << 20)
        if how == "atomic save":
            (a.docs / "big.bin.tmp").write_bytes(b"smaller\n")
            os.rename(a.docs / "big.bin.tmp", a.docs / "big.bin")
        else:
            os.truncate(a.docs / "big.bin", 1 << 20)
        (a.docs / "marker").write_text("after\n")
        a.sync(timeout=60)
        wait_for(lambda: (b.docs / "marker").exists(), timeout=20, what="b pulled A's changes")
        status = b.run("status").stdout
        assert "waits for Documents/big.bin to be uploaded, or closed by the processes reading it" in status, status
        if how == "truncate, chmod here":
            # A change here waits with the smaller version: its merge would replace the content.
            os.chmod(b.docs / "big.bin", 0o600)
            time.sleep(3)
        rest = reader.read()
    assert len(first) + len(rest) == len(old), f"the reader read {len(first) + len(rest)} of {len(old)} bytes"
    assert first + rest == old
    new = b"smaller\n" if how == "atomic save" else old[: 1 << 20]
    wait_for(lambda: read(b.docs / "big.bin") == new, timeout=20, what="the new version on b after the close")
    if how == "truncate, chmod here":
        settle(a, b)
        for u in (a, b):
            wait_for(lambda: read(u.docs / "big.bin") == new and os.stat(u.docs / "big.bin").st_mode & 0o777 == 0o600,
                     timeout=20, what=f"the smaller version and b's chmod on {u.root.name}")


def test_a_file_saved_with_a_backup_again_and_again_stays_on_the_other_device(pair):
    """A saves f as vim does (`mv f f~`, write a new f, `rm f~`) every 0.4 s for 8 s. B has f
    the whole time, never an f~, and gets newer versions while the saves go on (the new file
    takes f's identity when the backup goes: an edit of f, not a delete and a new file); when
    they stop, both devices have the last save, with no conflict version."""
    a, b = pair
    (a.docs / "f").write_text("version 0\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "f").exists(), what="f on b")
    seen, missing, backups = set(), 0, 0
    end = time.time() + 8
    i = 0
    while time.time() < end:
        i += 1
        os.rename(a.docs / "f", a.docs / "f~")
        (a.docs / "f").write_text(f"version {i}\n")
        os.unlink(a.docs / "f~")
        stop = time.time() + 0.4
        while time.time() < stop:
            try:
                seen.add(read(b.docs / "f"))
            except FileNotFoundError:
                missing += 1
            backups += (b.docs / "f~").exists()
            time.sleep(0.05)
    assert missing == 0, f"f was missing on b {missing} times while a saved it"
    assert backups == 0, f"b saw the backup f~ {backups} times"
    assert len(seen - {b"version 0\n"}) >= 1, f"b got no newer version while a saved: {seen}"
    settle(a, b)
    last = f"version {i}\n".encode()
    for u in (a, b):
        wait_for(lambda: tree(u) == {"f": last}, timeout=20, what=f"the last save alone on {u.root.name}")
        assert Ubiq.xattr(u.docs / "f", "user.ubiq.conflicts") == "0"


def test_an_edit_elsewhere_during_a_slow_save_that_keeps_a_backup_is_kept(pair):
    """A saves f as vim does (`mv f f~`, open a new f, write, fsync, `rm f~`, close), the
    writing taking 3 s, longer than the upload delay; 1 s in, B writes f. B's write is kept
    (current or a conflict version of f, on both devices), B never sees f~, and f never
    leaves B."""
    a, b = pair
    (a.docs / "f").write_text("version 0\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "f").exists(), what="f on b")
    os.rename(a.docs / "f", a.docs / "f~")
    fd = os.open(a.docs / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    missing = backups = 0
    for i in range(6):
        os.write(fd, f"A line {i}\n".encode())
        stop = time.time() + 0.5
        while time.time() < stop:
            missing += not (b.docs / "f").exists()
            backups += (b.docs / "f~").exists()
            time.sleep(0.05)
        if i == 1:
            (b.docs / "f").write_text("B edit\n")
    os.fsync(fd)
    os.unlink(a.docs / "f~")
    os.close(fd)
    settle(a, b, rounds=3)
    assert missing == 0 and backups == 0, f"on b while a saved: f missing {missing} times, f~ seen {backups} times"
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["f"], timeout=20, what=f"f alone on {u.root.name}")
        kept = {u.run("versions", u.docs / "f", "--cat", v["version"]).stdout for v in versions(u, u.docs / "f")}
        kept.add(read(u.docs / "f").decode())
        assert "B edit\n" in kept, f"b's write is gone on {u.root.name}: {kept}"
        assert "".join(f"A line {i}\n" for i in range(6)) in kept, kept
