"""Figures from Results directories, calibration data and kernel benchmarks.

``python -m viz PATH [PATH ...] [--out DIR] [--format png|svg] [--step N] [--skip N]`` makes without Jupyter
the figures the notebooks show. Each PATH is one of:

* a Results directory (one ``sim.run`` run, a sweep's ``multirun/...`` directory, runner runs): speedup and
  bubble per policy, the speed/coverage frontier, and the per-rank timeline of one step (baseline vs
  sparsebalance, else the fastest other policy) for simulated runs; simulator-predicted vs runner-measured
  step times for runner runs (runner.compare's replay);
* runner.collect's tables of several runner runs (``runner/results/learning_*``): learning curves (50-step
  mean training accuracy per run, coloured by run name without ``_s<seed>``) and held-out accuracy per run;
* a cost profile (``calibrate/profiles/<gpu>.json``): its fitted model against the raw measurements beside
  it, residuals, and predicted vs measured whole layers;
* a kernel benchmark CSV (``benchmarks/results/*.csv``): our kernel vs FlexAttention vs dense cuDNN.

Figures are built on ``matplotlib.figure.Figure`` (no pyplot state), so the same functions serve the CLI
and the notebooks. Bad input (an empty, partial or older-schema directory) is one ``error:`` line and exit
code 2, no traceback.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from sim.core import fail
from viz.figures import figures_for, save
from viz.runs import PlotError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m viz", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path,
                    help="Results dir, runner.collect tables dir, profile .json or benchmark .csv")
    ap.add_argument("--out", type=Path, default=None,
                    help="where figures go (default: <results dir>/figures, else ./figures)")
    ap.add_argument("--format", choices=("png", "svg"), default="png")
    ap.add_argument("--step", type=int, default=0, help="the step the timeline shows")
    ap.add_argument("--skip", type=int, default=None,
                    help="runner runs: first steps left out of fidelity (default: runner.compare's, else 1)")
    args = ap.parse_args(argv)
    try:
        for path in args.paths:
            if not path.exists():
                raise PlotError(f"{path}: no such file or directory")
            out = args.out or (path / "figures" if path.is_dir() else Path("figures"))
            with warnings.catch_warnings(record=True) as skipped:  # one line each, not Python's two
                warnings.simplefilter("always")
                figures = figures_for(path, args.step, args.skip)
            for w in skipped:
                print(f"warning: {w.message}", file=sys.stderr)
            for written in save(figures, out, args.format):
                print(f"figure: {written}")
    except PlotError as exc:
        fail(str(exc))
    return 0
