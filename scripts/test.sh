#!/usr/bin/env bash
# Runs the whole test suite: unit tests (swift test) and end-to-end tests on real FUSE mounts
# (pytest, Tests/integration). Installs and builds what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
scripts/setup.sh debug

echo "== unit tests"
swift test 2>&1 | tail -n 30
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || { echo "unit tests failed" >&2; exit "$status"; }

echo "== end-to-end tests (real FUSE mounts)"
export UBIQFS_BIN="$PWD/.build/debug/ubiqfs"
python3 -m pytest -q -p no:cacheprovider Tests/integration "$@"
