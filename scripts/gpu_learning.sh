#!/usr/bin/env bash
# Accuracy under DST's budgets, over seeds, on one GPU of the kind GPU (default h200, its cluster;
# scripts/gpu_env.sh): conf/experiment/learning_lookup.yaml (the tiny model at
# the size where it learns the lookup, a DP8 layout's Plans trained in one process, so that sparsebalance shifts
# budget between ranks) under baseline and sparsebalance for every seed of SEEDS, and the multihop task under the
# baseline for MULTIHOP_SEEDS. The runs are small and host-bound, so they train side by side, one process each
# (one CPU thread each), and are cut at RUN_LIMIT_S; a run cut short keeps its last checkpoint
# (runner.checkpoint_every) and is evaluated there (eval_summary.csv's `steps` says where). Every run is then
# evaluated by runner.evaluate on held-out sequences of EVAL_LENGTHS under each EVAL_P. Thirteen runs side by side
# (the defaults) take about 460 s for 2000 steps on a 16-core H200 host; a call cut short is finished by calling
# again while the machine still holds outputs/learning_runs.
#
# $OUT gets runner.collect's tables of every run (train.csv, eval_summary.csv, eval.csv, budgets.csv,
# coverage_by_length.csv), learning_runs.tgz (each run dir without checkpoint, plans and per-sequence rows) and
# learning.log.
# Extra arguments are Hydra overrides for every run (e.g. steps=1000).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
SEEDS=${SEEDS:-"0 1 2 3 4 5"}
MULTIHOP_SEEDS=${MULTIHOP_SEEDS:-"0"}
RUN_LIMIT_S=${RUN_LIMIT_S:-450}
EVAL_LIMIT_S=${EVAL_LIMIT_S:-60}
EVAL_LENGTHS=${EVAL_LENGTHS:-128,256,512,1024}
EVAL_P=${EVAL_P:-1.0,0.9,0.8}
EVAL_SEQUENCES=${EVAL_SEQUENCES:-128}
RUNS=${RUNS:-outputs/learning_runs}
OUT=${OUT:-$RUNS}
mkdir -p "$RUNS" "$OUT"
export OMP_NUM_THREADS=1

# finished <summary.json>: whether the run wrote its summary after its last planned step.
finished() {
  [ -f "$1" ] && python3 -c "import json, sys; s = json.load(open(sys.argv[1])); sys.exit(s['steps'] < s['steps_planned'])" "$1"
}

# train <name> <overrides...>: one run of the recipe in the background, cut at RUN_LIMIT_S, continued from its
# checkpoint where an earlier call left one.
train() {
  local name=$1 dir="$RUNS/$1"
  shift
  finished "$dir/summary.json" && return
  mkdir -p "$dir"
  local resume=()
  [ -f "$dir/checkpoint.pt" ] && resume=(runner.resume="$(realpath "$dir/checkpoint.pt")")
  echo "== $name: $* ${resume[*]}" >> "$OUT/learning.log"
  timeout "$RUN_LIMIT_S" python3 -m runner.train +experiment=learning_lookup "${GPU_OVERRIDES[@]}" \
    hydra.run.dir="$dir" "$@" \
    "${resume[@]}" "${EXTRA[@]}" >> "$dir/train.log" 2>&1 &
}

EXTRA=("$@")
for seed in $SEEDS; do
  for policy in baseline sparsebalance; do
    train "retrieval_${policy}_s${seed}" policy="$policy" seed="$seed"
  done
done
for seed in $MULTIHOP_SEEDS; do
  # a multihop sequence needs room for its records' chains: 97 tokens at the least
  train "multihop_baseline_s${seed}" runner.task.kind=multihop workload.min_len=128 policy=baseline seed="$seed"
done
wait

for dir in "$RUNS"/*/; do
  if [ -f "$dir/checkpoint.pt" ]; then
    timeout "$EVAL_LIMIT_S" python3 -m runner.evaluate "$dir" --lengths "$EVAL_LENGTHS" --p "$EVAL_P" \
      --sequences "$EVAL_SEQUENCES" > "$dir/eval.log" 2>&1 &
  fi
done
wait
for dir in "$RUNS"/*/; do
  { echo "== $(basename "$dir")"; tail -n 1 "$dir/train.log" | tr '\r' '\n' | tail -n 1; cat "$dir/eval.log"; } \
    >> "$OUT/learning.log" 2>&1
done

# a run that failed before its first step has no tables; it is in learning.log, not in the collected tables
collected=()
for dir in "$RUNS"/*/; do
  [ -f "$dir/train.csv" ] && collected+=("$dir")
done
python3 -m runner.collect "${collected[@]}" --out "$OUT"
status=$?
tar czf "$OUT/learning_runs.tgz" --exclude=checkpoint.pt --exclude=plans.jsonl --exclude=sequences.csv \
  --exclude=micro_batches.csv -C "$RUNS" .
exit $status
