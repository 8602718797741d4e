#!/usr/bin/env bash
# Runs the whole test suite: unit tests (swift test), the server API tests on both engines
# (Tests/server), and the end-to-end FUSE suite (Tests/integration) against each cloud:
# the embedded engine, `ubiqfs serve` on SQLite, and `ubiqfs serve` on PostgreSQL + SeaweedFS.
# Installs and builds what it needs first. Every suite runs; the exit status says if any failed.
#
#   UBIQFS_TEST_MODES="embedded server server-scale"  which FUSE-suite clouds to run (default all)
#   extra arguments are passed to the FUSE suite's pytest (e.g. -k rename)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
scripts/setup.sh debug
scripts/test-server-deps.sh

failed=()
echo "== unit tests"
swift test 2>&1 | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("unit tests")

export UBIQFS_BIN="$PWD/.build/debug/ubiqfs"
echo "== server API tests (embedded and PostgreSQL + S3 engines)"
python3 -m pytest -q -p no:cacheprovider Tests/server || failed+=("server API tests")

for mode in ${UBIQFS_TEST_MODES:-embedded server server-scale}; do
  echo "== end-to-end tests (real FUSE mounts), cloud: $mode"
  UBIQFS_TEST_CLOUD="$mode" python3 -m pytest -q -p no:cacheprovider Tests/integration "$@" \
    || failed+=("end-to-end tests ($mode)")
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all tests passed"
