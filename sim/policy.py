"""Policy interfaces and registries: what the simulator and the runner plan through.

A policy is one file that defines a class and registers it under a name (``register_batching`` /
``register_sparsity``), plus one YAML in ``conf/policy/`` naming a batching and a sparsity policy with their
parameters. Each policy class declares its parameters as a ``Params`` dataclass; ``make_batching`` /
``make_sparsity`` validate the YAML's parameters against it, so a misspelt, mistyped or out-of-range parameter
fails before any step runs.

The simulator sits below the policies and never imports them: packages of policies announce themselves as
entry points of the group ``sparsebalance.policies`` (the built-in ``policies`` package in this project's
``pyproject.toml``; a third-party package the same way), and the first lookup imports them.
"""
from __future__ import annotations

from functools import cache
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, Mapping, Protocol, runtime_checkable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.config import validate
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.workload import Request

ENTRY_POINT_GROUP = "sparsebalance.policies"
BUILTIN_PACKAGE = "sparsebalance.policies"  # what this project's pyproject.toml names in that group


@runtime_checkable
class BatchingPolicy(Protocol):
    """May also define ``observe(observation)``: it is then shown every step's outcome (sim.planner)."""

    def plan(self, batch: list[Request], layout: Layout, cost: CostModel, step: int, belief: Belief) -> Plan: ...


@runtime_checkable
class SparsityPolicy(Protocol):
    """May also define ``observe(observation)``, as a batching policy may."""

    def tune(self, plan: Plan, layout: Layout, cost: CostModel, belief: Belief) -> Plan: ...


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


def make_batching(name: str, params: Mapping[str, Any]) -> BatchingPolicy:
    return _make(BATCHING, "batching", name, params)


def make_sparsity(name: str, params: Mapping[str, Any]) -> SparsityPolicy:
    return _make(SPARSITY, "sparsity", name, params)


@cache
def load_policy_packages() -> tuple[str, ...]:
    """Import every package that registers policies (once per process); their module names.

    A checkout used without installing it (only on ``PYTHONPATH``) has no entry points: then the project's
    own package, named in BUILTIN_PACKAGE, is the one loaded."""
    found = entry_points(group=ENTRY_POINT_GROUP)
    modules = sorted({entry.value for entry in found}) or [BUILTIN_PACKAGE]
    for module in modules:
        import_module(module)
    return tuple(modules)


def _make(registry: dict, kind: str, name: str, params: Mapping[str, Any]):
    packages = load_policy_packages()
    if not registry:
        where = ", ".join(f"{m} from {getattr(import_module(m), '__path__', ['?'])[0]}" for m in packages)
        raise ConfigError(f"no {kind} policy is registered: imported {where}; a directory of that name in the "
                          "working directory shadows the installed package (run from another directory)")
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
        typed = OmegaConf.to_object(merged)
        validate(typed, f"policy.{kind}.params.")  # finite numbers, and each Params field's declared bound
        return cls(typed)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (policy {name!r})") from None
    except ValueError as exc:  # e.g. a Budget outside (0, 1]
        raise ConfigError(f"policy.{kind}.params for {name!r}: {exc}") from None
