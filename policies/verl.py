"""``verl``: verl's sequence balancing (``verl/utils/seqlen_balancing.py``), in this simulator's two levels.

* DP ranks: equal-count Karmarkar-Karp over verl's workload estimate ``24576 L + L^2`` (dense-block FLOPs
  ``12 h^2 L + 2 h L^2`` over ``2 h`` for h = 4096, which verl uses whatever the model), as verl's trainer
  balances the global batch before dispatching it;
* each rank's share: free-count Karmarkar-Karp over the same estimate into the rank's micro-batches, as
  verl's dynamic batching (``rearrange_micro_batches``) does, here with the layout's micro-batch count;
* order: verl's rule by default (``pipeline_order: verl``): heaviest first, then every other micro-batch
  reversed followed by the rest, so the lighter ones run at both ends of the pipeline.

Plain LDM at both levels, as verl runs it; ``refine: true`` adds this project's local search (within a
rank only with pp > 1: with pp = 1 a rank's time is the sum of its micro-batches, however they are cut).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.policies.base import PartitionParams, PartitionPolicy, PipelineOrder, batch_arrays
from sparsebalance.policies.karmarkar_karp import refined_partition
from sparsebalance.sim.balance import ldm_partition, verl_workload
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.policy import register_batching
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.workload import Request


@register_batching("verl")
class Verl(PartitionPolicy):
    @dataclass(frozen=True)
    class Params(PartitionParams):
        pipeline_order: PipelineOrder = PipelineOrder.verl
        refine: bool = False  # this project's local search after each LDM (not verl's)

    def costs(self, batch: list[Request], layout: Layout, cost: CostModel, belief: Belief) -> np.ndarray:
        return verl_workload(batch_arrays(batch)[1])

    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        return self.cut(costs, k, equal_count=True, refine=self.params.refine)

    def rank_partition(self, costs: np.ndarray, k: int, layout: Layout) -> list[list[int]]:
        return self.cut(costs, k, equal_count=False, refine=self.params.refine and layout.pp > 1)

    @staticmethod
    def cut(costs: np.ndarray, k: int, equal_count: bool, refine: bool) -> list[list[int]]:
        parts = ldm_partition(costs, k, equal_count)
        return refined_partition(costs, parts, equal_count) if refine else parts
