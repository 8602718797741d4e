"""The command line: status, sync, find, and how bad input is refused."""

from __future__ import annotations

import os

import pytest

from conftest import Ubiq, ubiq_mounts
from helpers import write_file


def assert_one_line_error(cp, *must_contain: str) -> None:
    """Non-zero exit, nothing mounted by accident, one `ubiqfs: ...` line on stderr."""
    assert cp.returncode != 0, f"expected failure, got exit 0 (stdout: {cp.stdout!r})"
    err = cp.stderr.strip()
    assert err.startswith("ubiqfs:"), f"stderr should start with 'ubiqfs:': {cp.stderr!r}"
    assert "\n" not in err, f"stderr should be one line: {cp.stderr!r}"
    for text in must_contain:
        assert text in err, f"{text!r} not in {err!r}"


# ---------------------------------------------------------------------------- status / sync


def test_status_json_after_sync_shows_nothing_pending(ubiq):
    for i in range(5):
        write_file(ubiq.docs / f"f{i}.txt", f"file {i}\n" * 1000)
    ubiq.sync()
    reports = ubiq.status()
    assert len(reports) == 1
    r = reports[0]
    assert r["container"] == "iCloud.default"
    assert r["account"] == ubiq.account
    assert r["mountpoint"] == str(ubiq.mnt)
    assert r["pid"] == ubiq.daemon_record()["pid"]
    assert r["queue"]["pendingItems"] == 0
    assert r["queue"]["pendingDeletes"] == 0
    assert r["queue"]["pendingBytes"] == 0
    assert r["queue"]["failing"] == []
    # The same through a path inside the mount, and as text.
    assert ubiq.status(ubiq.docs / "f1.txt") == reports
    assert "all changes uploaded" in ubiq.run("status").stdout


def test_status_shows_pending_uploads_until_synced(ubiq):
    ubiq.remount("--upload-delay-ms", "600000")
    write_file(ubiq.docs / "waiting.bin", os.urandom(10_000))
    q = ubiq.status()[0]["queue"]
    assert q["pendingItems"] >= 1
    assert q["pendingBytes"] >= 10_000
    assert ubiq.xattr(ubiq.docs / "waiting.bin", "user.ubiq.uploaded") == "0"
    assert ubiq.xattr(ubiq.docs / "waiting.bin", "user.ubiq.uploading") == "1"
    assert "pending" in ubiq.run("status").stdout
    # sync makes waiting entries due now.
    ubiq.sync()
    q = ubiq.status()[0]["queue"]
    assert (q["pendingItems"], q["pendingDeletes"], q["pendingBytes"]) == (0, 0, 0)
    assert ubiq.xattr(ubiq.docs / "waiting.bin", "user.ubiq.uploaded") == "1"


def test_status_after_unmount_shows_container_not_mounted(ubiq):
    write_file(ubiq.docs / "a.txt", "a")
    ubiq.sync()
    ubiq.unmount()
    reports = ubiq.status()
    assert len(reports) == 1
    assert reports[0].get("mountpoint") is None
    assert "not mounted" in ubiq.run("status").stdout
    ubiq.mount()


def test_sync_wait_on_a_path(ubiq):
    (ubiq.docs / "sub").mkdir()
    write_file(ubiq.docs / "sub" / "x.txt", "x")
    ubiq.sync(ubiq.docs / "sub")
    assert ubiq.xattr(ubiq.docs / "sub" / "x.txt", "user.ubiq.uploaded") == "1"
    assert ubiq.cloud_content(ubiq.item_id(ubiq.docs / "sub" / "x.txt")) == b"x"


# ---------------------------------------------------------------------------- find


def test_find_glob(ubiq):
    (ubiq.docs / "sub" / "deeper").mkdir(parents=True)
    for rel in ["a.txt", "sub/b.txt", "sub/deeper/c.txt", "notes.md", "sub/d.txt.bak"]:
        write_file(ubiq.docs / rel, rel)
    out = ubiq.run("find", "*.txt").stdout.splitlines()
    expected = {str(ubiq.docs / r) for r in ["a.txt", "sub/b.txt", "sub/deeper/c.txt"]}
    assert set(out) == expected
    assert len(out) == len(expected)
    assert all(os.path.isabs(p) and os.path.exists(p) for p in out)
    assert ubiq.run("find", "notes.*", "--container", "iCloud.default").stdout.split() == [str(ubiq.docs / "notes.md")]
    assert ubiq.run("find", "deeper").stdout.split() == [str(ubiq.docs / "sub" / "deeper")]
    # A renamed file is found under its new name only.
    os.rename(ubiq.docs / "a.txt", ubiq.docs / "sub" / "renamed.txt")
    out = set(ubiq.run("find", "*.txt").stdout.splitlines())
    assert str(ubiq.docs / "sub" / "renamed.txt") in out and str(ubiq.docs / "a.txt") not in out


def test_find_nothing_exits_1(ubiq):
    write_file(ubiq.docs / "a.txt", "a")
    cp = ubiq.run("find", "*.nomatch", check=False)
    assert cp.returncode == 1
    assert cp.stdout == ""
    cp = ubiq.run("find", "*.txt", "--container", "iCloud.com.example.other", check=False)
    assert cp.returncode == 1 and cp.stdout == ""


def test_find_bad_container_id(ubiq):
    assert_one_line_error(ubiq.run("find", "*", "--container", "bad/id", check=False), "bad/id")


# ---------------------------------------------------------------------------- mount / unmount


@pytest.mark.parametrize("bad", ["bad/id", "nodots", ".leading", "trailing.", "two..dots", "sp ace.x", ""])
def test_mount_with_bad_container_id(ubiq, bad):
    mnt = ubiq.root / "m"
    mnt.mkdir()
    cp = ubiq.run("mount", bad, mnt, check=False)
    assert_one_line_error(cp)
    assert str(mnt) not in ubiq_mounts()


def test_mount_at_missing_directory(ubiq):
    missing = ubiq.root / "does" / "not" / "exist"
    cp = ubiq.run("mount", "iCloud.com.example.other", missing, check=False)
    assert_one_line_error(cp, str(missing))
    assert not missing.exists()
    assert str(missing) not in ubiq_mounts()


def test_mount_on_a_regular_file(ubiq):
    f = ubiq.root / "file"
    f.write_text("x")
    cp = ubiq.run("mount", "iCloud.com.example.other", f, check=False)
    assert_one_line_error(cp)
    assert str(f) not in ubiq_mounts()


def test_mount_same_container_twice(ubiq):
    second = ubiq.root / "second"
    second.mkdir()
    cp = ubiq.run("mount", "iCloud.default", second, check=False)
    assert_one_line_error(cp, str(ubiq.mnt))
    assert str(second) not in ubiq_mounts()
    # The first mount is unharmed.
    write_file(ubiq.docs / "still.txt", "works")
    assert (ubiq.docs / "still.txt").read_text() == "works"
    assert ubiq.status()[0]["mountpoint"] == str(ubiq.mnt)


def test_mount_on_an_existing_mount(ubiq):
    cp = ubiq.run("mount", "iCloud.com.example.other", ubiq.mnt, check=False)
    assert_one_line_error(cp)
    assert ubiq_mounts().count(str(ubiq.mnt)) == 1
    assert os.listdir(ubiq.mnt) == ["Documents"]


def test_two_containers_side_by_side(ubiq):
    # Extra mount points live under the test's root, so teardown finds them whatever happens.
    other = Ubiq(ubiq.root, container="iCloud.com.example.notes")
    other.mnt = ubiq.root / "notes"
    other.mnt.mkdir()
    other.mount()
    try:
        write_file(ubiq.docs / "default.txt", "d")
        write_file(other.docs / "notes.txt", "n")
        assert os.listdir(ubiq.docs) == ["default.txt"]
        assert os.listdir(other.docs) == ["notes.txt"]
        assert other.xattr(other.docs / "notes.txt", "user.ubiq.container") == "iCloud.com.example.notes"
        ubiq.sync()
        mounted = {r["container"]: r["mountpoint"] for r in ubiq.status()}
        assert mounted == {"iCloud.default": str(ubiq.mnt), "iCloud.com.example.notes": str(other.mnt)}
        assert ubiq.run("find", "*.txt", "--container", "iCloud.com.example.notes").stdout.split() == [
            str(other.docs / "notes.txt")
        ]
        assert {i["name"] for i in ubiq.cloud_items("iCloud.com.example.notes", include_deleted=False)} >= {"notes.txt"}
        assert "notes.txt" not in {i["name"] for i in ubiq.cloud_items(include_deleted=False)}
    finally:
        other.unmount()


def test_unmount_of_a_non_mount(ubiq, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert_one_line_error(ubiq.run("unmount", plain, check=False), str(plain))
    assert_one_line_error(ubiq.run("unmount", tmp_path / "missing", check=False))
    # After a real unmount, a second one fails too.
    ubiq.unmount()
    assert_one_line_error(ubiq.run("unmount", ubiq.mnt, check=False))
    ubiq.mount()


def test_unmount_busy_mount_is_refused_then_lazy_works(ubiq):
    f = ubiq.docs / "held.txt"
    write_file(f, "held")
    with open(f, "rb") as held:
        cp = ubiq.run("unmount", ubiq.mnt, check=False)
        assert_one_line_error(cp, "busy")
        assert str(ubiq.mnt) in ubiq_mounts()
        assert held.read() == b"held"
    ubiq.unmount()
    assert str(ubiq.mnt) not in ubiq_mounts()
    ubiq.mount()
    # --lazy detaches even with an open file.
    held = open(ubiq.docs / "held.txt", "rb")
    try:
        ubiq.run("unmount", "--lazy", ubiq.mnt)
        assert str(ubiq.mnt) not in ubiq_mounts()
    finally:
        held.close()


def test_status_and_sync_outside_a_mount(ubiq, tmp_path):
    assert_one_line_error(ubiq.run("status", tmp_path, check=False))
    assert_one_line_error(ubiq.run("sync", "--wait", tmp_path, check=False))
    ubiq.unmount()
    assert_one_line_error(ubiq.run("sync", "--wait", check=False))
    ubiq.mount()


def test_usage_errors_exit_non_zero(ubiq, tmp_path):
    for args in (["mount"], ["mount", "a.b", "c", "d"], ["bogus"], ["mount", "--upload-delay-ms=-5", tmp_path]):
        cp = ubiq.run(*args, check=False)
        assert cp.returncode != 0, args
        assert cp.stderr.strip(), args
    assert len(ubiq_mounts()) == len(set(ubiq_mounts()))
