#!/usr/bin/env bash
# The sparsity-sensitivity profile of the runner's model on one GPU of the kind GPU (default h200, its cluster;
# scripts/gpu_env.sh): the learning recipe
# (conf/experiment/learning.yaml, the Triton kernel in bf16) trained on each task of TASKS under the baseline
# policy, then each final checkpoint's coverage curves measured on held-out sequences of its task
# (python -m runner.sensitivity: SEQUENCES per length of LENGTHS, top-p targets P and fixed kept fractions KEPT,
# per layer), and all of them fitted into one profile (python -m calibrate.sensitivity --check). A task whose
# run dir already holds a checkpoint is not trained again.
#
# $OUT gets: sensitivity_<task>.csv and .meta.json (the raw curves), sensitivity_<task>_train.csv (its loss and
# accuracy while training), sensitivity.json (the profile, to commit as calibrate/profiles/sensitivity_<name>.json)
# and sensitivity.log. Extra arguments are Hydra overrides for every training run.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
TASKS=${TASKS:-"retrieval multihop"}
RUN_LIMIT_S=${RUN_LIMIT_S:-60}
MEASURE_LIMIT_S=${MEASURE_LIMIT_S:-150}
LENGTHS=${LENGTHS:-512,1024,2048,4096,8192,16384}
P=${P:-0.5,0.7,0.8,0.9,0.95,0.99}
KEPT=${KEPT:-0.1,0.25,0.5}
SEQUENCES=${SEQUENCES:-32}
RUNS=${RUNS:-/tmp/sensitivity_runs}
OUT=${OUT:-$RUNS}
mkdir -p "$RUNS" "$OUT"
status=0
csvs=()
for task in $TASKS; do
  dir="$RUNS/$task"
  mkdir -p "$dir"
  if [ ! -f "$dir/checkpoint.pt" ]; then
    echo "== train $task" | tee -a "$OUT/sensitivity.log"
    # cut at RUN_LIMIT_S, the run keeps its last checkpoint (runner.checkpoint_every)
    timeout "$RUN_LIMIT_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m runner.train \
      +experiment=learning "${GPU_OVERRIDES[@]}" hydra.run.dir="$dir" runner.task.kind="$task" policy=baseline "$@" \
      > "$dir/train.log" 2>&1 || status=1
  fi
  cp "$dir/train.csv" "$OUT/sensitivity_${task}_train.csv" || status=1
  echo "== measure $task" | tee -a "$OUT/sensitivity.log"
  timeout "$MEASURE_LIMIT_S" python3 -m runner.sensitivity "$dir" --lengths "$LENGTHS" --p "$P" --kept "$KEPT" \
    --sequences "$SEQUENCES" --out "$OUT/sensitivity_${task}.csv" 2>&1 | tee -a "$OUT/sensitivity.log" || status=1
  # a measurement cut short keeps the lengths it finished
  if [ -f "$OUT/sensitivity_${task}.csv" ]; then csvs+=("$OUT/sensitivity_${task}.csv"); fi
done
echo "== fit" | tee -a "$OUT/sensitivity.log"
python3 -m calibrate.sensitivity "${csvs[@]}" --out "$OUT/sensitivity.json" --check 2>&1 \
  | tee -a "$OUT/sensitivity.log" || status=1
exit $status
