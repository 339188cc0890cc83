"""Which backend runs each micro-batch's attention: decided once, before the step, from what the planner expects.

Under ``cost.attention_backend=hybrid`` the choice between our kernel, a sparse peer and a dense peer depends on
the micro-batch's kept fractions, which a trainer only learns once the step has run. The runner therefore
chooses at the kept fractions the planner expects of the Plan's budgets (the mean over its belief's samples),
and the simulator makes the same choice with this same function, then prices the step's realised kept
fractions on it. Under ``ours`` and ``dense_best`` the choice does not depend on kept fractions.
"""
from __future__ import annotations

import numpy as np

from sparsebalance.sim.backends import OURS
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.cp_groups import plan_units, unit_costs
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.plan import Plan


def planned_backends(plan: Plan, cost: CostModel, layout: Layout, belief: Belief) -> np.ndarray:
    """The backend that runs each micro-batch's attention (``[dp, m]``; under dynamic CP one per unit of
    sim.cp_groups), as the cost model decides it (``MicroBatchCosts.backend``) at the kept fractions the planner
    expects of the Plan's budgets: the mean over ``belief``'s samples."""
    dp, m = layout.dp, layout.micro_batches
    dynamic = layout.dynamic or plan.dynamic_cp
    if cost.attention_backend == OURS and not dynamic:
        return np.full((dp, m), OURS)
    kept = plan.budgets.kept(cost, plan.lengths[None], belief.at(plan.seq_ids)).mean(axis=0)
    if dynamic:
        return unit_costs(cost, plan_units(plan, layout), plan.lengths, kept, layout)[0].backend
    costs = cost.micro_batch_costs(plan.lengths, kept, plan.dp_ranks * m + plan.micro_batch_ids, dp * m, layout)
    return costs.backend.reshape(dp, m)


def expectation_decides(cost: CostModel) -> bool:
    """Whether the backends depend on the kept fractions (``hybrid``), so that the simulator must take them from
    ``planned_backends`` rather than let the cost model choose at the step's realised values."""
    return cost.attention_backend == "hybrid"
