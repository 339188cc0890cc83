"""Seeded global batches of Sequences.

Every step draws from its own generator seeded with ``(seed, step)``, so a step's batch does not
depend on which steps ran before it (sweeps and partial reruns see the same data).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sim.config import ConfigError, LengthDistribution, WorkloadConfig

# Sensitivities are clipped away from 0: s -> 0 makes kept_fraction = p ** (1/s) underflow.
MIN_SENSITIVITY = 1e-3


@dataclass(frozen=True, slots=True)
class Sequence:
    id: int
    length: int  # tokens
    sensitivity: float  # coverage(kf) = kf ** sensitivity, in (0, 1]


def resolve_path(path: str) -> Path:
    """A path as given, or relative to the project root (configs name repo files from any cwd)."""
    given = Path(path)
    if given.is_absolute() or given.exists():
        return given
    return Path(__file__).resolve().parents[1] / given


def read_trace(path: str) -> np.ndarray:
    """Lengths from a CSV or JSONL trace with a ``length`` column (one sequence per row)."""
    file = resolve_path(path)
    if not file.is_file():
        raise ConfigError(f"workload.trace_path={path!r}: no such file (expected a CSV or JSONL trace)")
    try:
        frame = pd.read_json(file, lines=True) if file.suffix == ".jsonl" else pd.read_csv(file)
    except ValueError as exc:
        raise ConfigError(f"workload.trace_path={path!r}: unreadable trace ({exc})") from None
    if "length" not in frame.columns or frame.empty:
        raise ConfigError(
            f"workload.trace_path={path!r}: needs a non-empty 'length' column, found {list(frame.columns)}"
        )
    return frame["length"].to_numpy(dtype=np.int64)


class Workload:
    """Global batches of ``cfg.global_batch`` sequences, one per step."""

    def __init__(self, cfg: WorkloadConfig, max_context: int, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        self._validate(max_context)
        self._trace = read_trace(cfg.trace_path) if self._is_trace else None
        if self._trace is not None:
            self._check_lengths(self._trace, max_context, f"trace {cfg.trace_path!r}")

    @property
    def _is_trace(self) -> bool:
        return LengthDistribution(self.cfg.distribution) is LengthDistribution.trace

    def _validate(self, max_context: int) -> None:
        cfg = self.cfg
        if cfg.global_batch < 1:
            raise ConfigError(f"workload.global_batch={cfg.global_batch} must be >= 1")
        if not 1 <= cfg.min_len <= cfg.max_len:
            raise ConfigError(
                f"workload.min_len={cfg.min_len}, max_len={cfg.max_len}: need 1 <= min_len <= max_len"
            )
        if cfg.max_len > max_context:
            raise ConfigError(
                f"workload.max_len={cfg.max_len} exceeds the model's max context {max_context}"
            )
        if self._is_trace and not cfg.trace_path:
            raise ConfigError("workload.distribution=trace needs workload.trace_path (CSV or JSONL)")
        if cfg.sensitivity_a <= 0 or cfg.sensitivity_b <= 0:
            raise ConfigError(
                f"workload.sensitivity_a={cfg.sensitivity_a}, sensitivity_b={cfg.sensitivity_b}: "
                "Beta parameters must be > 0"
            )

    @staticmethod
    def _check_lengths(lengths: np.ndarray, max_context: int, where: str) -> None:
        bad = lengths[(lengths < 1) | (lengths > max_context)]
        if bad.size:
            raise ConfigError(
                f"{where}: length {int(bad[0])} is outside the allowed range [1, {max_context}] (model max context)"
            )

    def _lengths(self, rng: np.random.Generator, step: int) -> np.ndarray:
        cfg, n = self.cfg, self.cfg.global_batch
        dist = LengthDistribution(cfg.distribution)
        if dist is LengthDistribution.trace:
            # Traces keep their arrival order, cycling when the run outlasts them.
            return self._trace[(step * n + np.arange(n)) % self._trace.size]
        if dist is LengthDistribution.longtail:
            raw = rng.lognormal(np.log(cfg.median), cfg.sigma, n)
        else:
            long = rng.random(n) < cfg.long_fraction
            raw = np.where(
                long,
                rng.lognormal(np.log(cfg.long_median), 0.15, n),
                rng.lognormal(np.log(cfg.short_median), 0.5, n),
            )
        return np.clip(np.rint(raw), cfg.min_len, cfg.max_len).astype(np.int64)

    def batch(self, step: int) -> list[Sequence]:
        rng = np.random.default_rng([self.seed, step])
        lengths = self._lengths(rng, step)
        sens = np.clip(
            rng.beta(self.cfg.sensitivity_a, self.cfg.sensitivity_b, lengths.size), MIN_SENSITIVITY, 1.0
        )
        first = step * self.cfg.global_batch
        return [
            Sequence(first + i, length, s) for i, (length, s) in enumerate(zip(lengths.tolist(), sens.tolist()))
        ]
