"""Under hybrid the simulator chooses each micro-batch's backend as the runner does: before the step, from the
kept fractions the planner expects (sim.choice.planned_backends), and prices the realised step on that choice."""
from __future__ import annotations

import numpy as np
from omegaconf import OmegaConf

import sparsebalance.sim.run as sim_run
from sparsebalance.sim.choice import planned_backends
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.setup import make_planner, prepare
from sparsebalance.sim.workload import requests, truth_of

PROFILE = "tests/fixtures/profile_h200_sparse_peer.json"


def hybrid_cfg(policy: str = "sparsebalance"):
    return OmegaConf.to_object(compose_config(["+experiment=paper", "steps=3", f"policy={policy}", "baseline=null",
                                               f"cost.profile={PROFILE}", "cost.attention_backend=hybrid"]))


def test_the_simulated_step_runs_the_backends_chosen_from_the_planners_expectation(monkeypatch):
    chosen = []

    def recording(*args):
        chosen.append(planned_backends(*args))
        return chosen[-1]

    monkeypatch.setattr(sim_run, "planned_backends", recording)
    rows = sim_run.simulate(hybrid_cfg()).results.micro_batches()
    first_stage = rows[rows.stage == 0]
    ran = [g.sort_values(["dp_rank", "micro_batch"]).attention_backend.to_numpy()
           for _, g in first_stage.groupby("step")]
    assert len(chosen) == len(ran) == 3
    for planned, step in zip(chosen, ran, strict=True):
        np.testing.assert_array_equal(planned.reshape(-1), step)


def test_the_choice_is_made_at_the_expectation_not_at_the_realised_kept_fractions():
    """Over a few steps of top-p sparsebalance the realised kept fractions would choose otherwise for some micro-batch;
    the step is then priced on the planned backend at the realised kept fractions."""
    cfg = hybrid_cfg()
    setup = prepare(cfg)
    engine = Engine(setup.layout, setup.cost, setup.cluster)
    planner = make_planner(cfg, setup)
    differs = 0
    for step in range(3):
        batch = setup.workload.batch(step)
        plan = planner.plan(requests(batch), step)
        planned = planned_backends(plan, setup.cost, setup.layout, planner.belief)
        priced = engine.step(plan, truth_of(batch), ran=planned)
        hindsight = engine.step(plan, truth_of(batch))
        pp = setup.layout.pp
        np.testing.assert_array_equal(priced.rows["attention_backend"][::pp], planned.reshape(-1))
        differs += int((planned.reshape(-1) != hindsight.rows["attention_backend"][::pp]).sum())
        planner.observe(plan, priced.kept, priced.coverage, priced.record.step_ms)
    assert differs > 0


def test_under_dynamic_cp_each_unit_runs_the_backend_chosen_before_the_step():
    cfg = OmegaConf.to_object(compose_config(["+experiment=paper", "steps=1", "policy=sparsebalance", "baseline=null",
                                              "layout.cp_mode=dynamic", f"cost.profile={PROFILE}",
                                              "cost.attention_backend=hybrid"]))
    setup = prepare(cfg)
    engine = Engine(setup.layout, setup.cost, setup.cluster)
    planner = make_planner(cfg, setup)
    batch = setup.workload.batch(0)
    plan = planner.plan(requests(batch), 0)
    planned = planned_backends(plan, setup.cost, setup.layout, planner.belief)
    realised = plan.budgets.kept(setup.cost, plan.lengths, np.array([truth_of(batch)[int(i)] for i in plan.seq_ids]))
    step = engine.step(plan, truth_of(batch), ran=planned).record.step_ms
    assert step == engine.expected_step_ms(plan, realised[None], planned)
    dense = engine.step(plan, truth_of(batch), ran=np.full(planned.shape, "fa4"))
    ours = engine.step(plan, truth_of(batch), ran=np.full(planned.shape, "ours"))
    assert dense.record.min_coverage == 1.0 > ours.record.min_coverage
