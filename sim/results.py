"""Results schema (shared with the runner) and its atomic writer.

Files in the run directory: ``micro_batches.csv`` (one MicroBatchRecord per row), ``steps.csv``
(StepRecord), ``summary.json`` and ``plans.jsonl`` (one Plan per line). They are written into a
temporary directory inside the run directory and moved into place with ``os.replace``, so a reader
never sees a half-written file; ``summary.json`` moves last and marks a complete run.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import pandas as pd

from sim.core import json_text

FLOAT_FORMAT = "%.9g"  # fixed formatting: same values -> same bytes


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


def prediction_fields(steps) -> dict:
    """How far the steps ran from the planner's predictions: the median and the largest of
    100 (realized / predicted - 1) over the steps that have a prediction (None where none has)."""
    err = (100 * (steps["step_ms"] / steps["predicted_ms"] - 1)).dropna() if "predicted_ms" in steps else []
    if len(err) == 0:
        return {"prediction_error_pct": None, "prediction_error_max_pct": None}
    return {"prediction_error_pct": float(err.median()), "prediction_error_max_pct": float(err.abs().max())}
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
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".results-", dir=run_dir))
        self.micro_batches().to_csv(tmp / "micro_batches.csv", index=False, float_format=FLOAT_FORMAT)
        self.steps_frame().to_csv(tmp / "steps.csv", index=False, float_format=FLOAT_FORMAT)
        if self.plans:
            (tmp / "plans.jsonl").write_text("".join(p + "\n" for p in self.plans))
        (tmp / "summary.json").write_text(json_text(summary))
        names = ["micro_batches.csv", "steps.csv", *(["plans.jsonl"] if self.plans else []), "summary.json"]
        for name in names:
            os.replace(tmp / name, run_dir / name)
        if not self.plans:
            (run_dir / "plans.jsonl").unlink(missing_ok=True)
        tmp.rmdir()
        return [run_dir / name for name in names]
