"""Fixtures for the end-to-end tests: every test gets its own state folder, embedded cloud and
mount point, mounted through the real `ubiqfs` binary, and always unmounted afterwards.

The helper object (`ubiq`) runs the CLI against the test's own folders, remounts, waits for
uploads and reads the embedded cloud (SQLite metadata + chunk files) directly, so a test can
compare what reached the cloud with what the mount shows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

UBIQFS_BIN = os.environ.get("UBIQFS_BIN", "/work/main/.build/debug/ubiqfs")

# ---------------------------------------------------------------------------- cloud mode
# UBIQFS_TEST_CLOUD picks the cloud the mounts sync with:
#   embedded      the in-process engine (SQLite + blob folder in <test>/cloud), the default;
#   server        a real `ubiqfs serve` over that same folder (SQLite engine), signed in with
#                 `ubiqfs account login`;
#   server-scale  `ubiqfs serve` on PostgreSQL + SeaweedFS S3 (started once per session).
# Devices sharing one cloud folder (see device2) share one server account; the second device
# talks to a second server process over the same storage.
CLOUD_MODE = os.environ.get("UBIQFS_TEST_CLOUD", "embedded")
if CLOUD_MODE not in ("embedded", "server", "server-scale"):
    raise RuntimeError(f"UBIQFS_TEST_CLOUD={CLOUD_MODE!r}: want embedded, server or server-scale")
if CLOUD_MODE != "embedded":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
    import ubiqstack  # noqa: E402

    ubiqstack.UBIQFS_BIN = UBIQFS_BIN


class _CloudAccount:
    """One server account shared by every device whose cloud folder is `key`."""

    def __init__(self, key: str, storage, servers: list, name: str, token: str, own_servers: bool):
        self.key, self.storage, self.servers = key, storage, servers
        self.name, self.token, self.own_servers = name, token, own_servers
        self.logins = 0

    def next_server(self):
        s = self.servers[self.logins % len(self.servers)]
        self.logins += 1
        return s


_ACCOUNTS: dict[str, _CloudAccount] = {}
_SCALE: dict = {}  # "stack", "servers": started on first use, stopped at session end; "logs": their folder


def pytest_configure(config):
    # The scale tier's server logs go beside the run's other files: the folder that holds
    # --basetemp (scripts/test.sh's reports folder), not into the basetemp itself, which
    # pytest empties when it first hands out a tmp_path.
    base = config.option.basetemp
    _SCALE["logs"] = Path(base).resolve().parent if base else Path(os.environ.get("TMPDIR", "/tmp"))


def _scale_servers() -> tuple:
    if "stack" not in _SCALE:
        stack = ubiqstack.ScaleStack()
        _SCALE["stack"] = stack
        stack.start()
        _SCALE["servers"] = []
        for i in range(2):
            s = ubiqstack.ServerProcess(stack.storage(), _SCALE["logs"] / f"ubiq-scale-serve-{os.getpid()}-{i}.log")
            _SCALE["servers"].append(s)
            s.start()
    return _SCALE["stack"].storage(), _SCALE["servers"]


def _cloud_account(key: str) -> _CloudAccount:
    acct = _ACCOUNTS.get(key)
    if acct is not None:
        return acct
    if CLOUD_MODE == "server":
        storage = ubiqstack.EmbeddedStorage(Path(key))
        servers = [ubiqstack.ServerProcess(storage, Path(key).parent / f"serve-{i}.log") for i in range(2)]
        acct = _CloudAccount(key, storage, servers, "tester", "", own_servers=True)
        _ACCOUNTS[key] = acct
        for s in servers:
            s.start()
        acct.token = ubiqstack.create_account(storage, acct.name)
    else:
        storage, servers = _scale_servers()
        name = f"t{abs(hash(key)) % 10**10}-{os.getpid()}"
        acct = _CloudAccount(key, storage, servers, name, ubiqstack.create_account(storage, name), own_servers=False)
        _ACCOUNTS[key] = acct
    return acct


def _stop_cloud(key: str) -> None:
    acct = _ACCOUNTS.pop(key, None)
    if acct is not None and acct.own_servers:
        for s in acct.servers:
            s.stop()


def _stop_all_clouds() -> None:
    for key in list(_ACCOUNTS):
        _stop_cloud(key)
    for s in _SCALE.pop("servers", []):
        s.stop()
    stack = _SCALE.pop("stack", None)
    if stack is not None:
        stack.stop()
DEFAULT_CONTAINER = "iCloud.default"
CLI_TIMEOUT = 90

# Every folder a test mounted under; checked once more at the end of the session.
_ROOTS: list[Path] = []
# Every daemon seen, as (pid, start time); none may outlive its test.
_DAEMONS: set[tuple[int, int]] = set()


# ---------------------------------------------------------------------------- mount table / procs


def _unescape_mountinfo(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def ubiq_mounts() -> list[str]:
    """Mount points of every fuse.ubiqfs mount on the machine."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if "-" not in parts:
                continue
            fstype = parts[parts.index("-") + 1]
            if fstype == "fuse.ubiqfs":
                found.append(_unescape_mountinfo(parts[4]))
    return found


def mounts_under(root: Path) -> list[str]:
    r = str(root)
    return [m for m in ubiq_mounts() if m == r or m.startswith(r + "/")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is as good as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with the pid, it names one process.
    pids wrap (32768 by default) and other test runs on the machine start ubiqfs processes too,
    so a pid alone may name another process by the time it is checked."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_ref(pid: int) -> tuple[int, int] | None:
    """(pid, start time) of a running process, or None."""
    start = _start_time(pid)
    return None if start is None else (pid, start)


def _still_running(ref: tuple[int, int]) -> bool:
    return _pid_alive(ref[0]) and _start_time(ref[0]) == ref[1]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def daemons_for_state(state: Path) -> list[int]:
    """Pids of ubiqfs daemons started with this --state-dir (exactly our own processes: every
    daemon is started with one)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        args = _cmdline(int(entry))
        if not args or "ubiqfs" not in os.path.basename(args[0]):
            continue
        if "--state-dir" in args:
            i = args.index("--state-dir")
            if i + 1 < len(args) and os.path.abspath(args[i + 1]) == str(state):
                pids.append(int(entry))
    return pids


def _is_ubiqfs_process(pid: int) -> bool:
    args = _cmdline(pid)
    return bool(args) and "ubiqfs" in os.path.basename(args[0])


def kill_daemon(pid: int, grace: float = 5.0, started: int | None = None) -> None:
    """SIGTERM, then SIGKILL, one daemon by pid (only if it still is a ubiqfs process, and the
    one that started at `started` when that is given)."""
    if not _pid_alive(pid) or not _is_ubiqfs_process(pid):
        return
    if started is not None and _start_time(pid) != started:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + grace
    while time.time() < deadline and _pid_alive(pid):
        time.sleep(0.05)
    if _pid_alive(pid) and _is_ubiqfs_process(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.time() + grace
        while time.time() < deadline and _pid_alive(pid):
            time.sleep(0.05)


def force_unmount(mountpoint: str) -> None:
    subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True, timeout=30)


# ---------------------------------------------------------------------------- helper object


class CLIError(AssertionError):
    pass


class Ubiq:
    """One test's ubiqfs world: state/, cloud/ and mnt/ under a fresh tmp folder."""

    def __init__(self, root: Path, container: str = DEFAULT_CONTAINER):
        self.root = root
        self.state = root / "state"
        self.cloud = root / "cloud"
        self.mnt = root / "mnt"
        self.container = container
        for d in (self.state, self.cloud, self.mnt):
            d.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env["UBIQFS_STATE_DIR"] = str(self.state)
        self.env["UBIQFS_CLOUD_DIR"] = str(self.cloud)
        self.mount_args = ["--upload-delay-ms", "100"]
        # The account whose state folders the mounts use ("local" for the embedded cloud).
        self.account = "local"
        self.api = None  # ubiqstack.Api of the signed-in account (server modes)
        self._own_cloud = str(self.cloud)

    # -- paths

    @property
    def docs(self) -> Path:
        return self.mnt / "Documents"

    def container_dir(self, container: str | None = None) -> Path:
        return self.state / "accounts" / self.account / (container or self.container)

    @property
    def daemon_log_path(self) -> Path:
        return self.container_dir() / "daemon.log"

    def daemon_log(self, container: str | None = None) -> str:
        try:
            return (self.container_dir(container) / "daemon.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def daemon_record(self, container: str | None = None) -> dict | None:
        try:
            return json.loads((self.container_dir(container) / "daemon.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    # -- CLI

    def run(self, *args, check: bool = True, timeout: float = CLI_TIMEOUT, cwd=None) -> subprocess.CompletedProcess:
        """Runs `ubiqfs ARGS` with this test's state and cloud folders."""
        cp = subprocess.run(
            [UBIQFS_BIN, *map(str, args)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or str(self.root),
        )
        if check and cp.returncode != 0:
            raise CLIError(
                f"ubiqfs {' '.join(map(str, args))} exited {cp.returncode}\n"
                f"stdout: {cp.stdout}\nstderr: {cp.stderr}\n"
                f"daemon.log (tail):\n{self.daemon_log()[-3000:]}"
            )
        return cp

    def mount(self, *extra: str) -> None:
        args = list(extra) if extra else self.mount_args
        self.ensure_cloud()
        self.run("mount", self.container, self.mnt, *args)
        assert str(self.mnt) in ubiq_mounts(), "mount returned but the kernel shows no mount"
        self._note_daemon()

    def _note_daemon(self) -> None:
        # daemon.json is written right after the kernel shows the mount; give it a moment.
        deadline = time.time() + 5
        while True:
            pids = daemons_for_state(self.state)
            rec = self.daemon_record()
            if (rec and int(rec["pid"]) in pids) or time.time() >= deadline:
                break
            time.sleep(0.02)
        _DAEMONS.update(r for r in map(process_ref, pids) if r)

    def unmount(self) -> None:
        self.run("unmount", self.mnt)
        assert str(self.mnt) not in ubiq_mounts()

    def remount(self, *extra: str) -> None:
        self.unmount()
        self.mount(*extra)

    def kill_daemon(self) -> None:
        """SIGKILL the daemon (what a crash does), wait until it is gone and detach its stale mount."""
        pid = int(self.daemon_record()["pid"])
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 30
        while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().split(")")[1].split()[0]
                # Exited, waiting to be reaped, once its last thread is gone: the main thread
                # can be a zombie while another (in an fdatasync, say) still exits and holds
                # the files, the container's lock among them.
                if state == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
                    break
            except OSError:
                break
            time.sleep(0.02)
        assert time.time() < deadline, f"daemon {pid} still alive 30 s after SIGKILL"
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
        assert str(self.mnt) not in ubiq_mounts()

    def sync(self, path: Path | str | None = None, timeout: float = 30) -> None:
        args = ["sync", "--wait"] + ([str(path)] if path is not None else []) + ["--timeout", str(timeout)]
        self.run(*args, timeout=timeout + 30)

    def status(self, path: Path | str | None = None) -> list[dict]:
        args = ["status", "--json"] + ([str(path)] if path is not None else [])
        return json.loads(self.run(*args).stdout)

    # -- cloud

    @property
    def cloud_key(self) -> str:
        """The cloud this device syncs with (devices sharing a cloud folder share an account)."""
        return str(Path(self.env.get("UBIQFS_CLOUD_DIR", self.cloud)))

    def ensure_cloud(self) -> None:
        """Server modes: make sure this state folder is signed in to the cloud's account."""
        if CLOUD_MODE == "embedded":
            return
        acct = _cloud_account(self.cloud_key)
        self.account = acct.name
        cfg = self.state / "account.json"
        if cfg.exists() and json.loads(cfg.read_text()).get("account") == acct.name:
            if self.api is None:
                self.api = ubiqstack.Api(json.loads(cfg.read_text())["server"], acct.token)
            return
        server = acct.next_server()
        self.run("account", "login", "--server", server.url, "--token", acct.token, "--device", f"dev-{self.root.name}")
        self.api = ubiqstack.Api(server.url, acct.token)

    def set_quota(self, quota: int) -> None:
        """What a cloud operator does: change the account's quota (0 = unlimited)."""
        if CLOUD_MODE == "embedded":
            db = self._cloud_db()
            try:
                db.execute("UPDATE accounts SET quotaBytes = ? WHERE name = 'local'", (quota,))
                db.commit()
            finally:
                db.close()
            return
        self.ensure_cloud()
        acct = _cloud_account(self.cloud_key)
        ubiqstack.run_cli(
            "server", "account", "quota", acct.name, str(quota), *acct.storage.args(), env_extra=acct.storage.env()
        )

    def collect_garbage(self, grace: str = "0") -> dict:
        """What a cloud operator does: `ubiqfs server gc` on the cloud's storage; returns this
        account's result ({account, chunks, bytes})."""
        if CLOUD_MODE == "embedded":
            out = self.run("server", "gc", "--grace", grace, "--json", "--data", self.cloud).stdout
        else:
            self.ensure_cloud()
            acct = _cloud_account(self.cloud_key)
            out = ubiqstack.run_cli(
                "server", "gc", "--grace", grace, "--json", *acct.storage.args(), env_extra=acct.storage.env()
            ).stdout
        mine = [r for r in map(json.loads, out.splitlines()) if r["account"] == self.account]
        assert len(mine) == 1, out
        return mine[0]

    def _cloud_db(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.cloud / "cloud.sqlite"), timeout=10)
        db.execute("PRAGMA busy_timeout = 10000")
        return db

    def cloud_items(self, container: str | None = None, include_deleted: bool = True) -> list[dict]:
        """Every cloud record of the container (decoded JSON), deleted ones too unless asked."""
        if CLOUD_MODE != "embedded":
            self.ensure_cloud()
            items = self.api.all_items(container or self.container)
            return [i for i in items if include_deleted or not i.get("deleted")]
        db = self._cloud_db()
        try:
            rows = db.execute(
                "SELECT record FROM items WHERE account = 'local' AND container = ?", (container or self.container,)
            ).fetchall()
        finally:
            db.close()
        items = [json.loads(r[0] if isinstance(r[0], (str, bytes)) else bytes(r[0])) for r in rows]
        return [i for i in items if include_deleted or not i.get("deleted")]

    def cloud_item(self, item_id: str, container: str | None = None) -> dict | None:
        for item in self.cloud_items(container):
            if item["itemID"] == item_id:
                return item
        return None

    def blob_path(self, digest: str) -> Path:
        """Where the embedded engine (also behind UBIQFS_TEST_CLOUD=server) keeps a chunk."""
        return self.cloud / "blobs" / self.account / digest[:2] / digest

    def stored_chunks(self) -> dict[str, int]:
        """hash -> size of every chunk the cloud stores for this account (any cloud mode)."""
        if CLOUD_MODE != "server-scale":
            root = self.cloud / "blobs" / self.account
            return {p.name: p.stat().st_size for p in root.rglob("*") if p.is_file() and ".tmp." not in p.name}
        self.ensure_cloud()
        pg = _SCALE["stack"].pg
        out = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "-d", "ubiq", "-At", "-F", " ", "-c",
             f"SELECT hash, size FROM chunks WHERE account = '{self.account}'"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        return {h: int(n) for h, n in (line.split() for line in out.splitlines() if line.strip())}

    def cloud_content(self, item_id: str, container: str | None = None) -> bytes:
        """The bytes the cloud holds for a file: its chunks' blobs, concatenated."""
        item = self.cloud_item(item_id, container)
        assert item is not None, f"no cloud item {item_id}"
        data = bytearray()
        for chunk in item.get("chunks", []):
            if CLOUD_MODE == "embedded":
                blob = self.blob_path(chunk["hash"]).read_bytes()
            else:
                blob = self.api.chunk(chunk["hash"])
            assert len(blob) == chunk["length"], f"blob {chunk['hash']} has {len(blob)} bytes, manifest says {chunk['length']}"
            assert hashlib.sha256(blob).hexdigest() == chunk["hash"], f"blob {chunk['hash']} is corrupt"
            data += blob
        return bytes(data)

    # -- items

    @staticmethod
    def xattr(path: Path | str, name: str) -> str:
        return os.getxattr(str(path), name, follow_symlinks=False).decode()

    def item_id(self, path: Path | str) -> str:
        return self.xattr(path, "user.ubiq.item_id")

    def cloud_item_for(self, path: Path | str) -> dict | None:
        return self.cloud_item(self.item_id(path))


# ---------------------------------------------------------------------------- fixtures / hooks


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(scope="session")
def ubiqfs_bin() -> str:
    if not os.access(UBIQFS_BIN, os.X_OK):
        pytest.exit(f"ubiqfs binary not found at {UBIQFS_BIN} (build it or set UBIQFS_BIN)", returncode=2)
    return UBIQFS_BIN


def _teardown_root(u: Ubiq) -> list[str]:
    """Unmounts everything under the test's folder and stops its daemons; returns problems."""
    problems = []
    if str(u.mnt) in ubiq_mounts():
        try:
            cp = u.run("unmount", u.mnt, check=False, timeout=60)
            if cp.returncode != 0:
                problems.append(f"ubiqfs unmount failed: {cp.stderr.strip()}")
        except subprocess.TimeoutExpired:
            problems.append("ubiqfs unmount timed out")
    for mp in mounts_under(u.root):
        # Anything still mounted (a second mount made by a test, or a failed unmount).
        try:
            subprocess.run([UBIQFS_BIN, "unmount", mp], env=u.env, capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            pass
        if mp in ubiq_mounts():
            force_unmount(mp)
    # Daemons of this state folder, by command line (every daemon.json names one of them; a pid
    # from a daemon.json alone may be reused by now).
    refs = {r for r in map(process_ref, daemons_for_state(u.state)) if r}
    deadline = time.time() + 10
    while time.time() < deadline and any(_still_running(r) for r in refs):
        time.sleep(0.05)
    for pid, started in refs:
        if _still_running((pid, started)):
            problems.append(f"daemon {pid} still running after unmount; killed")
            kill_daemon(pid, started=started)
    left = mounts_under(u.root)
    if left:
        problems.append(f"mounts left behind: {left}")
    if CLOUD_MODE != "embedded" and u.cloud_key == u._own_cloud:
        _stop_cloud(u._own_cloud)
    return problems


@contextlib.contextmanager
def another_device(first: Ubiq, tmp_path_factory, name: str):
    """A second device of `first`'s account: its own state folder and mount point, the same
    cloud. When the block ends, everything it mounted or started is stopped, and a mount left
    behind fails the test."""
    root = tmp_path_factory.mktemp(name)
    _ROOTS.append(root)
    device = Ubiq(root)
    device.cloud = first.cloud
    device.env["UBIQFS_CLOUD_DIR"] = str(first.cloud)
    try:
        yield device
    finally:
        problems = _teardown_root(device)
        assert not [m for m in ubiq_mounts() if m.startswith(str(root))], problems


@pytest.fixture
def ubiq(tmp_path_factory, request, ubiqfs_bin):
    root = tmp_path_factory.mktemp("ubiq")
    _ROOTS.append(root)
    u = Ubiq(root)
    try:
        u.mount()
        yield u
    finally:
        problems = _teardown_root(u)
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"---- daemon.log ({u.daemon_log_path}) tail ----")
            print(u.daemon_log()[-6000:])
        # A test that left a file open inside the mount makes unmount fail; the forced unmount
        # above still cleaned up. Report only what could not be cleaned.
        leftover = mounts_under(root)
        assert not leftover, f"mounts left behind: {leftover}; problems: {problems}"


@pytest.fixture(scope="session", autouse=True)
def _no_mounts_left_behind():
    try:
        yield
    finally:
        _stop_all_clouds()
    problems = []
    for root in _ROOTS:
        for mp in mounts_under(root):
            problems.append(f"mount left behind: {mp}")
            force_unmount(mp)
    for pid, started in sorted(_DAEMONS):
        if _still_running((pid, started)):
            problems.append(f"daemon left running: pid {pid}")
            kill_daemon(pid, started=started)
    assert not problems, "; ".join(problems)
