"""Which attention backend runs each micro-batch in the runner, and loading the dense ones.

The choice is the cost model's (``sim.backends.choose``, the simulator's own decision), made at the kept fractions
the planner expects of the Plan's budgets: ``ours`` everywhere by default; ``dense_best`` the dense backend the
profile prices fastest; ``hybrid`` the faster of that and ours at the budgets.
"""
from __future__ import annotations

import numpy as np

from sparsebalance.kernels.backends import BackendAbsent, load
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.plan import Plan


def load_dense(cost: CostModel, key: str, cp: int) -> dict[str, object]:
    """The dense backends a run's micro-batches may run on, loaded by name: under ``dense_best`` and ``hybrid``
    every one the cost model prices (its choice may fall on any of them), under ``ours`` none. One ConfigError
    line, naming ``key`` (the config key that chose the mode), where one cannot run here or the processes hold
    CP shards (the dense backends run whole documents)."""
    mode = cost.attention_backend
    if mode == OURS:
        return {}
    if cp > 1:
        raise ConfigError(f"{key}={mode} with layout.cp={cp}: the runner runs a dense backend on whole documents "
                          f"only; allowed: {key}={OURS} with cp > 1, or layout.cp=1 (or runner.one_process=true)")
    loaded = {}
    for name in cost.dense_backends():
        try:
            loaded[name] = load(name)
        except (BackendAbsent, ValueError) as exc:
            raise ConfigError(f"{key}={mode}: the cost profile prices the dense backend {name}, which cannot run "
                              f"here ({exc}); allowed: {key}={OURS}, or a machine where "
                              f"{', '.join(cost.dense_backends())} load (the peers extra on a GPU)") from None
    return loaded


def micro_batch_backends(plan: Plan, cost: CostModel, layout: Layout, belief: Belief | None) -> np.ndarray:
    """``[dp, m]``: the backend that runs each micro-batch's attention, as the cost model decides it
    (``MicroBatchCosts.backend``: the simulator's decision) at the kept fractions the planner expects of the
    Plan's budgets, the mean over its belief's samples. (The simulator's engine decides at the data's truth,
    which the runner's planner does not know.)"""
    dp, m = layout.dp, layout.micro_batches
    if cost.attention_backend == OURS:
        return np.full((dp, m), OURS)
    kept = plan.budgets.kept(cost, plan.lengths[None], belief.at(plan.seq_ids))
    costs = cost.micro_batch_costs(plan.lengths, kept.mean(axis=0), plan.dp_ranks * m + plan.micro_batch_ids, dp * m,
                                   layout)
    return costs.backend.reshape(dp, m)
