#!/usr/bin/env bash
# Installs what ubiqfs needs, builds it (release) and mounts the demo container
# iCloud.default on the embedded cloud at ~/iCloud (or the folder given as $1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh release
mnt="${1:-$HOME/iCloud}"
mkdir -p "$mnt"
bin="$PWD/.build/release/ubiqfs"
"$bin" mount iCloud.default "$mnt"
cat <<EOT

Try:
  cp some-file "$mnt/Documents/" && getfattr -d -m user.ubiq "$mnt/Documents/some-file"
  $bin status
  $bin sync --wait "$mnt"
  $bin unmount "$mnt"
EOT
