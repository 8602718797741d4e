"""Real tools in the mount: big files, many files, git, editors' saves, cp -a, rsync, sqlite3."""

from __future__ import annotations

import os
import random
import shutil
import stat

import pytest

from helpers import read_file, sh, sha256, sha256_file, tree_snapshot, write_file

MiB = 1 << 20


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# ---------------------------------------------------------------------------- size and count


def test_large_file_survives_remount(ubiq):
    data = random_bytes(20 * MiB, seed=20)
    p = ubiq.docs / "big.bin"
    # Written in odd-sized pieces, the way tools do.
    with open(p, "wb") as f:
        view = memoryview(data)
        for off in range(0, len(data), 777_777):
            f.write(view[off : off + 777_777])
    assert os.stat(p).st_size == len(data)
    assert sha256_file(p) == sha256(data)
    sh("cp", p, ubiq.docs / "copy.bin")
    sh("cmp", p, ubiq.docs / "copy.bin")
    ubiq.remount()
    assert os.stat(p).st_size == len(data)
    assert sha256_file(p) == sha256(data)
    assert sha256_file(ubiq.docs / "copy.bin") == sha256(data)


def test_large_file_via_dd(ubiq):
    p = ubiq.docs / "dd.bin"
    sh("dd", "if=/dev/urandom", f"of={p}", "bs=1M", "count=8", "status=none")
    assert os.stat(p).st_size == 8 * MiB
    before = sha256_file(p)
    # Overwrite one block in place (conv=notrunc) and check only it changed.
    sh("dd", "if=/dev/zero", f"of={p}", "bs=4096", "count=1", "seek=100", "conv=notrunc", "status=none")
    data = read_file(p)
    assert len(data) == 8 * MiB
    assert data[100 * 4096 : 101 * 4096] == b"\0" * 4096
    assert sha256(data) != before
    ubiq.remount()
    assert sha256_file(p) == sha256(data)


def test_many_files_readdir_complete(ubiq):
    d = ubiq.docs / "many"
    d.mkdir()
    names = {f"file-{i:04d}-{'x' * (i % 40)}.txt" for i in range(500)}
    for n in names:
        write_file(d / n, n)
    assert set(os.listdir(d)) == names
    assert len(os.listdir(d)) == 500
    ls = sh("ls", "-1", d).stdout.split("\n")[:-1]
    assert sorted(ls) == sorted(names)
    assert len(ls) == 500
    assert int(sh("sh", "-c", f"ls -f '{d}' | wc -l").stdout) == 502  # with . and ..
    # Remove half while listing stays consistent.
    removed = sorted(names)[::2]
    for n in removed:
        os.unlink(d / n)
    assert set(os.listdir(d)) == names - set(removed)
    ubiq.remount()
    assert set(os.listdir(d)) == names - set(removed)
    for n in sorted(names - set(removed))[:20]:
        assert read_file(d / n) == n.encode()


# ---------------------------------------------------------------------------- git


def git(repo, *args, check=True):
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME="Test", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="Test",
        GIT_COMMITTER_EMAIL="t@example.com", GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null",
    )
    return sh("git", *args, cwd=repo, check=check, env=env)


def test_git_commit_status_log_across_remount(ubiq):
    repo = ubiq.docs / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write_file(repo / "README.md", "# hello\n")
    (repo / "src").mkdir()
    write_file(repo / "src" / "main.c", "int main(void) { return 0; }\n")
    os.symlink("README.md", repo / "link")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    write_file(repo / "README.md", "# hello\nmore\n")
    git(repo, "commit", "-q", "-am", "second")
    assert git(repo, "status", "--porcelain").stdout == ""
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    ubiq.remount()
    assert git(repo, "status", "--porcelain").stdout == ""
    log = git(repo, "log", "--format=%s").stdout.split()
    assert log == ["second", "first"]
    assert git(repo, "rev-parse", "HEAD").stdout.strip() == head
    git(repo, "fsck", "--strict")
    # Branches, checkout and gc (packs, renames over existing files) keep working.
    git(repo, "checkout", "-q", "-b", "topic")
    write_file(repo / "new.txt", "n\n")
    git(repo, "add", "new.txt")
    git(repo, "commit", "-q", "-m", "third")
    git(repo, "checkout", "-q", "main")
    assert not (repo / "new.txt").exists()
    git(repo, "merge", "-q", "topic")
    git(repo, "gc", "-q")
    assert git(repo, "status", "--porcelain").stdout == ""
    assert git(repo, "log", "--format=%s").stdout.split() == ["third", "second", "first"]


def test_git_clone_of_a_repo_in_the_mount(ubiq, tmp_path):
    src = ubiq.docs / "origin"
    src.mkdir()
    git(src, "init", "-q", "-b", "main")
    for i in range(30):
        write_file(src / f"f{i}.txt", f"{i}\n" * 100)
    git(src, "add", "-A")
    git(src, "commit", "-q", "-m", "files")
    git(ubiq.docs, "clone", "-q", str(src), str(ubiq.docs / "clone"))
    assert git(ubiq.docs / "clone", "status", "--porcelain").stdout == ""
    assert sh("diff", "-r", "--exclude=.git", src, ubiq.docs / "clone").returncode == 0


# ---------------------------------------------------------------------------- editor saves


def editor_save(path, data: bytes, temp_name: str) -> int:
    """What vim/gedit do on save: write a temp file next to the original, fsync, rename over
    the original. Returns the temp file's inode."""
    tmp = path.parent / temp_name
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        ino = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return ino


def test_editor_save_keeps_item_identity(ubiq):
    p = ubiq.docs / "notes.txt"
    write_file(p, "version 1\n")
    ubiq.sync()
    item_id = ubiq.item_id(p)
    assert ubiq.cloud_content(item_id) == b"version 1\n"

    for v in range(2, 5):
        tmp_ino = editor_save(p, f"version {v}\n".encode(), ".notes.txt.swp")
        assert read_file(p) == f"version {v}\n".encode()
        assert os.stat(p).st_ino == tmp_ino
        assert not (ubiq.docs / ".notes.txt.swp").exists()
        assert ubiq.item_id(p) == item_id

    ubiq.sync()
    assert ubiq.item_id(p) == item_id
    assert ubiq.xattr(p, "user.ubiq.uploaded") == "1"
    assert ubiq.cloud_content(item_id) == b"version 4\n"
    live = [i for i in ubiq.cloud_items(include_deleted=False) if i.get("parentID") == "documents"]
    assert [i["name"] for i in live] == ["notes.txt"], live
    assert live[0]["itemID"] == item_id


def test_real_vim_edit(ubiq):
    if not shutil.which("vim"):
        pytest.skip("vim is not installed")
    p = ubiq.docs / "vim.txt"
    write_file(p, "first line\n")
    ubiq.sync()
    item_id = ubiq.item_id(p)
    sh("vim", "-u", "NONE", "-i", "NONE", "-N", "-es", "-c", "normal Gosecond line", "-c", "wq", p, timeout=60)
    assert read_file(p) == b"first line\nsecond line\n"
    assert sorted(os.listdir(ubiq.docs)) == ["vim.txt"]  # no swap or backup files left
    ubiq.sync()
    assert ubiq.item_id(p) == item_id
    assert ubiq.cloud_content(item_id) == b"first line\nsecond line\n"
    live = [i["name"] for i in ubiq.cloud_items(include_deleted=False) if i.get("parentID") == "documents"]
    assert live == ["vim.txt"]


# ---------------------------------------------------------------------------- copying trees


def make_source_tree(top, xattrs=True):
    """A small tree with every kind of entry, explicit modes and distinct times."""
    rng = random.Random(7)
    (top / "a" / "b" / "c").mkdir(parents=True)
    (top / "empty").mkdir()
    write_file(top / "top.txt", "top\n")
    write_file(top / "a" / "bin.dat", rng.randbytes(300_000))
    write_file(top / "a" / "b" / "c" / "deep.txt", "deep\n" * 1000)
    write_file(top / "a" / "b" / "empty.txt", b"")
    write_file(top / "exec.sh", "#!/bin/sh\necho hi\n")
    os.chmod(top / "exec.sh", 0o750)
    os.chmod(top / "a" / "bin.dat", 0o600)
    os.symlink("a/b/c/deep.txt", top / "rel-link")
    os.symlink("../top.txt", top / "a" / "up-link")
    entries = sorted(p for p in top.rglob("*") if not p.is_dir() or p.is_symlink())
    for i, p in enumerate(entries):
        os.utime(p, ns=(1_000_000_000_000_000_000 + i, 1_100_000_000_123_456_789 + i * 1_000_000_001), follow_symlinks=False)
    if xattrs:
        try:
            os.setxattr(top / "top.txt", "user.origin", b"source")
            os.setxattr(top / "a" / "bin.dat", "user.bin", bytes(range(64)))
        except OSError:
            pytest.skip("the tmp filesystem does not support user xattrs")


def test_cp_a_tree_and_diff(ubiq, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_source_tree(src)
    dst = ubiq.docs / "copy"
    sh("cp", "-a", src, dst)
    sh("diff", "-r", "--no-dereference", src, dst)
    assert tree_snapshot(dst) == tree_snapshot(src)
    # And back out again.
    back = tmp_path / "back"
    sh("cp", "-r", "--preserve=mode,timestamps,links", dst, back)
    sh("diff", "-r", "--no-dereference", src, back)
    ubiq.remount()
    sh("diff", "-r", "--no-dereference", src, dst)
    assert tree_snapshot(dst) == tree_snapshot(src)


def need_rsync():
    if not shutil.which("rsync"):
        pytest.skip("rsync is not installed")


def test_rsync_a_tree(ubiq, tmp_path):
    need_rsync()
    src = tmp_path / "src"
    src.mkdir()
    make_source_tree(src, xattrs=False)
    dst = ubiq.docs / "rsynced"
    sh("rsync", "-a", f"{src}/", f"{dst}/")
    sh("diff", "-r", "--no-dereference", src, dst)
    assert tree_snapshot(dst) == tree_snapshot(src)
    # A second run after a change (rsync writes a temp file and renames it over).
    write_file(src / "top.txt", "changed\n")
    sh("rsync", "-a", f"{src}/", f"{dst}/")
    sh("diff", "-r", "--no-dereference", src, dst)
    assert tree_snapshot(dst) == tree_snapshot(src)
    assert sorted(os.listdir(dst)) == sorted(os.listdir(src))  # no temp files left


def test_rsync_with_xattrs_into_the_mount(ubiq, tmp_path):
    need_rsync()
    src = tmp_path / "src"
    src.mkdir()
    make_source_tree(src)
    dst = ubiq.docs / "rsynced"
    sh("rsync", "-aX", f"{src}/", f"{dst}/")
    assert tree_snapshot(dst) == tree_snapshot(src)
    write_file(src / "top.txt", "changed\n")
    sh("rsync", "-aX", f"{src}/", f"{dst}/")
    assert tree_snapshot(dst) == tree_snapshot(src)


def test_tar_roundtrip(ubiq, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_source_tree(src)
    sh("tar", "-C", src, "-cf", tmp_path / "t.tar", ".")
    dst = ubiq.docs / "untarred"
    dst.mkdir()
    sh("tar", "-C", dst, "-xf", tmp_path / "t.tar")
    sh("diff", "-r", "--no-dereference", src, dst)


def test_sqlite_database_in_the_mount(ubiq):
    if not shutil.which("sqlite3"):
        pytest.skip("sqlite3 is not installed")
    db = ubiq.docs / "app.db"
    script = "CREATE TABLE t(x INTEGER, y TEXT);" + "".join(
        f"INSERT INTO t VALUES ({i}, '{'v' * (i % 50)}');" for i in range(2000)
    )
    sh("sqlite3", db, input=script)
    sh("sqlite3", db, "PRAGMA journal_mode=WAL; INSERT INTO t VALUES (-1, 'wal');")
    assert sh("sqlite3", db, "PRAGMA integrity_check;").stdout.strip() == "ok"
    ubiq.remount()
    assert sh("sqlite3", db, "SELECT count(*), sum(x) FROM t;").stdout.strip() == f"2001|{sum(range(2000)) - 1}"
    assert sh("sqlite3", db, "PRAGMA integrity_check;").stdout.strip() == "ok"


def test_ls_and_stat_report_what_was_set(ubiq):
    p = ubiq.docs / "f.txt"
    write_file(p, "12345")
    os.chmod(p, 0o640)
    os.utime(p, ns=(1_234_567_890_000_000_000, 1_234_567_890_000_000_000))
    out = sh("stat", "-c", "%s|%a|%F|%Y|%u|%g", p).stdout.strip().split("|")
    assert out == ["5", "640", "regular file", "1234567890", str(os.getuid()), str(os.getgid())]
    assert sh("ls", "-l", p).stdout.startswith("-rw-r-----")
    assert stat.S_ISDIR(os.stat(ubiq.docs).st_mode)
