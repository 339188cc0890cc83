"""A run's parts built from its config: the cluster, layout, cost and memory models, the workload, and the
planner (policies plus estimator) that the simulator and the runner plan through."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import PolicyConfig, RunConfig, compose_config, policy_cost, policy_layout, validate
from sparsebalance.sim.core import CONF_DIR, ConfigError, group_options
from sparsebalance.sim.cost import CostModel, make_cost
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.estimate import make_estimator
from sparsebalance.sim.memory import MemoryModel
from sparsebalance.sim.planner import Planner
from sparsebalance.sim.policy import make_batching, make_sparsity
from sparsebalance.sim.workload import Workload


def load_policy(name: str) -> PolicyConfig:
    """A policy config by name, outside Hydra's composition (the baseline of a run)."""
    path = CONF_DIR / "policy" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"baseline={name!r} is not a policy; allowed: {', '.join(group_options('policy'))}")
    return OmegaConf.merge(OmegaConf.structured(PolicyConfig), OmegaConf.load(path))


@dataclass
class Setup:
    """What a run is built from, once its config has passed every check."""

    cluster: Cluster
    layout: Layout
    cost: CostModel
    workload: Workload
    memory: MemoryModel


def prepare(cfg: RunConfig) -> Setup:
    """Validate a run config (ranges, layout, sizes, trace, profiles) and build its parts."""
    validate(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    check_profile_gpu(cfg, cost)
    memory = MemoryModel.from_config(cfg, layout, cost.block_size)
    return Setup(cluster, layout, cost, Workload(cfg.workload, cfg.model.max_context, cfg.seed), memory)


def policy_run(cfg: RunConfig, policy: PolicyConfig | DictConfig | None = None) -> RunConfig:
    """The run as ``policy`` (default ``cfg.policy``) trains it: the one place a policy reaches a run (sim.run,
    sim.compare, build_planner, runner.train, runner.replay, runner.compare). It is ``cfg.policy``, and the cost
    prices attention on its backend where it names one (verl_dense: dense_best); its batching, sparsity and
    estimator are built from it by :func:`make_planner`."""
    policy = cfg.policy if policy is None else policy
    policy = OmegaConf.to_object(policy) if isinstance(policy, DictConfig) else policy
    layout = policy_layout(cfg.layout, cfg.cluster.nodes * cfg.cluster.gpus_per_node, policy)
    return replace(cfg, policy=policy, cost=policy_cost(cfg.cost, policy), layout=layout)


def policy_setup(cfg: RunConfig, policy: PolicyConfig | DictConfig | None = None) -> tuple[RunConfig, Setup]:
    """:func:`policy_run` and its prepared parts."""
    run = policy_run(cfg, policy)
    return run, prepare(run)


def check_profile_gpu(cfg: RunConfig, cost: CostModel) -> None:
    """A calibrated cost's profile must be measured on the cluster's GPU (where the cluster names one)."""
    measured = getattr(cost, "profile", {}).get("gpu")
    if cfg.cluster.gpu is not None and measured is not None and measured != cfg.cluster.gpu:
        raise ConfigError(f"cost.profile={cfg.cost.profile!r} was measured on {measured}, but "
                          f"cluster={cfg.cluster.name} is {cfg.cluster.gpu}; allowed: a profile of {cfg.cluster.gpu} "
                          f"(the cluster's own: {cfg.cluster.profile})")


def make_policy(policy: PolicyConfig):
    return (make_batching(policy.batching.name, policy.batching.params),
            make_sparsity(policy.sparsity.name, policy.sparsity.params))


def make_planner(cfg: RunConfig, setup: Setup, policy: PolicyConfig | None = None,
                 truth: Callable[[int], dict[int, float]] | None = None) -> Planner:
    """The planner of ``policy`` (default ``cfg.policy``) on a prepared run. ``truth`` (step -> {id: s}) is
    what only the simulator can hand over, for the ``oracle`` estimator's bound rows."""
    policy = cfg.policy if policy is None else policy
    mode = policy_cost(cfg.cost, policy).attention_backend
    mode = str(getattr(mode, "value", mode))
    if setup.cost.attention_backend != mode:
        raise ConfigError(f"policy {policy.name!r} trains on attention backend {mode}, but the setup's cost model "
                          f"prices {setup.cost.attention_backend}; allowed: the parts of sim.setup.policy_setup(cfg, "
                          "policy)")
    batching, sparsity = make_policy(policy)
    estimator = make_estimator(str(getattr(policy.estimator, "value", policy.estimator)),
                               setup.workload.population, cfg.seed, truth)
    engine = Engine(setup.layout, setup.cost, setup.cluster)
    return Planner(batching, sparsity, estimator, setup.layout, setup.cost, setup.memory, engine)


def build_planner(policy: str = "sparsebalance", overrides: Sequence[str] = ()) -> Planner:
    """A planner for another trainer's loop, from this project's configs by name: ``policy`` one of conf/policy/,
    ``overrides`` as on sim.run's command line (``+experiment=paper``, ``layout.dp=4``, ``model=tiny``). The
    caller needs no Hydra: it gets a ``sim.planner.Planner`` (plan / observe)."""
    return make_planner(*policy_setup(OmegaConf.to_object(compose_config([f"policy={policy}", *overrides]))))
