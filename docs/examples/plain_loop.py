"""Drive the SparseBalance planner from a plain PyTorch training loop: no Hydra, no runner.

Each step the loop hands the planner the global batch's lengths, gets back per (DP rank, micro-batch) the
sequences to pack and each one's attention budget, runs them through the block-sparse attention kernel, and
hands back what the kernel reported of every sequence (kept fraction and coverage) with the step's time. The
planner never sees how a sequence's attention spreads: it learns that from these reports.

Here one process plays every DP rank of a 2-rank layout on the CPU (the kernel's PyTorch reference runs
there); a real trainer runs only its own rank's micro-batches and all-gathers the reports.

    python docs/examples/plain_loop.py
"""
from __future__ import annotations

import time

import numpy as np
import torch

from sparsebalance.kernels.sparse_attention import sparse_attention
from sparsebalance.sim.setup import build_planner

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 32
PLANNER_OVERRIDES = [  # a small layout: 2 DP ranks, 2 micro-batches each, 8 sequences of 128-1024 tokens
    "model=tiny", "cost=roofline", f"cost.block_size={BLOCK}", "cluster.gpus_per_node=2", "layout.micro_batches=2",
    "workload.global_batch=8", "workload.min_len=128", "workload.max_len=1024", "workload.median=256",
]


class Attention(torch.nn.Module):
    """One causal attention layer over packed documents, through the block-sparse kernel."""

    def __init__(self) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * KV_HEADS * HEAD_DIM)

    def forward(self, x, cu_seqlens, budget: dict):
        q = self.q(x).view(-1, HEADS, HEAD_DIM)
        k, v = self.kv(x).view(-1, 2, KV_HEADS, HEAD_DIM).unbind(1)
        o, selection = sparse_attention(q, k, v, cu_seqlens, **budget, block_size=BLOCK, return_selection=True)
        return o.reshape(x.shape), selection


def kernel_budget(seqs) -> dict:
    """The kernel's budget keywords for one micro-batch's sequences, whole: the kept fractions where the plan set
    them, else top-k block counts (with their coverage floors as ``p``, where set), else the top-p targets. A
    policy keeps one family per micro-batch."""
    budgets = [a.budget for a in seqs]
    if budgets[0].kept_fraction is not None:
        return {"kept_fraction": torch.tensor([b.kept_fraction for b in budgets])}
    if budgets[0].top_k is not None:
        floors = [b.p_floor for b in budgets]
        return {"top_k": torch.tensor([b.top_k for b in budgets]),
                "p": None if floors[0] is None else torch.tensor(floors)}
    return {"p": torch.tensor([b.p for b in budgets])}


def main(steps: int = 3, seed: int = 0, policy: str = "sparsebalance", reports: list | None = None) -> list[float]:
    """Train ``steps`` steps under ``policy``; the planner's predicted step times. ``reports`` (a list) gets per
    step the plan and what the kernel reported of each of its sequences (kept fraction)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    planner = build_planner(policy, PLANNER_OVERRIDES)
    model = Attention()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    predicted = []
    for step in range(steps):
        lengths = np.clip(rng.lognormal(np.log(256), 1.0, 8).astype(int), 128, 1024)  # your data loader's
        plan = planner.plan(lengths.tolist(), step)
        predicted.append(planner.predicted_ms)
        kept, coverage = {}, {}
        start = time.perf_counter()
        for rank in range(plan.dp):
            for mb in range(plan.micro_batches):
                seqs = plan.micro_batch(rank, mb)
                if not seqs:
                    continue
                cu_seqlens = torch.tensor(np.cumsum([0] + [a.length for a in seqs]), dtype=torch.int32)
                x = torch.randn(int(cu_seqlens[-1]), HEADS * HEAD_DIM)
                out, selection = model(x, cu_seqlens, kernel_budget(seqs))
                out.pow(2).mean().backward()
                for a, k, c in zip(seqs, selection.kept_fraction.tolist(), selection.coverage.tolist(), strict=True):
                    kept[a.seq_id], coverage[a.seq_id] = k, c
        optimizer.step()
        optimizer.zero_grad()
        step_ms = (time.perf_counter() - start) * 1e3
        planner.observe(plan, [kept[a.seq_id] for a in plan.assignments],
                        [coverage[a.seq_id] for a in plan.assignments], step_ms)
        if reports is not None:
            reports.append((plan, dict(kept)))
        budgets = sorted({str(a.budget) for a in plan.assignments})
        print(f"step {step}: {len(plan.assignments)} sequences on {plan.dp} ranks, {len(budgets)} budgets, "
              f"mean kept fraction {np.mean(list(kept.values())):.3f}, {step_ms:.0f} ms")
    return predicted


if __name__ == "__main__":
    main()
