#!/usr/bin/env bash
# The fair attention benchmark with its hybrid column in one call, on one GPU of the kind GPU (default h200;
# scripts/gpu_env.sh): the packed 64K batch of long-tail documents (MHA 16:16 and GQA 32:4) at sparsity 0 and
# SPARSITIES, timed in turns (ROUNDS rounds, medians): our kernel, the dense kernels (cuDNN per document,
# FlashAttention-4 and -3 dense varlen, each where it loads; timed at sparsity 0, their work does not depend on
# it), FlashAttention-4's block-sparse form on ours' kept blocks (fa4_sparse), and `hybrid`: at every sparsity
# ours or another backend, whichever PROFILE (default the GPU's calibrate/profiles/<GPU>.json, which must price
# other backends: GPU=h100) prices faster for the batch at ours' kept fractions, as cost.attention_backend=hybrid
# decides in the simulator and the runner. The table shows hybrid's time beside the fastest dense kernel's and
# ours' (at least 1.0x: hybrid is as fast) and a note at each point where the profile chose the slower option.
#
# Writes under $OUT (5 files): attention_fair_hybrid.csv (every row), attention_fair_hybrid.md (the table:
# python -m benchmarks.attention --table of the CSV), fair.log (everything printed), environment.txt (GPU, driver,
# torch, Triton and the attention backends that load), status.txt (the exit code of each part).
# FlashAttention-4 comes from the wheels in .whl/ (carried; ignored by git) where the machine lacks it. The sparsities
# past DEADLINE_S seconds are skipped (rows saying so); extra arguments go to the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
OUT=${OUT:-/tmp/gpu_fair}
PROFILE=${PROFILE:-calibrate/profiles/$GPU.json}
SPARSITIES=${SPARSITIES:-0.05,0.1,0.15,0.2,0.25,0.5,0.75,0.9,0.95}
ROUNDS=${ROUNDS:-3}
DEADLINE_S=${DEADLINE_S:-360}
mkdir -p "$OUT"

experiment() {
  peers_report "$OUT/environment.txt" || exit 1

  : >"$OUT/status.txt"
  timeout $((DEADLINE_S + 120)) python3 -m benchmarks.attention --fair --profile "$PROFILE" --rounds "$ROUNDS" \
    --flex-mode default --fair-sparsities "$SPARSITIES" \
    --fair-impls cudnn_per_document_dense,fa4_varlen_dense,fa3_varlen_dense,fa4_sparse --deadline-s "$DEADLINE_S" \
    --csv "$OUT/attention_fair_hybrid.csv" "$@"
  code=$?
  echo "benchmarks.attention --fair: exit $code" | tee -a "$OUT/status.txt"
  [ "$code" = 0 ] || return 1
  python3 -m benchmarks.attention --table "$OUT/attention_fair_hybrid.csv" | tee "$OUT/attention_fair_hybrid.md"
  code=${PIPESTATUS[0]}
  echo "benchmarks.attention --table: exit $code" | tee -a "$OUT/status.txt"
  return "$code"
}

experiment "$@" 2>&1 | tee "$OUT/fair.log"
exit "${PIPESTATUS[0]}"
