"""``torchrun --nproc_per_node=N -m runner.train policy=<name> ...``: real dp x cp x pp training under a Plan.

Every rank builds the same Plan for every global batch with the same objects ``sim.run`` uses (workload,
layout, cost model, policy registries), packs its replica's micro-batches from it, trains its pipeline
stage (1F1B; DDP or FSDP over the stage's dp x cp replicas; under CP its zigzag shards of every sequence,
runner/cp.py; AdamW, bf16 on the GPU), and measures what the
simulator predicts: per micro-batch compute time, waits on neighbouring stages and on the slowest replica,
the gradient reduction that outlasts the compute, tokens, and the kernel's kept fraction and coverage;
plus loss and retrieval accuracy. Rank 0 writes the simulator's Results files into the Hydra run dir.

Bad input (world size vs layout, unknown policy or data parallelism, a workload that does not fit the
model's context or the task, sequences too short for the CP chunks, a runner key out of range, a
checkpoint this run cannot continue, a sequence that the device's memory cannot hold (runner/capacity.py),
a run dir that cannot be written) is one ``error:`` line and exit code 2 before Hydra makes a run dir or any
process group exists; a rank that dies or hangs ends the job with a ``RankFailure`` line and exit code 1 within
``runner.timeout_s``.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.runner.dense import load_peers
from sparsebalance.runner.capacity import check_fits, device_capacity
from sparsebalance.runner.config import register
from sparsebalance.runner.device import check_attention, device_type
from sparsebalance.runner.dist import Comm, RankFailure, World, check_world
from sparsebalance.runner.loop import Trainer, check_resume
from sparsebalance.runner.parallel import DATA_PARALLEL
from sparsebalance.sim.choice import planned_backends
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import (CONF_DIR, EXIT_INTERRUPTED, ConfigError, check_group_overrides, fail, hydra_reason,
                                    interrupted, preset_overrides)
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.outputs import Outputs, discard_outputs, pin_output_dir
from sparsebalance.sim.results import FILES
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.planner import Planner
from sparsebalance.sim.run import (check_output_dir, command_overrides, fixed_overrides, is_sweep, summary_table,
                                   sweep_jobs)
from sparsebalance.sim.setup import make_planner, policy_setup
from sparsebalance.sim.workload import Workload, requests, truth_of

EXIT_RANK_FAILURE = 1
RUN_FILES = (*FILES, "train.csv", "sequences.csv")  # what a run writes beside Hydra's files


@dataclass(frozen=True)
class StepPlanner:
    """Global batch -> Plan, exactly as ``sim.run.simulate`` does it: the data generator knows each sequence's
    sensitivity (it builds the sequence from it), the planner gets ids and lengths and what earlier steps
    reported (``observe``)."""

    workload: Workload
    planner: Planner
    # the peer attention backends (dense or sparse) the run's micro-batches may run on, loaded
    # (runner.dense.load_peers)
    peers: dict = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return self.planner.layout

    @property
    def cost(self):
        return self.planner.cost

    @property
    def predicted_ms(self) -> float:
        """The step time the planner expected of its last Plan."""
        return self.planner.predicted_ms

    def plan(self, step: int) -> tuple[Plan, dict[int, float]]:
        """The step's Plan and the data's truth, which only the data generator and the kernel use."""
        batch = self.workload.batch(step)
        return self.planner.plan(requests(batch), step), truth_of(batch)

    def backends(self, plan: Plan) -> np.ndarray:
        """``[dp, m]``: which backend runs each micro-batch's attention (``cost.attention_backend``: the cost
        model's choice at the kept fractions the planner expects of the Plan, which it made last)."""
        return planned_backends(plan, self.cost, self.layout, self.planner.belief)

    def observe(self, plan: Plan, kept_fraction, coverage, step_ms: float, micro_batch_ms=None) -> None:
        self.planner.observe(plan, kept_fraction, coverage, step_ms, micro_batch_ms)


def build_planner(cfg: DictConfig, world: World) -> tuple[StepPlanner, Cluster]:
    """Everything that can reject the config, before any process group or model exists: every key's
    range and the checks across groups (``sim.run.prepare``, which also checks the runner's keys and
    the task, see runner/config.py), the world size, the attention backend and device."""
    # priced as sim.run prices it: under the policy's attention backend where it names one (verl_dense: dense_best)
    run, setup = policy_setup(OmegaConf.to_object(cfg))
    layout = setup.layout
    if cfg.runner.one_process:
        if world.size != 1:
            raise ConfigError(f"runner.one_process=true trains the layout's every replica in one process, but the "
                              f"world size is {world.size}; allowed: 1 (python -m runner.train, or torchrun "
                              "--nproc_per_node=1)")
    elif layout.tp > 1:
        raise ConfigError(f"layout.tp={layout.tp}: runner.train runs no tensor parallelism; allowed: layout.tp=1 (the "
                          "simulator prices tp > 1, and runner.tensor_parallel splits a model's layers over a TP mesh)")
    else:
        try:
            check_world(world, layout.dp, layout.cp, layout.pp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_context_parallel(layout.cp, cfg)
    check_attention(cfg.runner.attention, device_type(cfg.runner.device))
    if cfg.runner.data_parallel not in DATA_PARALLEL:
        raise ConfigError(f"runner.data_parallel={cfg.runner.data_parallel!r} is unknown; allowed: "
                          f"{', '.join(DATA_PARALLEL)}")
    # no truth: the runner has none to give, so the oracle estimator is refused here
    planner = make_planner(run, setup)
    # the policy's attention_backend (verl_dense: dense_best) where it sets one, else cost.attention_backend
    key = "cost.attention_backend" if cfg.policy.get("attention_backend") is None else "policy.attention_backend"
    peers = load_peers(planner.cost, key, process_layout(cfg, layout).cp)
    return StepPlanner(setup.workload, planner, peers), setup.cluster


def process_layout(cfg: DictConfig, layout: Layout) -> Layout:
    """The processes' layout: the Plans' own, or under ``runner.one_process`` one process with the whole model."""
    return Layout(dp=1, micro_batches=layout.micro_batches) if cfg.runner.one_process else layout


def check_context_parallel(cp: int, cfg: DictConfig) -> None:
    """What CP needs (runner/cp.py): a zigzag chunk of at least one token."""
    if cp == 1:
        return
    if cfg.workload.min_len < 2 * cp:
        raise ConfigError(f"workload.min_len={cfg.workload.min_len} is shorter than 2 x layout.cp = {2 * cp} "
                          f"tokens; allowed: >= {2 * cp} (every sequence is cut into 2 x cp zigzag chunks)")


def pick_device(name: str, world: World) -> torch.device:
    if device_type(name) == "cuda":
        torch.cuda.set_device(world.local_rank)  # kernels launch on the current device
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def compose(overrides: list[str]) -> DictConfig:
    """The config ``main`` will get, composed here so that Hydra's multi-line reports become one line."""
    try:
        cfg = compose_config(overrides, config_name="runner")
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(hydra_reason(exc)) from None
    if cfg.plot:
        # runner.yaml extends config.yaml, whose figures callback would draw on every rank, each from its own
        # Hydra run dir (${now:...} resolves per rank); only rank 0 writes the Results.
        raise ConfigError("plot=true is sim.run's; allowed for runner.train: false "
                          "(python -m viz <run dir> draws a finished run's figures)")
    return cfg


def check_inputs(argv: list[str], world: World) -> None:
    """Every check of the run, the checkpoint's too, before Hydra makes a run dir or any process group
    exists, so that bad input leaves nothing behind; for a sweep (``-m``), of every job before any runs."""
    check_group_overrides(argv)
    overrides = [a for a in argv if "=" in a and not a.startswith(("-", "hydra."))]
    sweep = any(arg in ("-m", "--multirun") for arg in argv)
    jobs = sweep_jobs(overrides) if sweep else [overrides]
    for job in jobs:
        cfg = compose(job)
        planner, _ = build_planner(cfg, world)
        if cfg.runner.resume:
            check_resume(cfg, planner, world.size)
        kind = device_type(cfg.runner.device)
        check_fits(cfg, planner.workload, planner.layout, planner.cost.block_size,
                   device_capacity(kind, world.local_rank, world.local_size), kind)
    hydra_args = [a for a in argv if "=" in a and a.lstrip("+").startswith(("hydra.", "hydra/"))]
    check_output_dir([*jobs[0], *hydra_args], "sweep" if sweep else "run", config_name="runner")


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
    comm = Comm(world, device, cfg.runner.timeout_s, process_layout(cfg, planner.layout))
    try:
        run_dir = Path(comm.broadcast(HydraConfig.get().runtime.output_dir))
        try:
            # A checkpoint that changed since check_inputs read it, or a batch no Plan fits (the planner).
            summary = Trainer(cfg, planner, cluster, comm, device, run_dir).train()
        except ConfigError as exc:
            fail(str(exc))
        comm.close()
        if summary is not None:
            report(summary, run_dir)
    except RankFailure as exc:
        # No orderly shutdown: the process group may wait on the rank that failed.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_RANK_FAILURE)


def report(summary: dict, run_dir: Path) -> None:
    """The closing lines on stdout, as sim.run prints them: the run's summary table (its loss and accuracy over
    the last quarter of the steps), then where its files are."""
    table = summary_table([summary], None).assign(loss=round(summary["final_loss"], 4),
                                                   accuracy=round(summary["final_accuracy"], 4))
    print(table.astype(object).where(table.notna(), "-").to_string(index=False))
    files = sorted(p.name for p in run_dir.iterdir() if p.is_file())
    print(f"results: {run_dir}  ({', '.join(files)})", flush=True)


def cli() -> None:
    """Check the run, then train; Ctrl-C reaches every rank: each removes its run directory if it never got
    results, and rank 0 ends with one line, exit code 130."""
    argv, world = preset_overrides(sys.argv[1:]), World.from_env()  # experiment=<name> or +experiment=<name>
    if "--help" in argv or "-h" in argv:  # Hydra's help, before the checks that need a launched world
        sys.argv[1:] = argv
        return main()
    try:
        check_inputs(argv, world)
        argv, outputs = pin_output_dir(argv, fixed_overrides(command_overrides(argv)), is_sweep(argv), "runner")
    except (ConfigError, OmegaConfBaseException) as exc:
        fail(str(exc).splitlines()[0])
    sys.argv[1:] = argv
    try:
        main()
    except KeyboardInterrupt:
        detail = discard_outputs(outputs, "train", RUN_FILES) + kept_steps(outputs)
        if world.rank == 0:
            interrupted(detail)
        sys.exit(EXIT_INTERRUPTED)


def kept_steps(outputs: Outputs) -> str:
    """What an interrupted run keeps: the steps written so far (summary.json's ``steps`` of ``steps_planned``)."""
    summary = outputs.path / "summary.json"
    if outputs.sweep or not summary.is_file():
        return ""
    written = json.loads(summary.read_text())
    return f"; {outputs.path} keeps the results of {written['steps']} of {written['steps_planned']} steps"


if __name__ == "__main__":
    cli()
