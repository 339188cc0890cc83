# Sourced by the runner's GPU scripts from the repository root: puts the repository on PYTHONPATH, installs
# the pure-Python dependencies from the wheels in .whl/ (carried to the machine; ignored by git) where the
# machine lacks them, and prints the GPU, driver, torch and Triton versions.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

gpu_environment() {
  if ! python3 -c "import hydra, omegaconf, simpy, tqdm, joblib, hydra_plugins.hydra_joblib_launcher" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || return 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}
