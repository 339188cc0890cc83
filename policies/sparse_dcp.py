"""``sparsebalance_dcp``: dynamic context parallelism that knows the attention is sparse.

Megatron sizes a sequence's CP group by its tokens and weighs it by ``L^2 / cp``; under top-k routing a long
sequence's attention grows about linearly in L, so that estimate sends long sparse sequences to groups far
larger than their work needs and misbalances the rest. Here, per step, over the planner's belief (never the
data's truth):

1. **Start budget**: the fewest top-k blocks per query block at which the belief expects the attention-weighted
   coverage to reach ``min_mean_coverage`` (verl_topk's rule, so the coverage is the baseline's).
2. **CP degree with the budget**: each sequence's busy time on c ranks at that budget, from the cost model
   (``sim.cost`` on ``Layout.with_cp(c)``: the kept work's shares per CP rank of ``sim.cp_shards``, the ring on
   the intra- or inter-node link); among the powers of two from the fewest that hold its tokens
   (``max_seq_len_per_rank``) to ``layout.cp``, the degree with the least GPU time (ranks x time) whose time
   stays within the micro-batch's cap (the larger of an even share of all GPU time and the slowest sequence's
   fastest time). A sparse long sequence thus gets fewer ranks than its dense twin.
3. **Grouping**: Megatron's greedy grouping (policies.dcp) on those cost-model times.
4. **Budgets per group**: in each micro-batch the slowest group sets the pace; every group gets the most
   blocks per query block that keeps it within ``tau`` times that pace, with the smallest ``tau`` at which
   the expected attention-weighted coverage still reaches the start's. Groups off the critical path buy
   coverage, the critical ones give it up.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.policies.base import batch_arrays
from sparsebalance.policies.dcp import Order, cp_degrees, grouped, groups_plan
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.config import FRACTION, bounded
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.plan import Budget, Plan
from sparsebalance.sim.policy import register_batching, register_sparsity
from sparsebalance.sim.workload import Request

BISECTIONS = 40  # steps of the search for tau: far below the grid of budgets


@register_batching("sparsebalance_dcp")
class SparseDCP:
    plans_cp_groups = True  # its plans carry CP groups: it runs on a dynamic-CP layout only
    name: str  # set by register_batching

    @dataclass(frozen=True)
    class Params:
        max_seq_len_per_rank: int = 16384  # tokens a CP rank may hold of one sequence: the fewest ranks it needs
        max_tokens_per_rank: int = 32768  # tokens a CP rank may hold of a group's sequences together (memory)
        k: int = 64  # a budget on the ladder (blocks per query block), as DST's
        k_floor: int = 16  # the fewest blocks per query block any sequence gets
        levels: int = 41  # budgets spaced evenly in log between k_floor and the longest sequence's blocks
        min_mean_coverage: float = bounded(0.905, FRACTION)  # the start: expected attention-weighted coverage
        pipeline_order: Order = Order.verl

    def __init__(self, params: Params) -> None:
        if not 1 <= params.k_floor <= params.k:
            raise ValueError(f"need 1 <= k_floor <= k, got k_floor={params.k_floor}, k={params.k}")
        self.params = params

    def plan(self, batch: list[Request], layout: Layout, cost: CostModel, step: int, belief: Belief) -> Plan:
        if not layout.dynamic:
            raise ConfigError(f"policy {self.name!r} plans dynamic CP groups; allowed: layout.cp_mode=dynamic or the "
                              "policy's cp_mode: dynamic")
        ids, lengths = batch_arrays(batch)
        p = self.params
        ks = ladder(p, -(-int(lengths.max()) // cost.block_size))
        kept = np.stack([cost.kept_fractions(lengths, np.ones(lengths.size), np.ones(lengths.size), None,
                                             np.full(lengths.size, float(k))) for k in ks])  # [levels, n]
        sensitivity = belief.at(ids)  # [S, n]
        covered = np.stack([cost.coverages(sensitivity, row).mean(axis=0) for row in kept])  # [levels, n]
        weight = lengths.astype(np.float64) ** 2
        reached = covered @ weight / weight.sum()
        meets = reached >= p.min_mean_coverage
        start = int(np.argmax(meets)) if meets.any() else len(ks) - 1
        least = cp_degrees(lengths, p.max_seq_len_per_rank, layout, ids)
        options = (2 ** np.arange(int(np.log2(layout.cp)) + 1)).tolist()
        times = {c: cost.sequence_costs(lengths, kept[start], layout.with_cp(c)) for c in options}
        degrees = chosen_degrees(times, least, layout)
        work = np.choose(np.searchsorted(options, degrees), [times[c] for c in options])
        groups = grouped(work, degrees, layout, lengths, p.max_tokens_per_rank)
        levels = group_levels(groups, degrees, kept, lengths, cost, layout, covered, weight, start)
        budgets = np.array([Budget(top_k=int(k)) for k in ks], dtype=object)[levels]
        return groups_plan(step, layout, ids, lengths, groups, Order(p.pipeline_order), budgets)


def ladder(p, blocks: int) -> np.ndarray:
    """The budgets (blocks per query block), fewest first: ``levels`` spaced in log from k_floor to the larger of
    4 k and the longest sequence's blocks (dense there), plus k: DST's top-k ladder."""
    top = max(4 * p.k, blocks)
    return np.unique(np.append(np.rint(np.geomspace(p.k_floor, top, p.levels)).astype(np.int64), p.k))


def chosen_degrees(times: dict[int, np.ndarray], least: np.ndarray, layout: Layout) -> np.ndarray:
    """Per sequence the degree from ``least`` up with the least GPU time within the cap (module doc, step 2)."""
    options = sorted(times)
    busy = np.stack([times[c] for c in options])  # [C, n]
    allowed = np.array(options)[:, None] >= least[None, :]
    gpu = np.where(allowed, busy * np.array(options)[:, None], np.inf)
    fastest = np.where(allowed, busy, np.inf).min(axis=0)
    cap = max(float(gpu.min(axis=0).sum()) / (layout.domain * layout.micro_batches), float(fastest.max()))
    fits = allowed & (busy <= cap)
    pick = np.where(fits.any(axis=0), np.argmin(np.where(fits, gpu, np.inf), axis=0),
                    np.argmin(np.where(allowed, busy, np.inf), axis=0))
    return np.array(options)[pick]


def group_levels(groups, degrees, kept, lengths, cost: CostModel, layout: Layout, covered, weight,
                 start: int) -> np.ndarray:
    """The budget level of each sequence (module doc, step 4): a group's per-rank time at each level (its
    members' times on its degree), the pace of its micro-batch at the start level, and the smallest tau whose
    levels keep the expected attention-weighted coverage of the start."""
    n_levels = kept.shape[0]
    load = np.zeros((len(groups), n_levels))
    for size in sorted({g.size for g in groups}):
        on = layout.with_cp(size)
        for j, g in enumerate(groups):
            if g.size != size:
                continue
            members = np.array(g.members)
            rows = np.repeat(members, n_levels)
            levels = np.tile(np.arange(n_levels), members.size)
            per = cost.sequence_costs(lengths[rows], kept[levels, rows], on).reshape(members.size, n_levels)
            load[j] = per.sum(axis=0)
    pace = np.zeros(layout.micro_batches)
    for j, g in enumerate(groups):
        pace[g.micro_batch] = max(pace[g.micro_batch], load[j, start])
    limit = pace[[g.micro_batch for g in groups]]  # [G]
    member_group = np.zeros(lengths.size, dtype=np.int64)
    for j, g in enumerate(groups):
        member_group[g.members] = j
    target = covered[start] @ weight

    def levels_at(tau: float) -> np.ndarray:
        within = load <= tau * limit[:, None] * (1 + 1e-12)
        top = np.where(within.any(axis=1), n_levels - 1 - np.argmax(within[:, ::-1], axis=1), 0)
        return top[member_group]

    def good(tau: float) -> bool:
        return covered[levels_at(tau), np.arange(lengths.size)] @ weight >= target * (1 - 1e-12)

    lo, hi = 0.0, 1.0
    if not good(hi):
        return np.full(lengths.size, start)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if good(mid) else (mid, hi)
    return levels_at(hi)


@register_sparsity("planned")
class Planned:
    """The batching policy's budgets as they are (sparsebalance_dcp chooses them with the CP groups)."""

    @dataclass(frozen=True)
    class Params:
        """No parameters: the budgets are the batching policy's."""

    def __init__(self, params: Params) -> None:
        self.params = params

    def tune(self, plan: Plan, layout: Layout, cost: CostModel, belief: Belief) -> Plan:
        return plan
