"""Figures from Results directories, calibration data and kernel benchmarks.

``python -m viz PATH [PATH ...] [--out DIR] [--format png|svg] [--step N] [--skip N]`` makes without Jupyter
the figures the notebooks show. Each PATH is one of:

* a Results directory (one ``sim.run`` run, a sweep's ``multirun/...`` directory, runner runs): speedup and
  bubble per policy, the speed/coverage frontier, and the per-rank timeline of one step (baseline vs
  sparsebalance, else the fastest other policy) for simulated runs; simulator-predicted vs runner-measured
  step times for runner runs (runner.compare's replay, priced by ``--profile PATH`` where given), and for a run on
  the CPU without one (no cost profile describes a CPU) its measured step times alone;
* runner.collect's tables of several runner runs (``results/runner/learning_*``): learning curves (50-step
  mean training accuracy per run, coloured by run name without ``_s<seed>``) and held-out accuracy per run;
* a cost profile (``calibrate/profiles/<gpu>.json``): its fitted model against the raw measurements beside
  it, residuals, and predicted vs measured whole layers;
* a grid CSV of ``python -m benchmarks.attention`` (``results/attention/attention_h200.csv``): our kernel vs
  FlexAttention vs dense cuDNN, and the cost model against it; or its ``--fair`` CSV
  (``results/attention/attention_fair_h100.csv``): each peer's time over ours per sparsity and head layout.

Figures go to ``<name>.<format>`` in the output directory; where several PATHs share one, each PATH's figures
are ``<its name>-<name>.<format>``, so that no input overwrites another's.

Figures are built on ``matplotlib.figure.Figure`` (no pyplot state), so the same functions serve the CLI
and the notebooks. Bad input (an empty, partial or older-schema directory, an output directory that cannot
be written) is one ``error:`` line and exit code 2, no traceback, before any figure is written.
"""
from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

from sparsebalance.sim.core import ArgumentParser, ConfigError, check_writable, fail
from sparsebalance.viz.figures import figures_for, save
from sparsebalance.viz.runs import PlotError


def destinations(paths: list[Path], out: Path | None) -> list[tuple[Path, str]]:
    """(output directory, figure name prefix) of each path: a prefix of the path's name where several paths
    share a directory; one ConfigError line where two of those have the same name."""
    dirs = [out or (path / "figures" if path.is_dir() else Path("figures")) for path in paths]
    names = [path.resolve().name if path.is_dir() else path.stem for path in paths]
    keys = [d.resolve() for d in dirs]
    shared = Counter(keys)
    for (key, name), count in Counter(zip(keys, names, strict=True)).items():
        if count > 1:
            raise ConfigError(f"{count} inputs named {name!r} would write the same figures into {key}; allowed: "
                              "inputs of distinct names, or one at a time with its own --out")
    return [(d, f"{n}-" if shared[k] > 1 else "") for d, k, n in zip(dirs, keys, names, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m viz", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path,
                    help="Results dir, runner.collect tables dir, profile .json or benchmark .csv")
    ap.add_argument("--out", type=Path, default=None,
                    help="where figures go (default: <results dir>/figures, else ./figures)")
    ap.add_argument("--format", choices=("png", "svg"), default="png")
    ap.add_argument("--step", type=int, default=0, help="the step the timeline shows")
    ap.add_argument("--skip", type=int, default=None,
                    help="runner runs: first steps left out of fidelity (default: runner.compare's, else 1)")
    ap.add_argument("--profile", default=None,
                    help="runner runs: the cost profile that prices them (runner.compare --profile); without it a "
                         "CPU run is drawn from its measured times alone")
    try:
        args = ap.parse_args(argv)
        for flag, value in (("--step", args.step), ("--skip", args.skip)):
            if value is not None and value < 0:
                ap.error(f"{flag} {value}: allowed: >= 0")
        missing = [path for path in args.paths if not path.exists()]
        if missing:
            raise PlotError(f"{missing[0]}: no such file or directory")
        places = destinations(args.paths, args.out)
        for out in dict.fromkeys(out for out, _ in places):
            check_writable(out, "--out", directory=True)
        # Every figure is made before any is written: a bad input leaves no figures of the good ones.
        made = []
        for path, (out, prefix) in zip(args.paths, places, strict=True):
            with warnings.catch_warnings(record=True) as skipped:  # one line each, not Python's two
                warnings.simplefilter("always")
                figures = figures_for(path, args.step, args.skip, args.profile)
            for w in skipped:
                print(f"warning: {w.message}", file=sys.stderr)
            made.append(({prefix + name: fig for name, fig in figures.items()}, out))
        for figures, out in made:
            for written in save(figures, out, args.format):
                print(f"figure: {written}")
    except (ConfigError, PlotError) as exc:
        fail(str(exc))
    return 0
