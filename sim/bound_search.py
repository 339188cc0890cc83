"""``bound: search``: an attainable bound on each step, found by a bounded search with the data's truth known.

A table's policies plan blind; this row says how fast a plan of the same step could be. Per step it searches
whole-sequence placements (which DP rank and micro-batch each sequence runs in) and per-sequence top-k budgets,
with every sequence's true sensitivity known, at an attention-weighted coverage no lower than what the
strongest baseline realised on that step. Budgets for a placement come from DST's top-k family
(``sparsebalance_topk``'s levels) planning with the truth and that step's coverage as its target, so every
plan it prices reaches the target; placements come from a first-improvement local search (move one sequence to
another micro-batch, or swap two), ``moves`` tries per step from a start placement, each priced by the
engine's closed-form step (``Engine.expected_step_ms`` at the true kept fractions) and kept only where it fits
in memory. The search is bounded, so the row is a plan that exists, not a proof that none is faster: a
policy's share of the way from the strongest baseline to it is how much of what is attainable it takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from omegaconf import OmegaConf

from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.cost import CostModel
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.estimate import Belief
from sparsebalance.sim.memory import MemoryModel
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.policy import make_sparsity
from sparsebalance.sim.setup import load_policy, prepare
from sparsebalance.sim.workload import truth_of

MOVES = 48  # placements tried per step: the search's bound (about 1-2 s per step of `paper` on one core)
BUDGETS_FROM = "sparsebalance_topk"  # whose DST levels price a placement (the paper's top-k routing)


@dataclass
class BoundSearch:
    """The parts a step's search prices with."""

    engine: Engine
    cost: CostModel
    layout: Layout
    memory: MemoryModel | None
    moves: int = MOVES

    def step(self, start: Plan, truth: dict[int, float], coverage: float, seed: int) -> tuple[float, float]:
        """(step ms, attention-weighted coverage) of the best plan found for ``start``'s sequences at no less
        than ``coverage``, starting from ``start``'s placement."""
        s = np.array([truth[int(i)] for i in start.seq_ids], dtype=np.float64)
        belief = Belief(start.seq_ids.copy(), s[None])
        params = OmegaConf.to_container(load_policy(BUDGETS_FROM).sparsity.params)
        tuner = make_sparsity("dst", {**params, "min_mean_coverage": float(min(coverage, 1.0)), "keep_start": False})
        rng = np.random.default_rng([seed, start.step, 11])
        ranks, mbs = start.dp_ranks.copy(), start.micro_batch_ids.copy()
        best_ms, best_cov = self.priced(start, ranks, mbs, tuner, belief)
        slots = self.layout.dp * self.layout.micro_batches
        for _ in range(self.moves):
            i, slot = int(rng.integers(len(start))), int(rng.integers(slots))
            r, m = divmod(slot, self.layout.micro_batches)
            there = np.flatnonzero((ranks == r) & (mbs == m))
            tried_r, tried_m = ranks.copy(), mbs.copy()
            if there.size and rng.random() < 0.5:  # swap with one of the sequences there
                j = int(rng.choice(there))
                tried_r[j], tried_m[j] = ranks[i], mbs[i]
            tried_r[i], tried_m[i] = r, m
            ms, cov = self.priced(start, tried_r, tried_m, tuner, belief)
            if ms < best_ms:
                best_ms, best_cov, ranks, mbs = ms, cov, tried_r, tried_m
        return best_ms, best_cov

    def priced(self, start: Plan, ranks, mbs, tuner, belief: Belief) -> tuple[float, float]:
        """The step time and attention-weighted coverage of the placement with DST's budgets under the truth;
        inf where it does not fit in memory."""
        plan = tuner.tune(start.placed(ranks, mbs), self.layout, self.cost, belief)
        s = belief.at(plan.seq_ids)
        kept = plan.budgets.kept(self.cost, plan.lengths[None], s)
        if self.memory is not None and self.memory.overfull(self.memory.plan_bytes(plan, self.cost)) is not None:
            return float("inf"), float("nan")
        weights = plan.lengths.astype(np.float64) ** 2
        coverage = float(np.average(self.cost.coverages(s[0], kept[0]), weights=weights))
        return self.engine.expected_step_ms(plan, kept), coverage


def searched(cfg, plans: list[str], coverages, moves: int = MOVES) -> tuple[float, float]:
    """Mean (step ms, attention-weighted coverage) over a run's steps of ``bound: search`` (``cfg`` a RunConfig),
    each step started from the placement of ``plans`` (a policy's, as JSON) at no less than ``coverages``."""
    setup = prepare(cfg)
    search = BoundSearch(Engine(setup.layout, setup.cost, setup.cluster), setup.cost, setup.layout, setup.memory,
                         moves)
    found = [search.step(Plan.from_json(text), truth_of(setup.workload.batch(step)), float(target), cfg.seed)
             for step, (text, target) in enumerate(zip(plans, coverages, strict=True))]
    return float(np.mean([f[0] for f in found])), float(np.mean([f[1] for f in found]))
