"""Seeded global batches of Sequences.

Every step draws from its own generator seeded with ``(seed, step)``, so a step's batch does not
depend on which steps ran before it (sweeps and partial reruns see the same data).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import special

from sparsebalance.sim.config import LengthDistribution, WorkloadConfig, validate
from sparsebalance.sim.core import ConfigError, not_a_file, resolve_path
from sparsebalance.sim.sensitivity import load_sensitivity_profile

# Sensitivities are clipped away from 0: s -> 0 makes kept_fraction = p ** (1/s) underflow.
MIN_SENSITIVITY = 1e-3


@dataclass(frozen=True, slots=True)
class Request:
    """What a trainer knows of a sequence before it runs."""

    id: int
    length: int  # tokens


@dataclass(frozen=True, slots=True)
class Sequence(Request):
    """A sequence with the data's truth: how its attention spreads. Only the engine (and in the runner the
    data generator and the kernel) sees ``sensitivity``; planners get ``requests(batch)``."""

    sensitivity: float  # coverage(kf) = kf ** sensitivity, in (0, 1]


def requests(batch) -> list[Request]:
    """The batch as a planner sees it: ids and lengths."""
    return [Request(s.id, s.length) for s in batch]


def truth_of(batch) -> dict[int, float]:
    """Sequence id -> sensitivity: what the engine prices a step with."""
    return {s.id: s.sensitivity for s in batch}


def read_trace(path: str) -> np.ndarray:
    """Lengths from a CSV or JSONL trace with a ``length`` column (one sequence per row)."""
    file = resolve_path(path)
    problem = not_a_file(file)
    if problem:
        raise ConfigError(f"workload.trace_path={path!r}: {problem}; allowed: a CSV or JSONL trace file")
    try:
        frame = _read_jsonl(file) if file.suffix == ".jsonl" else pd.read_csv(file, dtype=str)
    except ValueError as exc:
        raise ConfigError(f"workload.trace_path={path!r}: unreadable trace ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"workload.trace_path={path!r}: cannot be read ({reason})") from None
    if "length" not in frame.columns or frame.empty:
        raise ConfigError(
            f"workload.trace_path={path!r}: needs a non-empty 'length' column, found {list(frame.columns)}"
        )
    return trace_lengths(frame["length"], path, json_numbers=file.suffix == ".jsonl")


def _read_jsonl(file: Path) -> pd.DataFrame:
    """Rows as parsed, as objects: no value is rounded, truncated or overflowed before it is checked
    (pandas' own reader turns a column with one fraction into floats)."""
    with file.open() as lines:
        return pd.DataFrame([json.loads(line) for line in lines if line.strip()], dtype=object)


def trace_lengths(column: pd.Series, path: str, json_numbers: bool = False) -> np.ndarray:
    """The column as positive whole token counts; the first value that is not one is named with its row. A
    JSONL trace's lengths are JSON numbers: a quoted one is a string, refused like any other text. Digits are
    ASCII 0-9: ``str.isdigit`` also takes other scripts' digits ('٣') and superscripts ('²')."""
    lengths = []
    for row, raw in enumerate(column.tolist(), start=1):
        text = str(raw).strip()
        typed = not json_numbers or (isinstance(raw, int) and not isinstance(raw, bool))
        if not typed or not (text.isascii() and text.isdigit()) or int(text) < 1:
            allowed = ("a JSON whole number of tokens >= 1" if json_numbers
                       else "a whole number of tokens >= 1 in the digits 0-9")
            raise ConfigError(f"workload.trace_path={path!r}: row {row} has length {raw!r}; allowed: {allowed}")
        lengths.append(int(text))
    return np.array(lengths, dtype=object)


class Workload:
    """Global batches of ``cfg.global_batch`` sequences, one per step."""

    def __init__(self, cfg: WorkloadConfig, max_context: int, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        self._validate(max_context)
        self._trace = (
            self._check_lengths(read_trace(cfg.trace_path), max_context, f"trace {cfg.trace_path!r}")
            if self._is_trace else None
        )
        self._profile = (
            load_sensitivity_profile(cfg.sensitivity_profile, cfg.sensitivity_task) if cfg.sensitivity_profile else None
        )

    @property
    def _is_trace(self) -> bool:
        return LengthDistribution(self.cfg.distribution) is LengthDistribution.trace

    def _validate(self, max_context: int) -> None:
        validate(self.cfg, "workload.")
        if self.cfg.max_len > max_context:
            raise ConfigError(
                f"workload.max_len={self.cfg.max_len} exceeds the model's max context {max_context}"
            )

    @staticmethod
    def _check_lengths(lengths: np.ndarray, max_context: int, where: str) -> np.ndarray:
        """Exact (arbitrary-size) integers in, int64 out, once every length fits the model's context."""
        bad = [int(n) for n in lengths if n > max_context]
        if bad:
            raise ConfigError(
                f"{where}: length {bad[0]} is outside the allowed range [1, {max_context}] (model max context)"
            )
        return lengths.astype(np.int64)

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

    def sensitivities(self, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One s per length: from the measured profile given the length, or from the Beta prior."""
        raw = (self._profile.draw(lengths, rng) if self._profile is not None
               else rng.beta(self.cfg.sensitivity_a, self.cfg.sensitivity_b, lengths.size))
        return np.clip(raw, MIN_SENSITIVITY, 1.0)

    def population(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        """The workload's population figures, nothing per sequence: the mean and standard deviation of
        logit(s) at each length (the measured profile's, or the Beta(a, b) prior's exact ones:
        E logit s = digamma(a) - digamma(b), Var logit s = trigamma(a) + trigamma(b))."""
        lengths = np.asarray(lengths, dtype=np.float64)
        if self._profile is not None:
            return self._profile.mean(lengths), self._profile.std(lengths)
        a, b = self.cfg.sensitivity_a, self.cfg.sensitivity_b
        mean = float(special.digamma(a) - special.digamma(b))
        std = float(np.sqrt(special.polygamma(1, a) + special.polygamma(1, b)))
        return np.full(lengths.size, mean), np.full(lengths.size, std)

    def batch(self, step: int) -> list[Sequence]:
        rng = np.random.default_rng([self.seed, step])
        lengths = self._lengths(rng, step)
        sens = self.sensitivities(lengths, rng)
        first = step * self.cfg.global_batch
        return [
            Sequence(first + i, length, s)
            for i, (length, s) in enumerate(zip(lengths.tolist(), sens.tolist(), strict=True))
        ]
