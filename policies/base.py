"""Policy interfaces and registries.

A policy is one file that defines a class and registers it under a name, plus one YAML in
``conf/policy/`` naming a batching and a sparsity policy with their parameters. Each policy class
declares its parameters as a ``Params`` dataclass; ``make_batching``/``make_sparsity`` validate
the YAML's parameters against it, so a misspelt or mistyped parameter fails before any step runs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping, Protocol, runtime_checkable

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from policies.plan import Assignment, Budget, Plan
from sim.cluster import Layout
from sim.config import ConfigError
from sim.cost import CostModel
from sim.workload import Sequence


@dataclass(frozen=True)
class NoParams:
    """For policies without parameters."""


@runtime_checkable
class BatchingPolicy(Protocol):
    """May also define ``observe(plan)``: it is then shown every tuned Plan (see ``plan_step``)."""

    def plan(self, batch: list[Sequence], layout: Layout, cost: CostModel, step: int) -> Plan: ...


@runtime_checkable
class SparsityPolicy(Protocol):
    def tune(self, plan: Plan, layout: Layout, cost: CostModel) -> Plan: ...


BATCHING: dict[str, type] = {}
SPARSITY: dict[str, type] = {}


def register_batching(name: str):
    return _register(BATCHING, name)


def register_sparsity(name: str):
    return _register(SPARSITY, name)


def _register(registry: dict, name: str):
    def add(cls):
        if name in registry:
            raise ValueError(f"policy name {name!r} is registered twice ({registry[name]} and {cls})")
        cls.name = name
        registry[name] = cls
        return cls

    return add


def plan_step(batching: BatchingPolicy, sparsity: SparsityPolicy, batch: list[Sequence], layout: Layout,
              cost: CostModel, step: int) -> Plan:
    """One global batch to its Plan: batching, sparsity tuning, then the tuned Plan shown to a batching
    policy that learns from it (sab's expected budgets). sim.run and the runner both plan through this,
    so they produce the same Plans."""
    plan = sparsity.tune(batching.plan(batch, layout, cost, step), layout, cost)
    observe = getattr(batching, "observe", None)
    if observe is not None:
        observe(plan)
    return plan


def make_batching(name: str, params: Mapping[str, Any]) -> BatchingPolicy:
    return _make(BATCHING, "batching", name, params)


def make_sparsity(name: str, params: Mapping[str, Any]) -> SparsityPolicy:
    return _make(SPARSITY, "sparsity", name, params)


def _make(registry: dict, kind: str, name: str, params: Mapping[str, Any]):
    if name not in registry:
        raise ConfigError(f"policy.{kind}.name={name!r} is unknown; allowed: {', '.join(sorted(registry))}")
    cls = registry[name]
    schema = OmegaConf.structured(cls.Params)
    try:
        merged = OmegaConf.merge(schema, dict(params))
    except OmegaConfBaseException as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"policy.{kind}.params.{exc.full_key} for {name!r}: {first}") from None
    try:
        return cls(OmegaConf.to_object(merged))
    except ValueError as exc:  # e.g. a Budget outside (0, 1]
        raise ConfigError(f"policy.{kind}.params for {name!r}: {exc}") from None


# ----------------------------------------------------------------------------- batching helpers
class PartitionPolicy(ABC):
    """Batching in two levels: split the global batch over DP ranks, then each rank's share over its
    micro-batches (never across global batches, which would change the optimiser's semantics).

    Subclasses say how to cut a list of costs into k parts; the cost of a sequence is its dense busy
    time from the CostModel (``sequence_costs``), which a sparsity-aware policy overrides.
    """

    Params: ClassVar[type] = NoParams

    def __init__(self, params) -> None:
        self.params = params

    def costs(self, batch: list[Sequence], layout: Layout, cost: CostModel) -> np.ndarray:
        lengths = np.fromiter((s.length for s in batch), dtype=np.int64, count=len(batch))
        return cost.sequence_costs(lengths, np.ones(lengths.size), layout)

    @abstractmethod
    def partition(self, costs: np.ndarray, k: int) -> list[list[int]]:
        """Indices into ``costs`` for each of k parts (order inside a part is execution order).

        The plan lists assignments by (rank, micro-batch), in that order.
        """

    def plan(self, batch: list[Sequence], layout: Layout, cost: CostModel, step: int) -> Plan:
        costs = self.costs(batch, layout, cost)
        assignments = []
        for rank, members in enumerate(self.partition(costs, layout.dp)):
            for mb, sub in enumerate(self.partition(costs[members], layout.micro_batches)):
                for i in sub:
                    seq = batch[members[i]]
                    assignments.append(Assignment(seq.id, seq.length, seq.sensitivity, rank, mb))
        return Plan(step=step, dp=layout.dp, micro_batches=layout.micro_batches, assignments=tuple(assignments))


def uniform_budget_plan(plan: Plan, budget: Budget) -> Plan:
    """The plan with one budget for every sequence (a no-op when it already has it)."""
    if all(a.budget == budget for a in plan.assignments):
        return plan
    # Plan.with_budgets without the id map: `fixed` runs this for every sequence of every step.
    return replace(plan, assignments=tuple(
        Assignment(a.seq_id, a.length, a.sensitivity, a.dp_rank, a.micro_batch, budget, a.cp_budgets)
        for a in plan.assignments
    ))
