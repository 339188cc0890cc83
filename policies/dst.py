"""``dst``: SparseBalance's workload-aware bidirectional dynamic sparsity tuning.

Every sequence starts at the budget ``p`` (what ``fixed`` would give it). DST then moves sparsity from
where it is free to where it buys time: the bottleneck DP rank gets a lower budget (more sparsity, never
below ``floor``), the other ranks a higher one (less sparsity, never above ``cap``, the profile anchor)
until they fill the idle time up to the new makespan. Under the power-law coverage model a budget p
gives coverage max(p, diag ** s) >= p, so ``floor`` is a coverage floor for every sequence.

What "bottleneck" means: the data-parallel barrier makes the step as long as its slowest rank, and a
rank's time is its pipeline's: 1F1B over its micro-batches, evaluated exactly by ``pipeline_ms`` (the
engine's schedule and hand-offs, vectorised over ranks and budget levels; with pp = 1 it is the sum of
the micro-batches). Budgets are discrete levels (``levels`` between floor and cap, plus ``p``); every
(rank, level) is costed up front with one vectorised CostModel call, so the search below is table
look-ups.

1. Rank level (bidirectional): for a target makespan tau every rank takes the highest level whose
   pipeline time fits in tau. DST picks the smallest tau (so the fastest step) at which the mean
   coverage is still at least ``min_mean_coverage`` (default: the start's, so sparsity is traded
   between sequences, not taken from the model). The mean is weighted by ``coverage_weight``: by
   default by attention work (length ** 2), since an unweighted mean lets DST buy speed with sparsity
   on the long stragglers, where most of the attention is, while short sequences gain coverage that
   weighs little. tau never exceeds the start's makespan, so DST is never slower than ``fixed`` at the
   same ``p``.
2. Micro-batch level (fills pipeline bubbles): with tau fixed, each micro-batch in turn is raised to
   the highest level that keeps its rank within tau; repeated until nothing moves (a fixed point).
   A micro-batch off the critical path of the 1F1B schedule gets a higher budget for free, and with
   pp > 1 that coverage is counted when choosing tau (``best_levels``).

Infeasible cases, handled explicitly:
* ``floor <= p <= cap`` is checked when the policy is built (a ConfigError otherwise);
* the bottleneck cannot go below the floor: if even at the floor it is slower than the level the
  coverage target allows, tau is the bottleneck's time at the floor (the floor wins over speed) and
  the others fill up to that;
* a ``min_mean_coverage`` no makespan up to the start's can reach: tau stays at the start's makespan
  and the ranks fill their idle time (the makespan guarantee wins over the coverage target);
* a plan with nothing to gain (no makespan or coverage improvement) is returned at the uniform ``p``,
  so with zero heterogeneity and pp = 1 DST is exactly ``fixed``. Identical micro-batches in a pipeline
  are not homogeneous: 1F1B puts the first one's forward and the last one's backward alone on every
  stage, and hand-offs leave slack, so with pp > 1 DST may trade budget between pipeline positions
  (never slower, never less mean coverage).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache
from typing import Optional

import numpy as np

from policies.base import uniform_budget_plan

from sim.config import FRACTION, bounded
from sim.policy import register_sparsity
from sim.plan import Assignment, Budget, Plan
from sim.cluster import Layout
from sim.cost import CostModel

FINE_TAUS = 64  # with pp > 1, makespans tried between the uniform-level ones
MAX_SWEEPS = 8  # micro-batch refinement: each sweep raises levels only, so it settles in a few


class CoverageWeight(str, Enum):
    """How DST's coverage constraint weighs sequences (the mean it keeps no lower than the start's)."""

    sequence = "sequence"  # every sequence alike: the plain mean
    token = "token"  # by length
    attention = "attention"  # by length ** 2, the attention work: sparsity on long sequences counts most

    def weights(self, lengths: np.ndarray) -> np.ndarray:
        lengths = lengths.astype(np.float64)
        return {"sequence": np.ones_like(lengths), "token": lengths, "attention": lengths**2}[self.value]


@register_sparsity("dst")
class DynamicSparsityTuning:
    @dataclass(frozen=True)
    class Params:
        p: float = 0.9  # starting budget (the `fixed` budget DST is compared with)
        floor: float = 0.8  # lowest coverage target any sequence may get
        cap: float = 1.0  # highest: the profile anchor (1.0 = dense)
        levels: int = 11  # budget levels between floor and cap (steps of 0.02 by default)
        # None: the start's mean coverage (as weighted below)
        min_mean_coverage: Optional[float] = bounded(None, FRACTION)
        coverage_weight: CoverageWeight = CoverageWeight.attention  # the weighting of that mean

    def __init__(self, params: Params) -> None:
        if not 0.0 < params.floor <= params.p <= params.cap <= 1.0:
            raise ValueError(
                f"need 0 < floor <= p <= cap <= 1, got floor={params.floor}, p={params.p}, cap={params.cap}"
            )
        if params.levels < 2:
            raise ValueError(f"levels={params.levels} must be >= 2")
        self.params = params

    def tune(self, plan: Plan, layout: Layout, cost: CostModel) -> Plan:
        return tuned(self.params, plan, layout, cost)


def tuned(params: DynamicSparsityTuning.Params, plan: Plan, layout: Layout, cost: CostModel) -> Plan:
    if not plan.assignments:
        return plan
    grid = budget_grid(params)
    start_level = int(np.searchsorted(grid, params.p))
    table = LevelTable.build(plan, layout, cost, grid, CoverageWeight(params.coverage_weight))
    start = np.full((layout.dp, layout.micro_batches), start_level)
    start_ms, start_cov = table.makespan(start), table.mean_coverage(start)
    target_cov = start_cov if params.min_mean_coverage is None else params.min_mean_coverage
    levels = best_levels(table, start_ms, target_cov)
    new_ms, new_cov = table.makespan(levels), table.mean_coverage(levels)
    if new_ms > start_ms or (new_ms == start_ms and new_cov <= start_cov):
        return uniform_budget_plan(plan, Budget(p=params.p))
    budgets = [Budget(p=float(p)) for p in grid]
    return with_levels(plan, levels[table.rank, table.micro_batch], budgets)


def budget_grid(params: DynamicSparsityTuning.Params) -> np.ndarray:
    """``levels`` budgets from floor to cap, plus p itself (so `fixed` is reachable), rounded so that
    budgets in plans read cleanly (and clipped so rounding never leaves [floor, cap]). A level that
    rounds to p's neighbourhood gives way to p, so no two levels are the same budget up to rounding."""
    grid = np.clip(np.round(np.linspace(params.floor, params.cap, params.levels), 6), params.floor, params.cap)
    return np.unique(np.append(grid[np.abs(grid - params.p) > 5e-7], params.p))


def with_levels(plan: Plan, levels: np.ndarray, budgets: list[Budget]) -> Plan:
    """The plan with budgets[levels[i]] for its i-th assignment (Plan.with_budgets without the id map:
    this runs for every sequence of every step)."""
    assignments = tuple(
        Assignment(a.seq_id, a.length, a.sensitivity, a.dp_rank, a.micro_batch, budgets[k])
        for a, k in zip(plan.assignments, levels.tolist())
    )
    return replace(plan, assignments=assignments)


@dataclass(frozen=True)
class LevelTable:
    """Per-level micro-batch times and coverages of one plan (level = index into the budget grid)."""

    fwd: np.ndarray  # [levels, dp, m] ms per stage
    bwd: np.ndarray  # [levels, dp, m]
    p2p: np.ndarray  # [dp, m] stage hand-off ms (budget-independent)
    coverage: np.ndarray  # [levels, dp, m] weighted sum of the sequences' coverages, over the total weight
    rank_ms: np.ndarray  # [levels, dp] pipeline time with the whole rank at one level
    rank: np.ndarray  # [n] each sequence's rank (plan order)
    micro_batch: np.ndarray  # [n]
    pp: int

    @classmethod
    def build(cls, plan: Plan, layout: Layout, cost: CostModel, grid: np.ndarray,
              weight: CoverageWeight = CoverageWeight.sequence) -> LevelTable:
        rows = np.array([(a.dp_rank, a.micro_batch, a.length, a.sensitivity) for a in plan.assignments])
        rank, mb = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
        lengths, sens = rows[:, 2].astype(np.int64), rows[:, 3]
        dp, m, n, g = layout.dp, layout.micro_batches, len(rows), grid.size
        # One CostModel call for every (level, micro-batch): the sequences repeated once per level.
        kept = cost.kept_fractions(np.tile(lengths, g), np.tile(sens, g), np.repeat(grid, n))
        group = np.repeat(np.arange(g) * dp * m, n) + np.tile(rank * m + mb, g)
        costs = cost.micro_batch_costs(np.tile(lengths, g), kept, group, g * dp * m, layout)
        share = np.tile(weight.weights(lengths) / weight.weights(lengths).sum(), g)
        covered = np.bincount(group, weights=share * cost.coverages(np.tile(sens, g), kept), minlength=g * dp * m)
        fwd, bwd = costs.fwd_ms.reshape(g, dp, m), costs.bwd_ms.reshape(g, dp, m)
        p2p = cost.hand_off_ms(costs.tokens[: dp * m], layout).reshape(dp, m)
        return cls(fwd, bwd, p2p, covered.reshape(g, dp, m), pipeline_ms(fwd, bwd, p2p, layout.pp), rank, mb, layout.pp)

    def gather(self, field: np.ndarray, levels: np.ndarray) -> np.ndarray:
        """field[levels[r, j], r, j] for every (rank, micro-batch)."""
        dp, m = levels.shape
        return field[levels, np.arange(dp)[:, None], np.arange(m)[None, :]]

    def makespan(self, levels: np.ndarray) -> float:
        return float(pipeline_ms(self.gather(self.fwd, levels), self.gather(self.bwd, levels), self.p2p, self.pp).max())

    def mean_coverage(self, levels: np.ndarray) -> float:
        return float(self.gather(self.coverage, levels).sum())


def rank_levels(rank_ms: np.ndarray, tau: float) -> np.ndarray:
    """Per rank the highest level whose pipeline time fits in tau (level 0, the floor, if none does)."""
    fits = rank_ms <= tau
    highest = rank_ms.shape[0] - 1 - np.argmax(fits[::-1], axis=0)
    return np.where(fits.any(axis=0), highest, 0)


def best_levels(table: LevelTable, start_ms: float, target_cov: float) -> np.ndarray:
    """Levels for the smallest makespan tau, from the table's own times, that still reach target_cov.

    For a tau, every rank takes the highest level that fits (feasible when every rank has one: the
    bottleneck at the floor bounds tau from below). Feasibility and coverage grow with tau, so a binary
    search over the sorted candidate times up to start_ms finds the smallest good one; start_ms is
    always feasible with at least the start's coverage, and is kept when the target is out of reach.
    With pp > 1 a second search below that tau also counts the coverage fill_bubbles adds (micro-batches
    off the critical path, and single micro-batches raised into the gap between two uniform levels),
    which can buy a lower tau, over a finer set of makespans; with pp = 1 a rank's time is the plain sum
    of its micro-batches, there is nothing off the critical path, and the second search is skipped (it
    is the expensive one, and gained nothing measurable on the default workload at twice the planning
    time). Every returned tau was checked, so a greedy fill that is not monotone in tau costs
    optimality, never validity.
    """
    candidates = np.unique(table.rank_ms[table.rank_ms <= start_ms])
    m = table.fwd.shape[2]

    def uniform(tau: float) -> np.ndarray | None:
        if not (table.rank_ms <= tau).any(axis=0).all():
            return None
        return np.repeat(rank_levels(table.rank_ms, tau)[:, None], m, axis=1)

    def rank_good(tau: float) -> bool:
        levels = uniform(tau)
        return levels is not None and table.mean_coverage(levels) >= target_cov

    def filled_good(tau: float) -> bool:
        levels = uniform(tau)
        return levels is not None and table.mean_coverage(fill_bubbles(table, levels, tau)) >= target_cov

    tau = smallest_good(candidates, rank_good)
    if table.pp > 1:
        # Between two uniform times only single raised micro-batches fit, so search a finer grid too.
        finer = np.linspace(table.rank_ms.min(axis=0).max(), tau, FINE_TAUS)  # from the lowest feasible tau
        tau = smallest_good(np.union1d(candidates[candidates <= tau], finer), filled_good)
    return fill_bubbles(table, uniform(tau), tau)


def smallest_good(candidates: np.ndarray, good) -> float:
    """Binary search for the first good candidate (good is monotone; the last one is taken if none is)."""
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if good(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo])


def fill_bubbles(table: LevelTable, levels: np.ndarray, tau: float) -> np.ndarray:
    """Raise micro-batches one at a time to the highest level that keeps every rank within tau."""
    g, dp, m = table.fwd.shape
    levels = levels.copy()
    for _ in range(MAX_SWEEPS):
        moved = False
        for j in range(m):
            fwd = np.broadcast_to(table.gather(table.fwd, levels), (g, dp, m)).copy()
            bwd = np.broadcast_to(table.gather(table.bwd, levels), (g, dp, m)).copy()
            fwd[:, :, j], bwd[:, :, j] = table.fwd[:, :, j], table.bwd[:, :, j]
            fits = pipeline_ms(fwd, bwd, table.p2p, table.pp) <= tau  # [levels, dp]
            fits &= np.arange(g)[:, None] >= levels[:, j][None, :]  # only raise
            best = np.where(fits.any(axis=0), g - 1 - np.argmax(fits[::-1], axis=0), levels[:, j])
            moved |= bool((best != levels[:, j]).any())
            levels[:, j] = best
        if not moved:
            break
    return levels


@lru_cache(maxsize=64)
def schedule(pp: int, m: int) -> tuple[tuple[int, bool, int], ...]:
    """(stage, is_forward, micro_batch) of every op in an order that respects the 1F1B dependencies."""
    from sim.engine import one_f_one_b  # here, not at the top: sim.engine imports sim.plan, which loads this module

    queues = [one_f_one_b(stage, pp, m) for stage in range(pp)]
    done: set[tuple[int, bool, int]] = set()
    order = []
    while len(order) < 2 * pp * m:
        for stage, queue in enumerate(queues):
            while queue:
                is_fwd, mb = queue[0]
                dep = (stage - 1, True, mb) if is_fwd else ((stage, True, mb) if stage == pp - 1 else (stage + 1, False, mb))
                if (is_fwd and stage == 0) or dep in done:
                    queue.pop(0)
                    done.add((stage, is_fwd, mb))
                    order.append((stage, is_fwd, mb))
                else:
                    break
    return tuple(order)


def pipeline_ms(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, pp: int) -> np.ndarray:
    """Finish time of a 1F1B pipeline whose every stage takes fwd/bwd[..., j] for micro-batch j.

    Same schedule and hand-offs as sim.engine.run_pipeline (a stage waits for its input, the last stage
    turns a forward straight into its backward), as a longest-path recurrence over the leading axes.
    """
    m = fwd.shape[-1]
    if pp == 1:
        return (fwd + bwd).sum(axis=-1)
    free = [np.zeros(fwd.shape[:-1])] * pp
    end: dict[tuple[int, bool, int], np.ndarray] = {}
    for stage, is_fwd, mb in schedule(pp, m):
        if is_fwd:
            ready = end[(stage - 1, True, mb)] + p2p[..., mb] if stage > 0 else 0.0
        elif stage == pp - 1:
            ready = end[(stage, True, mb)]
        else:
            ready = end[(stage + 1, False, mb)] + p2p[..., mb]
        free[stage] = np.maximum(free[stage], ready) + (fwd[..., mb] if is_fwd else bwd[..., mb])
        end[(stage, is_fwd, mb)] = free[stage]
    return np.maximum.reduce(free)
