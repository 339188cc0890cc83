#!/usr/bin/env bash
# The H200 fidelity experiment: one GPU (world size 1), 4 micro-batches per step, the real Triton kernel in
# bf16, `baseline` (arrival order, fixed p=0.9) and `sparsebalance`, STEPS steps each. Run dirs are tarred
# into $OUT/h200_runs.tgz (one archive is easier to copy back than many files); `python -m runner.compare <run dir>` then
# replays them through the simulator on any machine. Extra arguments are Hydra overrides for both runs.
#
# Model: qwen2.5-3b's layer shape (the calibrated one) with 8 of its 36 layers so that a step takes about a
# second; vocab scaled by the same 8/36 because sim.cost spreads the embedding/LM-head FLOPs over the layers,
# so the per-layer features (and hence the calibrated per-layer times) stay exactly qwen2.5-3b's. Sequences are
# capped at 16K so that a micro-batch of four stays far inside the GPU's memory (about 110 KB/token/layer).
set -uo pipefail
STEPS=${STEPS:-20}
RUN_LIMIT_S=${RUN_LIMIT_S:-130}
RUNS=${RUNS:-/tmp/runner_runs}
OUT=${OUT:-$RUNS}
COMMON=(cluster.gpus_per_node=1 layout.micro_batches=4 model=qwen2.5-3b model.layers=8 model.vocab=33763
        workload=longtail workload.global_batch=16 workload.max_len=16384 cost=calibrated steps="$STEPS")
status=0
# A throwaway copy of the baseline run first fills Triton's on-disk kernel cache, so that neither measured
# run pays JIT compilation, which the simulator does not model (WARMUP=0 skips it). It must be the whole run:
# Triton specialises kernels on integer arguments, so new batches bring new compilations (2 steps were not
# enough on the H200, see runner/results/h200.md).
if [ "${WARMUP:-1}" = 1 ]; then
  timeout "$RUN_LIMIT_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m runner.train \
    policy=baseline hydra.run.dir="$RUNS/../warmup" "${COMMON[@]}" "$@" || status=1
fi
for policy in baseline sparsebalance; do
  timeout "$RUN_LIMIT_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m runner.train \
    policy="$policy" hydra.run.dir="$RUNS/$policy" "${COMMON[@]}" "$@" || status=1
  tar czf "$OUT/h200_runs.tgz" -C "$RUNS" .  # after each run: a later timeout keeps what is done
done
exit $status
