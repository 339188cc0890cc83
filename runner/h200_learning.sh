#!/usr/bin/env bash
# The learning recipe on one H200 (conf/experiment/learning.yaml: conf/model/tiny.yaml, 256 to 8K tokens, 32
# sequences per step, the Triton kernel in bf16): the multihop task under the baseline policy, then the
# retrieval task under baseline and sparsebalance for the same STEPS over SEEDS (by default 70% of the steps the
# multihop run reached in RUN_LIMIT_S, in multiples of 20). Every run's final checkpoint
# is evaluated by runner.evaluate on held-out sequences of EVAL_LENGTHS under each EVAL_P. Every run trains the
# Plans of a DP-rank layout (DP, default 8) in one process (runner.one_process=true): on one GPU's own layout
# (dp 1) sparsebalance plans the baseline's budgets, so only a dp > 1 layout compares what the budgets teach.
#
# $OUT gets: learning_runs.tgz (each run dir without its checkpoint: train.csv, steps.csv, sequences.csv,
# summary.json, eval.csv, eval_summary.csv, train.log, eval.log), learning_eval.csv (every run's
# eval_summary.csv, one table), learning_train.csv (every run's train.csv, one table) and learning.log.
# Extra arguments are Hydra overrides for every run (e.g. steps=100 workload.max_len=16384 model.max_context=16384).
set -uo pipefail
SEEDS=${SEEDS:-"0 1 2"}
DP=${DP:-8}
RUN_LIMIT_S=${RUN_LIMIT_S:-50}
EVAL_LIMIT_S=${EVAL_LIMIT_S:-25}
EVAL_LENGTHS=${EVAL_LENGTHS:-512,2048,8192}
EVAL_P=${EVAL_P:-1.0,0.9,0.8}
EVAL_SEQUENCES=${EVAL_SEQUENCES:-32}
RUNS=${RUNS:-/tmp/learning_runs}
OUT=${OUT:-$RUNS}
mkdir -p "$RUNS" "$OUT"
status=0

# train <name> <overrides...>: one run of the recipe, cut at RUN_LIMIT_S (its last checkpoint stays), evaluated.
train() {
  local name=$1 dir="$RUNS/$1"
  shift
  echo "== $name: $*" | tee -a "$OUT/learning.log"
  mkdir -p "$dir"
  timeout "$RUN_LIMIT_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m runner.train \
    +experiment=learning hydra.run.dir="$dir" cluster.gpus_per_node="$DP" runner.one_process=true "$@" "${EXTRA[@]}" > "$dir/train.log" 2>&1 || status=1
  tail -n 2 "$dir/train.log" | tr '\r' '\n' | tail -n 1 >> "$OUT/learning.log"
  timeout "$EVAL_LIMIT_S" python3 -m runner.evaluate "$dir" --lengths "$EVAL_LENGTHS" --p "$EVAL_P" \
    --sequences "$EVAL_SEQUENCES" > "$dir/eval.log" 2>&1 || status=1
  tee -a "$OUT/learning.log" < "$dir/eval.log"
  tar czf "$OUT/learning_runs.tgz" --exclude=checkpoint.pt -C "$RUNS" .  # after each run: a timeout keeps it
}

EXTRA=("$@")
# The multihop run goes first with more steps than its time allows; how far it got sets STEPS (unless given)
# for the retrieval runs, so that each of them finishes its STEPS inside RUN_LIMIT_S and every policy and
# seed is compared after the same number of steps.
train multihop_baseline_s0 runner.task.kind=multihop policy=baseline seed=0 steps=20000 runner.checkpoint_every=20
if [ -z "${STEPS:-}" ]; then
  done_steps=$(($(wc -l < "$RUNS/multihop_baseline_s0/train.csv") - 1))
  STEPS=$(( (done_steps * 7 / 10) / 20 * 20 ))
  [ "$STEPS" -ge 20 ] || STEPS=20
fi
echo "== retrieval runs: $STEPS steps each" | tee -a "$OUT/learning.log"
for seed in $SEEDS; do
  for policy in baseline sparsebalance; do
    train "retrieval_${policy}_s${seed}" runner.task.kind=retrieval policy="$policy" seed="$seed" steps="$STEPS" \
      runner.checkpoint_every="$STEPS"
  done
done

# One table each of every run's evaluation and training curve, keyed by the run's name (task_policy_seed).
python3 - "$RUNS" "$OUT" <<'EOF' || status=1
import sys
from pathlib import Path

import pandas as pd

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
for name, target in (("eval_summary.csv", "learning_eval.csv"), ("train.csv", "learning_train.csv")):
    tables = [pd.read_csv(p).assign(run=p.parent.name) for p in sorted(runs.glob(f"*/{name}"))]
    if tables:
        pd.concat(tables).to_csv(out / target, index=False)
EOF
exit $status
