"""The planner as a library call: ``sparsebalance.partition(lengths, dp=..., micro_batches=...)`` gives a trainer the
sequence indices of each DP rank's micro-batches, and the attention budget of each, under one of conf/policy/.

A policy that balances on verl's workload estimate with one fixed budget (``verl``, ``verl_dense``) is cut here
with numpy alone (sim.balance): importing and calling it loads neither Hydra, OmegaConf, SimPy, SciPy nor pandas.
Every other policy, and any call with ``model`` (the memory check), plans through the project's Planner, built
once per set of arguments (sim.setup): the first such call takes the configuration stack's import and
composition, seconds on a small machine.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from sparsebalance.sim.balance import ldm_partition, verl_order, verl_workload
from sparsebalance.sim.core import CONF_DIR
from sparsebalance.sim.plan import Budget

LIGHT_BATCHING = {"name": "verl", "params": {"pipeline_order": ("packed", "verl"), "refine": (False,)}}
LIGHT_SPARSITY = "fixed"  # one Budget for every sequence
BUDGET_FIELDS = {f.name for f in fields(Budget)}


@dataclass(frozen=True)
class Partition:
    """``indices[rank][micro_batch]``: positions in the caller's ``lengths``, each micro-batch's in execution order,
    the micro-batches of a rank in the order it runs them; ``budgets`` the same shape, each sequence's attention
    budget (``Budget(p=1.0)`` is dense attention)."""

    indices: list[list[list[int]]]
    budgets: list[list[list[Budget]]]


def partition(lengths, *, dp: int, micro_batches: int = 1, policy: str = "verl", model: str | None = None,
              pp: int = 1, cp: int = 1, tp: int = 1, cluster: str | None = None) -> Partition:
    """``lengths`` (a list, numpy array or torch tensor of sequence lengths, whole numbers >= 1) over ``dp`` ranks
    of ``micro_batches`` each, as ``policy`` (a name in conf/policy/) plans them for a layout of ``pp`` pipeline
    stages, ``cp`` context-parallel and ``tp`` tensor-parallel ranks on ``cluster`` (conf/cluster/; default the
    project's). ``model``: None (no memory check; a cost-aware policy prices the default model), a model we ship
    (conf/model/) or the path of a Hugging Face ``config.json``: then every micro-batch must fit its memory.
    Bad input raises ValueError naming the value and what is allowed."""
    layout = {name: _count(name, value) for name, value in
              (("dp", dp), ("micro_batches", micro_batches), ("pp", pp), ("cp", cp), ("tp", tp))}
    values = _lengths(lengths, layout["dp"] * layout["micro_batches"])
    if not isinstance(policy, str) or not isinstance(cluster, (str, type(None))):
        raise ValueError(f"policy={policy!r}, cluster={cluster!r}: allowed: names of conf/policy/ and conf/cluster/")
    spec = _policy_spec(policy)
    _check_cluster(cluster)
    _check_model(model)
    if model is None and _is_light(spec):
        return _light(values, layout["dp"], layout["micro_batches"], layout["pp"], spec)
    plan = _planner(policy, model, cluster, *layout.values()).plan(values.tolist(), 0)
    return _from_plan(plan.partitions(), plan.seq_ids.tolist(), plan.budgets.budgets())


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: allowed: a whole number >= 1")
    return int(value)


def _lengths(lengths, slots: int) -> np.ndarray:
    """The lengths as int64, or one ValueError line; a torch tensor is read without importing torch."""
    if hasattr(lengths, "detach"):
        lengths = lengths.detach().cpu().numpy()
    if isinstance(lengths, (str, bytes, dict)) or not hasattr(lengths, "__len__"):
        raise ValueError(f"lengths={lengths!r:.80}: allowed: a list, numpy array or torch tensor of whole numbers")
    values = np.asarray(lengths)
    if values.ndim != 1 or values.dtype.kind not in "iu" or values.size == 0 or values.min() < 1:
        raise ValueError(f"lengths={_shown(lengths)}: allowed: a non-empty 1-D sequence of whole numbers >= 1 "
                         f"(got {values.ndim}-D, dtype {values.dtype})")
    if values.size < slots:
        raise ValueError(f"lengths has {values.size} sequences: allowed: at least dp x micro_batches = {slots}, "
                         "one per micro-batch")
    return values.astype(np.int64)


def _shown(lengths) -> str:
    text = repr(lengths.tolist() if isinstance(lengths, np.ndarray) else lengths)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def _policy_spec(policy: str) -> dict:
    import yaml  # PyYAML, which OmegaConf also reads with; the light path's only configuration reader

    path = CONF_DIR / "policy" / f"{policy}.yaml"
    if not path.is_file() or path.parent != CONF_DIR / "policy":
        allowed = ", ".join(sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml")))
        raise ValueError(f"policy={policy!r}: allowed: {allowed}")
    return yaml.safe_load(path.read_text())


@functools.cache
def _check_cluster(cluster: str | None) -> None:
    allowed = sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))
    if cluster is not None and cluster not in allowed:
        raise ValueError(f"cluster={cluster!r}: allowed: None (the project's default) or one of {', '.join(allowed)}")


def _is_light(spec: dict) -> bool:
    """Whether the policy is verl's balancing with one fixed budget, which numpy cuts as the Planner would."""
    batching, sparsity = spec.get("batching", {}), spec.get("sparsity", {})
    params = batching.get("params") or {}
    return (batching.get("name") == LIGHT_BATCHING["name"] and sparsity.get("name") == LIGHT_SPARSITY
            and all(key in LIGHT_BATCHING["params"] and value in LIGHT_BATCHING["params"][key]
                    for key, value in params.items())
            and set(sparsity.get("params") or {}) <= BUDGET_FIELDS)


def _light(lengths: np.ndarray, dp: int, micro_batches: int, pp: int, spec: dict) -> Partition:
    """policies/verl.py's two levels (equal-count LDM over ranks, free-count LDM within a rank) and, with pp > 1,
    its micro-batch order; tests/test_front_door.py checks this against the Planner's Plan."""
    work = verl_workload(lengths)
    loads = work.tolist()
    order = (spec["batching"].get("params") or {}).get("pipeline_order", "packed")
    indices = []
    for members in ldm_partition(work, dp, True):
        micro = [[members[i] for i in part] for part in ldm_partition(work[members], micro_batches, False)]
        if order == "verl" and pp > 1 and micro_batches > 1:  # a load summed in row order, as the policy sums it
            micro = [micro[j] for j in verl_order([sum(loads[i] for i in mb) for mb in micro])]
        indices.append(micro)
    budget = Budget(**(spec["sparsity"].get("params") or {}))
    return Partition(indices, [[[budget] * len(mb) for mb in rank] for rank in indices])


@functools.lru_cache(maxsize=8)
def _planner(policy: str, model: str | None, cluster: str | None, dp: int, micro_batches: int, pp: int, cp: int,
             tp: int):
    """The project's Planner of ``policy`` on this layout, its GPUs sized to the layout (nodes of the cluster's
    size, or one node of fewer GPUs), without the step-time prediction nobody here reads."""
    from sparsebalance.sim.setup import composed_run, make_planner, policy_setup

    overrides = [f"policy={policy}", f"layout.dp={dp}", f"layout.micro_batches={micro_batches}", f"layout.pp={pp}",
                 f"layout.cp={cp}", f"layout.tp={tp}", *([f"cluster={cluster}"] if cluster else []),
                 *_model_overrides(model)]
    cfg = copy.deepcopy(composed_run(tuple(overrides)))
    gpus, per_node = dp * pp * cp * tp, cfg.cluster.gpus_per_node
    nodes, per_node = (gpus // per_node, per_node) if gpus % per_node == 0 else (1, gpus)
    cfg = replace(cfg, cluster=replace(cfg.cluster, nodes=nodes, gpus_per_node=per_node))
    planner = make_planner(*policy_setup(cfg))
    planner.timer = None
    if model is None:
        planner.memory = None
    return planner


def _check_model(model) -> None:
    if model is None or (isinstance(model, (str, Path)) and str(model).endswith(".json")):
        return  # a config.json is read, and refused in one line where it is not one, when the Planner is built
    shipped = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    if not isinstance(model, (str, Path)) or str(model) not in shipped:
        raise ValueError(f"model={model!r}: allowed: None, a Hugging Face config.json path or one of "
                         f"{', '.join(shipped)}")


def _model_overrides(model: str | None) -> list[str]:
    if model is None:
        return []
    if str(model).endswith(".json"):
        from sparsebalance.sim.advise_inputs import dotted, hf_model

        return dotted("model", hf_model(str(model)))
    return [f"model={model}"]


def _from_plan(parts: list[list[list[int]]], seq_ids: list[int], budgets: list[Budget]) -> Partition:
    """A Plan's ``partitions()`` with each sequence's budget beside it (its ids are the lengths' positions)."""
    by_id = dict(zip(seq_ids, budgets, strict=True))
    return Partition(parts, [[[by_id[i] for i in mb] for mb in rank] for rank in parts])
