"""The propagation group: two mounts of one account on a real `ubiqfs serve`."""

from __future__ import annotations

import propagation  # bench/propagation.py
from common import BIN, Recorder, Sizes, World

# --------------------------------------------------------------------------------------------
# propagation group


def propagation_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """Two daemons of one account on one `ubiqfs serve` (bench/propagation.py). A change not
    visible after propagation.LOST_AFTER_S counts as lost; a percentile that falls on a lost
    change is recorded as that timeout."""
    res = propagation.measure(sz.prop_n, BIN)
    cap = propagation.LOST_AFTER_S
    for kind in ("create", "modify"):
        for p in (50, 99):
            rec.row(f"prop_{kind}_p{p}", f"propagation p{p}, {kind} (n={sz.prop_n}, two mounts, serve)", "ms",
                    {"ubiqfs": min(propagation.pct(res[kind], p), cap) * 1000}, higher_is_better=False)
    rec.row("prop_lost", f"propagation: creates + modifies not visible after {cap:.0f} s", f"of {2 * sz.prop_n}",
            {"ubiqfs": propagation.lost(res["create"]) + propagation.lost(res["modify"])}, higher_is_better=False)
