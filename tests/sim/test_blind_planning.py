"""Plans from what a trainer can know: the planner gets ids and lengths and what earlier steps reported, never
a sequence's sensitivity; it predicts each step's time under its belief, and is shown each step's outcome."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import sparsebalance.sim.run as sim_run
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import topk_kept_fraction
from sparsebalance.sim.engine import Engine, PlanArrays
from sparsebalance.sim.estimate import Belief, OnlineEstimator, Observation, make_estimator, observed_sensitivity
from sparsebalance.sim.plan import Assignment, Budget, Plan
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import build_planner, load_policy, make_planner, prepare
from sparsebalance.sim.workload import Workload, requests, truth_of

PAPER = ["+experiment=paper", "steps=3"]


def paper_cfg(*overrides: str):
    return OmegaConf.to_object(compose_config([*PAPER, *overrides]))


@pytest.mark.parametrize("policy", ["sparsebalance", "sparsebalance_topk", "verl_dst", "verl_topk"])
def test_step0_plans_do_not_change_when_the_drawn_sensitivities_change(policy, monkeypatch):
    """Same lengths, same config, other sensitivities: the same step-0 Plan. The oracle, which reads them,
    plans otherwise (so the comparison can tell)."""
    cfg = paper_cfg(f"policy={policy}", "steps=1")

    def first_plans(estimator: str) -> tuple[str, str]:
        out = []
        for scale in (1.0, 0.25):
            monkeypatch.setattr(Workload, "sensitivities", lambda self, lengths, rng, _s=scale, _f=draw: _f(
                self, lengths, rng) * _s)
            policy_cfg = OmegaConf.merge(load_policy(policy), {"estimator": estimator})
            out.append(simulate(cfg, OmegaConf.to_object(policy_cfg)).results.plans[0])
        return tuple(out)

    draw = Workload.sensitivities
    blind = first_plans("online")
    assert blind[0] == blind[1]
    oracle = first_plans("oracle")
    assert oracle[0] != oracle[1]


def test_observe_reaches_the_estimator_and_both_policies_every_step(monkeypatch):
    seen = {"estimator": [], "batching": [], "sparsity": []}
    plans = []
    build = sim_run.make_planner

    def spied(cfg, setup, policy=None, truth=None):
        planner = build(cfg, setup, policy, truth)
        for part in seen:
            obj = getattr(planner, part)
            original = getattr(obj, "observe", None)

            def observe(observation, _part=part, _original=original):
                seen[_part].append(observation)
                if _original is not None:
                    _original(observation)
            obj.observe = observe
        plan = planner.plan
        planner.plan = lambda batch, step: plans.append(plan(batch, step)) or plans[-1]
        return planner

    monkeypatch.setattr(sim_run, "make_planner", spied)
    out = simulate(paper_cfg("policy=sparsebalance", "baseline=null"))
    for part, observations in seen.items():
        assert [o.plan for o in observations] == plans, part
    kept = out.kept
    for observation, step_kept in zip(seen["estimator"], kept, strict=True):
        np.testing.assert_array_equal(observation.kept_fraction, step_kept)
        assert ((observation.coverage > 0) & (observation.coverage <= 1)).all()


@pytest.mark.parametrize("preset", ["+experiment=paper", "+experiment=paper_bubble_light"])
def test_the_prediction_is_the_engines_step_when_the_belief_is_the_truth(preset):
    """The planner's prediction runs the engine's pipeline and gradient reduction in closed form: with the
    oracle's belief (one sample, the truth) it is the step the engine then simulates."""
    cfg = OmegaConf.to_object(compose_config([preset, "policy=sparsebalance", "policy.estimator=oracle"]))
    setup = prepare(cfg)
    engine = Engine(setup.layout, setup.cost, setup.cluster)
    planner = make_planner(cfg, setup, truth=lambda step: truth_of(setup.workload.batch(step)))
    for step in range(2):
        batch = setup.workload.batch(step)
        plan = planner.plan(requests(batch), step)
        outcome = engine.step(plan, truth_of(batch))
        assert planner.predicted_ms == pytest.approx(outcome.record.step_ms, rel=1e-9)
        planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)


def test_top_k_steps_take_the_time_planned_before_they_run():
    """Top-k budgets fix the kept blocks from the lengths: the blind prediction is the realized step."""
    out = simulate(paper_cfg("policy=sparsebalance_topk", "baseline=null"))
    steps = out.results.steps_frame()
    np.testing.assert_allclose(steps["predicted_ms"], steps["step_ms"], rtol=1e-9)
    assert out.summary["prediction_error_pct"] == pytest.approx(0.0, abs=1e-7)


def test_observed_sensitivity_inverts_the_coverage_model():
    s = np.array([0.05, 0.3, 0.9])
    kept = np.array([0.2, 0.5, 0.7])
    np.testing.assert_allclose(observed_sensitivity(kept, kept ** s), s, rtol=1e-12)
    # dense, or every kept block holding all the mass: nothing learned
    assert np.isnan(observed_sensitivity([1.0, 0.5], [1.0, 1.0])).all()


def test_the_online_estimator_moves_from_the_prior_to_what_it_observed():
    prior_mean, prior_std = -1.0, 1.0
    estimator = OnlineEstimator(lambda lengths: (np.full(len(lengths), prior_mean), np.full(len(lengths), prior_std)))
    rng = np.random.default_rng(0)
    truth_mean, truth_std = 0.5, 0.2
    lengths = np.full(4000, 8192)  # enough that the prior, worth 4 observations, no longer shows
    s = 1 / (1 + np.exp(-(truth_mean + truth_std * rng.standard_normal(lengths.size))))
    kept = np.full(lengths.size, 0.3)
    plan = Plan.of(0, 1, 1, [Assignment(i, 8192, 0, 0) for i in range(lengths.size)])
    estimator.observe(Observation(plan, kept, kept ** s, 1.0))
    mean, std = estimator.moments(np.array([8192, 1 << 20]))
    assert mean[0] == pytest.approx(truth_mean, abs=0.02) and std[0] == pytest.approx(truth_std, abs=0.02)
    assert (mean[1], std[1]) == (prior_mean, prior_std)  # a length bucket never seen keeps the prior
    belief = estimator.belief([7, 8], [8192, 8192], step=3)
    assert belief.samples.shape[1] == 2 and np.median(belief.samples) == pytest.approx(0.62, abs=0.05)


def test_the_oracle_needs_the_truth_that_only_the_simulator_has():
    with pytest.raises(ConfigError, match="only the simulator has"):
        make_estimator("oracle", lambda lengths: (lengths, lengths), seed=0)


def test_a_run_that_plans_with_the_oracle_is_labelled_a_bound():
    """sim.run takes policy.estimator=oracle (the simulator has the truth), but its row and summary say so."""
    cfg = compose_config(["policy=sparsebalance", "steps=1", "baseline=null"])
    blind, oracle = (simulate(cfg, OmegaConf.merge(cfg.policy, {"estimator": estimator})).summary["policy"]
                     for estimator in ("online", "oracle"))
    assert (blind, oracle) == ("sparsebalance", "oracle: sparsebalance")


def test_a_plan_carries_no_sensitivity_and_top_k_budgets_survive_json():
    plan = Plan.of(3, 1, 1, (Assignment(1, 4096, 0, 0, Budget(top_k=32, p_floor=0.8)), Assignment(2, 512, 0, 0)))
    text = plan.to_json()
    assert "sensitivity" not in text and "top_k" in text
    assert Plan.from_json(text) == plan
    with pytest.raises(ValueError, match="top_k"):
        Budget(top_k=0)
    with pytest.raises(ValueError, match="p_floor"):
        Budget(p_floor=0.9)


def test_planner_from_plain_lengths_names_them_by_step():
    planner = build_planner("verl", ["model=tiny", "cost=roofline", "cluster.gpus_per_node=2"])
    plan = planner.plan([4096, 1024, 2048, 512], step=2)
    assert sorted(a.seq_id for a in plan.assignments) == [8, 9, 10, 11]
    assert isinstance(planner.belief, Belief)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40_000), st.integers(1, 400), st.sampled_from([16, 64, 128]))
def test_top_k_keeps_min_k_blocks_of_every_causal_row(length, k, block):
    nb = -(-length // block)
    rows = np.arange(1, nb + 1)
    assert topk_kept_fraction(length, k, block) == pytest.approx(np.minimum(k, rows).sum() / rows.sum(), rel=1e-12)


@pytest.mark.parametrize("backend", ["dense_best", "hybrid"])
def test_micro_batches_on_a_dense_backend_keep_every_block(backend):
    """Where the cost model runs a micro-batch's attention dense, the engine reports kept 1 and coverage 1
    (dense_best runs every micro-batch so); the others keep their budgets' blocks."""
    fixture = "tests/fixtures/profile_h200_backends.json"
    cfg = paper_cfg("policy=verl", f"cost.profile={fixture}", f"cost.attention_backend={backend}", "steps=2")
    setup = prepare(cfg)
    layout, cost = setup.layout, setup.cost
    batch = setup.workload.batch(0)
    plan = make_planner(cfg, setup).plan(requests(batch), 0)
    outcome = Engine(layout, cost, setup.cluster).step(plan, truth_of(batch))
    arrays = PlanArrays.from_plan(plan, truth_of(batch))
    group = arrays.dp_rank * layout.micro_batches + arrays.micro_batch
    dense = cost.micro_batch_costs(arrays.length, arrays.kept(cost), group, layout.dp * layout.micro_batches,
                                   layout).dense[group]
    assert dense.all() if backend == "dense_best" else dense.any() and not dense.all()
    np.testing.assert_array_equal(outcome.kept[dense], 1.0)
    np.testing.assert_array_equal(outcome.coverage[dense], 1.0)
    np.testing.assert_array_equal(outcome.kept[~dense], arrays.kept(cost)[~dense])
