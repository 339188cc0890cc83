"""Predicted against measured: runner steps replayed through the simulator, the profile's whole layers."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sparsebalance.runner.compare import replay
from sparsebalance.sim.core import ConfigError
from sparsebalance.viz.runs import PlotError, Run
from sparsebalance.viz.style import policy_colours


def fidelity_frame(runs: list[Run], skip: int | None = None, profile: str | None = None) -> pd.DataFrame:
    """Per step of each runner run: measured and simulator-predicted step time (runner.compare's table).

    ``predicted_ms`` replays the run's Plans with the kept fractions the kernel really selected (the time model
    alone); ``plan_ms`` with the Plans' own budgets (the coverage model decides what is kept, as in a policy
    sweep). The first ``skip`` steps of each run (kernel compilation) are left out: by default as many as
    runner.compare left out of its scores (``compare.json``), else 1. A run without runner.compare's table is
    replayed here under ``profile`` (None: runner.compare's default, the committed H200 profile, which prices no
    run on the CPU).
    """
    measured = [r for r in runs if r.summary.get("source") == "runner"]
    if not measured:
        raise PlotError(
            f"no runner Results among {len(runs)} run(s) (summary.json source='runner'); "
            "make some with `torchrun -m runner.train ...` then `python -m runner.compare <run dir>`"
        )
    return pd.concat([_compare_table(r, skip, profile) for r in measured], ignore_index=True)


def unpriced(run: Run, profile: str | None) -> bool:
    """A runner run on the CPU that no table or profile prices: no cost profile describes a CPU, so without
    ``profile`` (a GPU's, named on purpose) it has measured times alone."""
    on_cpu = str(run.summary.get("device", "")).startswith("cpu")
    return on_cpu and profile is None and not (run.path / "compare.csv").is_file()


def plot_measured_steps(runs: list[Run]) -> Figure:
    """Each step's measured time per run, for runs that nothing prices (``unpriced``)."""
    colours = policy_colours([r.policy for r in runs])
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for run in runs:
        ax.plot(run.steps["step"], run.steps["step_ms"], marker="o", color=colours[run.policy],
                label=f"{run.policy} ({run.path.name})")
    ax.set_xlabel("step")
    ax.set_ylabel("measured step time (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Runner-measured step time on the CPU (no cost profile describes a CPU;\n"
                 "python -m viz --profile <a GPU's profile> prices it anyway)", fontsize=10)
    return fig


def _compare_table(run: Run, skip: int | None, profile: str | None) -> pd.DataFrame:
    """runner.compare's compare.csv, computed now if the run has none."""
    if (run.path / "compare.csv").is_file():
        table = pd.read_csv(run.path / "compare.csv")
        if skip is None and (run.path / "compare.json").is_file():
            skip = json.loads((run.path / "compare.json").read_text()).get("skipped_warmup_steps")
        skip = 1 if skip is None else skip  # runner.compare's default
    else:
        skip = 1 if skip is None else skip
        try:
            table, _, _ = replay(run.path, profile, skip)
        except ConfigError as exc:
            raise PlotError(str(exc)) from None
    missing = [c for c in ("step", "measured_ms", "sim_ms", "sim_plan_ms") if c not in table.columns]
    if missing:
        raise PlotError(f"{run.path}/compare.csv: unknown schema (no column {', '.join(missing)}); "
                        "re-run runner.compare")
    table = table[table["step"] >= table["step"].min() + skip]
    return pd.DataFrame({"group": run.policy, "step": table["step"], "measured_ms": table["measured_ms"],
                         "predicted_ms": table["sim_ms"], "plan_ms": table["sim_plan_ms"]})


def validation_frame(profile: dict) -> pd.DataFrame:
    """The profile's predicted vs measured whole layers (packed, mixed budgets, never fitted)."""
    table = profile.get("fit", {}).get("validation") or []
    if not table:
        raise PlotError("the profile has no validation table (provisional, or fitted before calibrate.fit wrote one)")
    return pd.DataFrame([{
        "group": v["model"],
        "predicted_ms": v["predicted_ms"],
        "measured_ms": v["measured_ms"],
    } for v in table])


def _median_ape(predicted: pd.Series, measured: pd.Series) -> float:
    """Median absolute % error: runner.compare's headline, robust to a step that compiled kernels."""
    return float((100 * (predicted - measured).abs() / measured).median())


def plot_fidelity(frame: pd.DataFrame, what: str, title: str) -> Figure:
    """Predicted against measured: the diagonal is perfect, the band ±10%; median |error| per group in the legend.

    A ``plan_ms`` column (step fidelity) adds hollow markers: the prediction with the Plans' own budgets.
    """
    colours = policy_colours(frame["group"])
    fig = Figure(figsize=(6.4, 6.0), layout="constrained")
    ax = fig.subplots()
    values = frame[[c for c in ("predicted_ms", "plan_ms", "measured_ms") if c in frame]].to_numpy()
    lo, hi = float(values.min()), float(values.max())
    log = lo > 0 and hi / lo > 100  # kernels from 0.1 ms to 1 s: only a log scale shows them all
    lo, hi = (lo / 1.5, hi * 1.5) if log else (0.0, 1.08 * hi)
    line = np.geomspace(lo, hi, 50) if log else np.array([lo, hi])
    ax.fill_between(line, 0.9 * line, 1.1 * line, color="0.92", label="±10%")
    ax.plot(line, line, color="0.3", lw=0.8, label="predicted = measured")
    for group, sub in frame.groupby("group", sort=False):
        ax.scatter(sub["measured_ms"], sub["predicted_ms"], color=colours[group], s=28, zorder=3,
                   label=f"{group} (median |error| {_median_ape(sub['predicted_ms'], sub['measured_ms']):.1f}%)")
        if "plan_ms" in sub:
            ax.scatter(sub["measured_ms"], sub["plan_ms"], facecolors="none", edgecolors=colours[group], s=28,
                       zorder=3,
                       label=f"{group}, Plan budgets ({_median_ape(sub['plan_ms'], sub['measured_ms']):.1f}%)")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel(f"measured {what} (ms)")
    ax.set_ylabel(f"predicted {what} (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=10)
    return fig


def plot_step_fidelity(frame: pd.DataFrame) -> Figure:
    steps = f"steps {frame['step'].min()}-{frame['step'].max()}"
    return plot_fidelity(frame, "step time", f"Simulator-predicted vs runner-measured step time ({steps})\n"
                                             "filled: kernel's kept fractions; hollow: the Plans' budgets")
