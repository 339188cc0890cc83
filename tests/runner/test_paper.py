"""The paper's layout as users launch it, on the CPU: ``torchrun --nproc_per_node=8 -m runner.train
+experiment=paper policy=sparsebalance`` (DP2 x PP4, 4 micro-batches of the longqa workload) with the
overrides of TINY, which make the model and the sequences small enough for 8 gloo ranks on a few cores.
Its first Plan is sim.run's and each later one its planner's after what the kernel reported, its Results hold
every (replica, micro-batch, stage), and runner.compare reads it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from equivalence import check_replanned
from pinned import PINNED_PROFILE
from sparsebalance.runner.dist import World
from sparsebalance.runner.train import build_planner, compose
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.run import simulate

pytestmark = pytest.mark.slow  # one 8-rank torchrun, the paper's layout as users launch it
ROOT = Path(__file__).resolve().parents[2]
PAPER = ["+experiment=paper", "policy=sparsebalance"]
# Qwen2.5-3B's 36 layers of width 2048 and 8K-token sequences become 4 layers of width 32 and sequences of
# 64-512 tokens (the retrieval task's keys and values fit a vocabulary of 128); 2 steps.
TINY = ["model.hidden=32", "model.layers=4", "model.heads=2", "model.kv_heads=1", "model.head_dim=16",
        "model.ffn=64", "model.vocab=128", "model.max_context=512", "workload.min_len=64", "workload.max_len=512",
        "workload.median=128", "steps=2"]
RUNNER = ["runner.task.n_keys=16", "runner.task.n_values=16", "runner.task.max_pairs=4"]


def launch(run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8", "-m",
           "sparsebalance.runner.train", f"hydra.run.dir={run_dir}", *PAPER, *TINY, *RUNNER]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def run_dir(once) -> Path:
    """The 8-rank run, launched once per session: its three checks may run on different xdist workers."""
    return once("paper", launch)


def test_plans_are_the_simulators(run_dir):
    """Step 0's Plan is sim.run's; step 1's is what the same planner makes when shown what the kernel reported of
    step 0 (sequences.csv, steps.csv), where sim.run's planner is shown the cost model's."""
    # The runner keeps its activations (conf/runner.yaml), so sim.run plans the same step without recompute.
    sim_cfg = compose_config([*PAPER, *TINY, "memory.activation_checkpointing=false"])
    recorded = (run_dir / "plans.jsonl").read_text().splitlines()
    assert len(recorded) == 2 and recorded[0] == simulate(sim_cfg).results.plans[0]
    planner, _ = build_planner(compose([*PAPER, *TINY, *RUNNER]), World(rank=0, size=8, local_rank=0))
    check_replanned(run_dir, planner)


def test_every_replica_micro_batch_and_stage_has_its_row(run_dir):
    rows = pd.read_csv(run_dir / "micro_batches.csv")
    assert len(rows) == len(rows.drop_duplicates(["step", "dp_rank", "micro_batch", "stage"])) == 2 * 2 * 4 * 4
    assert sorted(rows["stage"].unique()) == [0, 1, 2, 3] and sorted(rows["dp_rank"].unique()) == [0, 1]
    # Every stage of a replica sees the same micro-batches; the later stages wait for the earlier ones.
    tokens = rows.pivot_table(index=["step", "dp_rank", "micro_batch"], columns="stage", values="tokens")
    assert (tokens.nunique(axis=1) == 1).all()
    assert rows.loc[rows["stage"] == 3, "idle_ms"].sum() > 0
    train = pd.read_csv(run_dir / "train.csv")
    assert list(train["step"]) == [0, 1] and train["loss"].notna().all()


def test_compare_reads_the_run(run_dir):
    from sparsebalance.runner.compare import main

    assert main([str(run_dir), "--profile", str(PINNED_PROFILE), "--skip", "0"]) == 0
    assert len(pd.read_csv(run_dir / "compare.csv")) == 2
