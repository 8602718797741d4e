"""`ubiqfs watch` through two real mounts of one cloud: device 2's watcher reports the changes
made on device 1 (which raise no inotify event on device 2's mount) and its own, local and
remote, one JSON object per line."""

from __future__ import annotations

import glob
import json
import os
import queue
import sqlite3
import subprocess
import threading

from conftest import UBIQFS_BIN, Ubiq
from test_devices_and_content import device2, wait_for  # noqa: F401  (device2 is a fixture)


def last_event(u: Ubiq) -> int:
    """The newest event number in the index of the device's one mounted container."""
    [index] = glob.glob(os.path.join(u.env["UBIQFS_STATE_DIR"], "accounts", "*", "*", "index.sqlite"))
    db = sqlite3.connect(f"file:{index}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]
    finally:
        db.close()


class Watcher:
    """`ubiqfs watch --json [PATH]` of one device, its lines collected by a thread."""

    def __init__(self, u: Ubiq, *args: str):
        if "--since" not in args:
            # From the device's newest event, not from whenever the process gets to read it:
            # changes made while it starts are reported too.
            args = (*args, "--since", str(last_event(u)))
        self.proc = subprocess.Popen(
            [UBIQFS_BIN, "watch", "--json", *args], env=u.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def expect(self, event: str, path, origin: str, timeout: float = 20, **fields) -> dict:
        """Waits for the event (the earlier ones it passes stay in `seen`)."""
        want = dict(event=event, path=str(path), origin=origin, **{k: str(v) for k, v in fields.items()})
        for e in self.seen:
            if all(e.get(k) == v for k, v in want.items()):
                return e
        try:
            while True:
                e = self.lines.get(timeout=timeout)
                self.seen.append(e)
                if all(e.get(k) == v for k, v in want.items()):
                    return e
        except queue.Empty:
            died = ""
            if self.proc.poll() is not None:
                died = f"; watch exited with {self.proc.returncode}: {self.proc.stderr.read().strip()}"
            raise AssertionError(f"no {want} within {timeout} s; saw {self.seen}{died}") from None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


def test_watch_reports_remote_and_local_changes(ubiq, device2):
    a, b = ubiq, device2
    w = Watcher(b)
    try:
        # Changes made on device 1 arrive on device 2 from the cloud.
        (a.docs / "notes").mkdir()
        (a.docs / "notes" / "plan.txt").write_text("v1\n")
        w.expect("created", b.docs / "notes", "remote", kind="directory")
        created = w.expect("created", b.docs / "notes" / "plan.txt", "remote", kind="file")
        assert created["itemID"] == a.item_id(a.docs / "notes" / "plan.txt")
        (a.docs / "notes" / "plan.txt").write_text("v2, longer\n")
        w.expect("modified", b.docs / "notes" / "plan.txt", "remote")
        os.rename(a.docs / "notes", a.docs / "archive")
        w.expect("renamed", b.docs / "archive", "remote", **{"from": b.docs / "notes"})
        os.unlink(a.docs / "archive" / "plan.txt")
        w.expect("deleted", b.docs / "archive" / "plan.txt", "remote")

        # Device 2's own changes: made, then uploaded; its content downloaded and evicted.
        (b.docs / "mine.txt").write_text("local\n")
        w.expect("created", b.docs / "mine.txt", "local")
        w.expect("uploaded", b.docs / "mine.txt", "local")
        (a.docs / "big.bin").write_bytes(os.urandom(300_000))
        w.expect("created", b.docs / "big.bin", "remote")
        assert (b.docs / "big.bin").read_bytes() == (a.docs / "big.bin").read_bytes()
        w.expect("downloaded", b.docs / "big.bin", "local")
        b.run("evict", b.docs / "big.bin")
        w.expect("evicted", b.docs / "big.bin", "local")
        seqs = [e["seq"] for e in w.seen]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    finally:
        w.stop()


def test_watch_limited_to_a_folder_and_resumed(ubiq, device2):
    a, b = ubiq, device2
    (a.docs / "in").mkdir()
    (a.docs / "out").mkdir()
    wait_for(lambda: (b.docs / "out").is_dir(), timeout=15, what="the folders on device 2")
    w = Watcher(b, str(b.docs / "in"))
    try:
        (a.docs / "out" / "x.txt").write_text("outside\n")
        (a.docs / "in" / "y.txt").write_text("inside\n")
        first = w.expect("created", b.docs / "in" / "y.txt", "remote")
        wait_for(lambda: (b.docs / "out" / "x.txt").exists(), timeout=15, what="x.txt on device 2")
        (a.docs / "in" / "z.txt").write_text("inside too\n")
        w.expect("created", b.docs / "in" / "z.txt", "remote")
        assert not [e for e in w.seen if "/out/" in e["path"]], w.seen
    finally:
        w.stop()
    # Resumed after the first line: the events after it, again.
    again = Watcher(b, str(b.docs / "in"), "--since", str(first["seq"]))
    try:
        again.expect("created", b.docs / "in" / "z.txt", "remote", timeout=10)
        assert all(e["seq"] > first["seq"] for e in again.seen)
    finally:
        again.stop()


def test_watch_needs_a_mount(tmp_path):
    cp = subprocess.run(
        [UBIQFS_BIN, "watch"], env={**os.environ, "UBIQFS_STATE_DIR": str(tmp_path)}, capture_output=True, text=True,
        timeout=30,
    )
    assert cp.returncode != 0
    assert cp.stderr.strip().startswith("ubiqfs:") and "mounted" in cp.stderr, cp.stderr
