"""The runner's structured config: ``sim.config.RunConfig`` (the same groups as ``sim.run``) plus a
``runner`` node for what only real training has. ``conf/runner.yaml`` extends the stored schema."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

from sim.config import RunConfig


@dataclass
class TaskSettings:
    """Key-value retrieval task (runner/data.py)."""

    n_keys: int = 64
    n_values: int = 64
    max_pairs: int = 8
    n_queries: int = 2


@dataclass
class RunnerSettings:
    device: str = "auto"  # auto: cuda when available, else cpu
    attention: str = "kernel"  # runner.attention.BACKENDS
    lr: float = 1e-3
    weight_decay: float = 0.0
    timeout_s: float = 300.0  # dist init, every collective, and the monitored step barrier
    checkpoint_every: int = 0  # steps between checkpoints (and one at the end); 0: none
    resume: Optional[str] = None  # a checkpoint.pt to continue from
    task: TaskSettings = field(default_factory=TaskSettings)


@dataclass
class TrainConfig(RunConfig):
    runner: RunnerSettings = field(default_factory=RunnerSettings)


def register() -> None:
    ConfigStore.instance().store(name="runner_schema", node=TrainConfig)
