#!/usr/bin/env bash
# Multi-rank balance on the real kernel, on one GPU of the kind GPU (default h200; scripts/gpu_env.sh), its
# cluster and cost profile (runner/replay.py): every GPU's micro-batches of the
# simulator's Plans run one after another on the one device, timed with CUDA events after a warm-up run each,
# and every step is composed by the simulator's schedule (1F1B, hand-offs, gradient all-reduce); the
# communication is modelled, not run. Two layouts of the paper preset (8 GPUs), POLICIES on each in one process:
#   dp2xpp4  the preset itself: DP2 x PP4, global batch 16, 4 micro-batches of 2 per rank;
#   dp8      layout.dp=8 layout.pp=1, global batch 64: 8 sequences per rank in 4 micro-batches of 2 (the
#            preset's micro-batch size), about five times the work per step.
# Model: qwen2.5-3b's layer shape with LAYERS of its 36 layers and the vocabulary scaled by LAYERS/36, as
# scripts/gpu_fidelity.sh does: sim.cost spreads the LM head's FLOPs over the layers, so the per-layer features
# (and the calibrated per-layer times) stay qwen2.5-3b's, and the Plans, the simulated and the replayed steps
# all describe the same LAYERS-layer model (LAYERS/pp layers per stage). A replay starts no step round that
# would end after its deadline (DEADLINE_S for dp2xpp4, DP8_DEADLINE_S for dp8; the first round also compiles
# the kernels), so the two hold the GPU for about DEADLINE_S + DP8_DEADLINE_S plus start-up (~3.5 minutes).
#
# Writes under $OUT: <layout>/ (per policy a Results dir with replay.csv; comparison.csv and .json) and
# <layout>.log (the printed table). Needs torch with CUDA and Triton, numpy, pandas, PyYAML; Hydra, OmegaConf,
# ANTLR, SimPy and tqdm come from the wheels in .whl/ (carried; ignored by git) where the machine lacks them.
# Extra arguments are Hydra overrides for both layouts.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
OUT=${OUT:-/tmp/replay}
STEPS=${STEPS:-3}
LAYERS=${LAYERS:-4}
DEADLINE_S=${DEADLINE_S:-70}
DP8_DEADLINE_S=${DP8_DEADLINE_S:-120}
WARMUP=${WARMUP:-1}
POLICIES=${POLICIES:-baseline,lbb,verl,sparsebalance}
mkdir -p "$OUT"
gpu_environment || exit 1
project_commit

COMMON=(+experiment=paper "${GPU_OVERRIDES[@]}" "model.layers=$LAYERS" "model.vocab=$((151936 * LAYERS / 36))"
        "steps=$STEPS")
status=0
replay() {
  local name=$1 deadline=$2
  shift 2
  # The outer timeout only guards against a hang; the deadline ends the replay well before it.
  timeout "$((deadline + 180))" python3 -m runner.replay "${COMMON[@]}" "$@" --policies "$POLICIES" \
    --warmup "$WARMUP" --deadline-s "$deadline" --out "$OUT/$name" 2>&1 | tee "$OUT/$name.log" || status=1
}
replay dp2xpp4 "$DEADLINE_S" "$@"
replay dp8 "$DP8_DEADLINE_S" layout.dp=8 layout.pp=1 workload.global_batch=64 "$@"
exit $status
