"""Dynamic context parallelism as the trainers run it: ``megatron_dcp`` and ``verl_dcp``.

Megatron-Core's ``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``), in this
simulator's fixed micro-batch slots:

* each sequence gets the CP degree ``2 ** ceil(log2(L / max_seq_len_per_rank))`` (at least 1): the fewest
  power-of-two ranks whose shards fit the per-rank token budget;
* its work is estimated as ``L^2 / cp`` (Megatron) or verl's ``(24576 L + L^2) / cp``;
* micro-batches are formed one after another, as Megatron forms its groups: the remaining sequences, heaviest
  first, each to a new group on free ranks (which has no load yet) while free ranks last, else to the least
  loaded open group of its degree (it then runs after the group's others), as long as that group's work
  stays within the micro-batch's cap. Megatron closes a micro-batch once it is balanced and forms as many as
  it needs (it does not support pipeline stages yet); here the count is the layout's, so the cap is the
  larger of an even share (the rank-work, work x cp, over ranks and micro-batches) and the heaviest remaining
  sequence, and the last micro-batch takes what is left;
* ranks a micro-batch leaves free are given to a neighbouring group, whose degree doubles (Megatron's
  ``fill_empty_gpus``), the most loaded group first.

Groups are aligned power-of-two blocks of the domain (a buddy allocator), so a group of up to a node's GPUs sits
in one node. Megatron runs its micro-batches in the order it formed them (``packed``); verl orders them by load
with the lighter ones at both ends of the pipeline (``pipeline_order: verl``, as its balancer does). A sequence
needing more ranks than ``layout.cp`` is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from sparsebalance.policies.base import batch_arrays, verl_order
from sparsebalance.policies.verl import verl_workload
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.plan import Budget, BudgetArrays, Plan
from sparsebalance.sim.policy import register_batching
from sparsebalance.sim.workload import Request


class Order(str, Enum):
    packed = "packed"  # micro-batches in the order they were formed (Megatron)
    verl = "verl"  # by load, the lighter ones at both ends of the pipeline (verl)


@dataclass(frozen=True)
class DynamicCPParams:
    max_seq_len_per_rank: int = 16384  # tokens a CP rank may hold of one sequence (Megatron's flag of that name)
    max_tokens_per_rank: int = 32768  # tokens a CP rank may hold of a group's sequences together (memory)
    pipeline_order: Order = Order.packed


@dataclass
class Group:
    micro_batch: int
    first: int
    size: int
    load: float = 0.0
    members: list[int] | None = None
    tokens: int = 0


def cp_degrees(lengths: np.ndarray, per_rank: int, layout: Layout, ids: np.ndarray) -> np.ndarray:
    """Megatron's ``gpus_needed``: the power of two of ranks whose shards fit ``per_rank`` tokens."""
    needed = np.array([max(1, 2 ** math.ceil(math.log2(n / per_rank))) for n in lengths.tolist()], dtype=np.int64)
    over = np.flatnonzero(needed > layout.cp)
    if over.size:
        i = int(over[np.argmax(lengths[over])])
        raise ConfigError(f"sequence {int(ids[i])} of {int(lengths[i])} tokens needs {int(needed[i])} CP ranks at "
                          f"max_seq_len_per_rank={per_rank}, above layout.cp={layout.cp}; allowed: a larger layout.cp "
                          "or max_seq_len_per_rank")
    return needed


def grouped(work: np.ndarray, degrees: np.ndarray, layout: Layout, lengths: np.ndarray,
            token_cap: int) -> list[Group]:
    """Sequences (by index) into CP groups over ``layout.micro_batches`` micro-batches of the domain (module doc);
    ``work``: each sequence's per-rank work on its degree; a group holds at most ``token_cap`` tokens per rank
    (a sequence alone always fits its group)."""
    m, domain = layout.micro_batches, layout.domain
    target = float((work * degrees).sum()) / (domain * m)  # the per-rank work of an even micro-batch
    remaining = sorted(range(work.size), key=lambda i: (-work[i], i))
    groups: list[Group] = []
    for mb in range(m):
        # No micro-batch can be lighter than its heaviest sequence: it is filled up to that, or to the target.
        cap = max(target, float(work[remaining[0]])) if remaining else 0.0
        free = np.ones(domain, dtype=bool)
        mine: list[Group] = []
        for i in list(remaining):
            group = placed(mine, free, mb, int(degrees[i]), float(work[i]), math.inf if mb == m - 1 else cap,
                           (token_cap, int(lengths[i])))
            if group is not None:
                group.members.append(i)
                group.load += float(work[i]) * int(degrees[i]) / group.size  # its work spread on the group's ranks
                group.tokens += int(lengths[i])
                remaining.remove(i)
        if remaining and mb == m - 1:
            i = remaining[0]
            raise ConfigError(f"a sequence of {int(lengths[i])} tokens on {int(degrees[i])} CP ranks finds no place in "
                              f"the last micro-batch within max_tokens_per_rank={token_cap}; allowed: more "
                              "micro-batches (layout.micro_batches), a larger domain or max_tokens_per_rank")
        widen(mine, free, layout.cp)
        groups += mine
    return groups


def placed(groups: list[Group], free: np.ndarray, mb: int, c: int, w: float, cap: float,
           tokens: tuple[int, int]) -> Group | None:
    """Where one sequence of degree ``c`` and per-rank work ``w`` goes in a micro-batch: a new group on the first
    free aligned block of ``c`` ranks (no load yet) while there is one, else the least loaded group of its
    degree, if its load stays within ``cap`` and its tokens per rank within ``tokens`` (cap, the sequence's);
    None: nowhere in this micro-batch."""
    token_cap, length = tokens
    if w <= cap and free.any():
        blocks = np.flatnonzero(free.reshape(-1, c).all(axis=1))
        if blocks.size:
            first = int(blocks[0]) * c
            free[first:first + c] = False
            groups.append(Group(mb, first, c, 0.0, []))
            return groups[-1]
    same = [g for g in groups if g.size == c and g.load + w <= cap and g.tokens + length <= token_cap * c]
    if not same and cap == math.inf:  # the last micro-batch takes what is left: any group with room for its tokens
        same = [g for g in groups if g.tokens + length <= token_cap * g.size]
    return min(same, key=lambda g: (g.load, g.first)) if same else None


def widen(groups: list[Group], free: np.ndarray, cp: int) -> None:
    """Give free ranks to the group beside them, most loaded first: its degree doubles and its work halves
    (Megatron's ``fill_empty_gpus``, which fills every free rank); repeated until no group can grow."""
    grown = True
    while grown:
        grown = False
        for g in sorted(groups, key=lambda g: (-g.load, g.first)):
            buddy = g.first ^ g.size
            if g.size < cp and free[buddy:buddy + g.size].all():
                free[buddy:buddy + g.size] = False
                g.first, g.size, g.load = min(g.first, buddy), 2 * g.size, g.load / 2
                grown = True
                break


class DynamicCP:
    """Megatron's grouping over one work estimate (``work``); subclasses name it."""

    Params = DynamicCPParams
    plans_cp_groups = True  # its plans carry CP groups: it runs on a dynamic-CP layout only

    def __init__(self, params) -> None:
        self.params = params

    @staticmethod
    def work(lengths: np.ndarray) -> np.ndarray:
        return lengths.astype(np.float64) ** 2

    def plan(self, batch: list[Request], layout: Layout, cost: CostModel, step: int, belief: Belief) -> Plan:
        if not layout.dynamic:
            raise ConfigError(f"policy {self.name!r} plans dynamic CP groups; allowed: layout.cp_mode=dynamic or the "
                              "policy's cp_mode: dynamic")
        ids, lengths = batch_arrays(batch)
        degrees = cp_degrees(lengths, self.params.max_seq_len_per_rank, layout, ids)
        groups = grouped(self.work(lengths) / degrees, degrees, layout, lengths, self.params.max_tokens_per_rank)
        return groups_plan(step, layout, ids, lengths, groups, Order(self.params.pipeline_order))


def groups_plan(step: int, layout: Layout, ids: np.ndarray, lengths: np.ndarray, groups: list[Group],
                order: Order, budgets: np.ndarray | None = None) -> Plan:
    """The Plan of the groups: rows by (DP rank, micro-batch), micro-batches renumbered by ``order``; ``budgets``
    (a Budget per sequence) or the default."""
    m = layout.micro_batches
    position = np.arange(m)
    if order is Order.verl and layout.pp > 1:
        loads = np.zeros(m)
        for g in groups:
            loads[g.micro_batch] = max(loads[g.micro_batch], g.load)
        position = np.argsort(verl_order(loads.tolist()))
    rows = [(g.first // layout.cp, int(position[g.micro_batch]), g.first, g.size, i) for g in groups for i in g.members]
    rows.sort(key=lambda r: r[:3])
    index = np.array([r[4] for r in rows], dtype=np.int64)
    table = np.array([r[:4] for r in rows], dtype=np.int64).reshape(-1, 4)
    chosen = BudgetArrays.uniform(Budget(), index.size) if budgets is None else BudgetArrays.of(budgets[index])
    return Plan(step, layout.dp, m, ids[index], lengths[index], table[:, 0], table[:, 1], chosen, table[:, 2],
                table[:, 3])


@register_batching("megatron_dcp")
class MegatronDCP(DynamicCP):
    """DynamicCP as Megatron-Core runs it: its L^2 / cp work estimate and its parameters, unchanged."""


@register_batching("verl_dcp")
class VerlDCP(DynamicCP):
    @dataclass(frozen=True)
    class Params(DynamicCPParams):
        pipeline_order: Order = Order.verl

    @staticmethod
    def work(lengths: np.ndarray) -> np.ndarray:
        return verl_workload(lengths)
