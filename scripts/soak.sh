#!/usr/bin/env bash
# Long randomized runs, for hours rather than CI's fixed budget.
#
#   scripts/soak.sh model [HOURS]   the filesystem core against the reference model
#                                   (Tests/UbiqFSCoreTests/ModelTests.swift), rounds of
#                                   UBIQ_MODEL_CASES sequences (default 2000) until HOURS
#                                   (default 1) have passed or a round fails.
#   scripts/soak.sh sim [HOURS]     the multi-device sync simulation
#                                   (Tests/UbiqFSCoreTests/SyncSimulation.swift), rounds of
#                                   UBIQ_SIM_CASES sequences (default 1000).
#
# Every round prints its sequence and step counts. A failure prints the shrunk step list and
# the seed (`.fixedSeed("…")`) that replays it; the run stops there, with the whole output in
# the log named at the end. Put the shrunk sequence into the suite's knownSequences.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"

what="${1:-model}"
hours="${2:-1}"
case "$what" in
  model) filter=coreMatchesTheReferenceModel; cases_var=UBIQ_MODEL_CASES; default_cases=2000 ;;
  sim) filter=devicesConvergeWithNothingLost; cases_var=UBIQ_SIM_CASES; default_cases=1000 ;;
  *) echo "soak.sh: unknown soak '$what' (known: model, sim)" >&2; exit 2 ;;
esac

log="$(mktemp "${TMPDIR:-/tmp}/ubiqfs-soak-$what.XXXXXX.log")"
if ! build_log="$(swift build --build-tests 2>&1)"; then
  echo "$build_log" | grep -E "error" >&2
  echo "soak: build failed" >&2
  exit 1
fi
deadline=$(( $(date +%s) + $(awk "BEGIN { printf \"%d\", $hours * 3600 }") ))
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
  sequences=$((sequences + cases))
  echo "soak: round $rounds passed ($sequences sequences, $steps steps so far)"
done
echo "soak: $rounds rounds, $sequences sequences, $steps steps, no failure; log: $log"
