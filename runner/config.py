"""The runner's structured config: ``sim.config.RunConfig`` (the same groups as ``sim.run``) plus a
``runner`` node for what only real training has. ``conf/runner.yaml`` extends the stored schema.

The runner's own numeric keys carry their ranges like the shared groups' (``sim.config.bounded``), so
that ``sim.config.validate`` on the composed config checks them too; the checks between the task and the
model or workload are ``TrainConfig.check``'s. The task's node is ``runner.task.TaskConfig``, the record
data generation reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from hydra.core.config_store import ConfigStore

from sparsebalance.runner.task import TaskConfig
from sparsebalance.sim.config import FRACTION, NON_NEGATIVE, POSITIVE, Bound, RunConfig, bounded
from sparsebalance.sim.core import ConfigError

# Process-group and collective timeouts become timedeltas and C++ milliseconds: a week is far beyond any
# step, and far below where those overflow.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class LRSchedule(str, Enum):
    """What follows the warmup (runner.loop.lr_factor): the peak LR to the end, or a cosine to the floor."""

    constant = "constant"
    cosine = "cosine"


@dataclass
class RunnerSettings:
    device: str = "auto"  # auto: cuda when available, else cpu
    attention: str = "kernel"  # runner.attention.BACKENDS
    # runner.parallel.DATA_PARALLEL: ddp (DistributedDataParallel) | fsdp (FSDP2 fully_shard)
    data_parallel: str = "ddp"
    lr: float = bounded(1e-3, POSITIVE)
    weight_decay: float = bounded(0.0, NON_NEGATIVE)
    lr_schedule: LRSchedule = LRSchedule.constant
    warmup_steps: int = bounded(0, NON_NEGATIVE)  # linear from lr / warmup_steps to lr; 0: lr from the start
    min_lr_ratio: float = bounded(0.0, FRACTION)  # cosine: the share of lr it decays to by the run's end
    # dist init, every collective and transfer, and the barrier that names missing ranks after a failure
    timeout_s: float = bounded(300.0, Bound(0, MAX_TIMEOUT_S, lo_open=True))
    checkpoint_every: int = bounded(0, NON_NEGATIVE)  # steps between checkpoints (and one at the end); 0: none
    resume: Optional[str] = None  # a checkpoint.pt to continue from
    # Train every replica's micro-batches of the layout's Plans in this one process (world size 1, the whole
    # model): the gradient the dp x cp x pp run computes, so that a layout's budgets can be trained on one
    # device for accuracy studies. Its times are sequential, not a distributed step's.
    one_process: bool = False
    task: TaskConfig = field(default_factory=TaskConfig)


@dataclass
class TrainConfig(RunConfig):
    runner: RunnerSettings = field(default_factory=RunnerSettings)

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if self.overwrite:
            raise ConfigError(f"{prefix}overwrite=true is sim.run's; runner.train does not replace a run's results; "
                              "allowed: a new hydra.run.dir, or runner.resume=<checkpoint> to continue a run")
        self.runner.task.check_fits(self.model.vocab, self.workload.min_len, prefix)


def register() -> None:
    ConfigStore.instance().store(name="runner_schema", node=TrainConfig)
