"""The parallel layouts train what one process trains: DP2 and PP2 x DP2 under torchrun on the CPU (gloo), with
DDP and with FSDP2, against the same Plan run in this process, micro-batch after micro-batch on one whole
model. Their first step's loss and gradients (saved by grad_probe.py before the optimiser steps) must agree
within float tolerance; the Plans must be the simulator's byte for byte; the Results hold a row per
(replica, micro-batch, stage) and ``runner.compare`` replays them.

The policy gives every sequence the same budget whatever the layout (baseline), so that the layouts train
the same attention; a different packing of the same sequences changes only the order of float sums.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from pinned import PINNED_PROFILE
from runner.attention import make_attention
from runner.config import register
from runner.data import TaskConfig, n_answers, pack
from runner.model import ModelShape, TinyLlama
from sim.core import compose_config
from sim.plan import Plan
from sim.run import simulate

ROOT = Path(__file__).resolve().parents[2]
# A tiny model (2 layers: one per stage at pp=2) with tied embeddings, as Qwen2.5-3B has them.
SHARED = [
    "cost=roofline", "cost.block_size=32", "layout.micro_batches=2", "model.hidden=32", "model.layers=2",
    "model.heads=2", "model.kv_heads=1", "model.head_dim=16", "model.ffn=64", "model.vocab=128",
    "model.max_context=512", "workload.global_batch=8", "workload.min_len=64", "workload.max_len=512",
    "workload.median=128", "seed=5", "policy=baseline", "steps=1",
]
RUNNER = ["runner.task.n_keys=16", "runner.task.n_values=16", "runner.task.max_pairs=4"]
LAYOUTS = {  # name: (processes, pipeline stages, data parallelism)
    "dp2-ddp": (2, 1, "ddp"),
    "dp2-fsdp": (2, 1, "fsdp"),
    "pp2xdp2-ddp": (4, 2, "ddp"),
    "pp2xdp2-fsdp": (4, 2, "fsdp"),
}
RTOL = 1e-5  # of each gradient's largest entry; fp32 sums in another order differ by ~1e-7


def layout_overrides(name: str) -> list[str]:
    nproc, pp, _ = LAYOUTS[name]
    return [*SHARED, f"cluster.gpus_per_node={nproc}", f"layout.pp={pp}"]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    nproc, _, data_parallel = LAYOUTS[name]
    run_dir = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "tests/runner/grad_probe.py", f"hydra.run.dir={run_dir}", *layout_overrides(name), *RUNNER,
           f"runner.data_parallel={data_parallel}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RUNNER_GRADS": str(run_dir)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return name, run_dir


def one_process(plan: Plan) -> tuple[float, dict[str, torch.Tensor]]:
    """The Plan's first step on one whole model: every micro-batch of every replica, loss summed over the
    global batch's scored tokens and divided by their count."""
    register()
    cfg = compose_config([*SHARED, *RUNNER, "cluster.gpus_per_node=1"], config_name="runner")
    task = TaskConfig(**cfg.runner.task)
    model = TinyLlama(ModelShape.from_config(cfg.model), seed=cfg.seed)
    attend = make_attention("kernel", cfg.cost.block_size)
    n = n_answers(plan.assignments, task)
    total = 0.0
    for rank in range(plan.dp):
        for mb in range(plan.micro_batches):
            b = pack(plan.micro_batch(rank, mb), task, cfg.model.vocab, cfg.seed, torch.device("cpu"))
            out = model(b.tokens, b.cu_seqlens, (b.p, b.kept_fraction), b.target_positions, attend)
            loss = F.cross_entropy(out.logits, b.targets, reduction="sum")
            (loss / n).backward()
            total += float(loss.detach())
    return total / n, {name: p.grad for name, p in model.named_parameters()}


def test_loss_and_gradients_are_the_single_process_ones(run):
    name, run_dir = run
    plan = Plan.from_json((run_dir / "plans.jsonl").read_text().splitlines()[0])
    loss, grads = one_process(plan)
    assert pd.read_csv(run_dir / "train.csv")["loss"].iloc[0] == pytest.approx(loss, rel=1e-6)
    saved = {}
    for path in sorted(run_dir.glob("rank*.pt")):
        saved.update(torch.load(path, weights_only=True))
    # A pipelined model's last stage holds its own copy of the tied embedding, as the LM head.
    expected = {**grads, "lm_head.weight": grads["embed.weight"]} if "lm_head.weight" in saved else grads
    assert saved.keys() == expected.keys()
    for key, grad in expected.items():
        torch.testing.assert_close(saved[key], grad, rtol=0, atol=RTOL * float(grad.abs().max()), msg=key)


def test_plans_are_the_simulators(run):
    name, run_dir = run
    expected = "".join(line + "\n" for line in simulate(compose_config(layout_overrides(name))).results.plans)
    assert (run_dir / "plans.jsonl").read_bytes() == expected.encode()


def test_results_have_a_row_per_replica_micro_batch_and_stage(run):
    name, run_dir = run
    plan = Plan.from_json((run_dir / "plans.jsonl").read_text().splitlines()[0])
    pp = LAYOUTS[name][1]
    rows = pd.read_csv(run_dir / "micro_batches.csv")
    keys = rows[["dp_rank", "micro_batch", "stage"]].drop_duplicates()
    assert len(keys) == len(rows) == plan.dp * plan.micro_batches * pp
    assert (rows["compute_ms"] > 0).all() and (rows["idle_ms"] >= 0).all() and (rows["comm_ms"] >= 0).all()
    if pp > 1:  # the last stage waits for the first one's activations
        assert rows.loc[rows["stage"] == pp - 1, "idle_ms"].sum() > 0
    sequences = pd.read_csv(run_dir / "sequences.csv")
    assert sorted(sequences["seq_id"]) == sorted(a.seq_id for a in plan.assignments)


def test_compare_replays_the_run(run):
    from runner.compare import main

    name, run_dir = run
    assert main([str(run_dir), "--profile", str(PINNED_PROFILE), "--skip", "0"]) == 0
    table = pd.read_csv(run_dir / "compare.csv")
    assert len(table) == 1 and (table["sim_ms"] > 0).all()
