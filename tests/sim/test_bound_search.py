"""``bound: search``: with the truth known, placements and top-k budgets searched at the strongest baseline's
coverage on every step; never slower than its start placement, and at least the coverage asked for."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from sparsebalance.sim.bound_search import BoundSearch
from sparsebalance.sim.compare import compare
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import load_policy, prepare
from sparsebalance.sim.workload import truth_of

PAPER = ["+experiment=paper", "steps=2"]


def test_a_searched_step_holds_the_coverage_and_never_loses_to_its_start():
    cfg = OmegaConf.to_object(compose_config(PAPER))
    setup = prepare(cfg)
    run = simulate(cfg, load_policy("sparsebalance_topk"))
    coverages = run.results.steps_frame()["attention_coverage"].to_numpy()
    still = BoundSearch(Engine(setup.layout, setup.cost, setup.cluster), setup.cost, setup.layout, setup.memory, 0)
    moving = BoundSearch(still.engine, setup.cost, setup.layout, setup.memory, 12)
    for step, text in enumerate(run.results.plans):
        start, truth = Plan.from_json(text), truth_of(setup.workload.batch(step))
        start_ms, start_cov = still.step(start, truth, coverages[step], seed=0)
        ms, cov = moving.step(start, truth, coverages[step], seed=0)
        assert ms <= start_ms and np.isfinite(ms)
        assert cov >= coverages[step] - 1e-9 and start_cov >= coverages[step] - 1e-9


@pytest.mark.slow
def test_compare_adds_the_search_row_beside_the_policies():
    table = compare(PAPER, ("verl_topk", "sparsebalance_topk"), 1, ("verl_topk",), search=4).set_index("policy")
    row = table.loc["bound: search"]
    assert np.isfinite(row["step_ms"]) and row["cov_vs_best"] >= -1e-9
    assert np.isnan(row["pred_err_%"]) and np.isnan(row["bubble_%"])
