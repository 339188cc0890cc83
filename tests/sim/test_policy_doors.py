"""One place applies a policy to a run (sim.setup.policy_run): every registered policy, built through each door
(sim.run and sim.compare's ``simulate``, ``sim.setup.build_planner``, the replay's ``make_planner(*policy_setup)``,
runner.train's ``build_planner``, runner.compare's cost), plans the same first step and predicts the same time;
a setup priced on another attention backend than the policy's is refused in one line."""
import numpy as np
import pytest
from omegaconf import OmegaConf
from pinned import BACKENDS_PROFILE
from sparsebalance.runner import train
from sparsebalance.runner.dist import World
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ConfigError, group_options
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import (
    build_planner,
    load_policy,
    make_planner,
    policy_run,
    policy_setup,
    prepare,
)
from sparsebalance.sim.workload import requests

SMALL = [f"cost.profile={BACKENDS_PROFILE}", "cluster.nodes=1", "workload.global_batch=32", "layout.micro_batches=2",
         "steps=1", "baseline=null"]
POLICIES = group_options("policy")


def first_step(planner, cfg):
    """The planner's plan of step 0 of the run's workload, and the time it predicts."""
    plan = planner.plan(requests(prepare(cfg).workload.batch(0)), 0)
    return plan, planner.predicted_ms


@pytest.fixture(scope="module")
def simulated():
    """Per policy, what sim.run (and sim.compare, which runs simulate per policy) planned and predicted."""
    out = {}
    base = OmegaConf.to_object(compose_config(SMALL))
    for name in POLICIES:
        run = simulate(base, load_policy(name))
        out[name] = Plan.from_json(run.results.plans[0]), run.results.steps_frame()["predicted_ms"].iloc[0]
    return out


@pytest.mark.parametrize("name", POLICIES)
def test_every_door_plans_and_predicts_a_policy_alike(name, simulated):
    plan, predicted = simulated[name]
    cfg = OmegaConf.to_object(compose_config([*SMALL, f"policy={name}"]))
    doors = {
        "build_planner": first_step(build_planner(name, SMALL), cfg),
        "policy_setup": first_step(make_planner(*policy_setup(cfg)), cfg),
    }
    for door, (door_plan, door_ms) in doors.items():
        assert door_plan == plan, door
        assert np.isclose(door_ms, predicted, rtol=0, atol=0), (door, door_ms, predicted)


@pytest.mark.parametrize("name", [n for n in POLICIES if load_policy(n).attention_backend is None
                                  and load_policy(n).cp_mode is None])
def test_the_runner_plans_a_policy_as_the_simulator_does(name):
    """runner.train's door on the CPU (the dense backends a policy may name need a GPU, refused there; dynamic-CP
    policies are not run by runner.train), against sim.run's on the same (runner) config."""
    cfg = train.compose([*SMALL, f"policy={name}"])
    planner, _ = train.build_planner(cfg, World(rank=0, size=8, local_rank=0))
    run = simulate(cfg)
    assert planner.planner.plan(requests(planner.workload.batch(0)), 0) == Plan.from_json(run.results.plans[0])
    assert planner.planner.predicted_ms == run.results.steps_frame()["predicted_ms"].iloc[0]


def test_verl_dense_is_priced_on_its_dense_backend_through_every_door():
    cfg = OmegaConf.to_object(compose_config([*SMALL, "policy=verl_dense"]))
    assert build_planner("verl_dense", SMALL).cost.attention_backend == "dense_best"
    assert policy_run(cfg).cost.attention_backend.value == "dense_best"  # runner.compare's
    assert policy_setup(cfg)[1].cost.attention_backend == "dense_best"  # runner.replay's and runner.train's


def test_a_setup_on_another_backend_than_the_policys_is_refused():
    cfg = OmegaConf.to_object(compose_config([*SMALL, "policy=verl_dense"]))
    with pytest.raises(ConfigError, match="trains on attention backend dense_best, but the setup's cost model "
                                          "prices ours"):
        make_planner(cfg, prepare(cfg))
