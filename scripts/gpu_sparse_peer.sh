#!/usr/bin/env bash
# FlashAttention-4's block-sparse form (kernels.backends fa4_sparse) on one GPU of the kind GPU (default h200;
# scripts/gpu_env.sh) in one call: its calibration beside the GPU's committed profile: calibrate.run
# --backends $BACKENDS (default fa4_sparse; a GPU whose profile prices no dense peer yet: fa4_sparse,fa4,cudnn) over
# a copy of calibrate/profiles/<GPU>_raw.csv (our attention grid's documents and kept fractions; the points
# already there are skipped), calibrate.fit --backends-only into a copy of <GPU>.json (its own terms
# unchanged; fa4_sparse does host work in each call, so the fit leaves it out of a CSV timed on the busy clock,
# as the committed ones are, and says so: its points are then for reading, not pricing), and --check of that
# copy; then its GPU tests against our kernel on the same selections (tests/kernels/test_flash_sparse.py),
# stopped after TEST_S seconds (default 240, 0: not run), since each case compiles.
# TIMING=events times the peers alone (calibrate.run --peers-only --timing events: device events around each
# call, the host work included) into a CSV of their own, <GPU>_events_raw.csv (a copy of the committed one where
# there is one, so a rerun resumes it), from which the fit takes them.
#
# Writes under $OUT (8 files): pytest.txt, <GPU>_raw.csv and <GPU>_raw.meta.json (the raw points with
# fa4_sparse's; with TIMING=events <GPU>_events_raw.*), <GPU>.json (the profile with the peers fitted), check.txt,
# peer.log (everything printed),
# environment.txt, status.txt (the exit code of each part). The profile is also left at $PROFILE_OUT (default
# /tmp/<GPU>_peers.json) for a later call on the same machine (gpu_fair.sh PROFILE=...). FlashAttention-4 comes
# from the wheels in .whl/ (carried; ignored by git) and the parts gpu_env.sh names. Calibration stops starting
# points after BUDGET_S seconds (default 180).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
OUT=${OUT:-/tmp/gpu_sparse_peer}
BUDGET_S=${BUDGET_S:-180}
BACKENDS=${BACKENDS:-fa4_sparse}
TEST_S=${TEST_S:-240}
TIMING=${TIMING:-busy}
case "$TIMING" in
  busy) RAW=${GPU}_raw ONLY=() ;;
  events) RAW=${GPU}_events_raw ONLY=(--peers-only) ;;
  *) echo "error: TIMING=$TIMING: allowed: busy (into <GPU>_raw.csv) or events (the peers alone)" >&2; exit 2 ;;
esac
PROFILE_OUT=${PROFILE_OUT:-/tmp/${GPU}_peers.json}
mkdir -p "$OUT"

part() {  # part NAME COMMAND...: run it, record its exit code
  local name=$1
  shift
  "$@"
  local code=$?
  echo "$name: exit $code" | tee -a "$OUT/status.txt"
  return "$code"
}

experiment() {
  peers_report "$OUT/environment.txt" || exit 1

  : >"$OUT/status.txt"
  cp "calibrate/profiles/$GPU.json" "$OUT/"
  [ -f "calibrate/profiles/$RAW.csv" ] && cp "calibrate/profiles/$RAW.csv" "calibrate/profiles/$RAW.meta.json" "$OUT/"
  part calibrate python3 -m calibrate.run --csv "$OUT/$RAW.csv" --backends "$BACKENDS" "${ONLY[@]}" --timing "$TIMING" \
    --time-budget-s "$BUDGET_S" --code-version "$(project_commit | cut -d' ' -f2 | cut -c1-7)" || return 1
  part fit python3 -m calibrate.fit --csv "$OUT/$RAW.csv" --out "$OUT/$GPU.json" --backends-only || return 1
  cp "$OUT/$GPU.json" "$PROFILE_OUT"
  part check python3 -m calibrate.fit --check "$OUT/$GPU.json" | tee "$OUT/check.txt"
  [ "$TEST_S" = 0 ] && return 0
  part pytest timeout "$TEST_S" python3 -m pytest tests/kernels/test_flash_sparse.py -q -p no:cacheprovider -k gpu \
    >"$OUT/pytest.txt" 2>&1
  tail -5 "$OUT/pytest.txt"
}

experiment 2>&1 | tee "$OUT/peer.log"
exit "${PIPESTATUS[0]}"
