#!/usr/bin/env bash
# The fidelity experiment in one call, on GPUs of the kind GPU (default h200; scripts/gpu_env.sh): `baseline`
# (arrival order, fixed p=0.9) and `sparsebalance` trained by runner.train on NPROC GPUs of one host (default 1:
# world size 1, 4 micro-batches per step), the real Triton kernel in bf16, STEPS steps each, then runner.compare
# replays both through the simulator, priced by PROFILE (default the GPU's calibrate/profiles/<GPU>.json):
#   - step time, measured vs simulated, per step, with each step's Triton compilations (zero after the first
#     steps: the kernels compile every variant a batch of these shapes can take at their first launch, so no
#     whole-run warm-up is needed; SKIP leaves the compiling steps out of the errors);
#   - peak memory per (DP rank, pipeline stage): sim.memory for the same Plans against
#     torch.cuda.max_memory_allocated per micro-batch and stage.
#
# Model: qwen2.5-3b's layer shape (the calibrated one, time and memory) with LAYERS of its 36 layers; the
# vocabulary scaled by LAYERS/36, because sim.cost spreads the embedding/LM-head FLOPs over the layers, so the
# per-layer features (and the calibrated per-layer times) stay exactly qwen2.5-3b's. Sequences up to 16K.
# Memory is priced as the runner holds it: the measured per-token terms (MEMORY_PROFILE, measured on the H200;
# a token's bytes are the model's and the kernel's, the same on any GPU), bf16 weights, the
# gradient and DDP's bucket copy of it (grad_bytes=4), AdamW's two bf16 moments and no fp32 master copy
# (optimizer_bytes=4), whole optimiser states on every replica (sharding=ddp), and logits only at the
# answer positions (logits_bytes=0).
#
# The attention each micro-batch runs on: BACKENDS (default `ours`), a list of cost.attention_backend values, trains
# every policy of POLICIES (default `baseline sparsebalance`) once per value: `ours` (the run dir is the policy's
# name), `hybrid` (each micro-batch on ours or the dense backend, whichever PROFILE prices faster at its budgets)
# and `dense_best` (every micro-batch dense on the fastest dense backend PROFILE prices), in run dirs
# <policy>-<backend>; micro_batches.csv records which backend ran each micro-batch. The dense modes need a profile
# that prices dense backends (GPU=h100) and those backends installed (FlashAttention-4 from .whl/, see
# gpu_env.sh's peers_environment; cuDNN comes with torch); where one cannot run, runner.train says so in one line.
#
# Writes under $OUT (7 files, nothing deeper): fidelity.log (everything printed), runs.tgz (every run dir; tarred
# again after every run, so a timeout keeps what is done), compare.csv and compare.json (every run's steps and
# summary), compare_memory.csv (the memory table), environment.txt (GPU, driver, torch and Triton versions, and
# with a dense mode the attention backends that load), status.txt (the exit code of each part).
# Nothing is fetched: Hydra, OmegaConf, ANTLR, SimPy and tqdm come from the wheels in .whl/ (carried; ignored by
# git) where the machine lacks them. Extra arguments are Hydra overrides for both runs (the CPU check runs it
# with a tiny model, without Triton: docs/runner.md).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
OUT=${OUT:-/tmp/gpu_fidelity}
RUNS=${RUNS:-/tmp/gpu_fidelity_runs}
STEPS=${STEPS:-10}
SKIP=${SKIP:-2}
LAYERS=${LAYERS:-4}
NPROC=${NPROC:-1}
RUN_LIMIT_S=${RUN_LIMIT_S:-150}  # a guard against a hang: a run takes about a minute
PROFILE=${PROFILE:-calibrate/profiles/$GPU.json}
MEMORY_PROFILE=${MEMORY_PROFILE:-calibrate/profiles/h200_memory.json}
POLICIES=${POLICIES:-baseline sparsebalance}
BACKENDS=${BACKENDS:-ours}
for backend in $BACKENDS; do
  case "$backend" in
    ours | hybrid | dense_best) ;;
    *) echo "error: BACKENDS=$BACKENDS: $backend is no cost.attention_backend; allowed: ours, hybrid, dense_best" >&2
       exit 2 ;;
  esac
done
mkdir -p "$OUT" "$RUNS"

experiment() {
  # not in a pipeline: gpu_environment exports the PYTHONPATH of the wheels it installs, which a subshell loses
  gpu_environment >"$OUT/environment.txt" 2>&1
  code=$?
  if [ "$code" = 0 ] && [ "$BACKENDS" != ours ]; then
    peers_environment >>"$OUT/environment.txt" 2>&1
    code=$?
  fi
  project_commit >>"$OUT/environment.txt"
  cat "$OUT/environment.txt"
  [ "$code" = 0 ] || exit 1

  COMMON=(cluster.gpus_per_node="$NPROC" layout.micro_batches=4 model=qwen2.5-3b "model.layers=$LAYERS"
          "model.vocab=$((151936 * LAYERS / 36))" workload=longtail workload.global_batch=16 workload.max_len=16384
          cost=calibrated "${GPU_OVERRIDES[@]}" "memory.profile=$MEMORY_PROFILE" memory.sharding=ddp
          memory.grad_bytes=4 memory.optimizer_bytes=4 memory.logits_bytes=0 "steps=$STEPS")
  : >"$OUT/status.txt"
  status=0
  names=()
  for backend in $BACKENDS; do
    for policy in $POLICIES; do
      name=$policy
      [ "$backend" = ours ] || name="$policy-$backend"
      names+=("$name")
      rm -rf "${RUNS:?}/$name"
      timeout "$RUN_LIMIT_S" python3 -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m runner.train \
        policy="$policy" hydra.run.dir="$RUNS/$name" "${COMMON[@]}" cost.attention_backend="$backend" "$@"
      code=$?
      echo "runner.train $name: exit $code" | tee -a "$OUT/status.txt"
      [ "$code" = 0 ] || status=1
      tar czf "$OUT/runs.tgz" -C "$RUNS" "${names[@]}" 2>/dev/null
    done
  done
  python3 -m runner.compare "${names[@]/#/$RUNS/}" --profile "$PROFILE" --skip "$SKIP" --out "$OUT/compare.csv"
  code=$?
  echo "runner.compare: exit $code" | tee -a "$OUT/status.txt"
  [ "$code" = 0 ] || status=1
  tar czf "$OUT/runs.tgz" -C "$RUNS" "${names[@]}" 2>/dev/null
  # Compilations after the first SKIP steps make those steps slower than any cost model; they must be zero.
  [ "$code" = 0 ] && python3 - "$OUT/compare.json" <<'EOF' | tee -a "$OUT/status.txt"
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
bad = [r["policy"] for r in runs if r["compilations_in_compared_steps"] != 0]
print("compilations after the skipped steps:", {r["policy"]: r["compilations_in_compared_steps"] for r in runs},
      "FAIL" if bad else "ok")
sys.exit(1 if bad else 0)
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "exit $status" | tee -a "$OUT/status.txt"
  return $status
}

experiment "$@" 2>&1 | tee "$OUT/fidelity.log"
exit "${PIPESTATUS[0]}"
