#!/usr/bin/env bash
# Context parallelism's attention pieces on one H200 (runner/cp_bench.py): for one sequence of each length, CP
# degree and budget (top-p P, fixed kept fraction KEPT), CP rank 0's pieces of one layer (its queries over every rank's K/V shard under the
# sequence's kernel selection, the log-sum-exp merge, their backward; bf16 inputs, float32 math in PyTorch)
# against sim.cost's predicted attention time of that rank (the calibrated H200 profile, qwen2.5-3b's layer
# shape), with the kernel's whole-sequence attention beside them. The ring's transfers are not run.
#
# Writes under $OUT: cp_bench.csv, cp_bench.log, environment.txt. Needs torch with CUDA and Triton, numpy,
# pandas, PyYAML; Hydra, OmegaConf, ANTLR, SimPy and tqdm come from the wheels in .whl/ (carried; ignored by
# git) where the machine lacks them. Extra arguments are Hydra overrides (sim.run's config).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cp_bench}
LENGTHS=${LENGTHS:-4096,8192,16384}
CP=${CP:-2,4}
P=${P:-1.0,0.9}
KEPT=${KEPT:-0.3,0.1}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! python3 -c "import hydra, omegaconf, simpy, tqdm" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/environment.txt"

# The workload's lengths only have to fit the model's context; the bench draws no workload.
timeout 540 python3 -m runner.cp_bench --device cuda --lengths "$LENGTHS" --cp "$CP" --p "$P" --kept "$KEPT" \
  --repeats "$REPEATS" --out "$OUT/cp_bench.csv" model=qwen2.5-3b cost=calibrated "$@" 2>&1 | tee "$OUT/cp_bench.log"
exit "${PIPESTATUS[0]}"
