"""``cost.attention_backend`` in the runner: each micro-batch's attention runs on the backend the cost model picks
for it, the simulator's decision (sim.backends.choose), and micro_batches.csv records which one ran.

No dense backend of the project runs on the CPU (cuDNN and FlashAttention need a GPU), so the runner refuses the
dense modes here in one line; the decision and the records are checked with ``reference`` (dense_train.py), a
dense backend that runs on the CPU, priced by a profile made for it: its attention costs a fixed time per token,
so that it beats our kernel on the small micro-batches and loses on the large ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dense_train import NAME, Reference
from pinned import BACKENDS_PROFILE
from sparsebalance.kernels.backends import BACKENDS
from sparsebalance.runner.dist import World
from sparsebalance.runner.train import build_planner, compose
from sparsebalance.sim.backends import DENSE_FEATURES
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.run import simulate
from tiny import ONE_RANK, TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
# the tiny model under the calibrated cost model (its attention costs ~0.5 ms a layer, mostly fixed), 8 sequences
# of 64-512 tokens in 2 micro-batches a step, every sequence at a fixed kept fraction: what the kernel keeps, and
# so each micro-batch's price, does not depend on the data, and the runner decides as the simulator does
TINY = [o for o in TINY_ONE_RANK if not o.startswith(("cost", "workload.global_batch"))] + [
    "cost=calibrated", "workload.global_batch=8", f"steps={STEPS}", "+policy.sparsity.params.kept_fraction=0.5"]
PER_TOKEN_MS = 2.3e-4  # reference's forward per token (its backward twice that): ~700 tokens cost ours' time


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """The pinned profile with ``reference`` as its only dense backend."""
    priced = json.loads(BACKENDS_PROFILE.read_text())
    zero = dict.fromkeys(DENSE_FEATURES, 0.0)
    priced["backends"] = {NAME: {"version": Reference().version(), "terms": {
        "attn_fwd": zero | {"tokens": PER_TOKEN_MS}, "attn_bwd": zero | {"tokens": 2 * PER_TOKEN_MS}}}}
    path = tmp_path_factory.mktemp("profile") / "reference.json"
    path.write_text(json.dumps(priced))
    return path


@pytest.fixture
def reference(monkeypatch):
    """``reference`` in the registry for one test (dense_train.py registers it in the runs it starts)."""
    monkeypatch.setitem(BACKENDS, NAME, Reference)


def overrides(profile: Path, mode: str) -> list[str]:
    return [*TINY, f"cost.profile={profile}", f"cost.attention_backend={mode}"]


def simulated_backends(profile: Path, mode: str) -> list[list[str]]:
    """Per step, the backend of each micro-batch as sim.run's engine records it."""
    sim = [o for o in overrides(profile, mode) if not o.startswith("runner.")]
    rows = simulate(compose_config([*sim, "memory.activation_checkpointing=false"])).results.micro_batches()
    return [g.sort_values("micro_batch").attention_backend.tolist() for _, g in rows.groupby("step")]


def planned_backends(profile: Path, mode: str) -> list[list[str]]:
    """Per step, the backend the runner picks for each micro-batch of its one replica."""
    planner, _ = build_planner(compose(overrides(profile, mode)), ONE_RANK)
    return [planner.backends(planner.plan(step)[0])[0].tolist() for step in range(STEPS)]


@pytest.mark.parametrize("mode", ["ours", "dense_best", "hybrid"])
def test_the_runner_picks_each_micro_batchs_backend_as_the_simulator_does(profile, reference, mode):
    planned = planned_backends(profile, mode)
    assert planned == simulated_backends(profile, mode)
    ran = {name for step in planned for name in step}
    assert ran == {"ours": {"ours"}, "dense_best": {NAME}, "hybrid": {"ours", NAME}}[mode]


@pytest.mark.slow
def test_a_hybrid_run_records_which_backend_ran_each_micro_batch(profile, tmp_path):
    """A CPU run through dense_train.py: micro_batches.csv names the backend of each micro-batch (the simulator's
    choice); the sequences that reference ran report every block kept and all their attention covered, those
    on our kernel what it selected at their kept fraction."""
    cmd = [sys.executable, "tests/runner/dense_train.py", f"hydra.run.dir={tmp_path}", *overrides(profile, "hybrid")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pd.read_csv(tmp_path / "micro_batches.csv")
    recorded = [g.sort_values("micro_batch").attention_backend.tolist() for _, g in rows.groupby("step")]
    assert recorded == simulated_backends(profile, "hybrid")
    sequences = pd.read_csv(tmp_path / "sequences.csv").merge(rows, on=["step", "dp_rank", "micro_batch"],
                                                              suffixes=("", "_mb"))
    dense = sequences[sequences.attention_backend == NAME]
    ours = sequences[sequences.attention_backend == "ours"]
    assert len(dense) and len(ours)
    assert (dense.kept_fraction == 1.0).all() and (dense.coverage == 1.0).all()
    assert (ours.kept_fraction < 1.0).any() and (ours.kept_fraction >= 0.5 - 1e-6).all()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_dense_mode_whose_backends_need_a_gpu_is_one_line_before_anything_runs(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run_dir}", *TINY,
           f"cost.profile={BACKENDS_PROFILE}", "cost.attention_backend=hybrid"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: cost.attention_backend=hybrid: the cost profile prices the dense backend cudnn, which cannot run "
        "here (cudnn: absent (RuntimeError: no CUDA GPU here)); allowed: cost.attention_backend=ours, or a machine "
        "where cudnn, fa4 load (the peers extra on a GPU)"]
    assert not run_dir.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_policy_that_trains_dense_names_its_own_key():
    with pytest.raises(ConfigError, match=r"^policy\.attention_backend=dense_best: the cost profile prices the dense "
                                          r"backend cudnn, which cannot run here \(cudnn: absent"):
        build_planner(compose([*TINY, f"cost.profile={BACKENDS_PROFILE}", "policy=verl_dense"]), ONE_RANK)


def test_dense_modes_refuse_context_parallel_processes(profile, reference):
    two = ["cluster.gpus_per_node=2", "layout.cp=2"]
    world = World(rank=0, size=2, local_rank=0, local_size=2)
    with pytest.raises(ConfigError, match=r"^cost\.attention_backend=hybrid with layout\.cp=2: the runner runs a "
                                          r"dense backend on whole documents only; allowed: "):
        build_planner(compose([*overrides(profile, "hybrid"), *two]), world)
    planner, _ = build_planner(compose([*overrides(profile, "hybrid"), *two, "runner.one_process=true"]), ONE_RANK)
    assert set(planner.dense) == {NAME}  # one process holds whole documents
    np.testing.assert_array_equal(planner.backends(planner.plan(0)[0]).shape, (1, 2))
