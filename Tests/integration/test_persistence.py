"""What survives an unmount and a new mount: tree, content, metadata, inodes, queued uploads."""

from __future__ import annotations

import os
import random

from helpers import read_file, sha256, sha256_file, tree_snapshot, write_file


def build_tree(top) -> None:
    rng = random.Random(3)
    (top / "docs" / "drafts").mkdir(parents=True)
    (top / "empty-dir").mkdir()
    (top / "media").mkdir()
    write_file(top / "README", "read me\n")
    write_file(top / "docs" / "a.md", "# A\n" * 100)
    write_file(top / "docs" / "drafts" / "b.md", "")
    write_file(top / "media" / "noise.bin", rng.randbytes(2_500_000))
    write_file(top / "run.sh", "#!/bin/sh\n")
    os.chmod(top / "run.sh", 0o700)
    os.chmod(top / "docs" / "drafts", 0o750)
    os.symlink("docs/a.md", top / "a-link")
    os.symlink("/outside/target", top / "docs" / "abs-link")
    os.setxattr(top / "README", "user.lang", b"en")
    os.setxattr(top / "docs", "user.kind", b"folder")
    os.utime(top / "README", ns=(1_000_000_000_000_000_000, 1_111_111_111_222_333_444))


def test_tree_and_content_after_remount(ubiq):
    build_tree(ubiq.docs)
    before = tree_snapshot(ubiq.docs, with_inodes=True)
    ubiq.remount()
    assert tree_snapshot(ubiq.docs, with_inodes=True) == before
    # Again after everything was uploaded.
    ubiq.sync()
    ubiq.remount()
    assert tree_snapshot(ubiq.docs, with_inodes=True) == before


def test_stable_inodes_across_remount(ubiq):
    build_tree(ubiq.docs)
    paths = [ubiq.mnt, ubiq.docs, *sorted(ubiq.docs.rglob("*"))]
    inodes = {str(p): os.lstat(p).st_ino for p in paths}
    assert len(set(inodes.values())) == len(inodes), "inode numbers must be unique"
    ubiq.remount()
    assert {str(p): os.lstat(p).st_ino for p in paths} == inodes
    # Renames keep the inode, before and after a remount.
    os.rename(ubiq.docs / "README", ubiq.docs / "docs" / "README.old")
    assert os.lstat(ubiq.docs / "docs" / "README.old").st_ino == inodes[str(ubiq.docs / "README")]
    ubiq.remount()
    assert os.lstat(ubiq.docs / "docs" / "README.old").st_ino == inodes[str(ubiq.docs / "README")]
    # readdir reports the same numbers as stat.
    for entry in os.scandir(ubiq.docs / "docs"):
        assert entry.inode() == os.lstat(entry.path).st_ino


def test_uploaded_state_survives_remount(ubiq):
    write_file(ubiq.docs / "f.txt", "uploaded once")
    ubiq.sync()
    item_id, etag = ubiq.item_id(ubiq.docs / "f.txt"), ubiq.xattr(ubiq.docs / "f.txt", "user.ubiq.etag")
    ubiq.remount()
    assert ubiq.item_id(ubiq.docs / "f.txt") == item_id
    assert ubiq.xattr(ubiq.docs / "f.txt", "user.ubiq.etag") == etag
    assert ubiq.xattr(ubiq.docs / "f.txt", "user.ubiq.uploaded") == "1"
    q = ubiq.status()[0]["queue"]
    assert (q["pendingItems"], q["pendingDeletes"]) == (0, 0), "a remount must not re-upload"


def test_queued_uploads_survive_unmount(ubiq):
    ubiq.remount("--upload-delay-ms", "600000")
    data = os.urandom(700_000)
    write_file(ubiq.docs / "queued.bin", data)
    os.mkdir(ubiq.docs / "queued-dir")
    assert ubiq.status()[0]["queue"]["pendingItems"] >= 2
    ubiq.unmount()
    assert "queued.bin" not in {i["name"] for i in ubiq.cloud_items()}
    assert ubiq.status()[0]["queue"]["pendingItems"] >= 2  # readable while unmounted
    ubiq.mount()
    ubiq.sync()
    assert sha256(ubiq.cloud_content(ubiq.item_id(ubiq.docs / "queued.bin"))) == sha256(data)
    assert ubiq.cloud_item_for(ubiq.docs / "queued-dir")["kind"] == 2


def test_content_written_just_before_unmount_is_kept(ubiq):
    data = os.urandom(3 * 1024 * 1024)
    with open(ubiq.docs / "last.bin", "wb") as f:
        f.write(data)
    ubiq.remount()
    assert sha256_file(ubiq.docs / "last.bin") == sha256(data)
    ubiq.sync()
    assert sha256(ubiq.cloud_content(ubiq.item_id(ubiq.docs / "last.bin"))) == sha256(data)


def test_deletes_and_renames_survive_remount(ubiq):
    build_tree(ubiq.docs)
    ubiq.sync()
    os.unlink(ubiq.docs / "README")
    os.rename(ubiq.docs / "docs", ubiq.docs / "documents-renamed")
    os.rmdir(ubiq.docs / "empty-dir")
    expected = tree_snapshot(ubiq.docs, with_inodes=True)
    ubiq.remount()
    assert tree_snapshot(ubiq.docs, with_inodes=True) == expected
    assert not (ubiq.docs / "README").exists()
    assert read_file(ubiq.docs / "documents-renamed" / "a.md") == b"# A\n" * 100
