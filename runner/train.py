"""``torchrun --nproc_per_node=N -m runner.train policy=<name> ...``: real data-parallel training under a Plan.

Every rank builds the same Plan for every global batch with the same objects ``sim.run`` uses (workload,
layout, cost model, policy registries), packs its own micro-batches from it, trains (AdamW; bf16 on the
GPU), and measures what the simulator predicts: per micro-batch compute time, the wait at the barrier
before the gradient all-reduce, the all-reduce itself, tokens, and the kernel's kept fraction and coverage;
plus loss and retrieval accuracy. Rank 0 writes the simulator's Results files into the Hydra run dir.

Bad input (world size vs layout, unknown policy, a workload that does not fit the model's context or
the task) is one ``error:`` line and exit code 2 before any process group exists; a rank that dies or
hangs ends the job with a ``RankFailure`` line and exit code 1 within ``runner.timeout_s``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import policies  # noqa: F401  (registers every policy)
from policies.base import make_batching, make_sparsity, plan_step
from runner.attention import BACKENDS
from runner.config import register
from runner.data import TaskConfig
from runner.dist import Comm, RankFailure, World, check_world
from runner.loop import Trainer
from sim.cluster import Cluster, Layout
from sim.config import ConfigError
from sim.cost import make_cost
from sim.run import CONF_DIR, check_group_overrides, fail
from sim.workload import Workload

EXIT_RANK_FAILURE = 1


@dataclass(frozen=True)
class Planner:
    """Global batch -> Plan, exactly as ``sim.run.simulate`` does it."""

    workload: Workload
    batching: object
    sparsity: object
    layout: Layout
    cost: object

    def plan(self, step: int):
        return plan_step(self.batching, self.sparsity, self.workload.batch(step), self.layout, self.cost, step)


def build_planner(cfg: DictConfig, world: World) -> tuple[Planner, Cluster]:
    """Everything that can reject the config, before any process group or model exists."""
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps} must be >= 1")
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    try:
        check_world(world, layout.dp, layout.cp, layout.pp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cost = make_cost(cfg.cost, cfg.model, cluster)
    workload = Workload(cfg.workload, cfg.model.max_context, cfg.seed)
    check_task(cfg)
    if cfg.runner.attention not in BACKENDS:
        raise ConfigError(f"runner.attention={cfg.runner.attention!r} is unknown; allowed: {', '.join(BACKENDS)}")
    batching = make_batching(cfg.policy.batching.name, cfg.policy.batching.params)
    sparsity = make_sparsity(cfg.policy.sparsity.name, cfg.policy.sparsity.params)
    return Planner(workload, batching, sparsity, layout, cost), cluster


def check_task(cfg: DictConfig) -> None:
    task = TaskConfig(**cfg.runner.task)
    if cfg.model.vocab < task.min_vocab():
        raise ConfigError(f"model.vocab={cfg.model.vocab} is too small for the retrieval task (needs {task.min_vocab()})")
    shortest = task.min_length(1.0)
    if cfg.workload.min_len < shortest:
        raise ConfigError(
            f"workload.min_len={cfg.workload.min_len} is too short for the retrieval task (needs {shortest} tokens)"
        )


def pick_device(name: str, world: World) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("runner.device=cuda but no CUDA device is visible")
        torch.cuda.set_device(world.local_rank)  # kernels launch on the current device
        return torch.device("cuda", world.local_rank)
    if name != "cpu":
        raise ConfigError(f"runner.device={name!r} is unknown; allowed: auto, cuda, cpu")
    return torch.device("cpu")


register()


# An absolute path: Hydra then reads files whether this module runs as __main__ or is imported by a wrapper.
@hydra.main(config_path=str(CONF_DIR), config_name="runner", version_base="1.3")
def main(cfg: DictConfig) -> None:
    world = World.from_env()
    try:
        planner, cluster = build_planner(cfg, world)
        device = pick_device(cfg.runner.device, world)
    except (ConfigError, OmegaConfBaseException) as exc:
        fail(str(exc).splitlines()[0])
    if device.type == "cpu":
        # Ranks share the host's cores; one thread each keeps them from oversubscribing it.
        torch.set_num_threads(1)
    comm = Comm(world, device, cfg.runner.timeout_s)
    try:
        run_dir = Path(comm.broadcast(HydraConfig.get().runtime.output_dir))
        try:
            trainer = Trainer(cfg, planner, cluster, comm, device, run_dir)
        except ConfigError as exc:  # a checkpoint this run cannot continue
            fail(str(exc))
        trainer.train()
        comm.close()
    except RankFailure as exc:
        # No orderly shutdown: the process group may wait on the rank that failed.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_RANK_FAILURE)


def cli() -> None:
    try:
        check_group_overrides(sys.argv[1:])
    except ConfigError as exc:
        fail(str(exc))
    main()


if __name__ == "__main__":
    cli()
