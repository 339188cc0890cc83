"""``fixed``: one budget for every sequence, whatever the load (p = 1 is dense attention)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sparsebalance.policies.base import uniform_budget_plan

from sparsebalance.sim.policy import register_sparsity
from sparsebalance.sim.plan import Budget, Plan
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief


@register_sparsity("fixed")
class Fixed:
    @dataclass(frozen=True)
    class Params:
        p: float = 1.0  # coverage target in (0, 1]
        kept_fraction: Optional[float] = None  # if set, fixes the kept-block fraction instead of p
        top_k: Optional[int] = None  # if set, keeps this many blocks per query block instead of p
        p_floor: Optional[float] = None  # with top_k: the rows' coverage floor

    def __init__(self, params: Params) -> None:
        self.budget = Budget(p=params.p, kept_fraction=params.kept_fraction, top_k=params.top_k, p_floor=params.p_floor)

    def tune(self, plan: Plan, layout: Layout, cost: CostModel, belief: Belief) -> Plan:
        return uniform_budget_plan(plan, self.budget)
