"""``sab``: SparseBalance's sparsity-aware batching.

Length-balanced batching costs every sequence as if it ran dense, but under sparse attention a
sequence's time depends on the kept fraction its budget buys, p ** (1 / sensitivity): two sequences of
the same length can differ several-fold. SAB costs each sequence with the CostModel at its *expected*
budget and its own sensitivity, then bin-packs with Karmarkar-Karp across DP ranks and then across each
rank's micro-batches, inside the global batch only (no reordering across global batches, which would
change what the optimiser sees per step).

The expected budget is an exponential moving average, per length bucket, of the budgets the paired
sparsity policy gave recently: the drivers (sim.run, runner.train) plan through
``policies.base.plan_step``, which shows every tuned Plan to ``observe``. The EMA is policy state
carried across steps: the same seed and config replay the same sequence of
plans. Buckets never seen yet take the mean of the seen ones, and before the first step everything
takes ``prior_p`` (1.0: dense, so step 0 is plain LBB).

Ours, not the paper's (``pipeline_order``, on by default): with pp > 1 each rank's packed micro-batches
are also put in the order with the shortest 1F1B time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from policies.base import PartitionPolicy

from sim.policy import register_batching
from policies.dst import pipeline_ms
from policies.karmarkar_karp import kk_partition
from sim.plan import Plan
from sim.cluster import Layout
from sim.cost import CostModel
from sim.workload import Sequence

MAX_ORDERED = 6  # micro-batches per rank up to which every order is tried (6! = 720)


@register_batching("sab")
class SparsityAwareBatching(PartitionPolicy):
    @dataclass(frozen=True)
    class Params:
        ema: float = 0.5  # weight of the newest step's budgets
        buckets_per_octave: int = 2  # length buckets: log2(length) in steps of 1 / this
        prior_p: float = 1.0  # expected budget before anything was observed
        equal_count: bool = True  # fixed micro-batch size, as the LBB baseline
        pipeline_order: bool = True  # with pp > 1, order each rank's micro-batches for 1F1B (ours, not the paper's)

    def __init__(self, params: Params) -> None:
        if not 0.0 < params.ema <= 1.0:
            raise ValueError(f"ema={params.ema} must be in (0, 1]")
        if params.buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave={params.buckets_per_octave} must be >= 1")
        if not 0.0 < params.prior_p <= 1.0:
            raise ValueError(f"prior_p={params.prior_p} must be in (0, 1]")
        super().__init__(params)
        self.expected_p: dict[int, float] = {}  # length bucket -> EMA of the budget p

    def bucket(self, lengths: np.ndarray) -> np.ndarray:
        return np.floor(np.log2(np.maximum(lengths, 1)) * self.params.buckets_per_octave).astype(np.int64)

    def expected(self, lengths: np.ndarray) -> np.ndarray:
        default = float(np.mean(list(self.expected_p.values()))) if self.expected_p else self.params.prior_p
        return np.array([self.expected_p.get(int(b), default) for b in self.bucket(lengths)])

    def costs(self, batch: list[Sequence], layout: Layout, cost: CostModel) -> np.ndarray:
        lengths = np.fromiter((s.length for s in batch), dtype=np.int64, count=len(batch))
        sens = np.fromiter((s.sensitivity for s in batch), dtype=np.float64, count=len(batch))
        kept = cost.kept_fractions(lengths, sens, self.expected(lengths))
        return cost.sequence_costs(lengths, kept, layout)

    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return kk_partition(costs, k, self.params.equal_count)

    def plan(self, batch: list[Sequence], layout: Layout, cost: CostModel, step: int) -> Plan:
        plan = super().plan(batch, layout, cost, step)
        if self.params.pipeline_order and layout.pp > 1 and layout.micro_batches <= MAX_ORDERED:
            plan = self.pipeline_order(plan, layout, cost)
        return plan

    def pipeline_order(self, plan: Plan, layout: Layout, cost: CostModel) -> Plan:
        """Each rank's micro-batches in the order with the shortest 1F1B time at the expected budgets.

        Bin-packing fixes what runs together, not when: in 1F1B the first micro-batch's forward and the
        last one's backward cross every stage alone (warm-up and cool-down), so the order changes the
        rank's time. Every order is tried (m! of them, vectorised; ties keep the packed order).
        """
        dp, m = layout.dp, layout.micro_batches
        rank = np.array([a.dp_rank for a in plan.assignments], dtype=np.int64)
        mb = np.array([a.micro_batch for a in plan.assignments], dtype=np.int64)
        lengths = np.array([a.length for a in plan.assignments], dtype=np.int64)
        sens = np.array([a.sensitivity for a in plan.assignments])
        kept = cost.kept_fractions(lengths, sens, self.expected(lengths))
        costs = cost.micro_batch_costs(lengths, kept, rank * m + mb, dp * m, layout)
        fwd, bwd = costs.fwd_ms.reshape(dp, m), costs.bwd_ms.reshape(dp, m)
        p2p = cost.hand_off_ms(costs.tokens, layout).reshape(dp, m)
        orders = np.array(list(itertools.permutations(range(m))))  # [orders, m], the packed order first
        span = pipeline_ms(fwd[:, orders], bwd[:, orders], p2p[:, orders], layout.pp)  # [dp, orders]
        position = np.argsort(orders[np.argmin(span, axis=1)], axis=1)  # [rank, old mb] -> new mb
        moved = [replace(a, micro_batch=int(position[a.dp_rank, a.micro_batch])) for a in plan.assignments]
        moved.sort(key=lambda a: (a.dp_rank, a.micro_batch))
        return replace(plan, assignments=tuple(moved))

    def observe(self, tuned: Plan) -> None:
        """Fold one step's budgets into the per-bucket EMA."""
        lengths = np.array([a.length for a in tuned.assignments], dtype=np.int64)
        p = np.array([a.budget.p for a in tuned.assignments])
        buckets = self.bucket(lengths)
        for b in np.unique(buckets).tolist():
            mean = float(p[buckets == b].mean())
            old = self.expected_p.get(b)
            self.expected_p[b] = mean if old is None else old + self.params.ema * (mean - old)
