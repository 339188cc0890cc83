"""Which figures a path calls for, by what it is, and writing them: shared by the CLI and the run callback."""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from sparsebalance.sim.core import atomic_path
from sparsebalance.viz.calibration import (DEFAULT_PROFILE, benchmark_vs_profile, calibration_frame, plot_calibration,
                             plot_residuals, profile_title, read_profile)
from sparsebalance.viz.fidelity import (fidelity_frame, plot_fidelity, plot_measured_steps, plot_step_fidelity,
                                        unpriced, validation_frame)
from sparsebalance.viz.kernels import fair_ratios, is_fair, plot_fair, plot_kernel_comparison, read_benchmark
from sparsebalance.viz.learning import is_learning_tables, learning_figures
from sparsebalance.viz.policies import plot_frontier, plot_policies
from sparsebalance.viz.runs import PlotError, read_runs, settings
from sparsebalance.viz.timeline import pick_timeline_runs, plot_timeline, replay_step


def results_figures(path: Path, step: int, skip: int | None = None, profile: str | None = None) -> dict[str, Figure]:
    """Policy figures (two or more runs) and a timeline for simulated runs, step fidelity for runner runs (priced
    by ``profile`` where given), measured step times for CPU runs that nothing prices."""
    runs = read_runs(path)
    simulated = [r for r in runs if r.summary.get("source") != "runner"]
    figures = {}
    if len(simulated) > 1:  # one run has nothing to compare with (its baseline is only summarised)
        figures["policies"] = plot_policies(simulated)
        figures["frontier"] = plot_frontier(simulated)
    if simulated:
        chosen = pick_timeline_runs(simulated)
        labels = dict(zip(map(id, simulated), settings(simulated), strict=True))
        traces = [replay_step(r, step, label=" ".join(filter(None, (r.policy, labels[id(r)])))) for r in chosen]
        figures["timeline"] = plot_timeline(traces)
    measured = [r for r in runs if r.summary.get("source") == "runner"]
    alone = [r for r in measured if unpriced(r, profile)]
    if alone:
        figures["step_times"] = plot_measured_steps(alone)
    if len(alone) < len(measured):
        figures["fidelity"] = plot_step_fidelity(fidelity_frame([r for r in measured if r not in alone], skip, profile))
    return figures


def profile_figures(path: Path) -> dict[str, Figure]:
    profile = read_profile(path)
    frame = calibration_frame(path)
    return {
        "calibration": plot_calibration(frame, profile),
        "residuals": plot_residuals(frame, profile),
        "layer_fidelity": plot_fidelity(validation_frame(profile), "whole-layer fwd+bwd time",
                                        f"Cost model vs measured whole layers ({profile_title(profile)})"),
    }


def figures_for(path: Path, step: int, skip: int | None = None, profile: str | None = None) -> dict[str, Figure]:
    """The figures a path calls for, by what it is; ``profile`` prices runner runs (runner.compare --profile)."""
    if path.is_dir():
        if is_learning_tables(path):
            return learning_figures(path)
        return results_figures(path, step, skip, profile)
    if path.suffix == ".json":
        return profile_figures(path)
    if path.suffix == ".csv":
        if is_fair(path):
            return {"fair": plot_fair(fair_ratios(path))}
        bench = read_benchmark(path)
        model = benchmark_vs_profile(bench, DEFAULT_PROFILE)
        profile = read_profile(DEFAULT_PROFILE)
        return {"kernels": plot_kernel_comparison(bench),
                "kernel_model": plot_calibration(model, profile, source=f"benchmark {path.name}"),
                "kernel_model_residuals": plot_residuals(model, profile)}
    raise PlotError(f"{path}: not a Results directory, runner.collect's tables, a cost profile (.json) or a "
                    "benchmark CSV of python -m benchmarks.attention (its grid or --fair CSV)")


def save(figures: dict[str, Figure], out: Path, fmt: str) -> list[Path]:
    """Each figure as ``out/<name>.<fmt>``, written whole or not at all (an interrupted save leaves no stub)."""
    paths = []
    for name, fig in figures.items():
        paths.append(out / f"{name}.{fmt}")
        with atomic_path(paths[-1]) as tmp:
            fig.savefig(tmp, format=fmt, dpi=130)
    return paths
