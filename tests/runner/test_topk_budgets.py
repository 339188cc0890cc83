"""Top-k budgets in the runner: ``pack`` carries a Plan's top-k counts (and coverage floors) to the kernel, the
one-process CPU runner trains sparsebalance_topk's Plans (sequences.csv's kept fractions are the closed form
per sequence without a floor, at least it with one), both CP attentions select top-k as one process does,
and the replay runs a top-k micro-batch and records what ran."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp

from cp_worlds import run_cp_cases
from sparsebalance.kernels.sparse_attention import sparse_attention
from sparsebalance.runner.attention import budget_keywords
from sparsebalance.runner.cp import make_cp_attention, shard_micro_batch
from sparsebalance.runner.cp_kernel import make_cp_kernel_attention
from sparsebalance.runner.data import pack
from sparsebalance.runner.task import TaskConfig
from sparsebalance.sim.cost import topk_kept_fraction
from sparsebalance.sim.plan import Assignment, Budget, Plan

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
# a tiny CPU model (tests/runner/equivalence.py's), sequences of 2-16 blocks of 32 tokens; DST's top-k levels
# from 1 to 16 blocks (k_cap 4 k), starting at 4, so that the long sequences keep fewer blocks than they have
TINY = [
    "cost=roofline", f"cost.block_size={BLOCK}", "layout.micro_batches=2", "model.hidden=32", "model.layers=2",
    "model.heads=2", "model.kv_heads=1", "model.head_dim=16", "model.ffn=64", "model.vocab=128",
    "model.max_context=512", "workload.global_batch=16", "workload.min_len=64", "workload.max_len=512",
    "workload.median=128", "seed=5", "steps=2", "runner.task.n_keys=16", "runner.task.n_values=16",
    "runner.task.max_pairs=4", "policy=sparsebalance_topk", "policy.sparsity.params.k=4",
    "policy.sparsity.params.k_floor=1",
]
# one process trains every replica's Plans of a 4-GPU layout, where DST moves the micro-batches' k apart
ONE_PROCESS = ["runner.one_process=true", "cluster.gpus_per_node=4"]
VOCAB = 256  # the default task's tokens (test packing)
FLOOR = 0.6


def assignments(budgets, lengths=(64, 100, 150)):
    return tuple(Assignment(i, n, 0, 0, b) for i, (n, b) in enumerate(zip(lengths, budgets, strict=True)))


def packed(budgets, lengths=(64, 100, 150)):
    return pack(assignments(budgets, lengths), {i: 0.5 for i in range(len(lengths))}, TaskConfig(), VOCAB, 0,
                torch.device("cpu"))


# ---------------------------------------------------------------------- packing
def test_pack_carries_top_k_counts_and_floors():
    batch = packed([Budget(top_k=k) for k in (1, 3, 2)])
    assert torch.equal(batch.top_k, torch.tensor([1, 3, 2])) and batch.p is None and batch.kept_fraction is None
    assert budget_keywords(batch.budgets) == {"top_k": batch.top_k, "p": None}
    floored = packed([Budget(top_k=k, p_floor=f) for k, f in ((1, 0.5), (3, 0.9), (2, 0.5))])
    assert torch.equal(floored.p, torch.tensor([0.5, 0.9, 0.5]))
    assert budget_keywords(floored.budgets) == {"top_k": floored.top_k, "p": floored.p}
    topp = packed([Budget(p=0.5)] * 3)
    assert topp.top_k is None and budget_keywords(topp.budgets) == {"p": topp.p}
    fixed = packed([Budget(kept_fraction=0.3)] * 3)
    assert budget_keywords(fixed.budgets) == {"kept_fraction": fixed.kept_fraction}


@pytest.mark.parametrize("budgets, message", [
    ([Budget(top_k=2), Budget(p=0.5), Budget(top_k=1)], r"mixes budget families \(p, top_k\)"),
    ([Budget(top_k=2), Budget(kept_fraction=0.5), Budget(top_k=1)], r"mixes budget families \(kept_fraction, top_k\)"),
    ([Budget(top_k=2, p_floor=0.5), Budget(top_k=2), Budget(top_k=1)], "with and without a coverage floor"),
])
def test_pack_refuses_a_micro_batch_the_kernel_cannot_take_in_one_call(budgets, message):
    with pytest.raises(ValueError, match=message) as info:
        packed(budgets)
    assert "\n" not in str(info.value)


def test_cp_shards_keep_the_micro_batchs_top_k():
    batch = packed([Budget(top_k=k, p_floor=0.7) for k in (1, 3, 2)])
    shard = shard_micro_batch(batch, 2, 1)
    assert shard.top_k is batch.top_k and shard.p is batch.p


# ---------------------------------------------------------------------- the runner end to end
def train(run_dir: Path, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run_dir}", *TINY, *ONE_PROCESS,
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def trained(run_dir: Path) -> pd.DataFrame:
    """Per (step, sequence) of the Plans: length, top_k, p_floor, and the kept fraction the run recorded."""
    plans = [Plan.from_json(line) for line in (run_dir / "plans.jsonl").read_text().splitlines()]
    rows = pd.DataFrame([{"step": plan.step, "seq_id": a.seq_id, "length": a.length, "top_k": a.budget.top_k,
                          "p_floor": a.budget.p_floor} for plan in plans for a in plan.assignments])
    kept = pd.read_csv(run_dir / "sequences.csv")[["step", "seq_id", "kept_fraction"]]
    return rows.merge(kept, on=["step", "seq_id"], how="outer", validate="1:1")


@pytest.fixture(scope="module")
def topk_run(once) -> pd.DataFrame:
    return trained(once("topk-one-process", train))


@pytest.fixture(scope="module")
def floor_run(once) -> pd.DataFrame:
    return trained(once("topk-floor-one-process",
                        lambda run_dir: train(run_dir, f"+policy.sparsity.params.p_floor={FLOOR}")))


@pytest.mark.slow
def test_the_runner_trains_the_plans_top_k_budgets(topk_run):
    """Without a floor a top-k row keeps min(k, its causal blocks) whatever the scores: every sequence's
    recorded kept fraction (mean over the layers) is the closed form of its Plan's k."""
    rows = topk_run
    assert rows["top_k"].notna().all() and rows["p_floor"].isna().all() and rows["kept_fraction"].notna().all()
    assert rows["top_k"].nunique() > 1, "DST gave every micro-batch the same k"
    want = topk_kept_fraction(rows["length"], rows["top_k"], BLOCK)
    np.testing.assert_allclose(rows["kept_fraction"], want, rtol=1e-6)
    assert (want < 1).sum() >= 3, "the run must drop blocks"


@pytest.mark.slow
def test_a_floor_keeps_at_least_the_top_k_blocks(floor_run):
    rows = floor_run
    assert (rows["p_floor"] == FLOOR).all()
    closed = topk_kept_fraction(rows["length"], rows["top_k"], BLOCK)
    assert (rows["kept_fraction"] >= closed - 1e-6).all()
    assert (rows["kept_fraction"] > closed + 1e-3).any(), "the floor never added a block"


# ---------------------------------------------------------------------- context parallelism
HQ, HKV, D = 4, 2, 16
CP_BLOCK = 16
# name: (cp, sequence lengths, top_k per sequence, floor per sequence or None)
CP_CASES = {
    "cp2-top-k": (2, (37, 61, 18), (2, 2, 2), None),
    "cp3-top-k-per-sequence-floor": (3, (83, 29, 45), (1, 3, 2), (0.5, 0.8, 0.3)),
}
# of each tensor's largest entry: fp32 sums in another order (the ring's pieces and merge against one softmax;
# observed up to 2.6e-6 on these sharpened inputs), where a wrong block moves outputs by their own size
CP_RTOL = 1e-5
CP_IMPLEMENTATIONS = {
    "ring": lambda ring: make_cp_attention(CP_BLOCK, ring),
    "kernel": lambda ring: make_cp_kernel_attention(CP_BLOCK, ring, "auto"),
}


def _cp_inputs(lengths, top_k, floor):
    gen = torch.Generator().manual_seed(sum(lengths))
    q, k, v, g = (torch.randn(sum(lengths), h, D, generator=gen) * s for h, s in ((HQ, 3), (HKV, 3), (HKV, 1), (HQ, 1)))
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    budgets = (None if floor is None else torch.tensor(floor), None, torch.tensor(top_k))
    return q, k, v, g, cu, budgets


def _cp_worker(rank: int, out: str) -> None:
    """Every top-k case with every CP implementation (cp_worlds.run_cp_cases)."""
    cases = {case: (cp, lambda lengths=lengths, top_k=top_k, floor=floor: _cp_inputs(lengths, top_k, floor))
             for case, (cp, lengths, top_k, floor) in CP_CASES.items()}
    run_cp_cases(rank, out, cases, CP_IMPLEMENTATIONS)


@pytest.fixture(scope="module")
def cp_outputs(once) -> Path:
    widest = max(cp for cp, *_ in CP_CASES.values())
    return once("cp-topk", lambda out: mp.spawn(_cp_worker, args=(str(out),), nprocs=widest, join=True))


@pytest.mark.slow
@pytest.mark.parametrize("impl", list(CP_IMPLEMENTATIONS))
@pytest.mark.parametrize("case", list(CP_CASES))
def test_cp_attention_selects_top_k_as_one_process(case, impl, cp_outputs):
    cp, lengths, top_k, floor = CP_CASES[case]
    q, k, v, g, cu, budgets = _cp_inputs(lengths, top_k, floor)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, sel = sparse_attention(q, k, v, cu, **budget_keywords(budgets), block_size=CP_BLOCK, return_selection=True,
                              backend="naive")
    o.backward(g)
    if floor is None:
        np.testing.assert_allclose(sel.kept_fraction, topk_kept_fraction(lengths, top_k, CP_BLOCK), rtol=1e-6)
    assert float(sel.kept_fraction.min()) < 1.0
    for rank in range(cp):
        got = torch.load(cp_outputs / f"{case}-{impl}" / f"rank{rank}.pt", weights_only=True)
        i = got["index"]
        for name, want in (("o", o.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(got[name], want[i], rtol=0, atol=CP_RTOL * float(want.abs().max()),
                                       msg=f"{name} on cp rank {rank}")
        torch.testing.assert_close(got["kept"], sel.kept_fraction, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["coverage"], sel.coverage, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- the replay
def test_the_replay_runs_top_k_and_records_what_ran():
    """runner.replay's staged model takes a top-k micro-batch (the closed form's kept fraction per sequence),
    and the replayed Plan's budgets are the kept fractions that ran."""
    from sparsebalance.runner.replay import kernel_budgets
    from sparsebalance.runner.staged import Measured, StagedModel, Untimed
    from sparsebalance.sim.shapes import ModelShape

    lengths = (64, 300, 150)
    budgets = [Budget(top_k=k) for k in (1, 3, 2)]
    shape = ModelShape("tiny", hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, ffn=64, vocab=VOCAB,
                       max_context=512)
    staged = StagedModel(shape, 2, 0, torch.device("cpu"), "kernel", BLOCK, recompute=True)
    kept, _ = staged.run(packed(budgets, lengths), Untimed(), ("topk", 0, 0, 0))
    np.testing.assert_allclose(kept, topk_kept_fraction(lengths, [1, 3, 2], BLOCK), rtol=1e-6)
    plan = Plan.of(0, 1, 1, assignments(budgets, lengths))
    ran = kernel_budgets(plan, Measured(np.zeros((1, 1, 2)), np.zeros((1, 1, 2)), dict(enumerate(kept.tolist())), {}))
    assert [a.budget for a in ran.assignments] == [Budget(kept_fraction=k) for k in kept.tolist()]
