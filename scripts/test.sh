#!/usr/bin/env bash
# Runs the whole test suite: unit tests (swift test), the server API tests on both engines
# (Tests/server), and the end-to-end FUSE suite (Tests/integration) against each cloud:
# the embedded engine, `ubiqfs serve` on SQLite, and `ubiqfs serve` on PostgreSQL + SeaweedFS.
# Installs and builds what it needs first. Every suite runs; the exit status says if any failed.
# pytest runs with -rs (every skip and its reason is printed), and a skip that
# Tests/allowed-skips.txt does not allow fails the run (scripts/check-skips.py; the list of
# skipped tests is printed at the end and added to the CI job summary).
#
#   UBIQFS_TEST_MODES="embedded server server-scale"  which FUSE-suite clouds to run (default all)
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

echo "== unit tests"
swift test 2>&1 | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("unit tests")

export UBIQFS_BIN="$PWD/.build/debug/ubiqfs"
reports="$(mktemp -d "${TMPDIR:-/tmp}/ubiqfs-test-reports.XXXXXX")"
suites=()
echo "== server API tests (embedded and PostgreSQL + S3 engines)"
python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$reports/server-api.xml" Tests/server \
  || failed+=("server API tests")
suites+=("server-api=$reports/server-api.xml")

for mode in ${UBIQFS_TEST_MODES:-embedded server server-scale}; do
  echo "== end-to-end tests (real FUSE mounts), cloud: $mode"
  UBIQFS_TEST_CLOUD="$mode" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$reports/$mode.xml" \
    Tests/integration "$@" || failed+=("end-to-end tests ($mode)")
  suites+=("$mode=$reports/$mode.xml")
done

echo "== skipped tests"
python3 scripts/check-skips.py Tests/allowed-skips.txt "${suites[@]}" || failed+=("unexpected skips")

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all tests passed"
