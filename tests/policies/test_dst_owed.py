"""Balanced DST keeps its start's coverage on the steps that ran, not only under its belief: what a step's
realized coverage fell short of the start budget's on the same sequences is owed to the next steps' target."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from sparsebalance.sim.config import compose_config
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.setup import make_planner, prepare
from sparsebalance.sim.workload import requests, truth_of


def attention_coverage(lengths, coverage) -> float:
    return float(np.average(coverage, weights=np.asarray(lengths, dtype=np.float64) ** 2))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_shortfall_is_owed_and_paid_by_the_next_plans(seed):
    """With a prior that believes attention too concentrated (s 0.1), the first top-k plans cover less than their
    start budget would have; DST owes the difference, and the run's mean coverage over a few steps comes back to
    the start's."""
    cfg = OmegaConf.to_object(compose_config(["+experiment=paper", "policy=sparsebalance_topk", f"seed={seed}",
                                              "policy.prior.mean=0.1", "policy.prior.spread=0.05"]))
    setup = prepare(cfg)
    planner, engine = make_planner(cfg, setup), Engine(setup.layout, setup.cost, setup.cluster)
    dst, realized, start = planner.sparsity, [], []
    for step in range(6):
        batch = setup.workload.batch(step)
        plan = planner.plan(requests(batch), step)
        outcome = engine.step(plan, truth_of(batch))
        budget, cost = dst.start
        s = np.array([truth_of(batch)[int(i)] for i in plan.seq_ids])
        kept = type(plan.budgets).uniform(budget, len(plan)).kept(cost, plan.lengths, s)
        start.append(attention_coverage(plan.lengths, cost.coverages(s, kept)))
        realized.append(attention_coverage(plan.lengths, outcome.coverage))
        owed = dst.owed
        planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)
        # a sequence the plan ran whole reports no sensitivity and counts as if the start had run it whole too:
        # DST never owes less than the true shortfall
        assert max(0.0, owed + start[-1] - realized[-1]) - 1e-9 <= dst.owed
        assert dst.owed >= 0.0
    assert np.mean(realized) >= np.mean(start) - 2e-3
