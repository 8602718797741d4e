#!/usr/bin/env python3
"""Fails when a test run skipped a test that Tests/allowed-skips.txt does not allow.

    scripts/check-skips.py ALLOW-LIST SUITE=JUNIT-XML [SUITE=JUNIT-XML ...]

SUITE names the run (the FUSE suite's cloud mode: embedded, server, server-scale; or "server-api"
for Tests/server); each JUNIT-XML is pytest's --junitxml report of that run. Every skipped
test is printed with its reason; one that no allow-list line matches fails the check, so a
test never silently stops running because a tool or service is missing. The list is also
written to $GITHUB_STEP_SUMMARY when that is set (the CI job summary).

Allow-list lines: SUITE | TEST | REASON, where SUITE and TEST are shell-style globs (TEST is
"file.py::test_name[params]"), and REASON says why skipping there is right. # starts a comment.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import xml.etree.ElementTree as ET


def load_allow_list(path: str) -> list[tuple[str, str, str]]:
    rules = []
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = [p.strip() for p in line.split("|")]
            if len(parts) != 3 or not all(parts):
                raise SystemExit(f"{path}:{n}: want 'SUITE | TEST | REASON', got {raw.strip()!r}")
            rules.append((parts[0], parts[1], parts[2]))
    return rules


def skipped_tests(junit: str) -> tuple[int, list[tuple[str, str]]]:
    """(number of tests, [(test id, skip message)]) from a pytest junit XML report."""
    root = ET.parse(junit).getroot()
    total, skipped = 0, []
    for case in root.iter("testcase"):
        total += 1
        skip = case.find("skipped")
        if skip is None:
            continue
        # classname is the module's dotted path then any class: "test_kv", "test_kv.TestX".
        parts = case.get("classname", "").split(".")
        i = next((k for k, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        test_id = "::".join(["/".join(parts[: i + 1]) + ".py", *parts[i + 1 :], case.get("name", "")])
        skipped.append((test_id, (skip.get("message") or skip.text or "").strip()))
    return total, skipped


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    rules = load_allow_list(sys.argv[1])
    lines, unexpected, missing = [], 0, 0
    for arg in sys.argv[2:]:
        suite, _, junit = arg.partition("=")
        if not os.path.exists(junit):
            lines.append(f"- {suite}: no report ({junit} missing; the run did not finish)")
            missing += 1
            continue
        total, skipped = skipped_tests(junit)
        lines.append(f"- {suite}: {total} tests, {len(skipped)} skipped")
        for test_id, message in skipped:
            allowed = [r for r in rules if fnmatch.fnmatchcase(suite, r[0]) and fnmatch.fnmatchcase(test_id, r[1])]
            if allowed:
                lines.append(f"  - allowed skip: {test_id}: {message} (allow-list: {allowed[0][2]})")
            else:
                unexpected += 1
                lines.append(f"  - UNEXPECTED SKIP: {test_id}: {message}")
    verdict = "skipped tests: all allowed"
    if unexpected:
        verdict = (
            f"skipped tests: {unexpected} unexpected (install what they need, or allow them in"
            f" {sys.argv[1]} with a reason)"
        )
    if missing:
        verdict += f"; {missing} run(s) left no report"
    report = "\n".join(["## Skipped tests", *lines, "", verdict]) + "\n"
    print(report, end="")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a") as f:
            f.write(report)
    return 1 if unexpected or missing else 0


if __name__ == "__main__":
    sys.exit(main())
