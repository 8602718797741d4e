#!/usr/bin/env bash
# Profiles the ubiqfs daemon while Python creates or removes N empty files in one folder,
# while the uploads of N empty files (created with uploads held back) drain to the embedded
# cloud, or while `tar xmf` unpacks a tarball (TARBALL, default: /usr/include packed; N unused).
# Usage: bench/profile.sh create|remove|drain|untar [N] [OUTDIR]
#   UBIQFS_BIN (default .build/release/ubiqfs), UPLOAD_DELAY_MS (default 600000: uploads held
#   back, so only the namespace work is measured).
# Writes OUTDIR/WORKLOAD.data (perf record --call-graph dwarf) and OUTDIR/WORKLOAD-tree.txt (the
# inclusive share of each frame, Swift names demangled). Mount and daemon are removed at the end.
set -euo pipefail
work=${1:?usage: profile.sh create|remove|drain|untar [N] [OUTDIR]}
n=${2:-3000}
out=$(mkdir -p "${3:-/tmp/ubiqfs-profile}" && cd "${3:-/tmp/ubiqfs-profile}" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${UBIQFS_BIN:-$root/.build/release/ubiqfs}
command -v perf >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null; }
tmp=$(mktemp -d /var/tmp/ubiqfs-profile-XXXX)
export UBIQFS_STATE_DIR=$tmp/state UBIQFS_CLOUD_DIR=$tmp/cloud
mkdir -p "$tmp/mnt"
cleanup() {
  "$bin" unmount "$tmp/mnt" >/dev/null 2>&1 || fusermount3 -uz "$tmp/mnt" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
"$bin" mount iCloud.default "$tmp/mnt" --upload-delay-ms "${UPLOAD_DELAY_MS:-600000}" >/dev/null
pid=$(pgrep -n -f "ubiqfs.*$tmp/mnt")
dir=$tmp/mnt/Documents/many
mkdir -p "$dir"
if [ "$work" = untar ] && [ -z "${TARBALL:-}" ]; then
  TARBALL=$tmp/include.tar
  tar cf "$TARBALL" -C /usr include
fi
if [ "$work" = remove ] || [ "$work" = drain ]; then
  python3 -c "import sys; [open(f'$dir/f{i}', 'wb').close() for i in range($n)]"
fi
perf record -F 999 --call-graph dwarf,16384 -p "$pid" -o "$out/$work.data" 2>/dev/null &
rec=$!
sleep 1
if [ "$work" = untar ]; then
  t0=$(date +%s.%N)
  tar xmf "$TARBALL" --no-same-owner -C "$dir"
  python3 -c "import sys; print(f'untar: {float(sys.argv[2]) - float(sys.argv[1]):.2f} s')" "$t0" "$(date +%s.%N)"
elif [ "$work" = drain ]; then
  t0=$(date +%s.%N)
  "$bin" sync --wait "$tmp/mnt" --timeout 3600 >/dev/null
  python3 -c "import sys; print(f'drain {sys.argv[1]}: {int(sys.argv[1]) / ($(date +%s.%N) - $t0):.0f} items per second')" "$n"
else
python3 - "$work" "$dir" "$n" <<'PY'
import os, sys, time
work, d, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
for i in range(n):
    if work == "create":
        open(f"{d}/f{i}", "wb").close()
    else:
        os.unlink(f"{d}/f{i}")
print(f"{work} {n}: {n / (time.perf_counter() - t0):.0f} per second")
PY
fi
kill -INT "$rec"
wait "$rec" 2>/dev/null || true
perf report -i "$out/$work.data" --children --sort sym --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' \
  | swift demangle --simplified > "$out/$work-tree.txt"
echo "wrote $out/$work.data and $out/$work-tree.txt"
