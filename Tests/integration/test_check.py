"""`ubiqfs check` on real mounts: a device whose index lost track of the cloud (its change
token passed records it never applied, an upload it never queued) is told, item by item, what
differs; `--repair` mends it, and both devices and the cloud agree with every content kept."""

from __future__ import annotations

import json
import os
import sqlite3

from conftest import another_device
from helpers import read_file, write_file
from test_devices_and_content import wait_for

FAST = ["--upload-delay-ms", "100", "--pull-interval-ms", "100"]


def check(u, *args):
    return u.run("check", *args, check=False, timeout=180)


def faults(u) -> dict[str, str]:
    cp = check(u, "--json")
    report = json.loads(cp.stdout.splitlines()[0])
    assert (cp.returncode == 0) == (not report["faults"]), cp.stdout + cp.stderr
    return {f["path"]: f["problem"] for f in report["faults"]}


def test_check_names_what_a_device_missed_and_repair_mends_it(ubiq, tmp_path_factory):
    a = ubiq
    a.unmount()
    a.mount(*FAST)
    for name in ("x.txt", "y.txt", "z.txt"):
        write_file(a.docs / name, f"{name} one\n")
    a.sync()
    with another_device(a, tmp_path_factory, "peer") as b:
        b.mount(*FAST)
        wait_for(lambda: (b.docs / "z.txt").exists(), timeout=30, what="b pulls a's files")
        assert check(a).returncode == 0 and check(b).returncode == 0
        b.unmount()
        write_file(a.docs / "x.txt", "x.txt two\n")
        write_file(a.docs / "n.txt", "new\n")
        os.unlink(a.docs / "z.txt")
        a.sync()
        # While b is not mounted, its index loses track: the change token passes every record
        # of the cloud (a's changes among them, never applied), and a file made on b loses its
        # queue entry before it is uploaded (its revision stays ahead of the cloud's).
        index = b.container_dir() / "index.sqlite"
        with sqlite3.connect(index) as db:
            db.execute("UPDATE meta SET value = '1000000000000' WHERE key = 'changeToken'")
        b.mount("--upload-delay-ms", "600000", "--pull-interval-ms", "100")
        write_file(b.docs / "w.txt", "made on b\n")
        b.unmount()
        with sqlite3.connect(index) as db:
            db.execute("DELETE FROM uploadQueue WHERE item = (SELECT id FROM items WHERE name = 'w.txt')")
        b.mount(*FAST)
        assert read_file(b.docs / "x.txt") == b"x.txt one\n", "b still shows what it had"
        found = faults(b)
        assert set(found) == {"Documents/n.txt", "Documents/w.txt", "Documents/x.txt", "Documents/z.txt"}, found
        assert "missing here" in found["Documents/n.txt"]
        assert "never uploaded" in found["Documents/w.txt"]
        assert "never applied" in found["Documents/x.txt"]
        cp = check(b)
        assert cp.returncode == 1 and "4 faults" in cp.stdout, cp.stdout + cp.stderr

        cp = check(b, "--repair", "--timeout", "60")
        assert cp.returncode == 0, cp.stdout + cp.stderr
        assert "in agreement with the cloud after repair" in cp.stdout
        b.sync()
        a.sync()
        wait_for(lambda: (a.docs / "w.txt").exists(), timeout=30, what="a pulls w.txt")
        for u in (a, b):
            assert sorted(os.listdir(u.docs)) == ["n.txt", "w.txt", "x.txt", "y.txt"]
            assert read_file(u.docs / "x.txt") == b"x.txt two\n"
            assert read_file(u.docs / "n.txt") == b"new\n"
            assert read_file(u.docs / "w.txt") == b"made on b\n"
            assert faults(u) == {}
        b.unmount()


def test_check_without_a_mount_is_a_clear_error(ubiq):
    ubiq.unmount()
    cp = check(ubiq)
    assert cp.returncode != 0
    assert cp.stderr.startswith("ubiqfs: ") and "nothing is mounted" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1
