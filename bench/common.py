"""What every benchmark group shares: the constants, shell and timing helpers, the sizes of a
run, the three targets (ext4, ubiqfs, rclone) and the recorder that merges rows into the
results file."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import propagation  # bench/propagation.py

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("UBIQFS_BIN", ROOT / ".build" / "release" / "ubiqfs"))
MIB = 1024 * 1024
GROUPS = ["io", "metadata", "bigdir", "tree", "content", "durability", "propagation"]
TARGET_NAMES = ["ext4", "fuse_limit", "ubiqfs", "rclone"]
# libfuse's passthrough_hp over ext4: the fastest any FUSE filesystem can be on this kernel.
FUSE_LIMIT_SRC = Path(os.environ.get("UBIQFS_FUSE_LIMIT_SRC", ROOT.parent / "shared" / "fuse-limit"))
FUSE_LIMIT_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ubiqfs" / "fuse-limit" / "passthrough_hp"
# An older ubiqfs build (--baseline), measured by the groups that compare builds.
VALUE_NAMES = TARGET_NAMES + ["baseline"]
DRAIN_TIMEOUT_S = 3600


# --------------------------------------------------------------------------------------------
# helpers

# Commands the groups run, and the Debian package of each.
TOOLS = {"fio": "fio", "rclone": "rclone", "git": "git", "make": "make", "cc": "gcc", "tar": "tar"}


def ensure_tools():
    """Installs (apt) the packages of the commands the groups run that are missing."""
    missing = sorted({pkg for cmd, pkg in TOOLS.items() if shutil.which(cmd) is None})
    if missing:
        print(f"installing {', '.join(missing)} (apt)", flush=True)
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", *missing], check=True, env=env)


def sh(*args, check=True, env=None, cwd=None, capture=True):
    """Runs a command; output captured (text) unless capture=False, then it goes to /dev/null."""
    out = None if capture else subprocess.DEVNULL
    return subprocess.run([str(a) for a in args], check=check, env=env, cwd=cwd, text=True,
                          capture_output=capture, stdout=out, stderr=out)


def drop_caches():
    """sync, then drop page cache, dentries and inodes (FUSE mounts get FORGETs)."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn):
    """Seconds `fn()` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def mounted(path: Path) -> bool:
    """Whether `path` is a mount point in /proc/mounts."""
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def remove_tree(path: Path, tries=600):
    """rm -rf, retried for up to ~5 min: rclone answers EIO to rmdir while its write-back of the
    folder's files is still going on."""
    for _ in range(tries):
        if subprocess.run(["rm", "-rf", str(path)], capture_output=True).returncode == 0 and not path.exists():
            return
        time.sleep(0.5)
    raise RuntimeError(f"could not remove {path}")


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Sizes:
    """Workload sizes: full run or --quick."""
    quick: bool

    @property
    def big_bytes(self):  # sequential I/O, upload drain, streaming
        return (256 if self.quick else 1024) * MIB

    @property
    def many(self):  # metadata group
        return 2000 if self.quick else 10000

    @property
    def huge(self):  # bigdir group
        return 20000 if self.quick else 100000

    @property
    def tree_files(self):  # tree group
        return 2000 if self.quick else 8000

    @property
    def tree_bytes(self):
        return (40 if self.quick else 160) * MIB

    @property
    def small_copy(self):  # cp -r of small files
        return 1600 if self.quick else 6400

    @property
    def fsync_n(self):  # durability group: files created, appends
        return 300 if self.quick else 1000

    @property
    def prop_n(self):  # propagation rounds
        return 10 if self.quick else 30


def human_bytes(n: int) -> str:
    return f"{n // (1024 * MIB)} GiB" if n >= 1024 * MIB and n % (1024 * MIB) == 0 else f"{n // MIB} MiB"


def count(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


# --------------------------------------------------------------------------------------------
# the three targets


class Target:
    """A directory to run workloads in, and how to make its uploads complete."""

    def __init__(self, name, path, drain=None):
        self.name = name
        self.path = Path(path)
        self.drain = drain or (lambda: None)


def start_fuse_process(argv, mnt: Path, what: str) -> subprocess.Popen:
    """Starts a FUSE filesystem that runs in the foreground and waits until `mnt` is mounted."""
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 20
    while time.time() < deadline and not mounted(mnt):
        time.sleep(0.1)
    if not mounted(mnt):
        raise RuntimeError(f"{what} did not mount {mnt}")
    return proc


def stop_fuse_process(proc: subprocess.Popen | None, mnt: Path):
    """Unmounts `mnt` and stops its process; a mount that stays busy is detached lazily."""
    if mounted(mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    if proc:
        propagation.stop(proc)
    if mounted(mnt):
        subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)


class World:
    """The temporary folder, the ubiqfs mount (embedded cloud) and the rclone mount."""

    def __init__(self, tmp: Path, baseline_bin: Path | None = None):
        self.tmp = tmp
        self.env = dict(os.environ)
        self.env["UBIQFS_STATE_DIR"] = str(tmp / "ubiq-state")
        self.env["UBIQFS_CLOUD_DIR"] = str(tmp / "ubiq-cloud")
        self.baseline_bin = baseline_bin
        self.baseline_env = dict(os.environ)
        self.baseline_env["UBIQFS_STATE_DIR"] = str(tmp / "baseline-state")
        self.baseline_env["UBIQFS_CLOUD_DIR"] = str(tmp / "baseline-cloud")
        self.baseline_mnt = tmp / "baseline-mnt"
        self.ubiq_mnt = tmp / "ubiq-mnt"
        self.rclone_src = tmp / "rclone-src"
        self.rclone_mnt = tmp / "rclone-mnt"
        self.rclone_proc = None
        self.limit_src = tmp / "fuse-limit-src"
        self.limit_mnt = tmp / "fuse-limit-mnt"
        self.limit_proc = None
        self.native = tmp / "native"
        for d in (self.ubiq_mnt, self.rclone_src, self.rclone_mnt, self.native, self.limit_src, self.limit_mnt):
            d.mkdir(parents=True, exist_ok=True)

    def ubiq(self, *args, check=True):
        return sh(BIN, *args, env=self.env, check=check)

    def mount_ubiq(self, *extra):
        self.ubiq("mount", "iCloud.default", self.ubiq_mnt, "--upload-delay-ms", "200", *extra)

    def drain_ubiq(self):
        """Returns when everything on the ubiqfs mount is uploaded."""
        self.ubiq("sync", "--wait", self.ubiq_mnt, "--timeout", DRAIN_TIMEOUT_S)

    def unmount_ubiq(self):
        if mounted(self.ubiq_mnt):
            self.ubiq("unmount", self.ubiq_mnt, check=False)
        if mounted(self.ubiq_mnt):  # still busy: detach lazily so the daemon can go
            subprocess.run(["fusermount3", "-uz", str(self.ubiq_mnt)], check=False)

    def mount_baseline(self) -> Target:
        """Mounts the --baseline build like ubiqfs (own state and cloud folders) and returns it
        as the target named "baseline"."""
        self.baseline_mnt.mkdir(exist_ok=True)
        sh(self.baseline_bin, "mount", "iCloud.default", self.baseline_mnt, "--upload-delay-ms", "200",
           env=self.baseline_env)

        def drain():
            sh(self.baseline_bin, "sync", "--wait", self.baseline_mnt, "--timeout", DRAIN_TIMEOUT_S,
               env=self.baseline_env)

        return Target("baseline", self.baseline_mnt / "Documents", drain)

    def unmount_baseline(self):
        if mounted(self.baseline_mnt):
            sh(self.baseline_bin, "unmount", self.baseline_mnt, env=self.baseline_env, check=False)
        if mounted(self.baseline_mnt):
            subprocess.run(["fusermount3", "-uz", str(self.baseline_mnt)], check=False)

    def mount_fuse_limit(self):
        """libfuse's passthrough_hp over a folder on the same disk (built once from
        shared/fuse-limit into ~/.cache/ubiqfs/fuse-limit)."""
        if not os.access(FUSE_LIMIT_BIN, os.X_OK):
            sh("bash", FUSE_LIMIT_SRC / "build.sh", FUSE_LIMIT_BIN.parent)
        self.limit_proc = start_fuse_process(
            [FUSE_LIMIT_BIN, "--foreground", self.limit_src, self.limit_mnt], self.limit_mnt, "passthrough_hp")

    def unmount_fuse_limit(self):
        stop_fuse_process(self.limit_proc, self.limit_mnt)

    def mount_rclone(self):
        self.rclone_proc = start_fuse_process(
            ["rclone", "mount", self.rclone_src, self.rclone_mnt, "--vfs-cache-mode", "full",
             "--cache-dir", self.tmp / "rclone-cache", "--config", "/dev/null"], self.rclone_mnt, "rclone mount")

    def unmount_rclone(self):
        stop_fuse_process(self.rclone_proc, self.rclone_mnt)

    def targets(self):
        return [
            Target("ext4", self.native),
            Target("fuse_limit", self.limit_mnt),
            Target("ubiqfs", self.ubiq_mnt / "Documents", self.drain_ubiq),
            Target("rclone", self.rclone_mnt),
        ]

    def drain_all(self, targets):
        for t in targets:
            t.drain()


# --------------------------------------------------------------------------------------------
# results: rows, merged into a JSON file


class Recorder:
    """Collects the rows of one run; each finished group is merged into the results file.
    A group runs several passes; a row measured in several passes is recorded as the median
    of each target's values, with every pass's value kept next to it (`passes`)."""

    def __init__(self, path: Path, run: dict):
        self.path = path
        self.run = run
        self.rows: list[dict] = []
        self.group = None

    def row(self, key, name, unit, values, higher_is_better=True):
        """Records one measured row of the current group (one pass) and prints it."""
        self.rows.append({
            "key": key, "name": name, "unit": unit, "group": self.group,
            "values": {k: values[k] for k in VALUE_NAMES if k in values},
            "higher_is_better": higher_is_better, "measured_at": now_utc(), "run": self.run["id"],
        })
        print(f"  {name:58} " + "  ".join(f"{k}={v:.2f}" for k, v in values.items()), flush=True)

    @staticmethod
    def medians(rows: list[dict]) -> list[dict]:
        """One row per key: each target's median over the passes that measured it, the values
        of every pass in `passes`, the last pass's time in `measured_at`."""
        by_key: dict[str, list[dict]] = {}
        for r in rows:
            by_key.setdefault(r["key"], []).append(r)
        out = []
        for same in by_key.values():
            row = dict(same[-1])
            names = [k for k in VALUE_NAMES if any(k in r["values"] for r in same)]
            row["passes"] = {k: [r["values"][k] for r in same if k in r["values"]] for k in names}
            row["values"] = {k: statistics.median(v) for k, v in row["passes"].items()}
            out.append(row)
        return out

    def finish_group(self, group, seconds, passes=1):
        """Merges the rows of `group` into the results file (replacing that group's old rows)."""
        self.run.setdefault("groups", {})[group] = {
            "seconds": round(seconds, 1), "finished_at": now_utc(), "passes": passes}
        data = load_results(self.path)
        data["runs"][self.run["id"]] = self.run
        mine = self.medians([r for r in self.rows if r["group"] == group])
        data["rows"] = [r for r in data["rows"] if r["group"] != group] + mine
        data["rows"].sort(key=lambda r: GROUPS.index(r["group"]) if r["group"] in GROUPS else len(GROUPS))
        used = {r["run"] for r in data["rows"]}
        data["runs"] = {k: v for k, v in data["runs"].items() if k in used}
        save_results(self.path, data)


def load_results(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"version": 1, "runs": {}, "rows": []}


def save_results(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
