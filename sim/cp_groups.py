"""Dynamic context parallelism: a plan's CP groups as units of work on the dp x cp domain, priced and scheduled.

A pipeline stage's dp x cp GPUs form one domain (domain rank ``cp_rank + cp * dp_rank``, sim.cluster). Under
dynamic CP each sequence runs on its own CP group (``Plan.cp_first``/``cp_size``): a power of two of
consecutive domain ranks, at most ``layout.cp``, starting at a rank its size divides. A *unit* is the sequences
of one micro-batch that share a CP group: its ranks run them together, as a static CP group runs its
micro-batch, and the cost model prices it as a micro-batch of a static layout with that CP degree
(``Layout.with_cp``): each rank holds 1/c of its tokens, its ring exchange runs on the intra-node link when
the group fits in a node and on the inter-node link otherwise, and the sparse selection's kept work falls on
its ranks as ``sim.cp_shards`` says.

Schedule: every stage runs its micro-batches in 1F1B order; within one micro-batch its units in order of
first appearance in the plan. A unit's op on a stage starts once every rank of its group is free on that
stage and its input has arrived (the forward from the stage before, the backward from the stage after, each
after its hand-off), as the static engine's per-rank processes do; a static plan is the case where every
unit is one DP rank's whole CP group, and gives the static engine's times exactly. The recurrence runs over
a leading sample axis, so a planner prices many beliefs of one plan at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel, MicroBatchCosts
from sparsebalance.sim.pipeline import last_micro_batches, schedule
from sparsebalance.sim.plan import Plan


@dataclass(frozen=True, eq=False)
class Units:
    """A plan's units: ``row_unit[i]`` is the unit of plan row i; per unit its micro-batch and CP group."""

    row_unit: np.ndarray  # [n]
    micro_batch: np.ndarray  # [U]
    first: np.ndarray  # [U] first domain rank of the group
    size: np.ndarray  # [U] ranks of the group

    @property
    def count(self) -> int:
        return self.micro_batch.size

    @cached_property
    def cells(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unit, domain rank, micro-batch) of every rank of every unit's group."""
        unit = np.repeat(np.arange(self.count), self.size)
        offset = np.arange(unit.size) - np.repeat(np.cumsum(self.size) - self.size, self.size)
        return unit, self.first[unit] + offset, self.micro_batch[unit]


def plan_units(plan: Plan, layout: Layout) -> Units:
    """The units of a plan on ``layout``. A static plan has one unit per (DP rank, micro-batch), empty ones
    included (an empty micro-batch still orders its stage's ops, as in the static engine)."""
    dp, cp, m = layout.dp, layout.cp, layout.micro_batches
    if not plan.dynamic_cp:
        units = np.arange(dp * m)
        return Units(plan.micro_batch_ids * dp + plan.dp_ranks, units // dp, units % dp * cp, np.full(dp * m, cp))
    if not layout.dynamic:
        raise ConfigError("a plan with CP groups (cp_ranks) runs on layout.cp_mode=dynamic only; allowed: a static "
                          "plan, or layout.cp_mode=dynamic")
    first, size, mb = plan.cp_first, plan.cp_size, plan.micro_batch_ids
    bad = np.flatnonzero((size > cp) | (first + size > layout.domain) | (mb >= m))
    if bad.size:
        i = int(bad[0])
        raise ConfigError(f"sequence {int(plan.seq_ids[i])}: CP group of {int(size[i])} ranks from domain rank "
                          f"{int(first[i])} in micro-batch {int(mb[i])}; allowed: at most layout.cp={cp} ranks within "
                          f"the {layout.domain}-rank domain, micro-batches below {m}")
    key = (mb * layout.domain + first) * (cp + 1) + size
    _, first_row, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.lexsort((first_row, mb[first_row]))  # by micro-batch, then first appearance in the plan
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    rows = first_row[order]
    return Units(position[inverse.ravel()], mb[rows], first[rows], size[rows])


def unit_costs(cost: CostModel, units: Units, lengths, kept, layout: Layout,
               samples: int = 1) -> tuple[MicroBatchCosts, np.ndarray]:
    """(costs per unit, hand-off ms per unit): each unit priced as a micro-batch of ``layout.with_cp`` its size.
    ``lengths``/``kept``: the plan's rows, or ``samples`` copies of them one after another (a planner's beliefs),
    which are then priced as ``samples x U`` units, sample-major."""
    count = units.count * samples
    group = (np.arange(samples)[:, None] * units.count + units.row_unit[None, :]).ravel()
    size = np.tile(units.size, samples)
    lengths, kept = np.asarray(lengths), np.asarray(kept)
    sizes = np.unique(units.size)
    if sizes.size == 1:
        on = layout.with_cp(int(sizes[0]))
        costs = cost.micro_batch_costs(lengths, kept, group, count, on)
        return costs, cost.hand_off_ms(costs.tokens, on)
    parts, hand_offs, order = [], [], []
    for c in sizes.tolist():
        members = np.flatnonzero(size == c)
        local = np.full(count, -1)
        local[members] = np.arange(members.size)
        rows = np.flatnonzero(local[group] >= 0)
        on = layout.with_cp(c)
        part = cost.micro_batch_costs(lengths[rows], kept[rows], local[group[rows]], members.size, on)
        parts.append(part)
        hand_offs.append(cost.hand_off_ms(part.tokens, on))
        order.append(members)
    back = np.argsort(np.concatenate(order), kind="stable")
    joined = {name: np.concatenate([getattr(p, name) for p in parts])[back]
              for name in MicroBatchCosts.__dataclass_fields__}
    return MicroBatchCosts(**joined), np.concatenate(hand_offs)[back]


@dataclass(frozen=True)
class UnitTimeline:
    """Per sample: each (domain rank, stage)'s finish and the busy ms of its last backward; ``idle_ms`` [domain,
    m, pp] of the first sample when asked for (waits, and the barrier's on each stage's last micro-batch)."""

    finish_ms: np.ndarray  # [S, domain, pp]
    last_bwd_ms: np.ndarray  # [S, domain, pp]
    idle_ms: np.ndarray | None


def run_units(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, units: Units, layout: Layout,
              idle: bool = False) -> UnitTimeline:
    """The 1F1B schedule of the units (module doc); fwd, bwd: [S, U] busy ms, p2p: [U] hand-off ms."""
    domain, pp, m = layout.domain, layout.pp, layout.micro_batches
    s = fwd.shape[0]
    free = np.zeros((pp, s, domain))
    last_bwd = np.zeros((pp, s, domain))
    waits = np.zeros((domain, m, pp)) if idle else None
    by_mb = [[] for _ in range(m)]
    for u, mb in enumerate(units.micro_batch.tolist()):
        by_mb[mb].append(u)
    spans = [slice(f, f + c) for f, c in zip(units.first.tolist(), units.size.tolist(), strict=True)]
    fwd_t, bwd_t = np.ascontiguousarray(fwd.T), np.ascontiguousarray(bwd.T)  # [U, S]: one row per op
    hop = p2p.tolist()
    if pp == 1:
        ops = [(0, None, mb) for mb in range(m)]  # forward and backward as one op: nothing comes between them
        busy_of = {None: fwd_t + bwd_t}
    else:
        ops = schedule(pp, m)
        busy_of = {True: fwd_t, False: bwd_t}
    end: dict[tuple, np.ndarray] = {}
    for stage, is_fwd, mb in ops:
        row, busy = free[stage], busy_of[is_fwd]
        for u in by_mb[mb]:
            span = spans[u]
            start = row[:, span].max(axis=1)
            if is_fwd is None or (is_fwd and stage == 0):
                ready = start
            else:
                dep = (end[(stage - 1, True, u)] + hop[u] if is_fwd else end[(stage, True, u)] if stage == pp - 1
                       else end[(stage + 1, False, u)] + hop[u])
                ready = np.maximum(start, dep)
            if waits is not None:
                waits[span, mb, stage] += ready[0] - row[0, span]
            done = ready + busy[u]
            row[:, span] = done[:, None]
            end[(stage, is_fwd, u)] = done
            if is_fwd is not True:
                last_bwd[stage][:, span] = bwd_t[u][:, None]
    finish = free.transpose(1, 2, 0)
    if waits is not None:
        barrier = finish[0].max(initial=0.0)
        for stage, mb in enumerate(last_micro_batches(pp, m)):
            waits[:, mb, stage] += barrier - finish[0, :, stage]
    return UnitTimeline(finish, last_bwd.transpose(1, 2, 0), waits)


def unit_rows(units: Units, layout: Layout, values: np.ndarray, reduce: str = "sum") -> np.ndarray:
    """[domain, m]: per domain rank and micro-batch the ``reduce`` (sum or max) of ``values`` [U] over the units
    whose group holds the rank."""
    out = np.zeros((layout.domain, layout.micro_batches))
    unit, rank, mb = units.cells
    (np.add if reduce == "sum" else np.maximum).at(out, (rank, mb), np.asarray(values, dtype=np.float64)[unit])
    return out
