"""POSIX behaviour of the mount, exercised with real tools and plain system calls."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    assert_errno,
    read_file,
    renameat2,
    sh,
    write_file,
)

# ---------------------------------------------------------------------------- the mount itself


def test_new_container_shows_only_documents(ubiq):
    assert os.listdir(ubiq.mnt) == ["Documents"]
    assert os.listdir(ubiq.docs) == []
    assert stat.S_ISDIR(os.stat(ubiq.docs).st_mode)
    out = sh("ls", "-a", ubiq.mnt).stdout.split()
    assert out == [".", "..", "Documents"]


def test_statfs(ubiq):
    sv = os.statvfs(ubiq.docs)
    assert sv.f_namemax == 255
    assert sv.f_bsize > 0 and sv.f_blocks > 0
    sh("stat", "-f", ubiq.docs)
    sh("df", ubiq.mnt)


# ---------------------------------------------------------------------------- files


def test_create_read_write(ubiq):
    p = ubiq.docs / "hello.txt"
    write_file(p, "hello world\n")
    assert read_file(p) == b"hello world\n"
    assert os.stat(p).st_size == 12
    assert stat.S_ISREG(os.stat(p).st_mode)
    assert sh("cat", p).stdout == "hello world\n"
    assert "hello.txt" in os.listdir(ubiq.docs)


def test_shell_redirection_and_cp(ubiq):
    sh("sh", "-c", f"echo one > '{ubiq.docs}/a.txt' && echo two >> '{ubiq.docs}/a.txt'")
    assert read_file(ubiq.docs / "a.txt") == b"one\ntwo\n"
    sh("cp", ubiq.docs / "a.txt", ubiq.docs / "b.txt")
    sh("cmp", ubiq.docs / "a.txt", ubiq.docs / "b.txt")


def test_append(ubiq):
    p = ubiq.docs / "log.txt"
    write_file(p, "line1\n")
    for i in range(2, 6):
        write_file(p, f"line{i}\n", mode="ab")
    assert read_file(p) == b"".join(f"line{i}\n".encode() for i in range(1, 6))
    # O_APPEND writes go to the end even after a seek.
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"tail\n")
    finally:
        os.close(fd)
    assert read_file(p).endswith(b"line5\ntail\n")


def test_overwrite_shorter_with_o_trunc(ubiq):
    p = ubiq.docs / "f.txt"
    write_file(p, "a much longer first version\n")
    write_file(p, "short\n")
    assert read_file(p) == b"short\n"
    assert os.stat(p).st_size == 6


def test_write_in_the_middle_and_past_the_end(ubiq):
    p = ubiq.docs / "f.bin"
    write_file(p, b"0123456789")
    with open(p, "r+b") as f:
        f.seek(3)
        f.write(b"abc")
        f.seek(15)
        f.write(b"Z")
    assert read_file(p) == b"012abc6789" + b"\0" * 5 + b"Z"
    # pwrite/pread on one descriptor see each other.
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, b"XY", 0)
        assert os.pread(fd, 4, 0) == b"XY2a"
    finally:
        os.close(fd)


def test_truncate_shrink_and_extend(ubiq):
    p = ubiq.docs / "t.txt"
    write_file(p, "0123456789")
    sh("truncate", "-s", "4", p)
    assert read_file(p) == b"0123"
    sh("truncate", "-s", "8", p)
    assert read_file(p) == b"0123\0\0\0\0"
    os.truncate(p, 2)
    assert read_file(p) == b"01"
    assert os.stat(p).st_size == 2
    os.truncate(p, 0)
    assert read_file(p) == b""
    # ftruncate on an open descriptor.
    with open(p, "r+b") as f:
        f.write(b"abcdef")
        f.flush()
        os.ftruncate(f.fileno(), 3)
    assert read_file(p) == b"abc"
    # truncate -s creates a missing file.
    sh("truncate", "-s", "5", ubiq.docs / "new.bin")
    assert read_file(ubiq.docs / "new.bin") == b"\0" * 5


def test_fsync_and_fallocate(ubiq):
    p = ubiq.docs / "alloc.bin"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, 4096)
        os.write(fd, b"data")
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 4096
    assert read_file(p)[:4] == b"data"


def test_fallocate_keep_size_reserves_without_growing_and_rsync_preallocate_is_quiet(ubiq, tmp_path):
    p = ubiq.docs / "kept.txt"
    p.write_bytes(b"abc\n")
    cp = subprocess.run(["fallocate", "-n", "-l", "1M", str(p)], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    assert os.stat(p).st_size == 4 and read_file(p) == b"abc\n"
    # Other modes stay unsupported, with the errno ext4 gives for a mode it lacks.
    cp = subprocess.run(["fallocate", "--punch-hole", "-o", "0", "-l", "2", str(p)], capture_output=True, text=True)
    assert cp.returncode != 0 and "unsupported" in cp.stderr, cp
    assert read_file(p) == b"abc\n"
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 100_000)
    cp = subprocess.run(["rsync", "-a", "--preallocate", f"{src}/", f"{ubiq.docs / 'pre'}/"], capture_output=True, text=True)
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr
    assert read_file(ubiq.docs / "pre" / "f") == b"x" * 100_000


def test_a_setgid_folder_gives_new_items_its_group_and_new_folders_the_bit(ubiq):
    d = ubiq.docs / "shared"
    d.mkdir()
    os.chown(d, -1, 1)  # group daemon (gid 1), not root's
    os.chmod(d, 0o2775)
    (d / "f").write_text("f")
    (d / "sub").mkdir()
    os.symlink("f", d / "link")
    assert os.stat(d / "f").st_gid == 1 and not os.stat(d / "f").st_mode & stat.S_ISGID
    assert os.stat(d / "sub").st_gid == 1 and os.stat(d / "sub").st_mode & stat.S_ISGID
    assert os.lstat(d / "link").st_gid == 1
    # Without the bit, the creator's group, as on ext4.
    os.chmod(d, 0o775)
    (d / "g").write_text("g")
    assert os.stat(d / "g").st_gid == os.getgid()


def test_chmod(ubiq):
    p = ubiq.docs / "script.sh"
    write_file(p, "#!/bin/sh\necho ran\n")
    os.chmod(p, 0o600)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    sh("chmod", "755", p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o755
    assert sh(p).stdout == "ran\n"
    sh("chmod", "u=rw,go=", p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    d = ubiq.docs / "dir"
    os.mkdir(d, 0o755)
    os.chmod(d, 0o700)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_utimens(ubiq):
    p = ubiq.docs / "old.txt"
    write_file(p, "x")
    sh("touch", "-d", "2001-02-03 04:05:06.123456789 UTC", p)
    st = os.stat(p)
    assert st.st_mtime_ns == 981173106_123456789
    os.utime(p, ns=(1_000_000_000_111, 1_500_000_000_222_333_444))
    st = os.stat(p)
    assert st.st_atime_ns == 1_000_000_000_111
    assert st.st_mtime_ns == 1_500_000_000_222_333_444
    # touch without a date moves mtime to now.
    sh("touch", p)
    assert abs(os.stat(p).st_mtime - __import__("time").time()) < 60
    assert "2001" not in sh("ls", "-l", "--time-style=+%Y", p).stdout


def test_futimens_before_close_is_kept(ubiq):
    """cp -p / cp -a: write, set the times on the open descriptor, close. The times set last win."""
    p = ubiq.docs / "copied.txt"
    with open(p, "wb") as f:
        f.write(b"data")
        f.flush()  # the write(2) happens before futimens, as in cp
        os.utime(f.fileno(), ns=(1_000_000_000_000_000_000, 1_100_000_000_000_000_000))
        assert os.stat(p).st_mtime_ns == 1_100_000_000_000_000_000
    assert os.stat(p).st_mtime_ns == 1_100_000_000_000_000_000
    ubiq.remount()
    assert os.stat(p).st_mtime_ns == 1_100_000_000_000_000_000


def test_mtime_changes_on_write(ubiq):
    p = ubiq.docs / "m.txt"
    write_file(p, "a")
    os.utime(p, ns=(10**18, 10**18))
    write_file(p, "b", mode="ab")
    assert os.stat(p).st_mtime_ns != 10**18


def test_truncating_opens_and_ctime_as_on_ext4(ubiq, tmp_path):
    """ext4 (tmp_path) is the oracle. An open with O_TRUNC moves mtime and ctime also when the
    file is already empty (`: > stamp`), and truncates also when opened read-only (Linux does);
    ctime is the time of the last change of the inode, never raised to a later mtime."""
    results = {}
    for where in (tmp_path, ubiq.docs):
        got = {}
        stamp = where / "stamp"
        write_file(stamp, "")
        os.utime(stamp, ns=(10**18, 10**18))
        os.close(os.open(stamp, os.O_WRONLY | os.O_TRUNC))
        st = os.stat(stamp)
        got["empty O_TRUNC moves mtime"] = abs(st.st_mtime - time.time()) < 60
        got["empty O_TRUNC moves ctime"] = abs(st.st_ctime - time.time()) < 60
        ro = where / "ro"
        write_file(ro, "abc")
        os.close(os.open(ro, os.O_RDONLY | os.O_TRUNC))
        got["O_RDONLY|O_TRUNC size"] = os.stat(ro).st_size
        future = where / "future"
        write_file(future, "x")
        os.utime(future, ns=(7 * 10**18, 7 * 10**18))  # 2191
        got["ctime after a future mtime is now"] = abs(os.stat(future).st_ctime - time.time()) < 60
        os.chmod(future, 0o600)
        got["ctime after chmod is now"] = abs(os.stat(future).st_ctime - time.time()) < 60
        results[where] = got
    assert results[ubiq.docs] == results[tmp_path], results


def test_an_attribute_name_with_nothing_after_user_is_refused_as_on_ext4(ubiq, tmp_path):
    for where in (tmp_path, ubiq.docs):
        f = where / "x1"
        write_file(f, "x")
        assert_errno(errno.EINVAL, os.setxattr, f, "user.", b"1")
        assert_errno(errno.EINVAL, os.getxattr, f, "user.")
        assert_errno(errno.EINVAL, os.removexattr, f, "user.")
        assert "user." not in os.listxattr(f)


def test_unlink(ubiq):
    p = ubiq.docs / "gone.txt"
    write_file(p, "bye")
    sh("rm", p)
    assert not p.exists()
    assert "gone.txt" not in os.listdir(ubiq.docs)
    assert_errno(errno.ENOENT, os.stat, p)
    assert_errno(errno.ENOENT, os.unlink, p)
    # The name can be used again.
    write_file(p, "again")
    assert read_file(p) == b"again"


def test_unlinked_open_file_stays_readable(ubiq):
    p = ubiq.docs / "open.txt"
    write_file(p, "still here")
    with open(p, "r+b") as f:
        os.unlink(p)
        assert not p.exists()
        assert f.read() == b"still here"
        f.write(b"!")
        f.flush()
        assert os.fstat(f.fileno()).st_size == 11
    assert "open.txt" not in os.listdir(ubiq.docs)


# ---------------------------------------------------------------------------- directories


def test_mkdir_rmdir(ubiq):
    d = ubiq.docs / "a" / "b" / "c"
    sh("mkdir", "-p", d)
    assert d.is_dir()
    assert os.listdir(ubiq.docs / "a") == ["b"]
    write_file(d / "f.txt", "x")
    assert_errno(errno.ENOTEMPTY, os.rmdir, d)
    assert_errno(errno.ENOTEMPTY, os.rmdir, ubiq.docs / "a")
    os.unlink(d / "f.txt")
    os.rmdir(d)
    assert not d.exists()
    sh("rm", "-r", ubiq.docs / "a")
    assert os.listdir(ubiq.docs) == []


def test_rm_rf_tree(ubiq):
    top = ubiq.docs / "tree"
    for i in range(5):
        (top / f"d{i}" / "sub").mkdir(parents=True)
        for j in range(5):
            write_file(top / f"d{i}" / "sub" / f"f{j}", f"{i}{j}")
    sh("rm", "-rf", top)
    assert not top.exists()
    assert os.listdir(ubiq.docs) == []


def test_documents_cannot_be_removed(ubiq):
    with pytest.raises(OSError):
        os.rmdir(ubiq.docs)
    assert ubiq.docs.is_dir()


# ---------------------------------------------------------------------------- rename


def test_a_removed_directory_stays_usable_through_what_still_refers_to_it_as_on_ext4(ubiq, tmp_path):
    """ext4 (tmp_path) is the oracle: a directory removed while open (or while it is a
    process's working directory) answers fstat (no links), an empty listing, fchmod, fsync and
    flistxattr; `ls` in it lists nothing and succeeds."""
    results = {}
    for where in (tmp_path, ubiq.docs):
        got = {}
        os.mkdir(where / "gd")
        fd = os.open(where / "gd", os.O_RDONLY | os.O_DIRECTORY)
        os.rmdir(where / "gd")
        try:
            for name, call in [
                ("fstat links", lambda: os.fstat(fd).st_nlink),
                ("listing", lambda: os.listdir(fd)),
                ("fchmod", lambda: os.chmod(fd, 0o700) or stat.S_IMODE(os.fstat(fd).st_mode)),
                ("fsync", lambda: os.fsync(fd)),
                ("flistxattr", lambda: [n for n in os.listxattr(fd) if not n.startswith("user.ubiq.")]),
            ]:
                try:
                    got[name] = call()
                except OSError as e:
                    got[name] = errno.errorcode[e.errno]
        finally:
            os.close(fd)
        os.mkdir(where / "cwd")
        cp = subprocess.run(["sh", "-c", "cd cwd && rmdir ../cwd && ls -a ."], cwd=where, capture_output=True, text=True)
        got["ls in a removed cwd"] = (cp.returncode, cp.stdout)
        results[where] = got
    assert results[ubiq.docs] == results[tmp_path], results


def test_rename_file(ubiq):
    write_file(ubiq.docs / "a.txt", "A")
    os.mkdir(ubiq.docs / "sub")
    sh("mv", ubiq.docs / "a.txt", ubiq.docs / "b.txt")
    assert not (ubiq.docs / "a.txt").exists()
    assert read_file(ubiq.docs / "b.txt") == b"A"
    sh("mv", ubiq.docs / "b.txt", ubiq.docs / "sub")
    assert read_file(ubiq.docs / "sub" / "b.txt") == b"A"
    assert os.listdir(ubiq.docs) == ["sub"]


def test_rename_over_existing_file(ubiq):
    src, dst = ubiq.docs / "new.txt", ubiq.docs / "old.txt"
    write_file(src, "new content")
    write_file(dst, "old content that is longer")
    src_ino = os.stat(src).st_ino
    os.rename(src, dst)
    assert read_file(dst) == b"new content"
    assert not src.exists()
    assert os.stat(dst).st_ino == src_ino
    assert sorted(os.listdir(ubiq.docs)) == ["old.txt"]


def test_rename_directory(ubiq):
    src = ubiq.docs / "proj"
    (src / "deep" / "er").mkdir(parents=True)
    write_file(src / "deep" / "er" / "f.txt", "deep")
    write_file(src / "top.txt", "top")
    os.mkdir(ubiq.docs / "archive")
    sh("mv", src, ubiq.docs / "archive" / "proj2")
    assert not src.exists()
    new = ubiq.docs / "archive" / "proj2"
    assert read_file(new / "deep" / "er" / "f.txt") == b"deep"
    assert read_file(new / "top.txt") == b"top"
    assert sorted(os.listdir(new)) == ["deep", "top.txt"]


def test_rename_directory_errors(ubiq):
    a, b = ubiq.docs / "a", ubiq.docs / "b"
    os.mkdir(a)
    os.mkdir(b)
    write_file(b / "f", "x")
    write_file(ubiq.docs / "file", "x")
    assert_errno(errno.ENOTEMPTY, os.rename, a, b)
    assert_errno(errno.EINVAL, os.rename, a, a / "inside")
    assert_errno(errno.ENOTDIR, os.rename, a, ubiq.docs / "file")
    assert_errno(errno.EISDIR, os.rename, ubiq.docs / "file", a)
    assert_errno(errno.ENOENT, os.rename, ubiq.docs / "missing", ubiq.docs / "x")
    # Over an empty directory is fine.
    os.mkdir(ubiq.docs / "empty")
    os.rename(a, ubiq.docs / "empty")
    assert sorted(os.listdir(ubiq.docs)) == ["b", "empty", "file"]


def test_rename_noreplace(ubiq):
    a, b = ubiq.docs / "a.txt", ubiq.docs / "b.txt"
    write_file(a, "A")
    write_file(b, "B")
    assert_errno(errno.EEXIST, renameat2, a, b, RENAME_NOREPLACE)
    assert read_file(a) == b"A" and read_file(b) == b"B"
    renameat2(a, ubiq.docs / "c.txt", RENAME_NOREPLACE)
    assert not a.exists()
    assert read_file(ubiq.docs / "c.txt") == b"A"


def test_rename_exchange(ubiq):
    a, b = ubiq.docs / "a.txt", ubiq.docs / "b.txt"
    write_file(a, "AAAA")
    write_file(b, "BB")
    ino_a, ino_b = os.stat(a).st_ino, os.stat(b).st_ino
    renameat2(a, b, RENAME_EXCHANGE)
    assert read_file(a) == b"BB"
    assert read_file(b) == b"AAAA"
    assert os.stat(a).st_ino == ino_b and os.stat(b).st_ino == ino_a
    # A file and a directory, across directories.
    d = ubiq.docs / "d"
    (d / "inner").mkdir(parents=True)
    write_file(d / "inner" / "x", "x")
    renameat2(a, d, RENAME_EXCHANGE)
    assert read_file(d) == b"BB"
    assert read_file(a / "inner" / "x") == b"x"
    # Exchanging with a missing name fails.
    assert_errno(errno.ENOENT, renameat2, b, ubiq.docs / "missing", RENAME_EXCHANGE)


# ---------------------------------------------------------------------------- symlinks


def test_symlink_readlink(ubiq):
    target = ubiq.docs / "target.txt"
    write_file(target, "through the link")
    link = ubiq.docs / "link"
    os.symlink("target.txt", link)
    assert os.readlink(link) == "target.txt"
    assert stat.S_ISLNK(os.lstat(link).st_mode)
    assert os.lstat(link).st_size == len("target.txt")
    assert read_file(link) == b"through the link"
    sh("ln", "-s", "/nonexistent/far/away", ubiq.docs / "dangling")
    assert os.readlink(ubiq.docs / "dangling") == "/nonexistent/far/away"
    assert not (ubiq.docs / "dangling").exists()
    assert sh("readlink", ubiq.docs / "dangling").stdout.strip() == "/nonexistent/far/away"
    # A symlink to a directory; writing through it.
    os.mkdir(ubiq.docs / "dir")
    os.symlink("dir", ubiq.docs / "dirlink")
    write_file(ubiq.docs / "dirlink" / "f", "via link")
    assert read_file(ubiq.docs / "dir" / "f") == b"via link"
    # Removing the link leaves the target.
    os.unlink(link)
    assert read_file(target) == b"through the link"
    assert_errno(errno.EEXIST, os.symlink, "x", ubiq.docs / "dirlink")


# ---------------------------------------------------------------------------- xattrs


def test_user_xattrs_with_tools(ubiq):
    p = ubiq.docs / "x.txt"
    write_file(p, "x")
    sh("setfattr", "-n", "user.color", "-v", "red", p)
    sh("setfattr", "-n", "user.tag", "-v", "blue", p)
    assert sh("getfattr", "-n", "user.color", "--only-values", p).stdout == "red"
    dump = sh("getfattr", "-d", "-m", "^user\\.[^u]", p).stdout
    assert 'user.color="red"' in dump and 'user.tag="blue"' in dump
    sh("setfattr", "-x", "user.color", p)
    cp = sh("getfattr", "-n", "user.color", p, check=False)
    assert cp.returncode != 0 and "No such attribute" in cp.stderr
    assert "user.color" not in os.listxattr(p)
    assert "user.tag" in os.listxattr(p)


def test_user_xattrs_syscalls(ubiq):
    p = ubiq.docs / "x.bin"
    write_file(p, "x")
    binary = bytes(range(256)) * 4
    os.setxattr(p, "user.bin", binary)
    assert os.getxattr(p, "user.bin") == binary
    os.setxattr(p, "user.empty", b"")
    assert os.getxattr(p, "user.empty") == b""
    assert_errno(errno.ENODATA, os.getxattr, p, "user.missing")
    assert_errno(errno.ENODATA, os.removexattr, p, "user.missing")
    assert_errno(errno.EEXIST, os.setxattr, p, "user.bin", b"1", os.XATTR_CREATE)
    assert_errno(errno.ENODATA, os.setxattr, p, "user.nope", b"1", os.XATTR_REPLACE)
    os.setxattr(p, "user.bin", b"replaced", os.XATTR_REPLACE)
    assert os.getxattr(p, "user.bin") == b"replaced"
    os.removexattr(p, "user.bin")
    assert_errno(errno.ENODATA, os.getxattr, p, "user.bin")
    # On a directory too.
    os.setxattr(ubiq.docs, "user.dir", b"yes")
    assert os.getxattr(ubiq.docs, "user.dir") == b"yes"


def test_attributes_that_no_longer_fit_give_enospc_and_the_rest_stay_listable(ubiq):
    """As on ext4, extended attributes that no longer fit give ENOSPC. Here the bound is what
    listxattr can answer (and the cloud takes): about 60 KiB of names. Whatever was set stays
    listable and uploads."""
    p = ubiq.docs / "many.txt"
    write_file(p, "x")
    names = [f"user.attribute-{i:05d}-" + "p" * 20 for i in range(3000)]
    stored = []
    with pytest.raises(OSError) as refused:
        for n in names:
            os.setxattr(p, n, b"v")
            stored.append(n)
    assert refused.value.errno == errno.ENOSPC, refused.value
    assert 1400 < len(stored) < 1500, len(stored)  # 42 bytes a name, 60 KiB in all
    listed = os.listxattr(p)
    assert set(stored) <= set(listed)
    os.setxattr(p, stored[0], b"replaced")  # an attribute it has can still change
    ubiq.sync()
    assert ubiq.status()[0]["queue"]["failing"] == []


def test_virtual_status_xattrs(ubiq):
    p = ubiq.docs / "s.txt"
    write_file(p, "status")
    dump = sh("getfattr", "-d", "-m", "user.ubiq", p).stdout
    for name in ("status", "uploaded", "uploading", "item_id", "container"):
        assert f"user.ubiq.{name}=" in dump, dump
    assert ubiq.xattr(p, "user.ubiq.container") == "iCloud.default"
    assert ubiq.xattr(p, "user.ubiq.status") == "current"
    ubiq.sync()
    assert ubiq.xattr(p, "user.ubiq.uploaded") == "1"
    assert ubiq.xattr(p, "user.ubiq.uploading") == "0"
    assert ubiq.xattr(p, "user.ubiq.etag")
    # Status attributes cannot be changed from outside (whether the attempt errors or is ignored).
    item_id = ubiq.item_id(p)
    for attempt in (lambda: os.removexattr(p, "user.ubiq.item_id"), lambda: os.setxattr(p, "user.ubiq.item_id", b"x")):
        try:
            attempt()
        except OSError:
            pass
        assert ubiq.item_id(p) == item_id


def test_listed_xattrs_are_readable(ubiq):
    """Every name listxattr reports can be read with getxattr (what cp -a, rsync -X and tar
    --xattrs rely on), for files, directories and symlinks."""
    write_file(ubiq.docs / "f", "x")
    os.setxattr(ubiq.docs / "f", "user.mine", b"1")
    os.mkdir(ubiq.docs / "d")
    os.symlink("f", ubiq.docs / "l")
    for name in ("f", "d", "l"):
        p = ubiq.docs / name
        for attr in os.listxattr(p, follow_symlinks=False):
            try:
                os.getxattr(p, attr, follow_symlinks=False)
            except OSError as e:
                pytest.fail(f"{name}: listxattr lists {attr} but getxattr fails: {e}")


# ---------------------------------------------------------------------------- errors


def test_errno_enoent(ubiq):
    missing = ubiq.docs / "missing.txt"
    assert_errno(errno.ENOENT, open, missing, "rb")
    assert_errno(errno.ENOENT, os.stat, missing)
    assert_errno(errno.ENOENT, os.listdir, ubiq.docs / "nodir")
    assert_errno(errno.ENOENT, os.rmdir, ubiq.docs / "nodir")
    assert_errno(errno.ENOENT, os.readlink, missing)
    assert_errno(errno.ENOENT, open, ubiq.docs / "nodir" / "f", "wb")


def test_errno_eisdir(ubiq):
    d = ubiq.docs / "dir"
    os.mkdir(d)
    assert_errno(errno.EISDIR, os.open, d, os.O_WRONLY)
    assert_errno(errno.EISDIR, os.open, d, os.O_RDWR)
    assert_errno(errno.EISDIR, open, d, "wb")
    assert_errno(errno.EISDIR, os.unlink, d)


def test_errno_enotdir(ubiq):
    f = ubiq.docs / "file.txt"
    write_file(f, "x")
    assert_errno(errno.ENOTDIR, os.listdir, f)
    assert_errno(errno.ENOTDIR, open, f / "child", "rb")
    assert_errno(errno.ENOTDIR, os.mkdir, f / "child")
    assert_errno(errno.ENOTDIR, os.rmdir, f)


def test_errno_eexist(ubiq):
    f = ubiq.docs / "file.txt"
    write_file(f, "x")
    os.mkdir(ubiq.docs / "d")
    assert_errno(errno.EEXIST, os.mkdir, ubiq.docs / "d")
    assert_errno(errno.EEXIST, os.mkdir, f)
    assert_errno(errno.EEXIST, os.open, f, os.O_CREAT | os.O_EXCL | os.O_WRONLY)


def test_errno_enametoolong(ubiq):
    ok = "a" * 255
    write_file(ubiq.docs / ok, "255 bytes is fine")
    assert read_file(ubiq.docs / ok) == b"255 bytes is fine"
    assert ok in os.listdir(ubiq.docs)
    long = "b" * 256
    assert_errno(errno.ENAMETOOLONG, open, ubiq.docs / long, "wb")
    assert_errno(errno.ENAMETOOLONG, os.mkdir, ubiq.docs / long)
    assert_errno(errno.ENAMETOOLONG, os.stat, ubiq.docs / long)
    assert_errno(errno.ENAMETOOLONG, os.symlink, "x", ubiq.docs / long)
    assert_errno(errno.ENAMETOOLONG, os.rename, ubiq.docs / ok, ubiq.docs / long)
    # Multi-byte UTF-8: 128 two-byte characters are 256 bytes.
    assert_errno(errno.ENAMETOOLONG, open, ubiq.docs / ("é" * 128), "wb")
    write_file(ubiq.docs / ("é" * 127), "254 bytes")
    assert sorted(os.listdir(ubiq.docs)) == sorted([ok, "é" * 127])


def test_errno_eperm_hard_link(ubiq):
    f = ubiq.docs / "file.txt"
    write_file(f, "x")
    assert_errno(errno.EPERM, os.link, f, ubiq.docs / "hard.txt")
    assert not (ubiq.docs / "hard.txt").exists()
    cp = sh("ln", f, ubiq.docs / "hard2.txt", check=False)
    assert cp.returncode != 0
    assert os.listdir(ubiq.docs) == ["file.txt"]


def test_errno_eperm_special_files(ubiq):
    assert_errno(errno.EPERM, os.mkfifo, ubiq.docs / "fifo")
    assert not (ubiq.docs / "fifo").exists()


def test_unicode_and_odd_names(ubiq):
    names = ["naïve café.txt", "日本語.md", "with space", "-dash", "a'quote", 'd"quote', "semi;colon", "#hash", ".hidden"]
    for n in names:
        write_file(ubiq.docs / n, n)
    assert sorted(os.listdir(ubiq.docs)) == sorted(names)
    for n in names:
        assert read_file(ubiq.docs / n) == n.encode()


def test_the_kernel_never_forgets_more_entries_than_it_was_handed(ubiq):
    """Every entry a reply hands the kernel (lookup, create, mkdir, symlink, each readdirplus
    entry) is counted, also after the item is deleted, so when the kernel drops inodes from its
    caches and forgets them, it never forgets more than it was handed: the daemon keeps an
    inode's state (its page-cache epoch) exactly as long as the kernel may hold the inode."""
    tree = ubiq.docs / "tree"
    tree.mkdir()
    for i in range(40):
        sub = tree / f"dir{i}"
        sub.mkdir()
        for j in range(5):
            (sub / f"f{j}").write_text("x")
        os.symlink("f0", sub / "link")
    for _ in range(2):
        # ls -l lists through readdirplus; dropping the dentry and inode caches sends forgets.
        subprocess.run(["ls", "-lR", str(tree)], check=True, capture_output=True)
        os.rename(tree / "dir0", tree / "moved")
        os.rename(tree / "moved", tree / "dir0")
        Path("/proc/sys/vm/drop_caches").write_text("2")
    # Entries of deleted items stay counted until the kernel forgets them.
    subprocess.run(["ls", "-lR", str(tree)], check=True, capture_output=True)
    for i in range(20, 40):
        subprocess.run(["rm", "-r", str(tree / f"dir{i}")], check=True)
    (tree / "dir0" / "f1").unlink()
    Path("/proc/sys/vm/drop_caches").write_text("2")
    time.sleep(1)  # the kernel sends forgets in batches, asynchronously
    assert "than it was handed" not in ubiq.daemon_log()
