"""``sab``: SparseBalance's sparsity-aware batching.

Length-balanced batching costs every sequence as if it ran dense, but under sparse attention a
sequence's time depends on the kept fraction its budget buys, p ** (1 / sensitivity): two sequences of
the same length can differ several-fold. SAB costs each sequence with the CostModel at its *expected*
budget and its own sensitivity, then bin-packs with Karmarkar-Karp across DP ranks and then across each
rank's micro-batches, inside the global batch only (no reordering across global batches, which would
change what the optimiser sees per step).

The expected budget is an exponential moving average, per length bucket, of the budgets the paired
sparsity policy gave recently. The drivers (sim.run, runner.train) hand SAB no feedback, so SAB owns
an instance of that policy (``expect``: name and params, in ``sparsebalance`` an interpolation of the
policy's own sparsity part) and runs it on each plan it emits; the same deterministic policy runs again
in the driver and gives the same budgets. The EMA is policy state carried across steps: the same seed
and config replay the same sequence of plans. Buckets never seen yet take the mean of the seen ones,
and before the first step everything takes ``prior_p`` (1.0: dense, so step 0 is plain LBB).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from policies.base import PartitionPolicy, make_sparsity, register_batching
from policies.karmarkar_karp import kk_partition
from policies.plan import Plan
from sim.cluster import Layout
from sim.config import PolicyPart
from sim.cost import CostModel
from sim.workload import Sequence


@register_batching("sab")
class SparsityAwareBatching(PartitionPolicy):
    @dataclass(frozen=True)
    class Params:
        # The sparsity policy whose budgets SAB expects: {name: ..., params: {...}}.
        expect: PolicyPart = field(default_factory=lambda: PolicyPart("fixed", {"p": 1.0}))
        ema: float = 0.5  # weight of the newest step's budgets
        buckets_per_octave: int = 2  # length buckets: log2(length) in steps of 1 / this
        prior_p: float = 1.0  # expected budget before anything was observed
        equal_count: bool = True  # fixed micro-batch size, as the LBB baseline

    def __init__(self, params: Params) -> None:
        if not 0.0 < params.ema <= 1.0:
            raise ValueError(f"ema={params.ema} must be in (0, 1]")
        if params.buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave={params.buckets_per_octave} must be >= 1")
        if not 0.0 < params.prior_p <= 1.0:
            raise ValueError(f"prior_p={params.prior_p} must be in (0, 1]")
        super().__init__(params)
        self.expect = make_sparsity(params.expect.name, params.expect.params)
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
        self.observe(self.expect.tune(plan, layout, cost))
        return plan

    def observe(self, tuned: Plan) -> None:
        """Fold one step's budgets into the per-bucket EMA."""
        lengths = np.array([a.length for a in tuned.assignments], dtype=np.int64)
        p = np.array([a.budget.p for a in tuned.assignments])
        buckets = self.bucket(lengths)
        for b in np.unique(buckets).tolist():
            mean = float(p[buckets == b].mean())
            old = self.expected_p.get(b)
            self.expected_p[b] = mean if old is None else old + self.params.ema * (mean - old)
