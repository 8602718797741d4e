#!/usr/bin/env python3
"""ubiqfs benchmarks, side by side: native ext4 (a folder under /var/tmp), the FUSE limit
(libfuse's passthrough_hp example over a folder on the same disk, built from shared/fuse-limit),
ubiqfs (embedded cloud on the same disk) and rclone mount (--vfs-cache-mode full over a local
folder).
Not part of the test suite.

    python3 bench/bench.py [--quick] [--passes 3] [--only GROUP ...] [--results bench/results.json]
                           [--out docs/benchmarks.md] [--report-only]
                           [--baseline OLD_BIN --baseline-label TEXT]

Groups: io, metadata, bigdir, tree, content, durability, propagation (default: all, in one run).
With --baseline, the durability group also runs on a second mount served by an older ubiqfs build
(for example one built from the commit before a change), and the report compares the two.
Raw numbers go to a JSON results file; a run of some groups replaces every row of those groups
there and keeps the others, so one group can be re-measured alone. The markdown report (table of
ratios ubiqfs/ext4 and ubiqfs/rclone, DESIGN targets, met?) and a PNG plot next to it are then
regenerated from the whole results file. The report keeps everything after `<!-- notes -->`.

Needs: a release build (`swift build -c release`, or $UBIQFS_BIN); fio, rclone, git, make and gcc
are installed from apt when missing; matplotlib (pip) for the plot. Every mount and process it
starts is stopped at the end, even on failure.
"""

from __future__ import annotations

import argparse
import signal
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, GROUPS, ROOT, Recorder, Sizes, World, ensure_tools, load_results, now_utc  # noqa: E402
from group_content import content_rows  # noqa: E402
from group_durability import durability_rows  # noqa: E402
from group_io import io_rows  # noqa: E402
from group_metadata import bigdir_rows, metadata_rows  # noqa: E402
from group_propagation import propagation_rows  # noqa: E402
from group_tree import tree_rows  # noqa: E402
from report import write_plot, write_report  # noqa: E402


WORKLOADS = {"io": io_rows, "metadata": metadata_rows, "bigdir": bigdir_rows, "tree": tree_rows,
             "content": content_rows, "durability": durability_rows, "propagation": propagation_rows}


# --------------------------------------------------------------------------------------------
# main


def run_groups(groups, sz: Sizes, rec: Recorder, baseline_bin: Path | None = None, passes: int = 3):
    """Mounts ubiqfs, the FUSE limit and rclone in a fresh folder, runs each group `passes`
    times (every pass measures every target, so a noisy moment hits them alike; rows are the
    medians; each pass starts the order of the targets one further along, so none always
    follows the same one and pays for what it left the disk to do), unmounts everything."""
    tmp = Path(tempfile.mkdtemp(prefix="ubiq-bench-", dir="/var/tmp"))
    w = World(tmp, baseline_bin)
    try:
        w.mount_ubiq()
        w.mount_fuse_limit()
        w.mount_rclone()
        targets = w.targets()
        for group in groups:
            print(f"[{group}]", flush=True)
            rec.group = group
            t0 = time.perf_counter()
            for k in range(passes):
                print(f"[{group}] pass {k + 1} of {passes}", flush=True)
                shift = k % len(targets)
                WORKLOADS[group](w, targets[shift:] + targets[:shift], sz, rec)
            secs = time.perf_counter() - t0
            rec.finish_group(group, secs, passes)
            print(f"[{group}] done in {secs:.0f} s", flush=True)
    finally:
        w.unmount_ubiq()
        w.unmount_fuse_limit()
        w.unmount_rclone()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes, for testing: 256 MiB instead of 1 GiB, 2k/20k files instead of 10k/100k, "
                         "a 2k-file tree instead of 8k, 1600 small files instead of 6400, propagation n=10 not 30")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="markdown report; the plot goes next to it (same name, .png)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results.json"), help="raw results (JSON)")
    ap.add_argument("--only", choices=GROUPS, action="append", help="run only these groups (default: all)")
    ap.add_argument("--baseline", type=Path, help="an older ubiqfs binary the durability group also measures")
    ap.add_argument("--baseline-label", default="baseline", help="what the baseline is, for the report")
    ap.add_argument("--report-only", action="store_true", help="measure nothing; regenerate report and plot")
    ap.add_argument("--passes", type=int, default=3, help="passes of each group; rows are medians (default 3)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` still unmounts
    out, results = Path(args.out), Path(args.results)
    if not args.report_only:
        if not BIN.exists():
            sys.exit(f"build first: swift build -c release ({BIN} missing)")
        ensure_tools()
        groups = [g for g in GROUPS if g in (args.only or GROUPS)]
        run = {"id": now_utc(), "started": now_utc().replace("T", " ").replace("Z", " UTC"),
               "command": " ".join(["python3 bench/bench.py", *sys.argv[1:]]), "quick": args.quick,
               "passes": args.passes}
        if args.baseline:
            run["baseline"] = args.baseline_label
        run_groups(groups, Sizes(args.quick), Recorder(results, run), args.baseline, max(1, args.passes))
    data = load_results(results)
    if not data["rows"]:
        sys.exit(f"no results in {results}")
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    try:
        write_plot(data, png)
    except ImportError as e:
        print(f"no plot ({e})")
        png = None
    write_report(data, out, png, results)


if __name__ == "__main__":
    main()
