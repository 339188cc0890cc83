"""Results schema (shared with the runner) and its atomic writer.

Files in the run directory: ``micro_batches.csv`` (one MicroBatchRecord per row), ``steps.csv``
(StepRecord), ``summary.json`` and ``plans.jsonl`` (one Plan per line). They are written into a
temporary directory inside the run directory and moved into place with ``os.replace``, so a reader
never sees a half-written file; ``summary.json`` moves last and marks a complete run. Results that are
not finite are refused before anything is written.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.sim.backends import OURS
from sparsebalance.sim.core import ConfigError, json_text, temporary_dir

FLOAT_FORMAT = "%.9g"  # fixed formatting: same values -> same bytes
FILES = ("micro_batches.csv", "steps.csv", "plans.jsonl", "summary.json")  # summary.json last: a complete run


@dataclass(frozen=True)
class MicroBatchRecord:
    step: int
    dp_rank: int
    micro_batch: int
    stage: int
    compute_ms: float
    comm_ms: float
    idle_ms: float
    tokens: int
    kept_fraction: float
    coverage: float
    # GB on this (rank, stage) while this micro-batch's backward runs (sim.memory); NaN where not modelled
    peak_memory_gb: float = math.nan
    # the kernel that runs its attention: ours, or the peer backend cost.attention_backend picks (sim.backends)
    attention_backend: str = OURS


@dataclass(frozen=True)
class StepRecord:
    step: int
    step_ms: float
    bubble_fraction: float
    tokens_per_s: float
    mfu: float
    mean_coverage: float
    min_coverage: float
    peak_memory_gb: float = math.nan  # the largest over ranks, stages and micro-batches; NaN where not modelled
    # Coverage where the work is (coverage_fields); NaN where a writer does not compute them.
    token_coverage: float = math.nan  # weighted by length
    attention_coverage: float = math.nan  # weighted by length ** 2, the causal attention work
    long_coverage: float = math.nan  # mean over the longest quarter of the step's sequences
    # The step time the planner expected before the step ran (sim.planner); NaN where it made no prediction.
    predicted_ms: float = math.nan


COVERAGE_KEYS = ("token_coverage", "attention_coverage", "long_coverage")
# Figures a writer may leave out, NaN by default: the runner models no memory and makes no prediction.
OPTIONAL = tuple(dict.fromkeys(f.name for record in (MicroBatchRecord, StepRecord) for f in fields(record)
                               if isinstance(f.default, float) and math.isnan(f.default)))


PREDICTION_WITHIN_PCT = 5.0  # a prediction this close to the realized step time counts as met


def prediction_fields(steps) -> dict:
    """How far the steps ran from the planner's predictions, over the steps that have one (None where none
    has), of 100 (realized / predicted - 1): its median, the 90th percentile and the largest of its absolute
    value, and the share of steps (%) within PREDICTION_WITHIN_PCT."""
    err = (100 * (steps["step_ms"] / steps["predicted_ms"] - 1)).dropna() if "predicted_ms" in steps else []
    if len(err) == 0:
        return {key: None for key in PREDICTION_KEYS}
    size = err.abs()
    return {"prediction_error_pct": float(err.median()), "prediction_error_p90_pct": float(size.quantile(0.9)),
            "prediction_error_max_pct": float(size.max()),
            "prediction_within_5_pct": float(100 * (size <= PREDICTION_WITHIN_PCT).mean())}


PREDICTION_KEYS = ("prediction_error_pct", "prediction_error_p90_pct", "prediction_error_max_pct",
                   "prediction_within_5_pct")
LONG_SHARE = 0.25  # long_coverage: this share of a step's sequences, the longest


def coverage_fields(lengths: np.ndarray, coverage: np.ndarray) -> dict[str, float]:
    """A step's coverage figures beside the plain mean over sequences: weighted by tokens, by attention
    work (length ** 2: dense causal attention grows with its square, and sparsity saves time there), and
    over the longest quarter of sequences (at least one; ties in length keep plan order)."""
    if not coverage.size:
        return {"token_coverage": 1.0, "attention_coverage": 1.0, "long_coverage": 1.0}
    lengths = np.asarray(lengths, dtype=np.float64)
    longest = np.argsort(-lengths, kind="stable")[: max(1, math.ceil(LONG_SHARE * lengths.size))]
    return {
        "token_coverage": float(np.average(coverage, weights=lengths)),
        "attention_coverage": float(np.average(coverage, weights=lengths**2)),
        "long_coverage": float(coverage[longest].mean()),
    }


def _or_none(value: float) -> float | None:
    """A summary figure, or None (JSON null) where no step had it."""
    return None if math.isnan(value) else float(value)


def _columns(record_type) -> list[str]:
    return [f.name for f in fields(record_type)]


def records_frame(records: list, record_type) -> pd.DataFrame:
    """Typed records (the runner's path) as a frame with the schema's column order."""
    return pd.DataFrame([asdict(r) for r in records], columns=_columns(record_type))


class Results:
    """Accumulates one run's steps; micro-batch rows arrive as columns (the engine's vectorised output)."""

    def __init__(self) -> None:
        self._rows: list[dict[str, np.ndarray]] = []
        self.steps: list[StepRecord] = []
        self.plans: list[str] = []

    def add(self, record: StepRecord, rows: dict[str, np.ndarray], plan_json: str | None) -> None:
        self.steps.append(record)
        self._rows.append(rows)
        if plan_json is not None:
            self.plans.append(plan_json)

    def micro_batches(self) -> pd.DataFrame:
        names = _columns(MicroBatchRecord)
        if not self._rows:
            return pd.DataFrame(columns=names)
        return pd.DataFrame({n: np.concatenate([r[n] for r in self._rows]) for n in names})

    def steps_frame(self) -> pd.DataFrame:
        return records_frame(self.steps, StepRecord)

    def summary(self, **extra) -> dict:
        steps = self.steps_frame()
        total_ms = float(steps["step_ms"].sum())
        tokens = float((steps["tokens_per_s"] * steps["step_ms"]).sum() / 1e3)
        return {
            **extra,
            "steps": len(steps),
            "step_ms": float(steps["step_ms"].mean()),
            "bubble_fraction": float(steps["bubble_fraction"].mean()),
            "tokens_per_s": tokens / total_ms * 1e3 if total_ms else 0.0,
            "mfu": float(steps["mfu"].mean()),
            "mean_coverage": float(steps["mean_coverage"].mean()),
            "min_coverage": float(steps["min_coverage"].min()),
            "peak_memory_gb": _or_none(steps["peak_memory_gb"].max()),
            **{key: _or_none(steps[key].mean()) for key in COVERAGE_KEYS},  # means over steps
            **prediction_fields(steps),
        }

    def write(self, run_dir: Path, summary: dict) -> list[Path]:
        """Write all files atomically into run_dir; returns their final paths. ``plans.jsonl`` only where Plans
        were kept (``write_plans=true``); a run dir reused without them loses an earlier run's, which these
        results do not match."""
        micro_batches, steps = self.micro_batches(), self.steps_frame()
        check_finite(summary, micro_batches, steps)
        names = [name for name in FILES if name != "plans.jsonl" or self.plans]
        with temporary_dir(run_dir / ".results") as tmp:
            micro_batches.to_csv(tmp / "micro_batches.csv", index=False, float_format=FLOAT_FORMAT)
            steps.to_csv(tmp / "steps.csv", index=False, float_format=FLOAT_FORMAT)
            if self.plans:
                (tmp / "plans.jsonl").write_text("".join(p + "\n" for p in self.plans))
            (tmp / "summary.json").write_text(json_text(summary))
            for name in names:
                os.replace(tmp / name, run_dir / name)
        if not self.plans:
            (run_dir / "plans.jsonl").unlink(missing_ok=True)
        return [run_dir / name for name in names]


EMPTY_NAN = ("kept_fraction", "coverage")  # MicroBatchRecord figures that an empty micro-batch has none of


def check_finite(summary: dict, *frames: pd.DataFrame) -> None:
    """Refuse results that are not finite numbers (one ConfigError line; nothing is written): an absurd but finite
    input (a cost coefficient, a peak rate) can overflow a time to inf and a ratio of two to NaN, which is no
    result and, in summary.json, not JSON. Checked: the records' columns and the summary's means of them, and
    ``speedup_vs_baseline``; NaN stays allowed where the schema lets a writer leave a figure out (OPTIONAL). A
    writer's own summary keys (the runner's measured loss) are its own."""
    figures = [*(set(_columns(StepRecord)) - set(OPTIONAL)), "speedup_vs_baseline"]
    for key, value in summary.items():
        if key in figures and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"the run's {key} is {value}, not a finite number; nothing was written (check the "
                              "magnitudes of the cost profile's coefficients and the cluster's rates)")
    for frame in frames:
        numbers = frame.select_dtypes("number").drop(columns=[c for c in OPTIONAL if c in frame], errors="ignore")
        bad = ~np.isfinite(numbers.to_numpy(dtype=np.float64))
        if "tokens" in numbers:  # an empty micro-batch has no kept fraction or coverage (NaN, an empty cell)
            empty = numbers["tokens"].to_numpy() == 0
            for col in EMPTY_NAN:
                if col in numbers:
                    bad[empty, numbers.columns.get_loc(col)] = False
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise ConfigError(f"the run's {numbers.columns[col]} is {numbers.iat[row, col]} in row {row + 1}, not a "
                              "finite number; nothing was written (check the magnitudes of the cost profile's "
                              "coefficients and the cluster's rates)")
