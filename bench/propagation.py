#!/usr/bin/env python3
"""Two-mount propagation through a real `ubiqfs serve`: how long until a change made on one
mount (device A) is visible on another (device B). Not part of the test suite.

    python3 bench/propagation.py [--n 100] [--out docs/benchmarks-propagation.md]

Starts one server (embedded engine) on a loopback port, one account, two devices (separate
state folders, separate daemons), and measures create / modify / rename / delete visibility
on B by polling every 5 ms. Everything it starts is stopped at the end, even on failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("UBIQFS_BIN", ROOT / ".build" / "release" / "ubiqfs"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args, env=None, check=True):
    return subprocess.run([str(BIN), *map(str, args)], env=env, check=check, capture_output=True, text=True)


def wait_until(pred, timeout=30.0):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            if pred():
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.005)
    raise TimeoutError("change never became visible")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks-propagation.md"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ubiq-prop-", dir="/var/tmp"))
    port = free_port()
    server = None
    devices = []
    try:
        data = tmp / "server"
        server = subprocess.Popen([str(BIN), "serve", "--listen", f"127.0.0.1:{port}", "--data", data],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        token = None
        for _ in range(200):
            try:
                token = run("server", "account", "create", "bench", "--data", data).stdout.strip().split()[-1]
                break
            except subprocess.CalledProcessError:
                time.sleep(0.05)
        time.sleep(0.3)
        for name in ("a", "b"):
            env = dict(os.environ, UBIQFS_STATE_DIR=str(tmp / f"state-{name}"))
            mnt = tmp / f"mnt-{name}"
            mnt.mkdir()
            run("account", "login", "--server", f"http://127.0.0.1:{port}", "--token", token, "--device", name, env=env)
            run("mount", "iCloud.default", mnt, "--upload-delay-ms", "0", env=env)
            devices.append((env, mnt))
        a, b = devices[0][1] / "Documents", devices[1][1] / "Documents"
        results = {"create": [], "modify": [], "rename": [], "delete": []}
        for i in range(args.n):
            name = f"f{i}.txt"
            (a / name).write_text("one\n")
            results["create"].append(wait_until(lambda: (b / name).exists()))
            wait_until(lambda: (b / name).read_text() == "one\n")
            (a / name).write_text("two\n")
            results["modify"].append(wait_until(lambda: (b / name).read_text() == "two\n"))
            os.rename(a / name, a / f"r{i}.txt")
            results["rename"].append(wait_until(lambda: (b / f"r{i}.txt").exists() and not (b / name).exists()))
            os.unlink(a / f"r{i}.txt")
            results["delete"].append(wait_until(lambda: not (b / f"r{i}.txt").exists()))
        lines = [
            "# Two-mount propagation",
            "",
            f"Measured by `python3 bench/propagation.py --n {args.n}` ({time.strftime('%Y-%m-%d %H:%M')} UTC): two",
            "daemons (separate state folders) of one account on one `ubiqfs serve` (embedded engine) over",
            "loopback, release build, `--upload-delay-ms 0`. Time from the change returning on device A",
            "to it being visible on device B (polled every 5 ms). Target: p50 <= 1 s, p99 <= 3 s.",
            "",
            "| change | n | p50 | p90 | p99 | max |",
            "|---|---|---|---|---|---|",
        ]
        for k, v in results.items():
            lines.append(
                f"| {k} | {len(v)} | {pct(v, 50) * 1000:.0f} ms | {pct(v, 90) * 1000:.0f} ms | "
                f"{pct(v, 99) * 1000:.0f} ms | {max(v) * 1000:.0f} ms |")
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        for env, mnt in devices:
            run("unmount", mnt, env=env, check=False)
        if server:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
