"""Shared machinery of the built-in policies: two-level partitioning over DP ranks and micro-batches, the
micro-batch order for the pipeline, and uniform budgets. The interfaces and registries are ``sim.policy``."""
from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar

import numpy as np

from sparsebalance.policies.pipeline_fit import fitted
from sparsebalance.policies.repack import repack
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.memory import MemoryModel
from sparsebalance.sim.pipeline import pipeline_ms
from sparsebalance.sim.plan import Budget, BudgetArrays, Plan
from sparsebalance.sim.workload import Request


# ----------------------------------------------------------------------------- batching helpers
class PipelineOrder(str, Enum):
    """In which order a rank runs its micro-batches (the partition fixes only what runs together).

    In 1F1B the first micro-batch's forward and the last one's backward cross every stage alone (warm-up
    and cool-down), so with pp > 1 the order changes a rank's time; with pp = 1 it never does.
    """

    packed = "packed"  # as the partition returned them
    verl = "verl"  # by cost, the lighter micro-batches at both ends (verl's dynamic-batch rule)
    search = "search"  # the order with the shortest 1F1B time at the policy's own expected costs
    fit = "fit"  # search, then sequences moved between micro-batches and ranks for it (policies/pipeline_fit.py)


MAX_ORDERED = 6  # micro-batches per rank up to which ``search`` tries every order (6! = 720)
MAX_SWAP_ROUNDS = 64  # above MAX_ORDERED: pairwise-swap rounds of the order search (each strictly improves)


@dataclass(frozen=True)
class PartitionParams:
    """Parameters every PartitionPolicy accepts; a policy's own Params subclasses this."""

    pipeline_order: PipelineOrder = PipelineOrder.packed


class PartitionPolicy(ABC):
    """Batching in two levels: split the global batch over DP ranks, then each rank's share over its
    micro-batches (never across global batches, which would change the optimiser's semantics), then put
    each rank's micro-batches in the ``pipeline_order``.

    Subclasses say how to cut a list of costs into k parts; the cost of a sequence is its busy time
    from the CostModel (``sequence_costs``) at the kept fractions ``expected_kept`` gives (dense here; a
    sparsity-aware policy overrides it, from the planner's belief), or whatever ``costs`` a subclass returns
    instead.
    """

    Params: ClassVar[type] = PartitionParams

    def __init__(self, params) -> None:
        self.params = params

    def expected_kept(self, ids: np.ndarray, lengths: np.ndarray, belief: Belief, cost: CostModel) -> np.ndarray:
        """Kept fraction the policy expects each sequence to run at (1: it plans as if dense)."""
        return np.ones(lengths.size)

    def costs(self, batch: list[Request], layout: Layout, cost: CostModel, belief: Belief) -> np.ndarray:
        ids, lengths = batch_arrays(batch)
        return cost.sequence_costs(lengths, self.expected_kept(ids, lengths, belief, cost), layout)

    @abstractmethod
    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        """Indices into ``costs`` for each of k parts (order inside a part is execution order).

        The plan lists assignments by (rank, micro-batch), in that order.
        """

    def rank_partition(self, costs: np.ndarray, k: int, layout: Layout) -> list[list[int]]:
        """One rank's share over its k micro-batches (the DP-level cut, unless a policy cuts ranks otherwise)."""
        return self.partition(costs, k)

    def micro_batch_counts(self, batch: list[Request], ranks: list[list[int]], layout: Layout) -> list[int]:
        """How many of the layout's micro-batch slots each rank fills (all of them here); slots left over
        stay empty and take no time."""
        return [layout.micro_batches] * len(ranks)

    def plan(self, batch: list[Request], layout: Layout, cost: CostModel, step: int, belief: Belief) -> Plan:
        costs = self.costs(batch, layout, cost, belief)
        index, rank_of, mb_of = [], [], []  # per plan row: its sequence in the batch, rank and micro-batch
        ranks = self.partition(costs, layout.dp)
        for rank, (members, count) in enumerate(zip(ranks, self.micro_batch_counts(batch, ranks, layout), strict=True)):
            for mb, sub in enumerate(self.rank_partition(costs[members], count, layout)):
                index.extend(members[i] for i in sub)
                rank_of.extend([rank] * len(sub))
                mb_of.extend([mb] * len(sub))
        ids, lengths = batch_arrays(batch)
        index = np.array(index, dtype=np.int64)
        plan = Plan(step, layout.dp, layout.micro_batches, ids[index], lengths[index], rank_of, mb_of,
                    BudgetArrays.uniform(Budget(), index.size))
        return self.ordered(plan, costs, batch, layout, cost, belief)

    def ordered(self, plan: Plan, costs: np.ndarray, batch: list[Request], layout: Layout, cost: CostModel,
                belief: Belief) -> Plan:
        order = PipelineOrder(self.params.pipeline_order)
        if order is PipelineOrder.packed or layout.pp == 1 or layout.micro_batches == 1:
            return plan
        if order is PipelineOrder.verl:
            by_id = dict(zip(batch_arrays(batch)[0].tolist(), costs.tolist(), strict=True))
            m = layout.micro_batches
            loads = np.bincount(plan.dp_ranks * m + plan.micro_batch_ids,
                                weights=[by_id[i] for i in plan.seq_ids.tolist()], minlength=layout.dp * m)
            return reorder(plan, np.array([verl_order(row) for row in loads.reshape(layout.dp, m)]))
        kept = self.expected_kept(plan.seq_ids, plan.lengths, belief, cost)
        plan = reorder(plan, self.searched_orders(plan, layout, cost, kept))
        if order is PipelineOrder.fit:
            plan = fitted(plan, layout, cost, self.expected_kept(plan.seq_ids, plan.lengths, belief, cost))
        return plan

    def fit_memory(self, plan: Plan, memory: MemoryModel, cost: CostModel) -> Plan:
        """The plan repaired to fit the memory (sim.memory.MemoryModel.fitted asks for it): ``repack``."""
        return repack(plan, memory, cost)

    def searched_orders(self, plan: Plan, layout: Layout, cost: CostModel, kept: np.ndarray) -> np.ndarray:
        """Per rank the micro-batch order with the shortest 1F1B time at the expected kept fractions:
        every order up to MAX_ORDERED micro-batches (ties keep the packed order), else pairwise swaps from
        the better of the packed and the verl order."""
        dp, m = layout.dp, layout.micro_batches
        mb_costs = cost.micro_batch_costs(plan.lengths, kept, plan.dp_ranks * m + plan.micro_batch_ids, dp * m, layout)
        fwd, bwd = mb_costs.fwd_ms.reshape(dp, m), mb_costs.bwd_ms.reshape(dp, m)
        p2p = cost.hand_off_ms(mb_costs.tokens, layout).reshape(dp, m)

        def spans(orders: np.ndarray) -> np.ndarray:  # orders [dp, c, m] -> [dp, c]
            def take(x):
                return np.take_along_axis(x[:, None, :], orders, axis=2)

            return pipeline_ms(take(fwd), take(bwd), take(p2p), layout.pp)

        if m <= MAX_ORDERED:
            every = np.broadcast_to(np.array(list(itertools.permutations(range(m)))), (dp, math.factorial(m), m))
            return every[np.arange(dp), np.argmin(spans(every), axis=1)]
        start = np.stack([np.broadcast_to(np.arange(m), (dp, m)), np.array([verl_order(r) for r in fwd + bwd])], axis=1)
        best = start[np.arange(dp), np.argmin(spans(start), axis=1)]
        pairs = np.array(list(itertools.combinations(range(m), 2)))
        for _ in range(MAX_SWAP_ROUNDS):
            swapped = np.repeat(best[:, None, :], len(pairs), axis=1)
            rows = np.arange(len(pairs))
            swapped[:, rows, pairs[:, 0]], swapped[:, rows, pairs[:, 1]] = best[:, pairs[:, 1]], best[:, pairs[:, 0]]
            now, trial = spans(best[:, None, :])[:, 0], spans(swapped)
            better = trial.min(axis=1) < now * (1 - 1e-12)
            if not better.any():
                break
            best = np.where(better[:, None], swapped[np.arange(dp), np.argmin(trial, axis=1)], best)
        return best


def batch_arrays(batch: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    """Ids and lengths of a batch."""
    ids = np.fromiter((s.id for s in batch), dtype=np.int64, count=len(batch))
    lengths = np.fromiter((s.length for s in batch), dtype=np.int64, count=len(batch))
    return ids, lengths


def verl_order(loads) -> list[int]:
    """Micro-batches heaviest first, then every other one reversed followed by the rest: the lightest at
    both ends of the pipeline and the heaviest in the middle, where the steady state hides it (verl)."""
    by_load = sorted(range(len(loads)), key=lambda j: (loads[j], j), reverse=True)
    return by_load[::2][::-1] + by_load[1::2]


def reorder(plan: Plan, orders: np.ndarray) -> Plan:
    """The plan with rank r running its packed micro-batch orders[r, j] at position j."""
    position = np.argsort(orders, axis=1)  # [rank, packed micro-batch] -> position
    return plan.placed(plan.dp_ranks, position[plan.dp_ranks, plan.micro_batch_ids])


def uniform_budget_plan(plan: Plan, budget: Budget) -> Plan:
    """The plan with one budget for every sequence (a no-op when it already has it)."""
    budgets = BudgetArrays.uniform(budget, len(plan))
    return plan if plan.budgets == budgets else replace(plan, budgets=budgets)
