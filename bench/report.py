"""The DESIGN targets, and the markdown report and PNG plot made from the results file."""

from __future__ import annotations

from pathlib import Path

from common import GROUPS, ROOT, TARGET_NAMES


# --------------------------------------------------------------------------------------------
# DESIGN targets


# row key -> [(kind, reference, bound, text)]. Kinds, on ubiqfs's value u and the reference's r:
# "min_ratio" u/r >= bound, "gt_ratio" u/r > bound (rates); "max_ratio" u/r <= bound (times);
# "max" u <= bound (absolute, in the row's unit).
TARGETS = {}
for _j in (1, 4):
    TARGETS[f"seq_write_{_j}"] = [("min_ratio", "ext4", 0.9, ">= 0.9x ext4")]
    TARGETS[f"seq_read_{_j}"] = [("min_ratio", "ext4", 0.9, ">= 0.9x ext4")]
    TARGETS[f"seq_reread_{_j}"] = [("min_ratio", "ext4", 0.9, "~1.0x ext4 (>= 0.9x)")]
for _k in ("ls_many", "ls_many_cold", "ls_huge", "ls_huge_cold"):
    TARGETS[_k] = [("max_ratio", "ext4", 2.0, "<= 2x ext4 time")]
for _k in ("create_many", "remove_many", "create_huge"):
    TARGETS[_k] = [("gt_ratio", "rclone", 1.0, "> rclone")]
TARGETS["stat_many"] = [("gt_ratio", "rclone", 1.0, "> rclone"), ("min_ratio", "ext4", 0.9, "~ext4 (>= 0.9x)")]
TARGETS["evicted_ttfb"] = [("max", None, 20.0, "<= 20 ms")]
TARGETS["evicted_stream"] = [("min_ratio", "ext4", 0.8, ">= 0.8x raw read*")]
TARGETS["upload_drain"] = [("max_ratio", "ext4", 1.3, "<= 1.3x raw write*")]
TARGETS["edit_delta"] = [("max", None, 3.0, "< 3 %")]
for _kind in ("create", "modify"):
    TARGETS[f"prop_{_kind}_p50"] = [("max", None, 1000.0, "<= 1 s")]
    TARGETS[f"prop_{_kind}_p99"] = [("max", None, 3000.0, "<= 3 s")]
TARGETS["prop_lost"] = [("max", None, 0.0, "none")]
# Namespace goals against what FUSE allows on this kernel (the FUSE limit).
for _k in ("untar", "ls_lr_tree", "find_tree_cold", "rm_tree"):
    TARGETS.setdefault(_k, []).append(("max_ratio", "fuse_limit", 2.0, "<= 2x FUSE limit time"))
for _k in ("create_many", "remove_many"):
    TARGETS[_k].append(("min_ratio", "fuse_limit", 0.5, ">= 0.5x FUSE limit"))
TARGETS["git_status_warm"] = [("max_ratio", "ext4", 2.0, "<= 2x ext4 time")]


# What ubiqfs is compared with, and each one's color in the plot.
REFERENCES = ["ext4", "fuse_limit", "rclone"]
COLORS = {"ext4": "tab:blue", "fuse_limit": "tab:gray", "rclone": "tab:orange"}
LABELS = {"ext4": "ext4", "fuse_limit": "FUSE limit", "rclone": "rclone"}


def target_margin(row, target):
    """How far ubiqfs is from one target, normalized so that >= 1 means met (None: no data)."""
    kind, ref, bound, _ = target
    v = row["values"]
    if "ubiqfs" not in v or (ref and not v.get(ref)):
        return None
    u = v["ubiqfs"]
    if kind in ("min_ratio", "gt_ratio"):
        return (u / v[ref]) / bound
    if kind == "max_ratio":
        return bound / (u / v[ref]) if u else float("inf")
    return bound / u if u else float("inf")  # "max"


def target_met(row, target):
    m = target_margin(row, target)
    if m is None:
        return None
    return m > 1 if target[0] == "gt_ratio" else m >= 1


def ratio(row, ref):
    """ubiqfs / ref; None for counts (entries refused), which are not compared as ratios."""
    v = row["values"]
    if row["unit"] == "entries":
        return None
    return v["ubiqfs"] / v[ref] if "ubiqfs" in v and v.get(ref) else None


def better_factor(row, ref):
    """ubiqfs against `ref`, normalized so that > 1 means ubiqfs did better."""
    r = ratio(row, ref)
    if r is None or r == 0:
        return None
    return r if row["higher_is_better"] else 1 / r


# --------------------------------------------------------------------------------------------
# report and plot


def shown(path: Path) -> str:
    """path relative to the checkout when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def run_summary(data) -> list[str]:
    """Lines saying which run(s) the rows come from."""
    runs = data["runs"]
    used = list(dict.fromkeys(r["run"] for r in data["rows"]))
    if len(used) == 1:
        run = runs[used[0]]
        all_groups = set(run.get("groups", {})) >= set(GROUPS)
        what = "all groups" if all_groups else "groups " + ", ".join(run.get("groups", {}))
        return [f"All rows were measured in **one run** ({what}), started {run['started']}, "
                f"`{run['command']}`{' (--quick sizes)' if run['quick'] else ''}."]
    lines = [f"Rows come from **{len(used)} runs** (a group re-run replaces only its own rows); "
             "the `measured` column says when:", ""]
    for rid in used:
        run = runs[rid]
        groups = sorted({r["group"] for r in data["rows"] if r["run"] == rid}, key=GROUPS.index)
        lines.append(f"* {run['started']}: `{run['command']}` — {', '.join(groups)}"
                     f"{' (--quick sizes)' if run['quick'] else ''}")
    return lines


def fmt(x):
    if x is None:
        return "–"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def table_lines(data, multi_run: bool) -> list[str]:
    head = ("| group | workload | unit | ext4 | FUSE limit | ubiqfs | rclone | ubiqfs/ext4 | ubiqfs/FUSE limit "
            "| ubiqfs/rclone | target | met? |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|"
    if multi_run:
        head += " measured |"
        sep += "---|"
    lines = [head, sep]
    for row in data["rows"]:
        v = row["values"]
        cells = [row["group"], row["name"], row["unit"], *(fmt(v.get(k)) for k in TARGET_NAMES)]
        cells += [f"{r:.2f}x" if r is not None else "–" for r in (ratio(row, k) for k in REFERENCES)]
        targets = TARGETS.get(row["key"], [])
        met = [target_met(row, t) for t in targets]
        cells.append("; ".join(t[3] for t in targets) or "–")
        cells.append("–" if not targets or None in met else ("yes" if all(met) else "no"))
        if multi_run:
            cells.append(row["measured_at"].replace("T", " ").rstrip("Z"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def baseline_lines(data) -> list[str]:
    """The rows measured on a --baseline build too: this build against that one."""
    rows = [r for r in data["rows"] if "baseline" in r["values"] and "ubiqfs" in r["values"]]
    if not rows:
        return []
    labels = sorted({data["runs"][r["run"]].get("baseline", "baseline") for r in rows})
    lines = [f"Against an older build, in the same run and on the same disk (baseline: {'; '.join(labels)}):", "",
             "| workload | unit | baseline | ubiqfs | ubiqfs/baseline |", "|---|---|---|---|---|"]
    for row in rows:
        v = row["values"]
        r = v["ubiqfs"] / v["baseline"] if v["baseline"] else None
        lines.append(f"| {row['name']} | {row['unit']} | {fmt(v['baseline'])} | {fmt(v['ubiqfs'])} | "
                     f"{f'{r:.2f}x' if r is not None else '–'} |")
    return lines + [""]


def write_report(data, out: Path, png: Path | None, results: Path):
    """docs/benchmarks.md from the results; keeps the notes after the marker."""
    used = {r["run"] for r in data["rows"]}
    lines = [
        "# Benchmarks",
        "",
        "Measured by `python3 bench/bench.py` on this machine (2 cores, virtio disk), release build:",
        "native ext4 (a folder under /var/tmp), the FUSE limit (libfuse's passthrough_hp example over a folder",
        "on the same disk: the fastest any FUSE filesystem can be on this kernel), ubiqfs (embedded cloud on the",
        "same disk, `--upload-delay-ms 200`) and rclone mount `--vfs-cache-mode full` over a local folder.",
        f"Raw numbers: `{shown(results)}`; a `–` is a figure that run did not measure.",
        "",
        *run_summary(data),
        "",
        "Each group runs several passes (`--passes`, 3 by default), every pass on every system in turn, and each",
        "figure is the median of its passes (all of them are kept in the results file, under `passes`).",
        "Ratios are ubiqfs / ext4, ubiqfs / FUSE limit and ubiqfs / rclone of the numbers shown: for rates (MiB/s, ops/s) higher",
        "is better, for times (s, ms) lower is better, so a time ratio < 1 means ubiqfs was faster.",
        "`target` is the DESIGN.md target or the performance goal where one applies, `met?` is computed from the",
        "numbers (– where a figure it needs was not measured).",
        "\\* proxies: the DESIGN targets for upload drain and streaming are against raw HTTP PUT/GET; here the",
        "reference is a raw copy + sync / cold read of the same bytes on ext4 (the embedded cloud is on that disk).",
        "",
    ]
    if png:
        lines += [f"![ubiqfs against ext4, the FUSE limit, rclone and the DESIGN targets]({png.name})", ""]
    lines += table_lines(data, len(used) > 1)
    lines.append("")
    lines += baseline_lines(data)
    existing = out.read_text() if out.exists() else ""
    notes = existing.split("<!-- notes -->", 1)[1] if "<!-- notes -->" in existing else "\n"
    out.write_text("\n".join(lines) + "\n<!-- notes -->" + notes)
    print(f"wrote {out}")


def write_plot(data, png: Path):
    """Two panels of log-scale horizontal bars where > 1 always means ubiqfs did better: against
    ext4, the FUSE limit and rclone per row (rate ratio, or inverse time ratio), and against each DESIGN target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if any(better_factor(r, k) for k in REFERENCES)]
    marks = [(r, t) for r in data["rows"] for t in TARGETS.get(r["key"], [])
             if 0 < (target_margin(r, t) or 0) < float("inf")]  # a "none lost" target has no factor
    bars1 = [(r["name"], [(better_factor(r, ref), COLORS[ref], f"vs {LABELS[ref]}") for ref in REFERENCES])
             for r in rows]
    bars2 = [(f"{r['name']}: {t[3]}", [(target_margin(r, t), "tab:green" if target_met(r, t) else "tab:red", None)])
             for r, t in marks]
    n1, n2 = 2 * len(bars1), len(bars2)
    fig, axes = plt.subplots(2, 1, figsize=(13, 0.22 * (n1 + n2) + 3.0),
                             gridspec_kw={"height_ratios": [max(n1, 1), max(n2, 1)]})
    plot_bars(axes[0], bars1, "ubiqfs against ext4, the FUSE limit and rclone: > 1 = ubiqfs better "
                              "(rate ratio ubiqfs/x, or time ratio x/ubiqfs)")
    axes[0].legend(*zip(*[(plt.Rectangle((0, 0), 1, 1, color=COLORS[k]), f"vs {LABELS[k]}") for k in REFERENCES]),
                   fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 1.0))
    plot_bars(axes[1], bars2, "ubiqfs against the DESIGN targets: > 1 = met by that factor (green met, red not)")
    fig.suptitle(f"ubiqfs benchmarks (bench/bench.py), log scale; {run_stamp(data)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {png}")


def plot_bars(ax, groups, title):
    """groups: [(label, [(factor or None, color, legend)])]; bars of one label side by side,
    log x axis symmetric around 1, each bar annotated with its factor."""
    from matplotlib.ticker import FixedLocator, NullLocator
    height = 0.8 / max(len(g[1]) for g in groups) if groups else 0.8
    factors = [f for _, bars in groups for f, _, _ in bars if f]
    span = max([max(f, 1 / f) for f in factors] + [2.0]) * 2.5
    for y, (_, bars) in enumerate(groups):
        for i, (f, color, _) in enumerate(bars):
            if not f:
                continue
            yy = y - 0.4 + height * (i + 0.5)
            ax.barh(yy, f - 1, left=1, height=height * 0.9, color=color)  # from 1: right = better
            ax.annotate(f"{f:.2g}x", (f, yy), xytext=(3 if f >= 1 else -3, 0), textcoords="offset points",
                        ha="left" if f >= 1 else "right", va="center", fontsize=6)
    ax.set_yticks(range(len(groups)), [g[0] for g in groups], fontsize=7)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlim(1 / span, span)
    ticks = [t for t in (0.001, 0.01, 0.1, 0.3, 1, 3, 10, 100, 1000) if 1 / span <= t <= span]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}x" for t in ticks], fontsize=7)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)


def run_stamp(data):
    """'one run, <date>' or 'N runs, <first> .. <last>'."""
    used = sorted({r["run"] for r in data["rows"]})
    if len(used) == 1:
        return f"one run, {data['runs'][used[0]]['started']}"
    return f"{len(used)} runs, {used[0]} .. {used[-1]}"
