"""conf/runner.yaml extends conf/config.yaml: one override list means the same to sim.run and the runner, except
for what the runner states itself (its schema, no baseline, no recompute, its run dir, sweeps one job at a time).
In-process composition only: the torchrun suite (test_runner.py) checks the trained run's Plans."""
from __future__ import annotations

from dataclasses import fields

import pytest
import yaml
from hydra import compose as hydra_compose, initialize_config_dir
from omegaconf import OmegaConf

from pinned import pinned
from sparsebalance.runner.config import RunnerSettings, TrainConfig
from sparsebalance.runner.dist import World
from sparsebalance.runner.train import build_planner, compose
from sparsebalance.sim.config import RunConfig, compose_config, register
from sparsebalance.sim.core import CONF_DIR, ConfigError
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.run import simulate

# What runner.yaml states differently from config.yaml, as sim.run overrides.
RUNNER_DIFFERENCES = ["baseline=null", "memory.activation_checkpointing=false"]
CASES = {
    "default": [],
    "paper": ["+experiment=paper", "seed=3", "policy=kk"],
    "bimodal": ["workload=bimodal", "model=llama3-8b", "layout.pp=2", "steps=4"],
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_the_runner_config_is_the_simulators_plus_the_runner_node(overrides):
    train = OmegaConf.to_object(compose(overrides))
    run = OmegaConf.to_object(compose_config([*overrides, *RUNNER_DIFFERENCES]))
    assert type(train) is TrainConfig and type(run) is RunConfig
    assert {f.name: getattr(train, f.name) for f in fields(RunConfig)} == vars(run)
    assert train.runner == RunnerSettings()


def leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_runner_yaml_sets_only_what_differs_from_config_yaml():
    own = yaml.safe_load((CONF_DIR / "runner.yaml").read_text())
    own.pop("defaults")
    own.pop("hydra")
    run = compose_config()
    assert dict(leaves(own)) == {"baseline": None, "memory.activation_checkpointing": False}
    assert all(OmegaConf.select(run, key) != value for key, value in leaves(own))


def hydra_node(config_name: str, overrides=()):
    register()  # the run schema; importing runner.train stored the runner's
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True).hydra


def test_the_runner_keeps_its_run_dir_and_runs_sweep_jobs_in_turn():
    """Every rank of a torchrun job runs the whole sweep, each job on the one process group: never in parallel."""
    node = hydra_node("runner")
    assert node.launcher._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    assert OmegaConf.to_container(node.run)["dir"] == "outputs/runner/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    assert node.job.chdir is False
    assert node.runtime.choices.schema == "train" and hydra_node("config").runtime.choices.schema == "run"


def test_plot_is_refused_in_one_line():
    """config.yaml's figures callback would draw on every rank; only rank 0's run dir holds the Results."""
    with pytest.raises(ConfigError) as exc:
        compose(["plot=true"])
    assert str(exc.value) == ("plot=true is sim.run's; allowed for runner.train: false "
                              "(python -m viz <run dir> draws a finished run's figures)")


def test_the_runners_planner_plans_what_sim_run_simulates():
    """Shown what sim.run's planner is shown of each step (the engine's kept fractions, coverages and step time,
    where a runner shows the kernel's), the runner's planner makes sim.run's Plans."""
    overrides = pinned(["+experiment=paper", "policy=sparsebalance", "steps=3"])
    planner, cluster = build_planner(compose(overrides), World(rank=0, size=8, local_rank=0))
    engine = Engine(planner.layout, planner.cost, cluster)
    plans = simulate(compose_config([*overrides, *RUNNER_DIFFERENCES])).results.plans
    planned = []
    for step in range(3):
        plan, truth = planner.plan(step)
        outcome = engine.step(plan, truth)
        planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)
        planned.append(plan.to_json())
    assert planned == plans
