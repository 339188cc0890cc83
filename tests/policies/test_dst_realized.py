"""DST's "never slower than `fixed`", held against realized step times (the engine's, on the data's truth), not
against DST's own prediction. With top-k budgets a step's time is known before it runs, so DST is never slower
than its fixed start on any step where it owes no coverage (up to the gradient reduction's exposed tail, which DST
does not price: within 0.5%); the start is the one budget per step that the same belief gives the same placement.
A step that owes coverage (earlier steps covered less than their starts, `policies.dst`) raises its target above
the start's and may pay for it in time. With top-p budgets and a blind planner some steps run slower than `fixed`
would have, and repaying coverage costs more: what holds is the mean over each seed's steps, within 2% of
`fixed`'s (on `paper` blind top-p DST is no faster than `fixed` on seeds 1-2 once it repays coverage)."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from sparsebalance.sim.config import compose_config
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import load_policy, make_planner, prepare
from sparsebalance.sim.workload import requests, truth_of

SEEDS = range(3)


def realized(policy, seed: int) -> np.ndarray:
    cfg = OmegaConf.to_object(compose_config(["+experiment=paper", f"seed={seed}", "steps=10", "baseline=null"]))
    return simulate(cfg, OmegaConf.to_object(policy)).results.steps_frame()["step_ms"].to_numpy()


def with_its_start(policy, start_policy, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step, the realized time of the policy's plan and of the same placement under ``start_policy``'s
    budgets, planned from the same belief; the planner learns from its own plans' outcomes only."""
    cfg = OmegaConf.to_object(compose_config(["+experiment=paper", f"seed={seed}", "steps=10", "baseline=null"]))
    setup = prepare(cfg)
    truth = lambda step: truth_of(setup.workload.batch(step))  # noqa: E731
    planner = make_planner(cfg, setup, OmegaConf.to_object(policy), truth=truth)
    start = make_planner(cfg, setup, OmegaConf.to_object(start_policy), truth=truth).sparsity
    engine = Engine(setup.layout, setup.cost, setup.cluster, setup.memory)
    tuned_ms, start_ms, owed = [], [], []
    for step in range(cfg.steps):
        batch = setup.workload.batch(step)
        owed.append(planner.sparsity.owed)
        plan = planner.plan(requests(batch), step)
        fixed = start.tune(plan, setup.layout, setup.cost, planner.belief)
        outcome = engine.step(plan, truth_of(batch))
        tuned_ms.append(outcome.record.step_ms)
        start_ms.append(engine.step(fixed, truth_of(batch)).record.step_ms)
        planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)
    return np.array(tuned_ms), np.array(start_ms), np.array(owed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_top_k_dst_is_never_slower_than_its_fixed_start_on_any_step(seed):
    fixed = load_policy("verl_topk")
    tuned = OmegaConf.merge(fixed, {"sparsity": {"params": {"balance": True}}})
    dst, start, owed = with_its_start(tuned, fixed, seed)
    assert (owed == 0).sum() >= 3  # the guard is checked on several steps
    assert (dst <= start * 1.005)[owed == 0].all()
    assert dst.mean() < start.mean()
    assert (dst < start).mean() >= 0.5  # DST gains on most steps, not on one


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_blind_top_p_dst_is_within_2_percent_of_fixed_over_each_seeds_steps(seed):
    start, dst = realized(load_policy("verl"), seed), realized(load_policy("verl_dst"), seed)
    assert dst.mean() < start.mean() * 1.02
