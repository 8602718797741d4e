"""The command line: status, sync, find, how bad input is refused, what --help, the man page and
bash completion offer, recovery after a daemon crash, and progress of long operations."""

from __future__ import annotations

import errno
import json
import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import conftest
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


def test_status_tells_a_mount_detached_behind_the_daemons_back_while_a_file_is_open(ubiq):
    write_file(ubiq.docs / "open.txt", "kept open")
    ubiq.sync()
    pid = ubiq.daemon_record()["pid"]
    fd = os.open(ubiq.docs / "open.txt", os.O_RDONLY)
    try:
        subprocess.run(["fusermount3", "-uz", str(ubiq.mnt)], check=True)
        assert str(ubiq.mnt) not in ubiq_mounts()
        # The daemon still serves the open file; the mount point no longer shows it.
        r = ubiq.status()[0]
        assert r["pid"] == pid and r.get("detached") is True, r
        text = ubiq.run("status").stdout
        assert "detached" in text and "mounted at" not in text, text
        # Mounting again says why it cannot, and how it ends.
        cp = ubiq.run("mount", ubiq.container, ubiq.mnt, check=False)
        assert_one_line_error(cp, "detached", "open")
        assert os.read(fd, 100) == b"kept open"
    finally:
        os.close(fd)
    # The last close ends the daemon; the container mounts again.
    deadline = time.time() + 20
    while ubiq.status()[0].get("pid") is not None:
        assert time.time() < deadline, ubiq.status()
        time.sleep(0.2)
    assert "not mounted" in ubiq.run("status").stdout
    ubiq.mount()
    assert (ubiq.docs / "open.txt").read_text() == "kept open"


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


@pytest.mark.parametrize("pattern", ["[", "a[b", "x[]", "[^]"])
def test_find_a_malformed_pattern_is_an_error_not_a_silent_miss(ubiq, pattern):
    write_file(ubiq.docs / "a[b", "a")
    cp = ubiq.run("find", pattern, check=False)
    # Not 1, which says "nothing matches" (as grep's 1 does).
    assert cp.returncode not in (0, 1), cp
    assert_one_line_error(cp, "']'")
    assert cp.stdout == ""


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_find_a_limit_below_one_is_refused(ubiq, limit):
    write_file(ubiq.docs / "a.txt", "a")
    cp = ubiq.run("find", "*", "--limit", limit, check=False)
    assert_one_line_error(cp, "--limit")
    assert cp.stdout == ""


def test_find_a_class_with_a_literal_bracket_matches(ubiq):
    write_file(ubiq.docs / "a]b", "a")
    write_file(ubiq.docs / "a[b", "a")
    assert ubiq.run("find", "a[]]b").stdout.split() == [str(ubiq.docs / "a]b")]
    assert ubiq.run("find", "a[[]b").stdout.split() == [str(ubiq.docs / "a[b")]


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


def test_a_path_in_a_mount_of_another_state_folder_is_named_as_such(ubiq, tmp_path):
    write_file(ubiq.docs / "a.txt", "a")
    env = dict(ubiq.env, UBIQFS_STATE_DIR=str(tmp_path / "other-state"))
    cp = subprocess.run([conftest.UBIQFS_BIN, "sync", "--wait", str(ubiq.docs / "a.txt")], env=env,
                        capture_output=True, text=True, timeout=60)
    assert_one_line_error(cp, "another state folder", "--state-dir")
    assert "not inside a ubiqfs mount" not in cp.stderr


@pytest.mark.parametrize("command", ["download", "evict", "pin", "unpin"])
def test_content_commands_outside_a_mount_touch_nothing(ubiq, tmp_path, command):
    """A content command given a folder that is not in a mount (here, on the tests' own disk)
    refuses with one line, and leaves no `user.ubiq.*` attribute on anything below it."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_text("x\n")
    for target in (tmp_path, tmp_path / "sub" / "f"):
        cp = ubiq.run(command, target, check=False)
        assert_one_line_error(cp)
        assert "not inside a ubiqfs mount" in cp.stderr, cp.stderr
    for path in (tmp_path, tmp_path / "sub", tmp_path / "sub" / "f"):
        assert [a for a in os.listxattr(path) if a.startswith("user.ubiq")] == [], path
    # A path in the mount next to one outside it: nothing is done, outside or in.
    (ubiq.docs / "in.txt").write_text("in\n")
    ubiq.sync()
    assert_one_line_error(ubiq.run(command, ubiq.docs / "in.txt", tmp_path / "sub", check=False))
    assert [a for a in os.listxattr(tmp_path / "sub") if a.startswith("user.ubiq")] == []


def test_an_argument_that_is_not_utf8_is_refused_not_replaced(ubiq):
    """Arguments are bytes; one that is not valid UTF-8 (a key, a value, a path) gets a one-line
    error, instead of being read with U+FFFD in place of its bad bytes (which made two keys one)."""
    for args in ([b"kv", b"set", b"x\xff", b"1"], [b"kv", b"set", b"u8", b'"\xff\xfeab"'], [b"find", b"\xff*"]):
        cp = subprocess.run([str(conftest.UBIQFS_BIN).encode(), *args], env=ubiq.env, capture_output=True, text=True, timeout=60)
        assert_one_line_error(cp, "not valid UTF-8")
    assert ubiq.run("kv", "get", "x\ufffd", check=False).returncode != 0, "nothing was stored under a replaced key"


def test_a_file_the_cli_cannot_read_is_named_in_one_plain_line(ubiq, tmp_path):
    """A missing or malformed input file gets one line that names it and says why, in the
    system's words, not Foundation's error dump."""
    missing = tmp_path / "missing.json"
    for args in (["kv", "set", "k", "--data", missing], ["kv", "import", missing]):
        cp = ubiq.run(*args, check=False)
        assert_one_line_error(cp, f"{missing}: No such file or directory")
        assert "Domain=" not in cp.stderr, cp.stderr
    (tmp_path / "v.bin").write_bytes(b"bytes")
    assert_one_line_error(ubiq.run("kv", "set", "k", "42", "--data", tmp_path / "v.bin", check=False), "not both")
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"a":')
    cp = ubiq.run("kv", "import", truncated, check=False)
    assert_one_line_error(cp, "invalid JSON")
    assert "DecodingError" not in cp.stderr, cp.stderr


def test_usage_errors_exit_non_zero(ubiq, tmp_path):
    for args in (["mount"], ["mount", "a.b", "c", "d"], ["bogus"], ["mount", "--upload-delay-ms=-5", tmp_path]):
        cp = ubiq.run(*args, check=False)
        assert cp.returncode != 0, args
        assert cp.stderr.strip(), args
    assert len(ubiq_mounts()) == len(set(ubiq_mounts()))


@pytest.mark.parametrize("size", ["1e30", "9999999999T", "inf", "nan", "-5", "12Q"])
def test_a_size_that_does_not_fit_is_a_usage_error_not_a_crash(ubiq, tmp_path, size):
    for args in (["mount", f"--min-free={size}", tmp_path],
                 ["server", "account", "quota", "nobody", "--data", tmp_path / "server", "--", size]):
        cp = ubiq.run(*args, check=False)
        assert cp.returncode not in (0, -signal.SIGILL, -signal.SIGTRAP, 132, 133), (args, cp)
        assert "Fatal error" not in cp.stderr and "crashed" not in cp.stderr, (args, cp.stderr)
        assert "size" in cp.stderr, (args, cp.stderr)
        assert len(cp.stderr.strip().splitlines()) <= 3, (args, cp.stderr)


# ---------------------------------------------------------------------------- discoverability

REPO = Path(__file__).resolve().parents[2]
MAN_PAGE = REPO / "docs" / "ubiqfs.1"
# What the user guide tells people to run; each must be a command of its own.
USER_COMMANDS = [
    "mount", "unmount", "status", "sync", "find", "download", "evict", "pin", "unpin",
    "versions", "resolve", "kv", "account", "serve", "server",
]


def command_tree(ubiqfs_bin: str) -> list[tuple[list[str], dict]]:
    """Every command path the binary parses (from its own --experimental-dump-help), with the
    command's description; ArgumentParser's built-in `help` is left out."""
    cp = subprocess.run([ubiqfs_bin, "--experimental-dump-help"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    found = []

    def walk(cmd: dict, prefix: list[str]) -> None:
        for sub in cmd.get("subcommands") or []:
            if sub["commandName"] == "help":
                continue
            path = prefix + [sub["commandName"]]
            found.append((path, sub))
            walk(sub, path)

    walk(json.loads(cp.stdout)["command"], [])
    return found


def help_subcommands(ubiqfs_bin: str, parent: list[str]) -> list[str]:
    """The command names `ubiqfs PARENT... --help` lists under SUBCOMMANDS."""
    cp = subprocess.run([ubiqfs_bin, *parent, "--help"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert "SUBCOMMANDS:" in cp.stdout, cp.stdout
    section = cp.stdout.split("SUBCOMMANDS:", 1)[1]
    names = []
    for line in section.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^  (\S+)", line)
        if m:
            names.append(m.group(1))
        elif not line.startswith("   "):
            break  # the next section
    return names


def test_every_command_is_listed_in_help(ubiqfs_bin):
    tree = command_tree(ubiqfs_bin)
    top = [path[0] for path, _ in tree if len(path) == 1]
    missing = [c for c in USER_COMMANDS if c not in top]
    assert not missing, f"not commands of their own: {missing}"
    hidden = [" ".join(path) for path, info in tree if not info.get("shouldDisplay", True)]
    assert not hidden, f"commands a user can run but --help hides: {hidden}"
    for path, _ in tree:
        listed = help_subcommands(ubiqfs_bin, path[:-1])
        assert path[-1] in listed, f"`ubiqfs {' '.join(path[:-1])} --help` does not list {path[-1]}: {listed}"
    # Each command's own help works.
    for path, info in tree:
        cp = subprocess.run([ubiqfs_bin, *path, "--help"], capture_output=True, text=True, timeout=30)
        assert cp.returncode == 0 and "USAGE: ubiqfs " + " ".join(path) in cp.stdout, (path, cp.stdout, cp.stderr)


def test_man_page_documents_every_command(ubiqfs_bin):
    assert MAN_PAGE.is_file(), f"{MAN_PAGE} is missing (scripts/gen-manpage.py writes it)"
    page = MAN_PAGE.read_text()
    headings = re.findall(r'^\.SS "(.*)"$', page, flags=re.M)
    for path, _ in command_tree(ubiqfs_bin):
        assert "ubiqfs " + " ".join(path) in headings, f"man page has no section for `ubiqfs {' '.join(path)}`"
    # The shipped page is exactly what the generator makes from this binary (options included).
    cp = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen-manpage.py"), ubiqfs_bin], capture_output=True, text=True, timeout=60
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == page, "docs/ubiqfs.1 is out of date: run scripts/gen-manpage.py BIN > docs/ubiqfs.1"
    # man renders it without complaints.
    cp = subprocess.run(
        ["man", "--warnings", "-l", str(MAN_PAGE)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "MANPAGER": "cat", "MANWIDTH": "100"},
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr.strip() == "", cp.stderr
    for c in USER_COMMANDS:
        assert f"ubiqfs {c}" in cp.stdout


def bash_complete(script: str, words: list[str]) -> list[str]:
    """What bash offers after `words` (the last one is being typed) with the completion script."""
    line = " ".join(words)
    program = (
        script
        + "\n"
        + f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); COMP_CWORD={len(words) - 1};"
        + f" COMP_LINE={shlex.quote(line)}; COMP_POINT={len(line)};"
        + " _ubiqfs ubiqfs "
        + shlex.quote(words[-1])
        + " "
        + shlex.quote(words[-2])
        + '; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    cp = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.split()


def test_bash_completion_offers_every_command(ubiqfs_bin):
    cp = subprocess.run(
        [ubiqfs_bin, "--generate-completion-script", "bash"], capture_output=True, text=True, timeout=30
    )
    assert cp.returncode == 0, cp.stderr
    script = cp.stdout
    assert "complete " in script and "_ubiqfs" in script
    tree = command_tree(ubiqfs_bin)
    for path, _ in tree:
        offered = bash_complete(script, ["ubiqfs", *path[:-1], ""])
        assert path[-1] in offered, f"completion after `ubiqfs {' '.join(path[:-1])}` offers {offered}"
    assert "download" in bash_complete(script, ["ubiqfs", "dow"])


# ---------------------------------------------------------------------------- crashed daemon


def kill_9_daemon(u: Ubiq) -> int:
    """SIGKILLs the mount's daemon (a crash) and waits until it is gone; returns its pid."""
    pid = int(u.daemon_record()["pid"])
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline and conftest._pid_alive(pid):
        time.sleep(0.05)
    assert not conftest._pid_alive(pid), f"daemon {pid} survived SIGKILL"
    # The kernel still lists the mount, but nobody answers it any more (statfs always asks the
    # daemon; stat may still be answered from the kernel's attribute cache). Kernels say
    # ENOTCONN or, for an aborted connection, ECONNABORTED.
    assert str(u.mnt) in ubiq_mounts()
    with pytest.raises(OSError) as dead:
        os.statvfs(u.mnt)
    assert dead.value.errno in (errno.ENOTCONN, errno.ECONNABORTED), dead.value
    return pid


def test_status_names_a_crash_and_mount_recovers_the_stale_mount(ubiq):
    write_file(ubiq.docs / "synced.txt", "in the cloud\n")
    ubiq.sync()
    ubiq.remount("--upload-delay-ms", "600000")
    write_file(ubiq.docs / "queued.txt", "closed, not uploaded yet\n")
    pid = kill_9_daemon(ubiq)
    remedy = f"ubiqfs mount {ubiq.container} {ubiq.mnt}"

    out = ubiq.run("status").stdout
    assert "daemon crashed" in out and f"pid {pid}" in out and remedy in out, out
    [report] = ubiq.status()
    assert report.get("mountpoint") is None
    assert report["crashed"] == {"pid": pid, "mountpoint": str(ubiq.mnt), "staleMount": True, "remedy": remedy}
    # Commands that need the daemon say what to run.
    assert_one_line_error(ubiq.run("sync", "--wait", ubiq.docs, check=False), "daemon crashed", remedy)
    assert_one_line_error(ubiq.run("sync", "--wait", check=False), "daemon crashed", remedy)

    # Mounting again detaches the stale mount (saying so in one line) and mounts.
    cp = ubiq.run("mount", ubiq.container, ubiq.mnt, *ubiq.mount_args)
    ubiq._note_daemon()
    said = [line for line in (cp.stdout + cp.stderr).splitlines() if "stale" in line]
    assert len(said) == 1 and str(ubiq.mnt) in said[0], cp.stdout + cp.stderr
    assert ubiq_mounts().count(str(ubiq.mnt)) == 1
    assert (ubiq.docs / "synced.txt").read_text() == "in the cloud\n"
    assert (ubiq.docs / "queued.txt").read_text() == "closed, not uploaded yet\n"
    ubiq.sync()
    assert ubiq.cloud_content(ubiq.item_id(ubiq.docs / "queued.txt")) == b"closed, not uploaded yet\n"
    [report] = ubiq.status()
    assert report["mountpoint"] == str(ubiq.mnt) and report["pid"] == ubiq.daemon_record()["pid"] != pid
    assert report.get("crashed") is None
    assert "crashed" not in ubiq.run("status").stdout


def test_foreground_mount_recovers_a_stale_mount(ubiq):
    """What systemd's Restart=on-failure runs after a crash: `ubiqfs mount --foreground`."""
    write_file(ubiq.docs / "a.txt", "a\n")
    ubiq.sync()
    kill_9_daemon(ubiq)
    log = ubiq.root / "foreground.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [conftest.UBIQFS_BIN, "mount", "--foreground", ubiq.container, str(ubiq.mnt),
             "--state-dir", str(ubiq.state), *ubiq.mount_args],
            env=ubiq.env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ubiq.root),
        )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if str(ubiq.mnt) in ubiq_mounts() and os.path.exists(ubiq.docs / "a.txt"):
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"foreground mount exited {proc.returncode}: {log.read_text()}"
        ubiq._note_daemon()
        assert (ubiq.docs / "a.txt").read_text() == "a\n"
        assert ubiq_mounts().count(str(ubiq.mnt)) == 1
        said = [line for line in log.read_text().splitlines() if "stale" in line]
        assert len(said) == 1 and str(ubiq.mnt) in said[0], log.read_text()
        ubiq.unmount()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            conftest.kill_daemon(proc.pid)
    ubiq.mount()


def test_mount_elsewhere_after_a_crash_detaches_the_old_stale_mount(ubiq):
    write_file(ubiq.docs / "a.txt", "a\n")
    ubiq.sync()
    old = str(ubiq.mnt)
    kill_9_daemon(ubiq)
    elsewhere = Ubiq(ubiq.root)
    elsewhere.mnt = ubiq.root / "elsewhere"
    elsewhere.mnt.mkdir()
    cp = elsewhere.run("mount", ubiq.container, elsewhere.mnt, *ubiq.mount_args)
    elsewhere._note_daemon()
    try:
        said = [line for line in (cp.stdout + cp.stderr).splitlines() if "stale" in line]
        assert len(said) == 1 and old in said[0], cp.stdout + cp.stderr
        assert old not in ubiq_mounts(), "the crashed daemon's mount point is still a stale mount"
        assert (elsewhere.docs / "a.txt").read_text() == "a\n"
        [report] = ubiq.status()
        assert report["mountpoint"] == str(elsewhere.mnt) and report.get("crashed") is None
    finally:
        elsewhere.unmount()
    ubiq.mount()


def test_unmount_after_a_crash_clears_it(ubiq):
    kill_9_daemon(ubiq)
    cp = ubiq.run("unmount", ubiq.mnt)
    assert str(ubiq.mnt) not in ubiq_mounts()
    assert "unmounted" in cp.stdout
    out = ubiq.run("status").stdout
    assert "not mounted" in out and "crashed" not in out, out
    ubiq.mount()


# ---------------------------------------------------------------------------- progress


def run_on_tty(u: Ubiq, *args, timeout: float = 120) -> tuple[int, str]:
    """Runs `ubiqfs ARGS` with its stdout on a pseudo-terminal; returns (exit code, output)."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the last writer is gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        cp = subprocess.run(
            [conftest.UBIQFS_BIN, *map(str, args)], env=u.env, stdout=slave, stderr=subprocess.PIPE,
            timeout=timeout, cwd=str(u.root),
        )
    finally:
        os.close(slave)
    reader.join(10)
    os.close(master)
    assert cp.stderr == b"", cp.stderr
    return cp.returncode, b"".join(chunks).decode(errors="replace")


def evicted_tree(u: Ubiq, sizes: list[int]) -> tuple[Path, int]:
    """A synced, then evicted folder of files of these sizes; returns it and its byte count."""
    d = u.docs / "media"
    d.mkdir()
    for i, n in enumerate(sizes):
        write_file(d / f"f{i}.bin", os.urandom(n))
    u.sync()
    u.run("evict", d)
    assert all(Ubiq.xattr(d / f"f{i}.bin", "user.ubiq.status") == "not_downloaded" for i in range(len(sizes)))
    return d, sum(sizes)


def json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "no output"
    return [json.loads(line) for line in lines]


def test_download_json_progress(ubiq):
    ubiq.remount("--upload-delay-ms", "100", "--download-limit", "1M")
    d, total = evicted_tree(ubiq, [1_000_000, 700_000, 1_100_000, 10])
    out = ubiq.run("download", "--json", d).stdout
    reports = json_lines(out)
    last = reports[-1]
    assert last["done"] is True
    assert (last["filesDone"], last["filesTotal"]) == (4, 4)
    assert last["bytesDone"] == last["bytesTotal"] == total
    # About 3 s at 1 MB/s: progress came while it ran, never going backwards.
    running = reports[:-1]
    assert running and all(r["done"] is False and r["bytesTotal"] == total for r in running), reports
    done = [r["bytesDone"] for r in reports]
    assert done == sorted(done), done
    assert any(0 < r["bytesDone"] < total for r in running), reports
    assert all(r["bytesPerSecond"] >= 0 for r in reports)
    assert any(r.get("etaSeconds") is not None for r in running)
    for f in d.iterdir():
        assert Ubiq.xattr(f, "user.ubiq.status") == "current"
    # Nothing left to fetch: one final object with nothing to do.
    again = json_lines(ubiq.run("download", "--json", d).stdout)
    assert again[-1]["done"] is True and again[-1]["bytesTotal"] == 0 and again[-1]["filesTotal"] == 0


def test_download_progress_on_a_terminal_only(ubiq):
    ubiq.remount("--upload-delay-ms", "100", "--download-limit", "1M")
    d, total = evicted_tree(ubiq, [1_200_000, 1_200_000])
    rc, out = run_on_tty(ubiq, "download", d)
    assert rc == 0, out
    assert "ETA" in out and "/s" in out and "files" in out, out
    assert "downloaded 2 files" in out, out
    # Into a pipe (scripts), no progress output.
    ubiq.run("evict", d)
    cp = ubiq.run("download", d)
    assert cp.stdout == "" and cp.stderr == ""
    assert all(Ubiq.xattr(f, "user.ubiq.status") == "current" for f in d.iterdir())


def test_sync_wait_json_progress_says_what_is_left(ubiq):
    ubiq.remount("--upload-delay-ms", "100", "--upload-limit", "1M")
    for i in range(3):
        write_file(ubiq.docs / f"u{i}.bin", os.urandom(1_000_000))
    reports = json_lines(ubiq.run("sync", "--wait", "--json", "--timeout", "60").stdout)
    assert reports[-1] == {"pendingUploads": 0, "pendingDeletes": 0, "pendingBytes": 0, "done": True}
    running = reports[:-1]
    assert running and running[0]["pendingUploads"] >= 1 and running[0]["pendingBytes"] > 0, reports
    left = [r["pendingUploads"] for r in reports]
    assert left == sorted(left, reverse=True), left
    for i in range(3):
        assert ubiq.xattr(ubiq.docs / f"u{i}.bin", "user.ubiq.uploaded") == "1"


def test_sync_wait_progress_on_a_terminal(ubiq):
    ubiq.remount("--upload-delay-ms", "100", "--upload-limit", "1M")
    for i in range(2):
        write_file(ubiq.docs / f"u{i}.bin", os.urandom(1_000_000))
    rc, out = run_on_tty(ubiq, "sync", "--wait", ubiq.docs)
    assert rc == 0, out
    assert "left" in out and "upload" in out, out
    assert "all changes uploaded" in out, out
