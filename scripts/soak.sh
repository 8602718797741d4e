#!/usr/bin/env bash
# Long randomized runs, for hours rather than CI's fixed budget.
#
#   scripts/soak.sh model [HOURS]   the filesystem core against the reference model
#                                   (Tests/UbiqFSCoreTests/ModelTests.swift), rounds of
#                                   UBIQ_MODEL_CASES sequences (default 2000) until HOURS
#                                   (default 1) have passed or a round fails.
#   scripts/soak.sh sim [HOURS]     the multi-device sync simulation
#                                   (Tests/UbiqFSCoreTests/SyncSimulation.swift), rounds of
#                                   UBIQ_SIM_CASES sequences (default 1000), and the check that
#                                   a sequence run twice is the same run.
#                                   Both lift the time budget CI gives these tests (UBIQ_MODEL_SECONDS,
#                                   UBIQ_SIM_SECONDS), so every round runs all its sequences.
#   scripts/soak.sh durability [HOURS]
#                                   power losses (Tests/integration/test_power_loss.py): rounds
#                                   of the client test with UBIQ_POWER_LOSSES power losses each
#                                   (default 10, a new seed per round), and every fifth round the
#                                   server test, until HOURS have passed or a round fails.
#                                   UBIQFS_BIN=PATH runs that binary instead of building one.
#                                   A round in which LazyFS itself crashed is reported as void
#                                   and the soak goes on (it stops after 5 such rounds).
#                                   A round still running after UBIQ_ROUND_LIMIT seconds
#                                   (default 900) is a hang: the threads of every ubiqfs and
#                                   LazyFS process of the round (gdb) and the test's Python
#                                   stack go to the log, the round is stopped and the soak fails.
#                                   The folders of a failed or hung round are kept for a look.
#
# Every round prints its sequence and step counts (durability: its seed and power losses). A
# failure prints the shrunk step list and the seed (`.fixedSeed("…")`) that replays it; the run
# stops there, with the whole output in the log named at the end. Put the shrunk sequence into the suite's knownSequences.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"

what="${1:-model}"
hours="${2:-1}"
case "$what" in
  model)
    filter=coreMatchesTheReferenceModel
    cases_var=UBIQ_MODEL_CASES default_cases=2000
    export UBIQ_MODEL_SECONDS="${UBIQ_MODEL_SECONDS:-1000000000}"
    ;;
  sim)
    filter="devicesConvergeWithNothingLost|devicesConvergeOverHTTPWithNothingLost|foldersMovedIntoEachOther|aSequenceRunTwiceIsTheSameRun"
    cases_var=UBIQ_SIM_CASES default_cases=1000
    export UBIQ_SIM_SECONDS="${UBIQ_SIM_SECONDS:-1000000000}"
    ;;
  durability) ;;
  *) echo "soak.sh: unknown soak '$what' (known: model, sim, durability)" >&2; exit 2 ;;
esac

log="$(mktemp "${TMPDIR:-/tmp}/ubiqfs-soak-$what.XXXXXX.log")"
if [ "$what" = durability ] && [ -n "${UBIQFS_BIN:-}" ]; then
  # A given binary (a copy, so the soak can run while the checkout is rebuilt).
  [ -x "$UBIQFS_BIN" ] || { echo "soak: UBIQFS_BIN=$UBIQFS_BIN is not an executable" >&2; exit 1; }
elif { [ "$what" = durability ] || ! pkg-config --exists fuse3 sqlite3; } && ! scripts/setup.sh debug; then
  # Setup installs the build's libraries and every tool a soak uses (LazyFS for durability).
  # The model and simulation soaks need only the libraries, so they skip it once those are
  # there: setup rebuilds LazyFS for this checkout's path, under a CI run of another clone.
  echo "soak: setup failed" >&2
  exit 1
elif ! build_log="$(swift build --build-tests 2>&1)"; then
  echo "$build_log" | grep -E "error" >&2
  echo "soak: build failed" >&2
  exit 1
fi
deadline=$(( $(date +%s) + $(awk "BEGIN { printf \"%d\", $hours * 3600 }") ))

if [ "$what" = durability ]; then
  export UBIQFS_BIN="${UBIQFS_BIN:-$PWD/.build/debug/ubiqfs}"
  export UBIQFS_POWER_LOSS_ROUNDS="${UBIQ_POWER_LOSSES:-10}"
  round_limit="${UBIQ_ROUND_LIMIT:-900}"
  round_root="$(mktemp -d "${TMPDIR:-/tmp}/soak-round.XXXXXX")"
  # Every process of a round names a path under $round_root on its command line (mount points,
  # LazyFS's folders, the server's data folder).
  round_pids() {
    local pid
    for pid in $(pgrep -f -- "$round_root/tmp" || true); do
      case "$(cat "/proc/$pid/comm" 2>/dev/null)" in ubiqfs | lazyfs) echo "$pid" ;; esac
    done
  }
  dump_round_processes() {
    local pid
    echo "==== processes of the hung round"
    ps -o pid,ppid,stat,etime,args -p "$(round_pids | paste -sd, -)" 2>/dev/null || true
    for pid in $(round_pids); do
      echo "==== threads of $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) (pid $pid)"
      timeout 120 gdb -p "$pid" -batch -nx -ex "set pagination off" -ex "thread apply all bt" 2>&1 \
        | grep -vE "^\[New LWP|^warning: " || true
    done
    echo "==== fuse mounts"
    grep -F "$round_root" /proc/mounts || true
    local f
    for f in $(find "$round_root/tmp" -name daemon.log 2>/dev/null); do
      echo "==== $f (tail)"
      tail -n 60 "$f"
    done
  }
  stop_round() {
    kill -INT "$1" 2>/dev/null || true
    local i
    for i in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -KILL "$1" 2>/dev/null || true
    local m pid
    for m in $(grep -F "$round_root" /proc/mounts | awk '{print $2}'); do
      fusermount3 -uz "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    for pid in $(round_pids); do kill -KILL "$pid" 2>/dev/null || true; done
  }
  trap 'rm -rf "$round_root"' EXIT
  rounds=0
  losses=0
  void=0
  while [ "$(date +%s)" -lt "$deadline" ]; do
    rounds=$((rounds + 1))
    seed=$((RANDOM * 32768 + RANDOM))
    tests=(Tests/integration/test_power_loss.py::test_fsynced_writes_survive_power_loss_of_the_client)
    mode=embedded
    if [ $((rounds % 5)) -eq 0 ]; then
      tests=(Tests/integration/test_power_loss.py::test_acknowledged_uploads_survive_power_loss_of_the_server)
      mode=server
    fi
    round_out="$round_root/round.out"
    UBIQFS_POWER_LOSS_SEED=$seed UBIQFS_TEST_CLOUD=$mode python3 -m pytest -q -rs -s -p no:cacheprovider \
      -o faulthandler_timeout="$round_limit" --basetemp="$round_root/tmp" "${tests[@]}" > "$round_out" 2>&1 &
    pytest_pid=$!
    started=$(date +%s)
    while kill -0 "$pytest_pid" 2>/dev/null && [ $(( $(date +%s) - started )) -lt "$round_limit" ]; do
      sleep 2
    done
    if kill -0 "$pytest_pid" 2>/dev/null; then
      # Give faulthandler's Python stack dump a moment to land in the output first.
      sleep 5
      dump_round_processes >> "$round_out" 2>&1
      stop_round "$pytest_pid"
      cat "$round_out" >> "$log"
      echo "soak: round $rounds ($mode, seed $seed) HUNG: still running after ${round_limit}s;" \
        "thread dumps of its processes and the test's stack are in $log; its folders: $round_root" >&2
      trap - EXIT
      exit 1
    fi
    wait "$pytest_pid" && ok=1 || ok=0
    out="$(cat "$round_out")"
    echo "$out" >> "$log"
    if echo "$out" | grep -q "skipped"; then
      echo "$out" | tail -5 >&2
      echo "soak: round $rounds was skipped; full output: $log" >&2
      exit 1
    fi
    if [ "$ok" -ne 1 ] && echo "$out" | grep -q "LazyFS crashed"; then
      # The test tool died, not ubiqfs: the round proves nothing either way.
      void=$((void + 1))
      echo "soak: round $rounds ($mode, seed $seed) void: $(echo "$out" | grep -o "LazyFS crashed[^;]*" | head -1)"
      if [ "$void" -gt 5 ]; then
        echo "soak: LazyFS crashed in $void rounds; stopping (full output: $log)" >&2
        exit 1
      fi
      continue
    fi
    if [ "$ok" -ne 1 ]; then
      echo "$out" | grep -E "problems|seed|Error|assert" | head -30
      echo "soak: round $rounds (seed $seed) FAILED after $losses power losses; full output: $log;" \
        "its folders (state, cloud, LazyFS disk): $round_root/tmp" >&2
      trap - EXIT
      exit 1
    fi
    if [ "$mode" = server ]; then losses=$((losses + 1)); else losses=$((losses + UBIQFS_POWER_LOSS_ROUNDS)); fi
    echo "soak: round $rounds ($mode, seed $seed) passed ($losses power losses so far)"
  done
  echo "soak: $rounds rounds, $losses power losses, no failure ($void rounds void: LazyFS crashed); log: $log"
  exit 0
fi
rounds=0
sequences=0
steps=0
cases="${!cases_var:-$default_cases}"
export "$cases_var=$cases"
while [ "$(date +%s)" -lt "$deadline" ]; do
  rounds=$((rounds + 1))
  out="$(swift test --skip-build --filter "$filter" 2>&1)" && ok=1 || ok=0
  echo "$out" >> "$log"
  round_steps="$(echo "$out" | sed -n 's/.*"steps": \([0-9]*\).*/\1/p' | tail -1)"
  steps=$((steps + ${round_steps:-0}))
  if [ "$ok" -ne 1 ]; then
    echo "$out" | grep -E "Failure occured|shrunk down|fixedSeed|✘" | head -20
    echo "soak: round $rounds FAILED after $sequences sequences ($steps steps); full output: $log" >&2
    exit 1
  fi
  round_sequences="$(echo "$out" | sed -n 's/.*: \([0-9]*\) of [0-9]* sequences in.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')"
  sequences=$((sequences + ${round_sequences:-0}))
  echo "soak: round $rounds passed ($sequences sequences, $steps steps so far)"
done
echo "soak: $rounds rounds, $sequences sequences, $steps steps, no failure; log: $log"
