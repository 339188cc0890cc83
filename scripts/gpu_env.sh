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

peers_environment() {
  # The dense attention backends the cost profiles price (kernels.backends): cuDNN comes with torch; FlashAttention-4
  # and CUTLASS's Python DSL (the peers extra) from the wheels in .whl/ where the machine lacks them, under
  # /tmp/peers/site, with the DSL's CUDA 13 libraries from cu13.txz.* in .whl/ and PEERS_PARTS (an installed
  # nvidia-cutlass-dsl-libs-cu13, xz-compressed, split in parts). CUTLASS's `cutlass` package sits in
  # nvidia_cutlass_dsl/dsl_packages, which a wheel's .pth adds only in a site directory, so it goes on PYTHONPATH.
  # Prints which backends load and one line for each that does not; without a GPU none of them runs.
  if ! command -v nvidia-smi >/dev/null; then
    echo "no GPU: no dense attention backend runs here"
    return 0
  fi
  if ! python3 -c "import flash_attn.cute.interface" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers/site \
      .whl/flash_attn_4-*.whl .whl/nvidia_cutlass_dsl*.whl .whl/apache_tvm_ffi-*.whl .whl/torch_c_dlpack_ext-*.whl \
      .whl/quack_kernels-*.whl .whl/einops-*.whl || return 1
    # The parts come from .whl/ and from PEERS_PARTS: they do not fit one device call beside the wheels, so an
    # earlier call on the same machine leaves the last one there (cp .whl2/cu13.txz.01 /tmp/peers_parts/).
    local parts
    parts=$(for f in .whl/cu13.txz.* "${PEERS_PARTS:-/tmp/peers_parts}"/cu13.txz.*; do
      [ -f "$f" ] && echo "$(basename "$f") $f"
    done | sort | cut -d' ' -f2)
    # shellcheck disable=SC2086
    cat $parts | xz -dc | tar x -C /tmp/peers/site || return 1
    export PYTHONPATH="$PYTHONPATH:/tmp/peers/site:/tmp/peers/site/nvidia_cutlass_dsl/dsl_packages"
  fi
  python3 -c "
from sparsebalance.kernels.backends import load_all
loaded, absent = load_all()
print('attention backends:', {name: b.version() for name, b in loaded.items()})
print(*absent, sep='\n')"
}

project_commit() {
  # The project's own commit: of the checkout whose root this is (with a note where files differ from it), else
  # of the file .commit written beside the files when they were copied without their .git
  # (git rev-parse HEAD >.commit), never of another repository that happens to enclose the copy.
  if [ "$(git -C "$PWD" rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ]; then
    echo "commit $(git -C "$PWD" rev-parse HEAD)$(git -C "$PWD" diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
  elif [ -f .commit ]; then
    echo "commit $(head -c 40 .commit) (.commit, written when the files were copied)"
  else
    echo "commit unknown: $PWD is no git checkout's root and holds no .commit (git rev-parse HEAD >.commit before copying)"
  fi
}

peers_report() {
  # gpu_environment and peers_environment into $1 (the run's environment.txt), with the project's commit, printed
  # too; called directly, not in a pipeline, since both export the PYTHONPATH of what they install.
  gpu_environment >"$1" 2>&1 && peers_environment >>"$1" 2>&1
  local code=$?
  project_commit >>"$1"
  cat "$1"
  return "$code"
}
