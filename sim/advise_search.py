"""The advisor's search, cheap first: the planner's own price of every candidate, then the simulator on the
promising ones, successive halving over rungs of more steps and seeds.

Rung 0 (``price``) plans the first ``cheap_steps`` global batches of the base seed and records what the planner
expects of each plan under its belief (blind: the stated prior, policy.prior, nothing of the data's truth):
the step time (``Planner.predicted_ms``) and the attention-weighted coverage (the belief's mean of
``min(1, kf ** s)`` weighted by length ** 2). Planning also applies the memory model to whole plans, so a
candidate whose plans cannot fit is counted out here. Each later rung simulates the best ``keep`` of the rung
before over ``steps`` steps and ``seeds`` consecutive seeds (sim.run.simulate, the same loop as sim.run).

Order (``rank``): candidates that reach the coverage floor first, fastest first; then the others, those that
lose the least coverage first (sim.run's ``objective``); a predicted coverage is held to the floor as a simulated
one is, so that a candidate planned to keep just less than the reference does not crowd out those that keep
as much.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import joblib
import numpy as np
from joblib import Parallel, delayed
from omegaconf import DictConfig
from sparsebalance.sim.advise_space import Candidate, configured
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.progress import with_progress
from sparsebalance.sim.run import COVERAGE_TOLERANCE, simulate
from sparsebalance.sim.setup import make_planner, prepare
from sparsebalance.sim.workload import requests

SUMMARY_KEYS = ("step_ms", "attention_coverage", "min_coverage", "peak_memory_gb", "prediction_error_pct",
                "bubble_fraction", "steps")


@dataclass
class Scored:
    candidate: Candidate
    rung: int
    step_ms: float  # rung 0: the planner's price; later: the mean over seeds of the simulated step time
    coverage: float  # attention-weighted; rung 0: predicted
    per_seed: list[dict] = field(default_factory=list)  # rung >= 1: the summary figures of each seed
    problem: str | None = None  # rung 0: why its plans cannot run (memory), which leaves it out

    def figure(self, key: str) -> np.ndarray:
        return np.array([np.nan if s[key] is None else s[key] for s in self.per_seed], dtype=np.float64)


def price(candidate: Candidate, base: DictConfig, steps: int) -> Scored:
    """Rung 0: the planner's expected step time and coverage over the first ``steps`` batches."""
    cfg = configured(base, candidate)
    setup = prepare(cfg)
    planner = make_planner(cfg, setup)
    times, work, covered = [], 0.0, 0.0
    try:
        for step in range(steps):
            plan = planner.plan(requests(setup.workload.batch(step)), step)
            s = planner.belief.at(plan.seq_ids)
            kept = plan.budgets.kept(setup.cost, plan.lengths[None], s)
            weight = plan.lengths.astype(np.float64) ** 2
            covered += float((np.minimum(1.0, kept ** s).mean(axis=0) * weight).sum())
            work += float(weight.sum())
            times.append(planner.predicted_ms)
    except ConfigError as exc:  # the memory model's verdict on a whole plan
        return Scored(candidate, 0, np.inf, 0.0, problem=str(exc).splitlines()[0])
    return Scored(candidate, 0, float(np.mean(times)), covered / work)


def simulated(candidate: Candidate, base: DictConfig, rung: int, steps: int, seeds: range) -> Scored:
    """A later rung: the candidate simulated on each seed."""
    per_seed = []
    for seed in seeds:
        summary = simulate(configured(base, candidate, seed=seed, steps=steps, write_plans=False)).summary
        per_seed.append({key: summary.get(key) for key in SUMMARY_KEYS} | {"seed": seed})
    runs = Scored(candidate, rung, 0.0, 0.0, per_seed)
    runs.step_ms, runs.coverage = float(runs.figure("step_ms").mean()), float(runs.figure("attention_coverage").mean())
    return runs


def meets(scored: Scored, floor: float) -> bool:
    return scored.coverage >= floor - COVERAGE_TOLERANCE


def rank(scored: list[Scored], floor: float) -> list[Scored]:
    """Those that reach the floor, fastest first; then the rest, least coverage lost first."""
    ok = sorted((s for s in scored if meets(s, floor)), key=lambda s: s.step_ms)
    short = sorted((s for s in scored if not meets(s, floor)), key=lambda s: (-s.coverage, s.step_ms))
    return ok + short


def run_all(task, items: list, jobs: int, desc: str) -> tuple[list, float]:
    """``task`` on every item, in order, and the CPU seconds it took; with ``jobs`` != 1 in that many processes
    (joblib), the items sent in chunks, a few per process, so that the config each task carries is pickled once
    per chunk, not per item."""
    if jobs == 1:
        return _each(task, list(with_progress(items, desc, unit="run")))
    workers = joblib.cpu_count() if jobs < 0 else jobs
    size = max(1, len(items) // (4 * workers))
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    work = Parallel(n_jobs=jobs, return_as="generator")(delayed(_each)(task, chunk) for chunk in chunks)
    done = list(with_progress(work, desc, total=len(chunks), unit="chunk"))
    return [r for results, _ in done for r in results], sum(cpu for _, cpu in done)


def _each(task, chunk) -> tuple[list, float]:
    start = time.process_time()
    results = [task(item) for item in chunk]
    return results, time.process_time() - start


@dataclass(frozen=True)
class Rung:
    keep: int  # candidates carried into this rung from the one before
    steps: int
    seeds: int


def halving(candidates: list[Candidate], base: DictConfig, floor: float, cheap_steps: int, rungs: list[Rung],
            seed: int, jobs: int) -> tuple[list[Scored], list[list[Scored]], float]:
    """Rung 0 on every candidate, then each rung on the best of the one before. Returns the problems of rung 0
    (candidates whose plans cannot run), each rung's ranked results and the CPU seconds of the search."""
    priced, cpu = run_all(lambda c: price(c, base, cheap_steps), candidates, jobs, "advise: price")
    failed = [s for s in priced if s.problem]
    history = [rank([s for s in priced if not s.problem], floor)]
    for number, rung in enumerate(rungs, start=1):
        chosen = [s.candidate for s in history[-1][: rung.keep]]
        results, used = run_all(lambda c, n=number, r=rung: simulated(c, base, n, r.steps, range(seed, seed + r.seeds)),
                                chosen, jobs, f"advise: rung {number} ({rung.steps} steps x {rung.seeds} seeds)")
        history.append(rank(results, floor))
        cpu += used
    return failed, history, cpu
