"""``sab``: SparseBalance's sparsity-aware batching.

Length-balanced batching costs every sequence as if it ran dense, but under sparse attention a
sequence's time depends on the kept fraction its budget buys, p ** (1 / s) for a sequence of sensitivity
s: two sequences of the same length can differ several-fold. SAB costs each sequence with the CostModel at its
*expected* budget, then bin-packs with Karmarkar-Karp across DP ranks and then across each
rank's micro-batches, inside the global batch only (no reordering across global batches, which would
change what the optimiser sees per step).

SAB never sees a sequence's sensitivity: it averages the kept fraction over the planner's belief
(sim.estimate). The expected budget is an exponential moving average, per length bucket, of the budgets
the paired sparsity policy gave recently: the drivers (sim.run, runner.train) plan through
``sim.planner.Planner``, which shows every step's outcome, with the Plan that ran, to ``observe``. The EMA is policy
state carried across steps: the same seed and config replay the same sequence of
plans. Buckets never seen yet take the mean of the seen ones, and before the first step everything
takes ``prior_p`` (1.0: dense, so step 0 is plain LBB).

Ours, not the paper's (``pipeline_order: search``, the default here; every PartitionPolicy accepts the
parameter): with pp > 1 each rank's packed micro-batches are also put in the order with the shortest
1F1B time at the expected budgets.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.policies.base import PartitionParams, PartitionPolicy, PipelineOrder
from sparsebalance.policies.karmarkar_karp import kk_partition
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief, Observation
from sparsebalance.sim.plan import BudgetArrays
from sparsebalance.sim.policy import register_batching


@register_batching("sab")
class SparsityAwareBatching(PartitionPolicy):
    @dataclass(frozen=True)
    class Params(PartitionParams):
        pipeline_order: PipelineOrder = PipelineOrder.search  # ours, not the paper's (see the module docstring)
        ema: float = 0.5  # weight of the newest step's budgets
        buckets_per_octave: int = 2  # length buckets: log2(length) in steps of 1 / this
        prior_p: float = 1.0  # expected budget before anything was observed
        equal_count: bool = True  # fixed micro-batch size, as the LBB baseline
        refine: bool = False  # local search after Karmarkar-Karp (policies/karmarkar_karp.py)

    def __init__(self, params: Params) -> None:
        if not 0.0 < params.ema <= 1.0:
            raise ValueError(f"ema={params.ema} must be in (0, 1]")
        if params.buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave={params.buckets_per_octave} must be >= 1")
        if not 0.0 < params.prior_p <= 1.0:
            raise ValueError(f"prior_p={params.prior_p} must be in (0, 1]")
        super().__init__(params)
        self.expected_p: dict[int, float] = {}  # length bucket -> EMA of the budget p (or k, with top-k budgets)
        self.top_k = False  # the paired sparsity policy gives top-k budgets
        self.p_floor: float | None = None  # their coverage floor

    def bucket(self, lengths: np.ndarray) -> np.ndarray:
        return np.floor(np.log2(np.maximum(lengths, 1)) * self.params.buckets_per_octave).astype(np.int64)

    def expected(self, lengths: np.ndarray) -> np.ndarray:
        """The EMA budget of each sequence's bucket: p, or with top-k budgets k (blocks per query block)."""
        default = float(np.mean(list(self.expected_p.values()))) if self.expected_p else self.params.prior_p
        return np.array([self.expected_p.get(int(b), default) for b in self.bucket(lengths)])

    def expected_kept(self, ids: np.ndarray, lengths: np.ndarray, belief: Belief, cost: CostModel) -> np.ndarray:
        """The kept fraction the EMA budget buys, averaged over the belief's samples of each sequence."""
        budget = self.expected(lengths)
        nan = np.full(lengths.size, np.nan)
        if self.top_k:
            cols = BudgetArrays(np.ones(lengths.size), nan, budget, np.full(lengths.size, self.p_floor or np.nan))
        else:
            cols = BudgetArrays(budget, nan, nan, nan)
        return cols.kept(cost, lengths, belief.at(ids)).mean(axis=0)

    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return kk_partition(costs, k, self.params.equal_count, self.params.refine)

    def rank_partition(self, costs: np.ndarray, k: int, layout: Layout) -> list[list[int]]:
        # With pp = 1 a rank's time is the sum of its micro-batches however they are cut: no refinement.
        return kk_partition(costs, k, self.params.equal_count, self.params.refine and layout.pp > 1)

    def observe(self, observation: Observation) -> None:
        """Fold the budgets of the step that ran into the per-bucket EMA (of k, where they are top-k budgets)."""
        budgets = observation.plan.budgets
        top_k = np.flatnonzero(~np.isnan(budgets.top_k))
        self.top_k = bool(top_k.size)
        if self.top_k:
            p_floor = float(budgets.p_floor[top_k[0]])
            self.p_floor = None if np.isnan(p_floor) else p_floor
            value = budgets.top_k
        else:
            value = budgets.p
        buckets = self.bucket(observation.plan.lengths)
        for b in np.unique(buckets).tolist():
            mean = float(value[buckets == b].mean())
            old = self.expected_p.get(b)
            self.expected_p[b] = mean if old is None else old + self.params.ema * (mean - old)
