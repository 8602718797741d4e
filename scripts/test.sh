#!/usr/bin/env bash
# Runs the whole test suite: unit tests (swift test), the server API tests on both engines
# (Tests/server), and the end-to-end FUSE suite (Tests/integration) against each cloud:
# the embedded engine, `ubiqfs serve` on SQLite, and `ubiqfs serve` on PostgreSQL + SeaweedFS.
# Installs and builds what it needs first. Every suite runs; the exit status says if any failed.
# pytest runs with -rs (every skip and its reason is printed), and a skip that
# Tests/allowed-skips.txt does not allow fails the run (scripts/check-skips.py; the list of
# skipped tests is printed at the end and added to the CI job summary).
#
# The unit tests run first, under a watchdog. The pytest suites then run side by side in three
# lanes (FUSE on the embedded cloud; FUSE on `serve`; the server API tests, then FUSE on
# PostgreSQL + SeaweedFS): they spend most of their time waiting for mounts, daemons and sync,
# about a third of a core each. Each lane has its own temporary folder and log, and a watchdog;
# the logs are printed whole, one after another, when every lane has ended.
#
#   UBIQFS_TEST_MODES="embedded server server-scale"  which FUSE-suite clouds to run (default all)
#   UBIQFS_UNIT_TIMEOUT=1800    seconds the unit tests may take before they count as hung
#   UBIQFS_LANE_TIMEOUT=3000    seconds a pytest lane may take before it is stopped
#   extra arguments are passed to the FUSE suite's pytest (e.g. -k rename)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
scripts/setup.sh debug
scripts/test-server-deps.sh

failed=()
echo "== swift format lint (the committed .swift-format; a warning fails the run)"
swift format lint --strict --recursive Sources Tests Package.swift || failed+=("swift format lint")
echo "== module layers (scripts/check-layers.py)"
python3 scripts/check-layers.py || failed+=("module layers")

reports="$(mktemp -d "${TMPDIR:-/tmp}/ubiqfs-test-reports.XXXXXX")"

echo "== unit tests"
swift build --build-tests 2>&1 | grep -E "error|Build complete" || true
unit_log="$reports/unit.log"
set +e
timeout -k 30 "${UBIQFS_UNIT_TIMEOUT:-1800}" swift test --skip-build >"$unit_log" 2>&1
unit_status=$?
set -e
if [ "$unit_status" -eq 0 ]; then
  grep -E "^(model test|sync simulation|folder simulation)" "$unit_log" || true
  tail -n 3 "$unit_log"
else
  tail -n 60 "$unit_log"
  if [ "$unit_status" -eq 124 ] || [ "$unit_status" -eq 137 ]; then
    echo "unit tests HUNG: still running after ${UBIQFS_UNIT_TIMEOUT:-1800}s; tests started and never ended:"
    python3 - "$unit_log" <<'PY'
import re, sys
started, ended = [], set()
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Test (\S+\(\)) started", line)
    if m:
        started.append(m.group(1))
    m = re.search(r"Test (\S+\(\)) (passed|failed|skipped)", line)
    if m:
        ended.add(m.group(1))
for name in started:
    if name not in ended:
        print("  " + name)
PY
  fi
  failed+=("unit tests")
fi

export UBIQFS_BIN="$PWD/.build/debug/ubiqfs"
lane_timeout="${UBIQFS_LANE_TIMEOUT:-3000}"
suites=()
lanes=()

# run_suite ID TITLE DIR [pytest args...]: one pytest run, with its own temporary folder, its
# report at $reports/ID.xml and a watchdog.
run_suite() {
  local id="$1" title="$2" dir="$3"
  shift 3
  echo "== $title"
  local status=0
  timeout -s INT -k 120 "$lane_timeout" python3 -m pytest -q -rs -p no:cacheprovider \
    --basetemp="$reports/tmp-$id" --junitxml="$reports/$id.xml" "$dir" "$@" || status=$?
  [ "$status" -ne 124 ] || echo "$title: stopped after ${lane_timeout}s (UBIQFS_LANE_TIMEOUT)"
  [ "$status" -eq 0 ] || echo "FAILED-SUITE: $title"
}

fuse_suite() {
  local mode="$1"
  shift
  UBIQFS_TEST_CLOUD="$mode" run_suite "$mode" "end-to-end tests (real FUSE mounts), cloud: $mode" \
    Tests/integration "$@"
}

modes=" ${UBIQFS_TEST_MODES:-embedded server server-scale} "
wanted() { [[ "$modes" == *" $1 "* ]]; }

# The lane that starts PostgreSQL and SeaweedFS: the server API tests, then the FUSE suite on them.
scale_lane() {
  run_suite server-api "server API tests (embedded and PostgreSQL + S3 engines)" Tests/server
  if wanted server-scale; then fuse_suite server-scale "$@"; fi
}

# start_lane NAME FUNCTION [args...]: runs FUNCTION in the background, its output in NAME's log.
start_lane() {
  local name="$1"
  shift
  ("$@") >"$reports/lane-$name.log" 2>&1 &
  lanes+=("$name:$!")
}

start_lane scale scale_lane "$@"
suites+=("server-api=$reports/server-api.xml")
for mode in embedded server; do
  if wanted "$mode"; then start_lane "$mode" fuse_suite "$mode" "$@"; fi
done
for mode in embedded server server-scale; do
  if wanted "$mode"; then suites+=("$mode=$reports/$mode.xml"); fi
done

for lane in "${lanes[@]}"; do
  wait "${lane#*:}" || true
done
for lane in "${lanes[@]}"; do
  cat "$reports/lane-${lane%%:*}.log"
  while read -r suite; do failed+=("${suite#FAILED-SUITE: }"); done \
    < <(grep "^FAILED-SUITE: " "$reports/lane-${lane%%:*}.log" || true)
done

echo "== skipped tests"
python3 scripts/check-skips.py Tests/allowed-skips.txt "${suites[@]}" || failed+=("unexpected skips")

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  echo "logs, reports and the tests' temporary folders are kept in $reports" >&2
  exit 1
fi
# The tests' temporary folders (mounts' state and clouds, gigabytes) go; logs and reports stay.
rm -rf "$reports"/tmp-*
echo "all tests passed (logs and reports: $reports)"
