#!/usr/bin/env bash
# Context parallelism's attention pieces on one GPU of the kind GPU (default h200; scripts/gpu_env.sh)
# (runner/cp_bench.py): for one sequence of each length, CP
# degree and budget (top-p P, fixed kept fraction KEPT), CP rank 0's pieces of one layer (its queries over every
# rank's K/V shard under the sequence's kernel selection, the log-sum-exp merge, their backward; bf16 inputs,
# float32 math in PyTorch) against sim.cost's predicted attention time of that rank (the GPU's calibrated
# profile, qwen2.5-3b's layer shape), with the kernel's whole-sequence attention beside them, and each rank's
# share of the selection's kept work against sim.cp_shards. The ring's transfers are not run.
#
# Writes under $OUT: cp_bench.csv, cp_bench.log, environment.txt. Needs torch with CUDA and Triton, numpy,
# pandas, PyYAML; the rest comes from .whl/ (scripts/gpu_env.sh). Extra arguments are Hydra overrides
# (sim.run's config).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
OUT=${OUT:-/tmp/cp_bench}
LENGTHS=${LENGTHS:-4096,8192,16384}
CP=${CP:-2,4}
P=${P:-1.0,0.9}
KEPT=${KEPT:-0.3,0.1}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
gpu_environment > "$OUT/environment.txt" || exit 1
project_commit >>"$OUT/environment.txt"
cat "$OUT/environment.txt"

# The workload's lengths only have to fit the model's context; the bench draws no workload.
timeout 540 python3 -m runner.cp_bench --device cuda --lengths "$LENGTHS" --cp "$CP" --p "$P" --kept "$KEPT" \
  --repeats "$REPEATS" --out "$OUT/cp_bench.csv" model=qwen2.5-3b cost=calibrated "${GPU_OVERRIDES[@]}" "$@" 2>&1 \
  | tee "$OUT/cp_bench.log"
exit "${PIPESTATUS[0]}"
