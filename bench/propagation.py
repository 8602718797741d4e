#!/usr/bin/env python3
"""Two-mount propagation through a real `ubiqfs serve`: how long until a change made on one
mount (device A) is visible on another (device B). Not part of the test suite.

    python3 bench/propagation.py [--n 100] [--out docs/benchmarks-propagation.md]

Starts one server (embedded engine) on a loopback port, one account, two devices (separate
state folders, separate daemons), and measures create / modify / rename / delete visibility
on B by polling every 5 ms. Everything it starts is stopped at the end, even on failure.

bench/group_propagation.py imports `measure`, `pct` and `lost` from here for the propagation rows
of bench/bench.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("UBIQFS_BIN", ROOT / ".build" / "release" / "ubiqfs"))
CHANGES = ("create", "modify", "rename", "delete")
LOST_AFTER_S = 10.0  # a change not visible on B by then is counted as lost (inf), and the run goes on


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(binary, *args, env=None, check=True):
    """Runs the ubiqfs binary with `args`, capturing its output."""
    return subprocess.run([str(binary), *map(str, args)], env=env, check=check, capture_output=True, text=True)


def wait_until(pred, timeout=30.0):
    """Polls `pred` every 5 ms; returns the seconds it took to become true."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            if pred():
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.005)
    raise TimeoutError("change never became visible")


def visible(pred, timeout=LOST_AFTER_S):
    """Like wait_until, but a change not visible after `timeout` counts as lost: inf."""
    try:
        return wait_until(pred, timeout)
    except TimeoutError:
        return float("inf")


def pct(values, p):
    """The p-th percentile of `values` (nearest rank)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def stop(proc):
    """SIGTERM, then SIGKILL after 20 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(binary, data: Path):
    """Starts `ubiqfs serve` on a free loopback port; returns (process, url, account token)."""
    port = free_port()
    data.mkdir(parents=True, exist_ok=True)
    log = data.parent / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([str(binary), "serve", "--listen", f"127.0.0.1:{port}", "--data", str(data)],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(200):
            try:
                token = run(binary, "server", "account", "create", "bench", "--data", data).stdout.strip().split()[-1]
                break
            except subprocess.CalledProcessError:
                time.sleep(0.05)
        else:
            raise RuntimeError("could not create the server account")
        # The account is made in the data folder directly; wait until the server listens.
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"ubiqfs serve is not listening on port {port}: {log.read_text()[-500:]}")
    except BaseException:
        stop(server)
        raise
    return server, f"http://127.0.0.1:{port}", token


def measure_changes(a: Path, b: Path, n: int):
    """Makes n create/modify/rename/delete changes under `a`; times each until visible under `b`
    (inf: not visible after LOST_AFTER_S)."""
    results = {k: [] for k in CHANGES}
    for i in range(n):
        name, renamed = f"f{i}.txt", f"r{i}.txt"
        (a / name).write_text("one\n")
        results["create"].append(visible(lambda: (b / name).exists()))
        visible(lambda: (b / name).read_text() == "one\n")
        (a / name).write_text("two\n")
        results["modify"].append(visible(lambda: (b / name).read_text() == "two\n"))
        os.rename(a / name, a / renamed)
        results["rename"].append(visible(lambda: (b / renamed).exists() and not (b / name).exists()))
        os.unlink(a / renamed)
        results["delete"].append(visible(lambda: not (b / renamed).exists()))
    return results


def lost(values):
    """How many changes never became visible."""
    return sum(1 for v in values if v == float("inf"))


def ms(seconds):
    return "lost" if seconds == float("inf") else f"{seconds * 1000:.0f} ms"


def measure(n: int, binary=BIN) -> dict[str, list[float]]:
    """One server, two mounted devices of one account; returns seconds per change kind.

    Everything started (server, both daemons, the temporary folder) is gone when this returns
    or raises."""
    tmp = Path(tempfile.mkdtemp(prefix="ubiq-prop-", dir="/var/tmp"))
    server = None
    devices = []
    try:
        server, url, token = start_server(binary, tmp / "server")
        for name in ("a", "b"):
            env = dict(os.environ, UBIQFS_STATE_DIR=str(tmp / f"state-{name}"))
            env.pop("UBIQFS_CLOUD_DIR", None)
            mnt = tmp / f"mnt-{name}"
            mnt.mkdir()
            run(binary, "account", "login", "--server", url, "--token", token, "--device", name, env=env)
            run(binary, "mount", "iCloud.default", mnt, "--upload-delay-ms", "0", env=env)
            devices.append((env, mnt))
        return measure_changes(devices[0][1] / "Documents", devices[1][1] / "Documents", n)
    finally:
        for env, mnt in devices:
            run(binary, "unmount", mnt, env=env, check=False)
            if str(mnt) in Path("/proc/mounts").read_text():
                subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
        if server:
            stop(server)
        shutil.rmtree(tmp, ignore_errors=True)


def report(results, n: int) -> str:
    """The markdown of docs/benchmarks-propagation.md."""
    lines = [
        "# Two-mount propagation",
        "",
        f"Measured by `python3 bench/propagation.py --n {n}` ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC): two",
        "daemons (separate state folders) of one account on one `ubiqfs serve` (embedded engine) over",
        "loopback, release build, `--upload-delay-ms 0`. Time from the change returning on device A",
        "to it being visible on device B (polled every 5 ms). Target: p50 <= 1 s, p99 <= 3 s.",
        f"`lost`: not visible on B after {LOST_AFTER_S:.0f} s (counted as infinitely late in the percentiles).",
        "",
        "| change | n | lost | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in results.items():
        lines.append(f"| {k} | {len(v)} | {lost(v)} | {ms(pct(v, 50))} | {ms(pct(v, 90))} | "
                     f"{ms(pct(v, 99))} | {ms(max(v))} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks-propagation.md"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` still cleans up
    text = report(measure(args.n), args.n)
    Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
