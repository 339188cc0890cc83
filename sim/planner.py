"""The planner: global batches in, per-rank micro-batches with budgets out, the kernel's statistics back in.

``Planner`` is the one planning loop of the simulator (``sim.run``) and the runner (``runner.train``,
``runner.replay``), and what another trainer calls::

    planner = sim.setup.build_planner("sparsebalance", ["+experiment=paper"])   # or Planner(...) from parts
    for step, batch in enumerate(loader):
        plan = planner.plan(batch.lengths, step)           # Plan: (rank, micro-batch, budget) per sequence
        ... run it; per sequence the kernel reports kept_fraction and coverage ...
        planner.observe(plan, kept_fraction, coverage, step_ms)

It knows what a trainer knows before step t: the sequences' ids and lengths, the configuration and the
profiles, and what the steps before t reported. A sequence's sensitivity (the data's truth) never reaches it:
its policies price budgets over the estimator's belief (sim.estimate), and it records the step time that belief
predicts (``predicted_ms``), to be held against the time the step then took.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import numpy as np

from sparsebalance.sim.choice import expectation_decides, planned_backends
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief, Estimator, Observation
from sparsebalance.sim.memory import MemoryModel
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.workload import Request


class StepTimer(Protocol):
    """What ``Planner.predicted_ms`` needs of the engine (sim.engine.Engine has it)."""

    def expected_step_ms(self, plan: Plan, kept: np.ndarray, ran: np.ndarray | None = None) -> float: ...


@dataclass
class Planner:
    batching: object  # sim.policy.BatchingPolicy
    sparsity: object  # sim.policy.SparsityPolicy
    estimator: Estimator
    layout: Layout
    cost: CostModel
    memory: MemoryModel | None = None  # with one, every plan must fit (sim.memory)
    timer: StepTimer | None = None  # with one, each plan's step time is predicted under the belief
    predicted_ms: float = float("nan")  # the last plan's predicted step time
    belief: Belief | None = None  # the last plan's belief

    def plan(self, batch: Iterable, step: int) -> Plan:
        """The Plan of one global batch: ``batch`` holds the sequences (anything with ``id`` and ``length``;
        nothing else of them is read) or plain lengths, whose ids are then ``step * len + i``."""
        requests = as_requests(batch, step)
        ids = np.array([r.id for r in requests], dtype=np.int64)
        lengths = np.array([r.length for r in requests], dtype=np.int64)
        belief = self.estimator.belief(ids, lengths, step)
        if self.memory is not None:
            self.memory.check_batch(requests)
        plan = self.batching.plan(requests, self.layout, self.cost, step, belief)
        if self.memory is not None:
            plan = self.memory.fitted(plan, self.batching, self.cost)
        plan = self.sparsity.tune(plan, self.layout, self.cost, belief)
        if self.memory is not None:
            self.memory.check(plan, self.cost, f"{name_of(self.batching)} tuned by {name_of(self.sparsity)}")
        self.belief = belief
        self.predicted_ms = self.predict(plan, belief) if self.timer is not None else float("nan")
        return plan

    def predict(self, plan: Plan, belief: Belief) -> float:
        """The step time the belief expects of a plan: the mean, over its samples, of the engine's step, on the
        backends chosen before the step (sim.choice)."""
        kept = plan.budgets.kept(self.cost, plan.lengths[None], belief.at(plan.seq_ids))
        ran = planned_backends(plan, self.cost, self.layout, belief) if expectation_decides(self.cost) else None
        return self.timer.expected_step_ms(plan, kept, ran)

    def observe(self, plan: Plan, kept_fraction, coverage, step_ms: float, micro_batch_ms=None) -> None:
        """What the step of ``plan`` reported, per sequence in plan order; shown to the estimator and to each
        policy that defines ``observe``."""
        observation = Observation(plan, np.asarray(kept_fraction, dtype=np.float64),
                                  np.asarray(coverage, dtype=np.float64), float(step_ms),
                                  None if micro_batch_ms is None else np.asarray(micro_batch_ms, dtype=np.float64))
        for part in (self.estimator, self.batching, self.sparsity):
            observe = getattr(part, "observe", None)
            if observe is not None:
                observe(observation)


def as_requests(batch: Iterable, step: int) -> list[Request]:
    items = list(batch)
    if all(isinstance(x, (int, np.integer)) for x in items):
        return [Request(step * len(items) + i, int(n)) for i, n in enumerate(items)]
    # Requests of plain ints (sim.workload.requests gives them) are what this would build: kept as they are.
    if all(type(x) is Request and type(x.id) is int and type(x.length) is int for x in items):
        return items
    return [Request(int(x.id), int(x.length)) for x in items]


def name_of(policy) -> str:
    return getattr(policy, "name", type(policy).__name__)
