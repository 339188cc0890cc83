"""The estimators start from a prior the user states (policy.prior), never from the workload's generator, and
every table names it."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from sparsebalance.sim.compare import check_overrides, policy_variant
from sparsebalance.sim.config import PriorConfig, compose_config
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.estimate import Observation, OnlineEstimator
from sparsebalance.sim.plan import Assignment, Plan
from sparsebalance.sim.prior import stated_prior
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import make_planner, prepare
from sparsebalance.sim.workload import requests

PROFILE = "tests/fixtures/sensitivity_profile.json"


def first_plan(*overrides: str) -> str:
    cfg = OmegaConf.to_object(compose_config(["+experiment=paper", "policy=sparsebalance_topk", "steps=1",
                                              *overrides]))
    setup = prepare(cfg)
    return make_planner(cfg, setup).plan(requests(setup.workload.batch(0)), 0).to_json()


def test_the_first_plan_follows_the_stated_prior_not_the_generator():
    """Other generator parameters (the data's truth) leave the step-0 plan as it was; another prior changes it."""
    plan = first_plan()
    assert first_plan("workload.sensitivity_a=6.0", "workload.sensitivity_b=1.5") == plan
    assert first_plan("policy.prior.mean=0.1", "policy.prior.spread=0.05") != plan


def test_a_stated_prior_gives_logit_moments_with_its_trend():
    prior = stated_prior(PriorConfig(mean=0.2, spread=0.08, trend=-0.5, pivot=4096))
    mean, std = prior.moments(np.array([4096, 8192, 2048]))
    np.testing.assert_allclose(mean, np.log(0.2 / 0.8) + np.array([0.0, -0.5, 0.5]))
    np.testing.assert_allclose(std, 0.08 / (0.2 * 0.8))
    assert prior.describe() == "stated s 0.2 +- 0.08, logit s -0.5 per doubling from 4096"


def test_a_profile_prior_is_named_by_its_file_and_task():
    prior = stated_prior(PriorConfig(profile=PROFILE, task="retrieval"))
    assert prior.describe() == f"profile {PROFILE} (retrieval)"


@pytest.mark.parametrize("prior, message", [
    ({"profile": PROFILE, "mean": 0.3}, "policy.prior.mean=0.3 with policy.prior.profile"),
    ({"task": "retrieval"}, "policy.prior.task='retrieval' needs policy.prior.profile"),
    ({"mean": 1.0}, r"policy.prior.mean=1.0 is out of range"),
    ({"spread": 0.0}, r"policy.prior.spread=0.0 is out of range"),
])
def test_a_bad_prior_is_one_line_naming_its_key(prior, message):
    with pytest.raises(ConfigError, match=message):
        stated_prior(PriorConfig(**prior))


def test_every_run_names_the_prior_it_planned_with():
    cfg = compose_config(["+experiment=paper", "steps=1", "policy=verl", "policy.prior.mean=0.3"])
    assert simulate(cfg).summary["prior"] == "stated s 0.3 +- 0.25"
    oracle = OmegaConf.merge(cfg.policy, {"estimator": "oracle"})
    assert simulate(cfg, oracle).summary["prior"] == "none: the data's truth (oracle)"


def test_compare_plans_every_row_from_the_command_lines_prior_unless_the_row_overrides_it():
    prior = {"mean": 0.2, "spread": 0.1, "trend": 0.0, "pivot": 4096, "profile": None, "task": None}
    assert policy_variant("verl_topk", prior=prior).prior.mean == 0.2
    assert policy_variant("verl_topk:prior.mean=0.7", prior=prior).prior.mean == 0.7


def test_the_online_estimator_moves_a_wrong_prior_at_lengths_it_has_not_seen():
    """Observations at one length shift the prior everywhere, by their mean residual (the prior worth 4)."""
    estimator = OnlineEstimator(stated_prior(PriorConfig(mean=0.5, spread=0.25)).moments)
    n, truth = 12, -1.0  # every observed logit s
    plan = Plan.of(0, 1, 1, [Assignment(i, 2048, 0, 0) for i in range(n)])
    kept = np.full(n, 0.3)
    estimator.observe(Observation(plan, kept, kept ** (1 / (1 + np.exp(-truth))), 1.0))
    mean, _ = estimator.moments(np.array([1 << 16]))
    assert mean[0] == pytest.approx(truth * n / (n + estimator.prior_weight))


def test_a_coverage_promise_reports_what_it_still_owes():
    """Balanced DST promises its start's coverage and says what it still owes after the last step (0 where it
    kept it); a policy that promises none says null. sim.compare accepts policy.prior.* and nothing else of
    policy."""
    small = ["+experiment=paper", "steps=2", "policy.prior.mean=0.1", "policy.prior.spread=0.05"]
    owed = simulate(compose_config([*small, "policy=sparsebalance_topk"])).summary["coverage_owed"]
    assert isinstance(owed, float) and owed >= 0.0
    assert simulate(compose_config([*small, "policy=verl"])).summary["coverage_owed"] is None
    check_overrides(["policy.prior.mean=0.3"])
    with pytest.raises(ConfigError, match="^policy.name=verl: sim.compare does not read policy"):
        check_overrides(["policy.name=verl"])
