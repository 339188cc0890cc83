"""Results directories as ``Run`` records: read, checked against the current schema, summarised per policy."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.sim.results import MicroBatchRecord, StepRecord

RESULT_FILES = ("summary.json", "steps.csv", "micro_batches.csv")
SUMMARY_KEYS = ("policy", "steps", "step_ms", "bubble_fraction", "mean_coverage", "dp", "pp", "micro_batches")


class PlotError(ValueError):
    """Input the figures cannot be made from; its message is one line for the user."""


@dataclass(frozen=True)
class Run:
    """One complete Results directory."""

    path: Path
    summary: dict
    steps: pd.DataFrame
    micro_batches: pd.DataFrame
    overrides: tuple[str, ...]  # the Hydra job's overrides; empty outside Hydra

    @property
    def policy(self) -> str:
        return self.summary["policy"]

    @property
    def axes(self) -> tuple[str, ...]:
        """The job's overrides other than the policy, e.g. ``workload=bimodal``."""
        return tuple(o for o in self.overrides if not o.startswith(("policy=", "hydra.")))


def settings(runs: list[Run]) -> list[str]:
    """Per run, what sets it apart from the sweep's other runs besides the policy ('' when nothing does)."""
    common = set.intersection(*(set(r.axes) for r in runs)) if runs else set()
    return [" ".join(_short(o) for o in r.axes if o not in common) for r in runs]


def _short(override: str) -> str:
    """``policy.sparsity.params.p=0.8`` -> ``p=0.8``: tick labels name the knob, not its config path."""
    key, sep, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}{sep}{value}"


def _check_columns(path: Path, frame: pd.DataFrame, record_type) -> None:
    """Every field must be there, except those added later with a default, which older Results lack."""
    missing = [f.name for f in fields(record_type) if f.name not in frame.columns and f.default is MISSING]
    if missing:
        raise PlotError(
            f"{path}: older or unknown Results schema (no column {', '.join(missing)}); "
            "re-run it with the current `python -m sim.run`"
        )


def read_run(path: str | Path) -> Run:
    """A run directory's Results, checked against the current schema."""
    path = Path(path)
    present = [name for name in RESULT_FILES if (path / name).is_file()]
    if not present:
        raise PlotError(f"{path}: no Results here (expected {', '.join(RESULT_FILES)} from `python -m sim.run`)")
    if len(present) < len(RESULT_FILES):
        absent = sorted(set(RESULT_FILES) - set(present))
        raise PlotError(f"{path}: partial Results (no {', '.join(absent)}); the run did not finish, re-run it")
    try:
        summary = json.loads((path / "summary.json").read_text())
        steps = pd.read_csv(path / "steps.csv")
        micro_batches = pd.read_csv(path / "micro_batches.csv")
    except (json.JSONDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PlotError(f"{path}: unreadable Results ({str(exc).splitlines()[0]})") from None
    missing = [k for k in SUMMARY_KEYS if k not in summary] if isinstance(summary, dict) else list(SUMMARY_KEYS)
    if missing:
        raise PlotError(f"{path}: older or unknown Results schema (summary.json lacks {', '.join(missing)})")
    _check_columns(path / "steps.csv", steps, StepRecord)
    _check_columns(path / "micro_batches.csv", micro_batches, MicroBatchRecord)
    if steps.empty:
        raise PlotError(f"{path}: steps.csv has no rows")
    return Run(path, summary, steps, micro_batches, _overrides(path))


def _overrides(path: Path) -> tuple[str, ...]:
    file = path / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return ()
    # Hydra writes a plain YAML list of strings; read it without importing Hydra.
    lines = file.read_text().splitlines()
    return tuple(line[2:].strip().strip("'\"") for line in lines if line.startswith("- "))


def _job_order(path: Path) -> tuple:
    """Sweep jobs in their launch order (``10`` after ``9``), other directories by name."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def read_runs(root: str | Path) -> list[Run]:
    """Every complete run under root (root itself, or a sweep's job directories).

    Incomplete runs in a sweep are skipped with a warning; if none is complete, the first problem is raised.
    """
    root = Path(root)
    if not root.is_dir():
        raise PlotError(f"{root}: no such directory")
    dirs = sorted({f.parent for name in RESULT_FILES for f in root.rglob(name)}, key=_job_order)
    if not dirs:
        raise PlotError(
            f"{root}: no Results found (no {', '.join(RESULT_FILES)}); make some with "
            "`python -m sim.run policy=baseline` or a sweep `python -m sim.run -m policy=baseline,sparsebalance`"
        )
    runs, problems = [], []
    for d in dirs:
        try:
            runs.append(read_run(d))
        except PlotError as exc:
            problems.append(exc)
    if not runs:
        raise problems[0]
    for problem in problems:
        warnings.warn(f"skipped: {problem}", stacklevel=2)
    return runs


def summary_frame(runs: list[Run]) -> pd.DataFrame:
    """One row per run: policy, setting, means over steps and the speedup over the run's baseline.

    The speedup is over the sweep's run of the baseline policy in the same setting (same overrides, so a
    sweep over budgets compares like with like); without one, sim.run's own ``speedup_vs_baseline``.
    """
    rows = [{
        "policy": r.policy,
        "setting": setting,
        "baseline": r.summary.get("baseline") or "baseline",
        "step_ms": r.summary["step_ms"],
        "bubble_fraction": r.summary["bubble_fraction"],
        "mean_coverage": r.summary["mean_coverage"],
        "speedup": r.summary.get("speedup_vs_baseline"),
        "path": str(r.path),
    } for r, setting in zip(runs, settings(runs), strict=True)]
    frame = pd.DataFrame(rows)
    base_ms = {(r["policy"], r["setting"]): r["step_ms"] for r in rows}
    in_sweep = [base_ms.get((b, s), np.nan) for b, s in zip(frame["baseline"], frame["setting"], strict=True)]
    frame["speedup"] = (pd.Series(in_sweep) / frame["step_ms"]).fillna(frame["speedup"].astype(float))
    return frame


def simulate_sweep(overrides: list[str], out: str | Path) -> Path:
    """Run ``python -m sim.run -m <overrides>`` into ``out`` (the notebooks' small sweeps); returns ``out``.

    A subprocess rather than an in-process call: Hydra's multirun owns its process (logging, working dir).
    """
    out = Path(out)
    cmd = [sys.executable, "-m", "sim.run", "-m", *overrides, f"hydra.sweep.dir={out}"]
    print("$ python -m sim.run -m", " ".join(overrides), f"hydra.sweep.dir={out}")
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise PlotError(f"the sweep failed: {lines[-1]}")
    return out
