"""What the equivalence tests of the parallel layouts share (test_parallel.py).

A layout runs under torchrun on the CPU (gloo) for one step, writing its checkpoint, and is held against
the same Plan run in the test's own process, micro-batch after micro-batch on one whole model: the first
step's loss and gradients (saved by grad_probe.py before the optimiser steps) must agree within float
tolerance; the Plans must be the simulator's byte for byte; the Results hold a row per (replica,
micro-batch, stage) and ``runner.compare`` replays them.

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
from omegaconf import OmegaConf

from pinned import PINNED_PROFILE
from sparsebalance.runner.attention import make_attention
from sparsebalance.runner.config import TrainConfig, register
from sparsebalance.runner.data import n_answers, pack
from sparsebalance.model import make_model
from sparsebalance.runner.task import TaskConfig
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.run import simulate
from sparsebalance.sim.workload import Workload, truth_of

ROOT = Path(__file__).resolve().parents[2]
# A tiny model (2 layers: one per stage at pp=2) with tied embeddings, as Qwen2.5-3B has them.
SHARED = [
    "cost=roofline", "cost.block_size=32", "layout.micro_batches=2", "model.hidden=32", "model.layers=2",
    "model.heads=2", "model.kv_heads=1", "model.head_dim=16", "model.ffn=64", "model.vocab=128",
    "model.max_context=512", "workload.global_batch=8", "workload.min_len=64", "workload.max_len=512",
    "workload.median=128", "seed=5", "policy=baseline", "steps=1",
]
RUNNER = ["runner.task.n_keys=16", "runner.task.n_values=16", "runner.task.max_pairs=4"]
LAYOUTS = {  # name: (processes, pipeline stages, data parallelism, other overrides)
    "dp2-ddp": (2, 1, "ddp", []),
    "dp2-fsdp": (2, 1, "fsdp", []),
    "pp2xdp2-ddp": (4, 2, "ddp", []),
    "pp2xdp2-fsdp": (4, 2, "fsdp", []),
}
# Context parallelism (runner/cp.py), kept apart so that test_parallel.py runs the layouts above only.
CP_LAYOUTS = {
    "cp2-ddp": (2, 1, "ddp", ["layout.cp=2"]),
    "cp2-fsdp": (2, 1, "fsdp", ["layout.cp=2"]),
    "cp2xdp2-ddp": (4, 1, "ddp", ["layout.cp=2"]),
    "cp2xdp2-fsdp": (4, 1, "fsdp", ["layout.cp=2"]),
    # every dimension at once: tied embedding across stages, a ring per (replica, stage)
    "pp2xcp2-fsdp": (4, 2, "fsdp", ["layout.cp=2"]),
}
ALL_LAYOUTS = {**LAYOUTS, **CP_LAYOUTS}
LR = 1e-2
RTOL = 1e-5  # of each gradient's largest entry; fp32 sums in another order differ by ~1e-7


def layout_overrides(name: str) -> list[str]:
    nproc, pp, _, extra = ALL_LAYOUTS[name]
    return [*SHARED, f"cluster.gpus_per_node={nproc}", f"layout.pp={pp}", *extra]


def probe(run_dir: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    """``nproc`` processes under torchrun through grad_probe.py (which saves the first step's gradients), with
    the tiny runner config and ``overrides``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "tests/runner/grad_probe.py", f"hydra.run.dir={run_dir}", *RUNNER, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RUNNER_GRADS": str(run_dir)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def launch(name: str, run_dir: Path, *overrides: str) -> None:
    """The layout under torchrun, through grad_probe.py."""
    nproc, _, data_parallel, _ = ALL_LAYOUTS[name]
    proc = probe(run_dir, nproc, *layout_overrides(name), f"runner.data_parallel={data_parallel}",
                 f"runner.lr={LR}", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]


def one_step_run(name: str, tmp_path_factory) -> tuple[str, Path]:
    run_dir = tmp_path_factory.mktemp(name)
    launch(name, run_dir, "runner.checkpoint_every=1")
    return name, run_dir


def one_process(plans: list[Plan], truth: dict[int, float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The Plans' steps on one whole model, every micro-batch of every replica, loss summed over the global
    batch's scored tokens and divided by their count, AdamW between steps: each step's loss and the first
    step's gradients. ``truth``: each sequence's sensitivity, which its data is generated from."""
    register()
    cfg = compose_config([*SHARED, *RUNNER, "cluster.gpus_per_node=1", f"runner.lr={LR}"], config_name="runner")
    task = TaskConfig(**cfg.runner.task)
    model = make_model(cfg.model, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.runner.lr, weight_decay=cfg.runner.weight_decay)
    attend = make_attention("kernel", cfg.cost.block_size)
    losses, first = [], None
    for plan in plans:
        n = n_answers(plan.assignments, task, truth)
        total = 0.0
        for rank in range(plan.dp):
            for mb in range(plan.micro_batches):
                if not plan.micro_batch(rank, mb):
                    continue
                b = pack(plan.micro_batch(rank, mb), truth, task, cfg.model.vocab, cfg.seed, torch.device("cpu"))
                out = model(b.tokens, b.cu_seqlens, (b.p, b.kept_fraction), b.target_positions, attend)
                loss = F.cross_entropy(out.logits, b.targets, reduction="sum")
                (loss / n).backward()
                total += float(loss.detach())
        losses.append(total / n)
        if first is None:
            first = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, first


@torch.no_grad()
def first_step_selection(plan: Plan, truth: dict[int, float]) -> dict[int, tuple[float, float]]:
    """Per sequence of the Plan, the kept fraction and coverage (means over the layers) that one process's whole
    model selects from the initial weights, which the first step's forwards use."""
    register()
    cfg = compose_config([*SHARED, *RUNNER, "cluster.gpus_per_node=1"], config_name="runner")
    task = TaskConfig(**cfg.runner.task)
    model = make_model(cfg.model, cfg.seed)
    attend = make_attention("kernel", cfg.cost.block_size)
    stats = {}
    for rank in range(plan.dp):
        for mb in range(plan.micro_batches):
            assigned = plan.micro_batch(rank, mb)
            if not assigned:
                continue
            b = pack(assigned, truth, task, cfg.model.vocab, cfg.seed, torch.device("cpu"))
            out = model(b.tokens, b.cu_seqlens, (b.p, b.kept_fraction), b.target_positions, attend)
            for a, kept, coverage in zip(assigned, out.kept_fraction.tolist(), out.coverage.tolist(), strict=True):
                stats[a.seq_id] = (kept, coverage)
    return stats


def plans_of(run_dir: Path) -> list[Plan]:
    return [Plan.from_json(line) for line in (run_dir / "plans.jsonl").read_text().splitlines()]


def truth_of_run(run_dir: Path) -> dict[int, float]:
    """Sequence id -> sensitivity of every sequence the run planned: what its workload drew (and its data
    generator built each sequence from), from the run's saved config."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig),
                                              OmegaConf.load(run_dir / ".hydra" / "config.yaml")))
    workload = Workload(cfg.workload, cfg.model.max_context, cfg.seed)
    return {i: s for plan in plans_of(run_dir) for i, s in truth_of(workload.batch(plan.step)).items()}


# ---------------------------------------------------------------------- checks of one run
def check_loss_and_gradients(run_dir: Path) -> None:
    losses, grads = one_process(plans_of(run_dir)[:1], truth_of_run(run_dir))
    assert pd.read_csv(run_dir / "train.csv")["loss"].iloc[0] == pytest.approx(losses[0], rel=1e-6)
    saved = {}
    for path in sorted(run_dir.glob("rank*.pt")):
        saved.update(torch.load(path, weights_only=True))
    # A pipelined model's last stage holds its own copy of the tied embedding, as the LM head.
    expected = {**grads, "lm_head.weight": grads["embed.weight"]} if "lm_head.weight" in saved else grads
    assert saved.keys() == expected.keys()
    for key, grad in expected.items():
        torch.testing.assert_close(saved[key], grad, rtol=0, atol=RTOL * float(grad.abs().max()), msg=key)


def check_plans(name: str, run_dir: Path) -> None:
    expected = "".join(line + "\n" for line in simulate(compose_config(layout_overrides(name))).results.plans)
    assert (run_dir / "plans.jsonl").read_bytes() == expected.encode()


def check_rows(name: str, run_dir: Path) -> None:
    plan, pp = plans_of(run_dir)[0], ALL_LAYOUTS[name][1]
    rows = pd.read_csv(run_dir / "micro_batches.csv")
    keys = rows[["dp_rank", "micro_batch", "stage"]].drop_duplicates()
    assert len(keys) == len(rows) == plan.dp * plan.micro_batches * pp
    assert (rows["idle_ms"] >= 0).all() and (rows["comm_ms"] >= 0).all()
    empty = rows["tokens"] == 0
    assert (rows.loc[~empty, "compute_ms"] > 0).all() and (rows.loc[empty, "compute_ms"] == 0).all()
    assert not empty.any()  # a layout that would leave a micro-batch empty is refused
    if pp > 1:  # the last stage waits for the first one's activations
        assert rows.loc[rows["stage"] == pp - 1, "idle_ms"].sum() > 0
    sequences = pd.read_csv(run_dir / "sequences.csv")
    assert sorted(sequences["seq_id"]) == sorted(a.seq_id for a in plan.assignments)


def check_compare(run_dir: Path) -> None:
    from sparsebalance.runner.compare import main

    assert main([str(run_dir), "--profile", str(PINNED_PROFILE), "--skip", "0"]) == 0
    table = pd.read_csv(run_dir / "compare.csv")
    assert len(table) == len(plans_of(run_dir)) and (table["sim_ms"] > 0).all()


def check_replanned(run_dir: Path, planner) -> None:
    """Every Plan a runner run recorded is what ``planner`` (a fresh runner.train.StepPlanner of the same config)
    makes when shown, step by step, what the run's kernel reported (sequences.csv, steps.csv)."""
    recorded = (run_dir / "plans.jsonl").read_text().splitlines()
    sequences = pd.read_csv(run_dir / "sequences.csv").set_index(["step", "seq_id"])
    steps = pd.read_csv(run_dir / "steps.csv").set_index("step")
    for step, line in enumerate(recorded):
        plan, _ = planner.plan(step)
        assert plan.to_json() == line, step
        reported = sequences.loc[[(step, a.seq_id) for a in plan.assignments]]
        planner.observe(plan, reported["kept_fraction"], reported["coverage"], steps.loc[step, "step_ms"])
