"""Two and three devices of one account (real mounts, the test's cloud: embedded, `serve` on
SQLite, or `serve` on PostgreSQL + SeaweedFS) run a random workload at the same time: writes with
fsync, atomic saves, renames and moves, deletes, mkdir and `rm -r`, with uploads delayed 1.5 s so
that changes really are concurrent; now and then a daemon is killed with SIGKILL and mounted
again, and with `serve`, a server is killed with SIGKILL and started again. After each round
everything is synced: every device must show the same tree, every file must hold bytes some
writer wrote (never a torn or zeroed mix), and no upload may be left or failing.

Seeded: a failure names the seed and the operations. UBIQ_TWO_DEVICE_ROUNDS sets the number of
rounds (a small budget by default; the three-device test runs half as many),
UBIQ_TWO_DEVICE_SEED the first seed."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time

from conftest import CLOUD_MODE, Ubiq, _cloud_account, another_device
from test_conflicts import pair, settle  # noqa: F401  (the fixture)
from test_devices_and_content import wait_for

ROUNDS = int(os.environ.get("UBIQ_TWO_DEVICE_ROUNDS", "6"))
BASE_SEED = int(os.environ.get("UBIQ_TWO_DEVICE_SEED", "1000"))
OPS_PER_ROUND = 14
NAMES = ["a.txt", "b.txt", "c.txt"]
DIRS = ["D", "E", "D/F"]


def tree(root) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.normpath(os.path.join(rel, f))] = fh.read()
    return out


def write_fsync(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class Workload:
    def __init__(self, seed: int, written: set[bytes]):
        self.rng = random.Random(seed)
        self.seed = seed
        self.written = written
        self.log: list[str] = []
        self.count = 0

    def path(self) -> str:
        where = self.rng.choice(["", "", "D", "E", "D/F"])
        return os.path.join(where, self.rng.choice(NAMES)) if where else self.rng.choice(NAMES)

    def payload(self, who: str) -> bytes:
        self.count += 1
        data = f"{who} write {self.count} of round {self.seed}\n".encode() * self.rng.randrange(1, 200)
        self.written.add(data)
        return data

    def step(self, who: str, docs) -> None:
        kind = self.rng.choice(["write", "write", "save", "rename", "move", "delete", "mkdir", "rmtree"])
        p = self.path()
        if kind == "rename":
            q = os.path.join(os.path.dirname(p), self.rng.choice(NAMES))
        elif kind == "move":
            q = self.path()
        elif kind in ("mkdir", "rmtree"):
            p, q = self.rng.choice(DIRS), ""
        else:
            q = ""
        self.log.append(f"{who}:{kind}({p}{', ' + q if q else ''})")
        full = os.path.join(docs, p)
        try:
            if kind == "write":
                write_fsync(full, self.payload(who))
            elif kind == "save":
                tmp = full + ".tmp"
                write_fsync(tmp, self.payload(who))
                os.rename(tmp, full)
                dfd = os.open(os.path.dirname(full), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            elif kind in ("rename", "move"):
                os.rename(full, os.path.join(docs, q))
            elif kind == "delete":
                os.unlink(full)
            elif kind == "mkdir":
                os.mkdir(full)
            elif kind == "rmtree":
                shutil.rmtree(full)
        except OSError:
            pass  # a missing path or a name in the way: what a user would see too


def crash_and_remount(u: Ubiq) -> None:
    pid = int(u.daemon_record()["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="daemon to die")
    subprocess.run(["fusermount3", "-uz", str(u.mnt)], capture_output=True)
    u.mount("--upload-delay-ms", "1500", "--pull-interval-ms", "100")


def kill_and_restart_server(u: Ubiq, rng: random.Random) -> str:
    """`kill -9` of one of the account's `ubiqfs serve` processes, started again on its port:
    devices meet refused connections and lost replies meanwhile."""
    servers = _cloud_account(u.cloud_key).servers
    i = rng.randrange(len(servers))
    s = servers[i]
    os.kill(s.pid, signal.SIGKILL)
    s.proc.wait(timeout=10)
    s.start()
    return f"kill -9 server {i}"


def run_random_workload(devices: list, rounds: int, first_seed: int) -> None:
    names = "ABC"
    written: set[bytes] = set()
    for rnd in range(rounds):
        seed = first_seed + rnd
        w = Workload(seed, written)
        crash_at = w.rng.randrange(OPS_PER_ROUND) if w.rng.random() < 0.4 else -1
        victim = w.rng.choice(devices)
        server_kill_at = w.rng.randrange(OPS_PER_ROUND) if CLOUD_MODE != "embedded" and w.rng.random() < 0.4 else -1
        for i in range(OPS_PER_ROUND):
            u = w.rng.choice(devices)
            w.step(names[devices.index(u)], str(u.docs))
            if i == crash_at:
                w.log.append(f"kill -9 {names[devices.index(victim)]}")
                crash_and_remount(victim)
            if i == server_kill_at:
                w.log.append(kill_and_restart_server(devices[0], w.rng))
        for _ in range(3):
            for u in devices:
                u.sync(timeout=60)
            time.sleep(0.6)
        what = f"seed {seed}: {w.log}"
        first = devices[0]
        for other in devices[1:]:
            wait_for(lambda: tree(first.docs) == tree(other.docs), timeout=30,
                     what=f"the same tree on every device, {what}")
        for path, content in tree(first.docs).items():
            if content is not None:
                assert content in written, f"{path} holds bytes nobody wrote; {what}"
        for u in devices:
            q = u.status()[0]["queue"]
            assert q["pendingItems"] == 0 and q["pendingDeletes"] == 0 and not q["failing"], (q, what)


def test_two_devices_converge_under_a_random_workload(pair):  # noqa: F811
    run_random_workload(list(pair), ROUNDS, BASE_SEED)


def test_three_devices_converge_under_a_random_workload(pair, tmp_path_factory):  # noqa: F811
    a, b = pair
    with another_device(a, tmp_path_factory, "third") as c:
        c.mount("--upload-delay-ms", "1500", "--pull-interval-ms", "100")
        run_random_workload([a, b, c], max(1, ROUNDS // 2), BASE_SEED + 500)
