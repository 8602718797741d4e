#!/usr/bin/env bash
# Installs what ubiqfs needs on Debian 12 and builds it: the build's libraries, every tool the
# test suites run (so no test is skipped for a missing tool), and pytest. Run as root, it also
# installs the man page (docs/ubiqfs.1) and the bash, zsh and fish completions.
# Usage: scripts/setup.sh [debug|release]
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-debug}"
export PATH="/opt/swift/usr/bin:$PATH"

# Build: fuse3 libfuse3-dev libsqlite3-dev pkg-config.
# Tests (Tests/integration, through subprocess): fusermount3 (fuse3), getfattr/setfattr (attr),
# git, sqlite3, rsync, vim, man (man-db, for the man page test), and coreutils, diffutils, tar
# and bash, which every Debian system has. PostgreSQL and SeaweedFS for the server modes come
# from scripts/test-server-deps.sh.
need=()
for pkg in fuse3 libfuse3-dev libsqlite3-dev pkg-config python3 python3-pip \
  attr git sqlite3 rsync vim man-db bash-completion; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
python3 -c 'import pytest' 2>/dev/null || python3 -m pip install -q pytest

# LazyFS (shared/lazyfs beside the repository) for the power-loss tests
# (Tests/integration/test_power_loss.py): its build installs its Debian packages (cmake, g++,
# libspdlog-dev, libtoml11-dev) and builds it once into the cache; later runs reuse it.
lazyfs_src="$(cd .. && pwd)/shared/lazyfs"
lazyfs_out="${XDG_CACHE_HOME:-$HOME/.cache}/ubiqfs/lazyfs"
if [ -x "$lazyfs_src/build.sh" ]; then
  # The build folder remembers the source path it was configured from (CMakeCache.txt) and cmake
  # refuses to reuse it for the same sources at another path, so a folder from another checkout
  # location is dropped and the build starts over. The binary goes with it: it loads its page
  # cache library (libpcache.so) from that folder.
  for cache in "$lazyfs_out"/build/*/CMakeCache.txt; do
    [ -f "$cache" ] || continue
    grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$lazyfs_src/" "$cache" || {
      rm -rf "$lazyfs_out/build" "$lazyfs_out/lazyfs"
      break
    }
  done
  # A binary whose libraries are gone (its build folder removed by hand) is built again too.
  if [ -x "$lazyfs_out/lazyfs" ] && ldd "$lazyfs_out/lazyfs" | grep -q "not found"; then
    rm -f "$lazyfs_out/lazyfs"
  fi
  [ -x "$lazyfs_out/lazyfs" ] || echo "setup: building LazyFS into $lazyfs_out"
  "$lazyfs_src/build.sh" "$lazyfs_out"
else
  echo "setup: $lazyfs_src not found; the power-loss tests will fail (they need LazyFS)" >&2
fi

echo "setup: building ($config)"
swift build -c "$config" 2>&1 | grep -E "error|warning: unre|Compiling ubiqfs|Build complete" || true
bin=".build/$config/ubiqfs"
test -x "$bin" || { echo "setup: build failed" >&2; swift build -c "$config"; exit 1; }

if [ "$(id -u)" -eq 0 ]; then
  install -D -m 0644 docs/ubiqfs.1 /usr/local/share/man/man1/ubiqfs.1
  tmp="$(mktemp)"
  for shell_dest in bash:/usr/share/bash-completion/completions/ubiqfs \
    zsh:/usr/local/share/zsh/site-functions/_ubiqfs fish:/usr/share/fish/vendor_completions.d/ubiqfs.fish; do
    "$bin" --generate-completion-script "${shell_dest%%:*}" >"$tmp"
    install -D -m 0644 "$tmp" "${shell_dest#*:}"
  done
  rm -f "$tmp"
  echo "setup: installed the man page (man ubiqfs) and bash, zsh and fish completions"
else
  echo "setup: not root; man page and shell completions not installed (see docs/user-guide.md)"
fi
