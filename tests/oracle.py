"""What a test hands a policy in place of an estimator's belief when the policy is to plan as if it knew each
sequence's sensitivity (the data's truth, which planners never see in a run): a belief whose one sample is the
truth, as ``sim.estimate.OracleEstimator`` gives it. ``tests/conftest.py`` puts this directory on ``sys.path``."""
from __future__ import annotations

import numpy as np

from sparsebalance.sim.estimate import Belief, OracleEstimator
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.planner import Planner
from sparsebalance.sim.workload import requests, truth_of


def oracle(batch) -> Belief:
    """The belief that each sequence of ``batch`` (sim.workload.Sequence) has its true sensitivity."""
    return Belief(np.array([s.id for s in batch], dtype=np.int64),
                  np.array([[s.sensitivity for s in batch]], dtype=np.float64))


def oracle_planner(batching, sparsity, data, layout, cost, memory=None, timer=None) -> Planner:
    """A Planner whose estimator knows the sensitivities of ``data``: a sim.workload.Workload (its batch of each
    step) or one batch (whatever the step)."""
    if hasattr(data, "batch"):
        def truth(step):
            return truth_of(data.batch(step))
    else:
        known = truth_of(data)

        def truth(step):
            return known
    return Planner(batching, sparsity, OracleEstimator(truth), layout, cost, memory, timer)


def planned_step(planner: Planner, engine, batch, step: int) -> Plan:
    """One step as sim.run takes it: ``batch`` planned, its Plan priced by the engine on the truth, and the
    planner shown what the step reported; the Plan that ran."""
    plan = planner.plan(requests(batch), step)
    outcome = engine.step(plan, truth_of(batch))
    planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)
    return plan
