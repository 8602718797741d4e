#!/usr/bin/env python3
"""A bounded load test of `ubiqfs serve` on loopback: CLIENTS simulated devices (ACCOUNTS
accounts, the devices spread over them) sync through the HTTP API for SECONDS, and the run
reports latency percentiles per request kind, errors, and the server's memory.

Each device is two threads, as a mount is: a writer that uploads a new chunk (1-64 KiB) and
commits a file record, edits one of its files, or deletes one (60/30/10), with a pause of
50-250 ms between operations; and a puller that long-polls the change feed, reads the pages
and downloads one chunk of every tenth record it sees. Answers 409 (another device of the
account moved first) are the protocol working and counted apart; any other non-2xx, and any
connection failure, is an error.

    python3 bench/load.py [--clients 50] [--accounts 10] [--seconds 180] [--engine embedded|scale]

UBIQFS_BIN names the binary (default .build/release/ubiqfs). The results go to
bench/load-results.json and a Markdown table to stdout (for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "Tests" / "server"))
os.environ.setdefault("UBIQFS_BIN", str(ROOT / ".build" / "release" / "ubiqfs"))

import ubiqstack  # noqa: E402
from ubiqstack import Api, EmbeddedStorage, ScaleStack, ServerProcess, create_account  # noqa: E402

CONTAINER = "iCloud.com.example.load"


class Stats:
    """Latencies (seconds) per request kind, and outcomes; shared by every thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.conflicts = 0

    def record(self, kind: str, seconds: float, status: int | None):
        with self.lock:
            self.latency.setdefault(kind, []).append(seconds)
            if status == 409:
                self.conflicts += 1
            elif status is None or status >= 300:
                key = f"{kind} {status if status is not None else 'connection'}"
                self.errors[key] = self.errors.get(key, 0) + 1


def timed_request(stats: Stats, kind: str, api: Api, method: str, path: str, body=None, headers=None,
                  timeout: float = 30):
    t0 = time.perf_counter()
    try:
        r = api.request(method, path, body=body, headers=headers, timeout=timeout)
    except OSError:
        stats.record(kind, time.perf_counter() - t0, None)
        return None
    stats.record(kind, time.perf_counter() - t0, r.status)
    return r


class Device:
    def __init__(self, api: Api, stats: Stats, stop: threading.Event, seed: int):
        self.api, self.stats, self.stop = api, stats, stop
        self.rng = random.Random(seed)
        self.mine: dict[str, str] = {}  # item id -> etag
        self.seen_chunks: list[str] = []
        self.cq = f"/v1/containers/{Api.q(CONTAINER)}"

    def put_file(self, item_id: str, if_match: str | None):
        data = self.rng.randbytes(self.rng.randint(1024, 64 * 1024))
        digest = hashlib.sha256(data).hexdigest()
        if timed_request(self.stats, "PUT chunk", self.api, "PUT", f"/v1/chunks/{digest}", body=data) is None:
            return
        record = {
            "itemID": item_id, "parentID": "documents", "name": f"{item_id}.bin", "kind": 1, "mode": 0o644,
            "size": len(data), "mtimeNs": time.time_ns(), "xattrs": {}, "chunks": [{"hash": digest, "length": len(data)}],
            "etag": "", "deleted": False, "changeSeq": 0, "deviceID": "load",
        }
        headers = {"If-Match": f'"{if_match}"'} if if_match else {}
        r = timed_request(self.stats, "PUT item", self.api, "PUT", f"{self.cq}/items/{item_id}", body=record,
                          headers=headers)
        if r is not None and r.status in (200, 201):
            self.mine[item_id] = r.json()["etag"]

    def writer(self):
        while not self.stop.is_set():
            op = self.rng.random()
            if op < 0.6 or not self.mine:
                self.put_file(uuid.uuid4().hex, None)
            elif op < 0.9:
                item_id = self.rng.choice(list(self.mine))
                self.put_file(item_id, self.mine[item_id])
            else:
                item_id = self.rng.choice(list(self.mine))
                etag = self.mine.pop(item_id)
                timed_request(self.stats, "DELETE item", self.api, "DELETE",
                              f"{self.cq}/items/{item_id}?device=load", headers={"If-Match": f'"{etag}"'})
            self.stop.wait(self.rng.uniform(0.05, 0.25))

    def puller(self):
        since = 0
        while not self.stop.is_set():
            r = timed_request(self.stats, "GET changes", self.api, "GET", f"{self.cq}/changes?since={since}&limit=1000")
            if r is None or r.status != 200:
                self.stop.wait(1)
                continue
            page = r.json()
            for i, item in enumerate(page["items"]):
                if i % 10 == 0 and item.get("chunks"):
                    h = item["chunks"][0]["hash"]
                    timed_request(self.stats, "GET chunk", self.api, "GET", f"/v1/chunks/{h}")
            since = page["token"]
            if page["hasMore"]:
                continue
            # The push channel: a long-poll (not a latency figure: it waits on purpose).
            try:
                self.api.request("GET", f"{self.cq}/changes/wait?since={since}&timeout=5000", timeout=30)
            except OSError:
                self.stop.wait(1)


def rss_sampler(pid: int, stop: threading.Event, samples: list[int]):
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    samples.append(int(line.split()[1]) * 1024)
        except OSError:
            pass
        stop.wait(0.5)


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--accounts", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--engine", choices=["embedded", "scale"], default="embedded")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "load-results.json")
    args = ap.parse_args()
    ubiqstack.UBIQFS_BIN = os.environ["UBIQFS_BIN"]

    work = Path(tempfile.mkdtemp(prefix="ubiqfs-load-"))
    stack = None
    server = None
    try:
        if args.engine == "scale":
            stack = ScaleStack().start()
            storage = stack.storage()
        else:
            storage = EmbeddedStorage(work / "data")
        server = ServerProcess(storage, work / "serve.log").start()
        apis = []
        for a in range(args.accounts):
            token = create_account(storage, f"load-{a}-{uuid.uuid4().hex[:6]}")
            setup = Api(server.url, token)
            setup.ensure_container(CONTAINER)
            apis.append(setup)
        stats, stop = Stats(), threading.Event()
        devices = []
        for c in range(args.clients):
            account = apis[c % len(apis)]
            device_token = account.post("/v1/devices", {"name": f"device-{c}"}).json()["token"]
            devices.append(Device(account.with_token(device_token), stats, stop, seed=c))
        rss: list[int] = []
        threads = [threading.Thread(target=rss_sampler, args=(server.pid, stop, rss), daemon=True)]
        for d in devices:
            threads += [threading.Thread(target=d.writer, daemon=True), threading.Thread(target=d.puller, daemon=True)]
        started = time.time()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        elapsed = time.time() - started
        for t in threads:
            t.join(timeout=60)
        alive = server.proc.poll() is None
    finally:
        if server:
            server.stop()
        if stack:
            stack.stop()

    rows = []
    for kind in sorted(stats.latency):
        v = sorted(stats.latency[kind])
        rows.append({
            "kind": kind, "count": len(v), "per_s": len(v) / elapsed,
            "p50_ms": percentile(v, 50) * 1000, "p99_ms": percentile(v, 99) * 1000, "max_ms": v[-1] * 1000,
        })
    result = {
        "engine": args.engine, "clients": args.clients, "accounts": args.accounts, "seconds": round(elapsed, 1),
        "requests": sum(r["count"] for r in rows), "errors": stats.errors, "conflicts": stats.conflicts,
        "server_alive": alive, "rss_max_mib": round(max(rss) / 2**20, 1) if rss else None,
        "rss_end_mib": round(rss[-1] / 2**20, 1) if rss else None, "rows": rows,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.clients} clients ({args.accounts} accounts), {args.engine} engine, {elapsed:.0f} s: "
          f"{result['requests']} requests, {sum(stats.errors.values())} errors {stats.errors or ''}, "
          f"{stats.conflicts} conflicts (409), server RSS max {result['rss_max_mib']} MiB, "
          f"end {result['rss_end_mib']} MiB, server {'up' if alive else 'DOWN'}")
    print()
    print("| request | count | per s | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['count']} | {r['per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |")
    return 0 if alive and not stats.errors else 1


if __name__ == "__main__":
    sys.exit(main())
