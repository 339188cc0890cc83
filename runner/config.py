"""The runner's structured config: ``sim.config.RunConfig`` (the same groups as ``sim.run``) plus a
``runner`` node for what only real training has. ``conf/runner.yaml`` extends the stored schema.

The runner's own numeric keys carry their ranges like the shared groups' (``sim.config.bounded``), so
that ``sim.config.validate`` on the composed config checks them too; the checks between the task and the
model or workload are ``TrainConfig.check``'s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

from runner.data import TaskConfig
from sim.config import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bound, RunConfig, bounded
from sim.core import ConfigError

# Process-group and collective timeouts become timedeltas and C++ milliseconds: a week is far beyond any
# step, and far below where those overflow.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class TaskSettings:
    """Key-value retrieval task (runner/data.py)."""

    n_keys: int = bounded(64, AT_LEAST_ONE)
    n_values: int = bounded(64, AT_LEAST_ONE)
    max_pairs: int = bounded(8, AT_LEAST_ONE)
    n_queries: int = bounded(2, AT_LEAST_ONE)  # at least one scored answer per sequence

    def check(self, prefix: str) -> None:
        if self.max_pairs > self.n_keys:
            raise ConfigError(
                f"{prefix}max_pairs={self.max_pairs} exceeds {prefix}n_keys={self.n_keys}; allowed: "
                "max_pairs <= n_keys (the records of a sequence have distinct keys)"
            )


@dataclass
class RunnerSettings:
    device: str = "auto"  # auto: cuda when available, else cpu
    attention: str = "kernel"  # runner.attention.BACKENDS
    data_parallel: str = "ddp"  # runner.parallel.DATA_PARALLEL: ddp (DistributedDataParallel) | fsdp (FSDP2 fully_shard)
    lr: float = bounded(1e-3, POSITIVE)
    weight_decay: float = bounded(0.0, NON_NEGATIVE)
    # dist init, every collective and transfer, and the barrier that names missing ranks after a failure
    timeout_s: float = bounded(300.0, Bound(0, MAX_TIMEOUT_S, lo_open=True))
    checkpoint_every: int = bounded(0, NON_NEGATIVE)  # steps between checkpoints (and one at the end); 0: none
    resume: Optional[str] = None  # a checkpoint.pt to continue from
    task: TaskSettings = field(default_factory=TaskSettings)


@dataclass
class TrainConfig(RunConfig):
    runner: RunnerSettings = field(default_factory=RunnerSettings)

    def check(self, prefix: str) -> None:
        super().check(prefix)
        task = TaskConfig(**vars(self.runner.task))
        if self.model.vocab < task.min_vocab():
            raise ConfigError(
                f"{prefix}model.vocab={self.model.vocab} is too small for the retrieval task; allowed: "
                f">= {task.min_vocab()} (specials, runner.task.n_keys, n_values and one filler token)"
            )
        shortest = task.min_length(1.0)
        if self.workload.min_len < shortest:
            raise ConfigError(
                f"{prefix}workload.min_len={self.workload.min_len} is too short for the retrieval task; allowed: "
                f">= {shortest} tokens (runner.task.max_pairs records and their queries)"
            )


def register() -> None:
    ConfigStore.instance().store(name="runner_schema", node=TrainConfig)
