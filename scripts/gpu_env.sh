# Sourced by the GPU scripts (scripts/gpu_*.sh) from the repository root. GPU names the kind of GPU they run on
# (default h200): its cluster (conf/cluster/<GPU>.yaml: peak rates, HBM) and its measured cost profile
# (calibrate/profiles/<GPU>.json), which GPU_OVERRIDES passes to every run; a kind without both is one error line
# and exit code 2, before anything runs. Puts the repository on PYTHONPATH; gpu_environment installs the
# pure-Python dependencies from the wheels in .whl/ (carried to the machine; ignored by git) where the machine
# lacks them, and prints the GPU, driver, torch and Triton versions.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPU=${GPU:-h200}
if [ ! -f "conf/cluster/$GPU.yaml" ] || [ ! -f "calibrate/profiles/$GPU.json" ]; then
  kinds=()
  for profile in calibrate/profiles/*.json; do
    kind=$(basename "$profile" .json)
    [ -f "conf/cluster/$kind.yaml" ] && kinds+=("$kind")
  done
  allowed=$(printf '%s, ' "${kinds[@]}")
  echo "error: GPU=$GPU has no conf/cluster/$GPU.yaml and calibrate/profiles/$GPU.json; allowed: ${allowed%, }" >&2
  exit 2
fi
GPU_OVERRIDES=(cluster="$GPU" cost.profile="calibrate/profiles/$GPU.json")

gpu_environment() {
  if ! python3 -c "import hydra, omegaconf, simpy, tqdm, joblib, hydra_plugins.hydra_joblib_launcher" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || return 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  else
    echo "no nvidia-smi"
  fi
  # Triton is the GPU kernel's: without a GPU (the CPU check) the attention runs its PyTorch reference.
  python3 - <<'PY'
import torch
try:
    import triton
except ImportError:
    if torch.cuda.is_available():
        raise SystemExit("error: torch sees a GPU but triton is not installed; the GPU runs need it (the gpu extra)")
    print("torch", torch.__version__, "triton not installed (no GPU: the attention runs its PyTorch reference)")
else:
    print("torch", torch.__version__, "triton", triton.__version__)
PY
}
