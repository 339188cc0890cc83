"""The GPU scripts (``scripts/gpu_*.sh``): the GPU kind each runs for is checked before anything runs, and the
fidelity experiment's CPU check (docs/runner.md) runs where Triton is not installed."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("gpu_*.sh"))
RUNNABLE = [s for s in SCRIPTS if s.name != "gpu_env.sh"]  # gpu_env.sh is sourced by the others
# docs/runner.md's CPU check: a model of width 32 and sequences of 64-512 tokens
CPU_CHECK = ["runner.device=cpu", "model.hidden=32", "model.heads=2", "model.kv_heads=1", "model.head_dim=16",
             "model.ffn=64", "model.vocab=128", "model.max_context=512", "workload.min_len=64", "workload.max_len=512",
             "workload.median=128", "runner.task.n_keys=16", "runner.task.n_values=16", "runner.task.max_pairs=4",
             "memory.profile=null"]


def test_the_scripts_are_named_by_what_they_do_and_parse():
    assert [s.name for s in SCRIPTS] == ["gpu_cp_bench.sh", "gpu_env.sh", "gpu_fair.sh", "gpu_fidelity.sh",
                                         "gpu_learning.sh", "gpu_replay.sh", "gpu_sensitivity.sh", "gpu_sparse_peer.sh"]
    for script in SCRIPTS:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script.name


@pytest.mark.parametrize("script", RUNNABLE, ids=[s.stem for s in RUNNABLE])
def test_an_unknown_gpu_kind_is_one_line_before_anything_runs(script, tmp_path):
    env = {**os.environ, "GPU": "h300", "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: GPU=h300 has no conf/cluster/h300.yaml and "
                                        "calibrate/profiles/h300.json; allowed: h100, h200"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_fidelity_experiments_cpu_check_runs_without_triton(tmp_path):
    stub = tmp_path / "stub" / "triton"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'triton' (a machine without it)\")\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(stub.parent), "OUT": str(out), "RUNS": str(tmp_path / "runs"),
           "STEPS": "2", "SKIP": "1", "LAYERS": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_fidelity.sh"), *CPU_CHECK], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare.json", "compare_memory.csv",
                                                     "environment.txt", "fidelity.log", "runs.tgz", "status.txt"]
    assert "triton not installed" in (out / "environment.txt").read_text()
    assert (out / "status.txt").read_text().splitlines()[:3] == [
        "runner.train baseline: exit 0", "runner.train sparsebalance: exit 0", "runner.compare: exit 0"]
    assert "ran on the CPU, which no cost profile describes" in (out / "fidelity.log").read_text()


def test_an_unknown_attention_backend_is_one_line_before_anything_runs(tmp_path):
    env = {**os.environ, "BACKENDS": "ours flash", "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_fidelity.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: BACKENDS=ours flash: flash is no cost.attention_backend; "
                                        "allowed: ours, hybrid, dense_best"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the refusals of a machine without a GPU")
@pytest.mark.slow
def test_the_dense_modes_and_the_fair_benchmark_refuse_the_cpu_in_one_line_each(tmp_path):
    """The fidelity experiment's dense modes on the CPU: each run ends with runner.train's one line (no dense
    backend of the H100 profile runs here), and runner.compare has nothing to compare; the fair benchmark ends with
    the benchmark's one line. Both keep their environment and status files."""
    env = {**os.environ, "GPU": "h100", "BACKENDS": "hybrid dense_best", "POLICIES": "baseline",
           "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_fidelity.sh"), *CPU_CHECK], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    status = (tmp_path / "out" / "status.txt").read_text().splitlines()
    # torchrun's exit code for a rank that ended with runner.train's 2
    assert status[:2] == ["runner.train baseline-hybrid: exit 1", "runner.train baseline-dense_best: exit 1"]
    log = (tmp_path / "out" / "fidelity.log").read_text()
    for mode in ("hybrid", "dense_best"):
        assert (f"error: cost.attention_backend={mode}: the cost profile prices the dense backend cudnn, which cannot "
                "run here (cudnn: absent (RuntimeError: no CUDA GPU here))") in log
    assert "no GPU: no dense attention backend runs here" in (tmp_path / "out" / "environment.txt").read_text()
    fair = {**env, "OUT": str(tmp_path / "fair")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_fair.sh")], cwd=tmp_path, env=fair,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert sorted(p.name for p in (tmp_path / "fair").iterdir()) == ["environment.txt", "fair.log", "status.txt"]
    assert (tmp_path / "fair" / "status.txt").read_text() == "benchmarks.attention --fair: exit 2\n"
    assert "error: no CUDA GPU here" in (tmp_path / "fair" / "fair.log").read_text()
