#!/usr/bin/env bash
# Installs what ubiqfs needs on Debian 12 (apt packages, pytest) and builds it.
# Usage: scripts/setup.sh [debug|release]
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-debug}"
export PATH="/opt/swift/usr/bin:$PATH"

need=()
for pkg in fuse3 libfuse3-dev libsqlite3-dev pkg-config attr git sqlite3 python3 python3-pip rsync; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
python3 -c 'import pytest' 2>/dev/null || python3 -m pip install -q pytest

echo "setup: building ($config)"
swift build -c "$config" 2>&1 | grep -E "error|warning: unre|Compiling ubiqfs|Build complete" || true
test -x ".build/$config/ubiqfs" || { echo "setup: build failed" >&2; swift build -c "$config"; exit 1; }
