"""``dst``: SparseBalance's workload-aware bidirectional dynamic sparsity tuning.

Every sequence starts at the budget ``p`` (what ``fixed`` would give it). DST then moves sparsity from
where it is free to where it buys time: the bottleneck DP rank gets a lower budget (more sparsity, never
below ``floor``), the other ranks a higher one (less sparsity, never above ``cap``, the profile anchor)
until they fill the idle time up to the new makespan. Under the power-law coverage model a budget p
gives coverage max(p, diag ** s) >= p, so ``floor`` is a coverage floor for every sequence. With
``family: topk`` the levels are block counts k per query block instead (the paper's routing): a level's
time then follows from the lengths, and only its coverage is uncertain.

DST never sees a sequence's sensitivity. It prices every level under each of the planner's belief samples
(sim.estimate): a rank's time at a level is the ``quantile`` (0.75) of its times over the samples, so a
rank whose sequences may spread their attention more is planned with room for it; coverages are the
belief's expected ones.

What "bottleneck" means: the data-parallel barrier makes the step as long as its slowest rank, and a
rank's time is its pipeline's: 1F1B over its micro-batches, evaluated exactly by ``pipeline_ms`` (the
engine's schedule and hand-offs, vectorised over ranks and budget levels; with pp = 1 it is the sum of
the micro-batches). Budgets are discrete levels (``levels`` between floor and cap, plus ``p``); every
(rank, level) is costed up front with one vectorised CostModel call, so the search below is table
look-ups.

1. Rank level (bidirectional): for a target makespan tau every rank takes the highest level whose
   pipeline time fits in tau. DST picks the smallest tau (so the fastest step) at which the mean
   coverage is still at least the start's (``min_mean_coverage``, where set, chooses the start: the
   lowest level that meets it, one budget for the step), so sparsity is traded between sequences, not
   taken from the model, and the plan covers no less than ``fixed`` at the start's budget does. The mean
   is weighted by ``coverage_weight``: by default by attention work (length ** 2), since an unweighted
   mean lets DST buy speed with sparsity on the long stragglers, where most of the attention is, while
   short sequences gain coverage that weighs little. tau never exceeds the start's planned makespan,
   and a plan whose expected step (the belief's mean of the slowest rank) is slower than the start's is
   dropped for the start: DST is never expected to be slower than ``fixed`` at the same ``p``. Whether it is, is a
   question of realized times: ``sim.compare`` and the Results hold the planner's prediction beside every realized step.
2. Micro-batch level (fills pipeline bubbles): with tau fixed, each micro-batch in turn is raised to
   the highest level that keeps its rank within tau; repeated until nothing moves (a fixed point).
   A micro-batch off the critical path of the 1F1B schedule gets a higher budget for free, and with
   pp > 1 that coverage is counted when choosing tau (``best_levels``).

Infeasible cases, handled explicitly:
* ``floor <= p <= cap`` is checked when the policy is built (a ConfigError otherwise);
* the bottleneck cannot go below the floor: if even at the floor it is slower than the level the
  coverage target allows, tau is the bottleneck's time at the floor (the floor wins over speed) and
  the others fill up to that;
* a plan with nothing to gain (no makespan or coverage improvement) is returned at the uniform ``p``,
  so with zero heterogeneity and pp = 1 DST is exactly ``fixed``. Identical micro-batches in a pipeline
  are not homogeneous: 1F1B puts the first one's forward and the last one's backward alone on every
  stage, and hand-offs leave slack, so with pp > 1 DST may trade budget between pipeline positions
  (never slower, never less mean coverage).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

import numpy as np

from sparsebalance.policies.base import uniform_budget_plan

from sparsebalance.sim.config import FRACTION, bounded
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.pipeline import pipeline_ms
from sparsebalance.sim.policy import register_sparsity
from sparsebalance.sim.plan import Budget, BudgetArrays, Plan
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel

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


class Family(str, Enum):
    """Which budgets DST moves between (sim.plan.Budget)."""

    topp = "topp"  # coverage targets p: the kept blocks, and so the time, depend on the data
    topk = "topk"  # k blocks per query block (the paper's): the time follows from the lengths


@register_sparsity("dst")
class DynamicSparsityTuning:
    @dataclass(frozen=True)
    class Params:
        family: Family = Family.topp
        p: float = 0.9  # top-p: starting budget (the `fixed` budget DST is compared with)
        floor: float = 0.8  # top-p: lowest coverage target any sequence may get
        cap: float = 1.0  # top-p: highest: the profile anchor (1.0 = dense)
        levels: int = 11  # budget levels between floor and cap (steps of 0.02 by default)
        k: int = 64  # top-k: starting blocks per query block (with min_mean_coverage: the level that meets it)
        k_floor: int = 16  # top-k: fewest blocks per query block
        k_cap: Optional[int] = None  # top-k: most blocks per query block; None: 4 k, or the longest sequence's
        p_floor: Optional[float] = bounded(None, FRACTION)  # top-k: the rows' runtime coverage floor; None: none
        # None: start from p (or k); set: start from the lowest level that meets it. DST keeps the start's coverage
        min_mean_coverage: Optional[float] = bounded(None, FRACTION)
        coverage_weight: CoverageWeight = CoverageWeight.attention  # the weighting of that mean
        # each rank's time is planned at this quantile of what the belief about the sequences lets it take
        quantile: float = bounded(0.75, FRACTION)
        # false: no balancing, only the one budget per step that meets min_mean_coverage (a baseline's choice)
        balance: bool = True

    def __init__(self, params: Params) -> None:
        if Family(params.family) is Family.topp and not 0.0 < params.floor <= params.p <= params.cap <= 1.0:
            raise ValueError(
                f"need 0 < floor <= p <= cap <= 1, got floor={params.floor}, p={params.p}, cap={params.cap}"
            )
        cap = 4 * params.k if params.k_cap is None else params.k_cap
        if Family(params.family) is Family.topk and not 1 <= params.k_floor <= params.k <= cap:
            raise ValueError(f"need 1 <= k_floor <= k <= k_cap, got k_floor={params.k_floor}, k={params.k}, "
                             f"k_cap={params.k_cap}")
        if params.levels < 2:
            raise ValueError(f"levels={params.levels} must be >= 2")
        if not params.balance and params.min_mean_coverage is None:
            raise ValueError("balance=false picks the budget that meets min_mean_coverage: set min_mean_coverage")
        self.params = params

    def tune(self, plan: Plan, layout: Layout, cost: CostModel, belief: Belief) -> Plan:
        return tuned(self.params, plan, layout, cost, belief)


def tuned(params: DynamicSparsityTuning.Params, plan: Plan, layout: Layout, cost: CostModel, belief: Belief) -> Plan:
    if not len(plan):
        return plan
    longest = int(plan.lengths.max())
    budgets, start_level = level_budgets(params, cost.block_size, longest)
    table = LevelTable.build(plan, layout, cost, budgets, belief, CoverageWeight(params.coverage_weight),
                             params.quantile)
    if params.min_mean_coverage is not None:
        start_level = meeting_level(table, params.min_mean_coverage)
    if not params.balance:
        return uniform_budget_plan(plan, budgets[start_level])
    start = np.full((layout.dp, layout.micro_batches), start_level)
    start_ms, start_cov = table.makespan(start), table.mean_coverage(start)
    levels = best_levels(table, start_ms, start_cov)
    new_ms, new_cov = table.expected_ms(levels), table.mean_coverage(levels)
    start_expected = table.expected_ms(start)
    if new_ms > start_expected or (new_ms == start_expected and new_cov <= start_cov):
        return uniform_budget_plan(plan, budgets[start_level])
    return with_levels(plan, levels[table.rank, table.micro_batch], budgets)


def meeting_level(table: LevelTable, target: float) -> int:
    """The lowest uniform level that the belief expects to reach ``target`` (the highest where none does): the
    fixed budget that meets the coverage target, which DST then starts from and is never slower than."""
    dp, m = table.rank_ms.shape[1], table.fwd.shape[-1]
    levels = range(table.fwd.shape[0])
    return next((level for level in levels if table.mean_coverage(np.full((dp, m), level)) >= target), levels[-1])


def level_budgets(params: DynamicSparsityTuning.Params, block_size: int, longest: int = 0) -> tuple[list[Budget], int]:
    """The budgets DST chooses from, cheapest first, and the index of the starting one (``longest``: the step's
    longest sequence, whose every block the top-k levels reach where ``k_cap`` is None)."""
    if Family(params.family) is Family.topp:
        grid = budget_grid(params)
        return [Budget(p=float(p)) for p in grid], int(np.searchsorted(grid, params.p))
    return topk_budgets(params, -(-longest // block_size))


def topk_budgets(params: DynamicSparsityTuning.Params, blocks: int = 0) -> tuple[list[Budget], int]:
    """``levels`` block counts spaced evenly in log from k_floor to k_cap, plus k. Where k_cap is None the top is
    the larger of 4 k and ``blocks`` (the step's longest sequence's): every sequence runs dense at the top
    level, so a coverage target is always within reach."""
    top = params.k_cap if params.k_cap is not None else max(4 * params.k, blocks)
    ks = np.unique(np.append(np.rint(np.geomspace(params.k_floor, top, params.levels)).astype(np.int64), params.k))
    return [Budget(top_k=int(k), p_floor=params.p_floor) for k in ks.tolist()], int(np.searchsorted(ks, params.k))


def budget_grid(params: DynamicSparsityTuning.Params) -> np.ndarray:
    """``levels`` budgets from floor to cap, plus p itself (so `fixed` is reachable), rounded so that
    budgets in plans read cleanly (and clipped so rounding never leaves [floor, cap]). A level that
    rounds to p's neighbourhood gives way to p, so no two levels are the same budget up to rounding."""
    grid = np.clip(np.round(np.linspace(params.floor, params.cap, params.levels), 6), params.floor, params.cap)
    return np.unique(np.append(grid[np.abs(grid - params.p) > 5e-7], params.p))


def with_levels(plan: Plan, levels: np.ndarray, budgets: list[Budget]) -> Plan:
    """The plan with budgets[levels[i]] for its i-th sequence."""
    return replace(plan, budgets=BudgetArrays.of(budgets).take(levels))


@dataclass(frozen=True)
class LevelTable:
    """Per-level micro-batch times, under each of the belief's samples, and expected coverages of one plan
    (level = index into the budgets)."""

    fwd: np.ndarray  # [levels, S, dp, m] ms per stage
    bwd: np.ndarray  # [levels, S, dp, m]
    p2p: np.ndarray  # [dp, m] stage hand-off ms (budget-independent)
    coverage: np.ndarray  # [levels, dp, m] expected weighted sum of the coverages, over the total weight
    rank_ms: np.ndarray  # [levels, dp] the quantile of the pipeline time with the whole rank at one level
    rank: np.ndarray  # [n] each sequence's rank (plan order)
    micro_batch: np.ndarray  # [n]
    pp: int
    quantile: float
    distinct: int  # samples whose times differ: 1 where every level's kept blocks follow from the lengths

    def priced(self, field: np.ndarray) -> np.ndarray:
        """``field`` (fwd or bwd) over its distinct samples only: a quantile of alike samples is their value."""
        return field[:, : self.distinct]

    @classmethod
    def build(cls, plan: Plan, layout: Layout, cost: CostModel, budgets: list[Budget], belief: Belief,
              weight: CoverageWeight = CoverageWeight.sequence, quantile: float = 0.5) -> LevelTable:
        rank, mb, lengths = plan.dp_ranks, plan.micro_batch_ids, plan.lengths
        samples = belief.at(plan.seq_ids)  # [S, n]
        dp, m, n, g, s = layout.dp, layout.micro_batches, lengths.size, len(budgets), samples.shape[0]
        cols = BudgetArrays.of(budgets)
        kept, coverage, inverse = distinct_outcomes(cost, lengths, samples, cols)  # [g, K], [g, K], [S, n]
        group = rank * m + mb
        if cols.fixes_blocks.all():
            # every level's kept blocks follow from the lengths: one CostModel call per level serves every sample
            costs = cost.micro_batch_costs(lengths, kept[:, inverse[0]], group, dp * m, layout)
            per_sample = 1
        else:  # one CostModel call for every (level, sample) pair: the replicas of the batch
            costs = cost.micro_batch_costs(lengths, kept[:, inverse].reshape(g * s, n), group, dp * m, layout)
            per_sample = s
        fwd = np.broadcast_to(costs.fwd_ms.reshape(g, per_sample, dp, m), (g, s, dp, m))
        bwd = np.broadcast_to(costs.bwd_ms.reshape(g, per_sample, dp, m), (g, s, dp, m))
        share = weight.weights(lengths) / weight.weights(lengths).sum()
        # a micro-batch the cost model runs on a dense backend (cost.attention_backend) keeps every block
        dense = costs.dense.reshape(g, per_sample, dp * m)[:, :, group]
        expected = (share * np.where(dense, 1.0, coverage[:, inverse])).mean(axis=1)  # [g, n]
        covered = np.bincount((np.arange(g)[:, None] * dp * m + group).ravel(), weights=expected.ravel(),
                              minlength=g * dp * m)
        p2p = cost.hand_off_ms(costs.tokens[: dp * m], layout).reshape(dp, m)
        rank_ms = np.quantile(pipeline_ms(fwd[:, :per_sample], bwd[:, :per_sample], p2p, layout.pp), quantile, axis=1)
        return cls(fwd, bwd, p2p, covered.reshape(g, dp, m), rank_ms, rank, mb, layout.pp, quantile, per_sample)

    def gather(self, field: np.ndarray, levels: np.ndarray) -> np.ndarray:
        """field[levels[r, j], r, j] for every (rank, micro-batch)."""
        dp, m = levels.shape
        return field[levels, np.arange(dp)[:, None], np.arange(m)[None, :]]

    def gather_times(self, field: np.ndarray, levels: np.ndarray) -> np.ndarray:
        """[S, dp, m]: field[levels[r, j], sample, r, j]."""
        dp, m = levels.shape
        s = field.shape[1]
        return field[levels[None], np.arange(s)[:, None, None], np.arange(dp)[None, :, None],
                     np.arange(m)[None, None, :]]

    def rank_times(self, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
        """The planning quantile, over the samples (axis -3), of each rank's pipeline time."""
        return np.quantile(pipeline_ms(fwd, bwd, self.p2p, self.pp), self.quantile, axis=-2)

    def makespan(self, levels: np.ndarray) -> float:
        """The slowest rank's planned (quantile) time."""
        fwd, bwd = self.priced(self.fwd), self.priced(self.bwd)
        return float(self.rank_times(self.gather_times(fwd, levels), self.gather_times(bwd, levels)).max())

    def expected_ms(self, levels: np.ndarray) -> float:
        """The belief's mean of the slowest rank's time: what the step is expected to take."""
        ranks = pipeline_ms(self.gather_times(self.fwd, levels), self.gather_times(self.bwd, levels), self.p2p, self.pp)
        return float(ranks.max(axis=-1).mean())

    def mean_coverage(self, levels: np.ndarray) -> float:
        return float(self.gather(self.coverage, levels).sum())


def distinct_outcomes(cost: CostModel, lengths: np.ndarray, samples: np.ndarray,
                      cols: BudgetArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kept, coverage, inverse)``: the kept fraction and the coverage (``[levels, K]``) of each of the K distinct
    (block count, sampled sensitivity) pairs at each level (a row of ``cols``), and ``inverse`` (``[S, n]``): the
    pair of each sample of each sequence. The cost model's kept fractions see a length only through its block
    count (``CostModel.block_counts``), and a belief holds a few sensitivities per length bucket, so the K pairs
    are far fewer than the samples; each is priced once, with the same bits as priced per sample."""
    _, s_index = np.unique(samples, return_inverse=True)
    blocks = cost.block_counts(lengths)
    keys = blocks[None, :] * (int(s_index.max(initial=0)) + 1) + s_index.reshape(samples.shape)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    sample, seq = np.unravel_index(first, samples.shape)
    s = samples[sample, seq]
    kept = cost.kept_fractions(lengths[seq], s, *(c[:, None] for c in (cols.p, cols.kept_fraction, cols.top_k,
                                                                       cols.p_floor)))
    return kept, cost.coverages(s, kept), inverse.reshape(samples.shape)


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
    m = table.fwd.shape[-1]

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
    """Raise micro-batches one at a time to the highest level that keeps every rank's planned time within tau."""
    all_fwd, all_bwd = table.priced(table.fwd), table.priced(table.bwd)
    g, s, dp, m = all_fwd.shape
    levels = levels.copy()
    for _ in range(MAX_SWEEPS):
        moved = False
        for j in range(m):
            fwd = np.broadcast_to(table.gather_times(all_fwd, levels), (g, s, dp, m)).copy()
            bwd = np.broadcast_to(table.gather_times(all_bwd, levels), (g, s, dp, m)).copy()
            fwd[..., j], bwd[..., j] = all_fwd[..., j], all_bwd[..., j]
            fits = table.rank_times(fwd, bwd) <= tau  # [levels, dp]
            fits &= np.arange(g)[:, None] >= levels[:, j][None, :]  # only raise
            best = np.where(fits.any(axis=0), g - 1 - np.argmax(fits[::-1], axis=0), levels[:, j])
            moved |= bool((best != levels[:, j]).any())
            levels[:, j] = best
        if not moved:
            break
    return levels
