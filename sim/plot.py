"""Figures from Results directories, calibration data and kernel benchmarks.

``python -m sim.plot PATH [PATH ...] [--out DIR] [--format png|svg] [--step N] [--skip N]`` makes without Jupyter
the figures the notebooks show. Each PATH is one of:

* a Results directory (one ``sim.run`` run, a sweep's ``multirun/...`` directory, runner runs): speedup and
  bubble per policy, the speed/coverage frontier, and the per-rank timeline of one step (baseline vs
  sparsebalance, else the fastest other policy) for simulated runs; simulator-predicted vs runner-measured
  step times for runner runs (runner.compare's replay);
* a cost profile (``calibrate/profiles/<gpu>.json``): its fitted model against the raw measurements beside
  it, residuals, and predicted vs measured whole layers;
* a kernel benchmark CSV (``benchmarks/results/*.csv``): our kernel vs FlexAttention vs dense cuDNN.

Figures are built on ``matplotlib.figure.Figure`` (no pyplot state), so the same functions serve the CLI
and the notebooks. Bad input (an empty, partial or older-schema directory) is one line, no traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from sim.results import MicroBatchRecord, StepRecord

# Okabe-Ito (colour-blind safe), yellow left out: it vanishes on white.
OKABE_ITO = ("#000000", "#D55E00", "#0072B2", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
FORWARD, BACKWARD, IDLE, COMM = "#56B4E9", "#0072B2", "#D9D9D9", "#E69F00"
RESULT_FILES = ("summary.json", "steps.csv", "micro_batches.csv")
SUMMARY_KEYS = ("policy", "steps", "step_ms", "bubble_fraction", "mean_coverage", "dp", "pp", "micro_batches")


class PlotError(ValueError):
    """Input the figures cannot be made from; its message is one line for the user."""


# ----------------------------------------------------------------------------- Results directories
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
    missing = [f.name for f in fields(record_type) if f.name not in frame.columns]
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
    } for r, setting in zip(runs, settings(runs))]
    frame = pd.DataFrame(rows)
    base_ms = {(r["policy"], r["setting"]): r["step_ms"] for r in rows}
    in_sweep = [base_ms.get((b, s), np.nan) for b, s in zip(frame["baseline"], frame["setting"])]
    frame["speedup"] = (pd.Series(in_sweep) / frame["step_ms"]).fillna(frame["speedup"].astype(float))
    return frame


def policy_colours(policies) -> dict[str, str]:
    """A colour per policy in order of first appearance, so every figure of one sweep agrees."""
    names = list(dict.fromkeys(policies))
    if "baseline" in names:  # the reference is always black
        names.remove("baseline")
        names.insert(0, "baseline")
    return {name: OKABE_ITO[i % len(OKABE_ITO)] for i, name in enumerate(names)}


def _context(runs: list[Run]) -> str:
    """What the runs share, for titles: model, workload, layout and steps ('various' where they differ)."""

    def shared(key: str) -> str:
        values = {str(r.summary.get(key, "?")) for r in runs}
        return values.pop() if len(values) == 1 else "various"

    layout = f"dp{shared('dp')}×cp{shared('cp')}×pp{shared('pp')}, {shared('micro_batches')} micro-batches"
    return f"{shared('model')}, {shared('workload')} workload, {layout}, {shared('steps')} steps, {shared('cost')} cost"


def simulate_sweep(overrides: list[str], out: str | Path) -> Path:
    """Run ``python -m sim.run -m <overrides>`` into ``out`` (the notebooks' small sweeps); returns ``out``.

    A subprocess rather than an in-process call: Hydra's multirun owns its process (logging, working dir).
    """
    import subprocess

    out = Path(out)
    cmd = [sys.executable, "-m", "sim.run", "-m", *overrides, f"hydra.sweep.dir={out}"]
    print("$ python -m sim.run -m", " ".join(overrides), f"hydra.sweep.dir={out}")
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise PlotError(f"the sweep failed: {lines[-1]}")
    return out


# ----------------------------------------------------------------------------- policy comparison
def plot_policies(runs: list[Run]) -> Figure:
    """Speedup over the baseline and bubble fraction per policy, grouped by the sweep's other axes."""
    frame = summary_frame(runs)
    colours = policy_colours(frame["policy"])
    groups = list(dict.fromkeys(frame["setting"]))
    policies = [p for p in colours if p in set(frame["policy"])]
    # 10 inches at least: the two-line title names model, workload, layout, steps and cost.
    fig = Figure(figsize=(max(10.0, 1.2 * len(groups) * len(policies) + 2), 4.2), layout="constrained")
    ax_speed, ax_bubble = fig.subplots(1, 2)
    width = 0.8 / len(policies)
    x = np.arange(len(groups))
    for i, policy in enumerate(policies):
        # Repeated runs of one policy and setting (e.g. plotting all of outputs/) show their mean.
        sub = frame[frame["policy"] == policy].groupby("setting")[["speedup", "bubble_fraction"]].mean()
        sub = sub.reindex(groups)
        pos = x - 0.4 + (i + 0.5) * width
        ax_speed.bar(pos, sub["speedup"], width, color=colours[policy], label=policy)
        ax_bubble.bar(pos, 100 * sub["bubble_fraction"], width, color=colours[policy], label=policy)
        for p, v in zip(pos, sub["speedup"]):
            if np.isfinite(v):
                ax_speed.annotate(f"{v:.2f}×", (p, v), ha="center", va="bottom", fontsize=8)
    ax_speed.axhline(1.0, color="0.4", lw=0.8, ls="--")
    baseline = frame["baseline"].iloc[0]
    ax_speed.set_ylabel(f"speedup over {baseline} (step-time ratio, ×)")
    ax_speed.set_title("Speedup (higher is better)")
    ax_bubble.set_ylabel("bubble fraction (% of GPU time idle)")
    ax_bubble.set_title("Bubble (lower is better)")
    for ax in (ax_speed, ax_bubble):
        if len(groups) == 1:  # one setting: name the bars themselves
            ax.set_xticks(x[0] - 0.4 + (np.arange(len(policies)) + 0.5) * width, policies)
            ax.set_xlabel("policy")
        else:
            ax.set_xticks(x, groups, rotation=15 if len(groups) > 3 else 0)
            ax.set_xlabel("sweep setting (one bar per policy)")
        ax.grid(axis="y", alpha=0.3)
    ax_speed.margins(y=0.15)
    fig.legend(*ax_speed.get_legend_handles_labels(), title="policy", fontsize=8, loc="outside right")
    fig.suptitle(f"Speedup and bubble fraction per policy\n({_context(runs)})")
    return fig


def pareto(points: pd.DataFrame) -> pd.DataFrame:
    """Rows not beaten on both axes: no other run is at least as fast with at least as much coverage."""
    ordered = points.sort_values(["step_ms", "mean_coverage"], ascending=[True, False])
    best = -np.inf
    keep = []
    for idx, cov in zip(ordered.index, ordered["mean_coverage"]):
        if cov > best:
            keep.append(idx)
            best = cov
    return ordered.loc[keep]


def plot_frontier(runs: list[Run]) -> Figure:
    """Step time vs mean coverage: one point per run (whiskers: 10th-90th percentile over steps)."""
    frame = summary_frame(runs)
    colours = policy_colours(frame["policy"])
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    ax = fig.subplots()
    for policy, colour in colours.items():
        idx = [i for i, r in enumerate(runs) if r.policy == policy]
        sub = frame.loc[idx].sort_values("mean_coverage")
        lo = [runs[i].steps["step_ms"].quantile(0.1) for i in sub.index]
        hi = [runs[i].steps["step_ms"].quantile(0.9) for i in sub.index]
        yerr = np.clip([sub["step_ms"] - lo, np.array(hi) - sub["step_ms"]], 0, None)
        ax.errorbar(sub["mean_coverage"], sub["step_ms"], yerr=yerr, color=colour, marker="o", ms=6,
                    capsize=3, lw=1.2, label=policy)
    front = pareto(frame).sort_values("mean_coverage")
    if len(front) > 1:
        ax.plot(front["mean_coverage"], front["step_ms"], color="0.5", ls=":", lw=2, zorder=0,
                label="Pareto frontier")
    ax.set_xlabel("mean attention coverage (fraction of attention mass kept, higher is better)")
    ax.set_ylabel("step time (ms, lower is better; whiskers: 10th-90th pct over steps)")
    ax.grid(alpha=0.3)
    ax.legend(title="policy", fontsize=8)
    ax.set_title(f"Speed vs coverage per policy\n({_context(runs)})", fontsize=10)
    return fig


# ----------------------------------------------------------------------------- timeline of one step
@dataclass(frozen=True)
class StepTrace:
    """Every forward/backward of one step on each (DP rank, stage), replayed through the engine."""

    label: str
    step: int
    ops: pd.DataFrame  # start_ms, end_ms, dp_rank, stage, kind ('F'/'B'), micro_batch
    barrier_ms: float  # when the last rank finishes its backward; the all-reduce starts here
    step_ms: float
    bubble_fraction: float
    dp: int
    pp: int


def _plan_line(run: Run, step: int) -> str:
    file = run.path / "plans.jsonl"
    if not file.is_file() or file.stat().st_size == 0:
        raise PlotError(f"{run.path}: no plans.jsonl (run with write_plans=true) to replay step {step} from")
    for line in file.read_text().splitlines():
        if json.loads(line).get("step") == step:
            return line
    raise PlotError(f"{run.path}: no plan for step {step} (steps 0..{len(run.steps) - 1})")


def replay_step(run: Run, step: int = 0, label: str | None = None) -> StepTrace:
    """Re-simulate one step of a sim.run run from its saved config and Plan, with the engine's trace.

    Results keep per-micro-batch totals, not start times; the replay recovers them exactly, and is checked
    against the run's own step time so a changed profile or engine cannot draw a different step silently.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from sim.plan import Plan
    from sim.cluster import Cluster, Layout
    from sim.config import RunConfig
    from sim.core import ConfigError
    from sim.cost import make_cost
    from sim.engine import Engine

    config = run.path / ".hydra" / "config.yaml"
    if not config.is_file():
        raise PlotError(f"{run.path}: no .hydra/config.yaml; the timeline replays `python -m sim.run` runs only")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(config))
        cluster = Cluster.from_config(cfg.cluster)
        layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
        engine = Engine(layout, make_cost(cfg.cost, cfg.model, cluster), cluster)
    except (ConfigError, OmegaConfBaseException) as exc:
        raise PlotError(f"{config}: cannot rebuild the run ({str(exc).splitlines()[0]})") from None
    outcome = engine.step(Plan.from_json(_plan_line(run, step)), trace=True)
    recorded = run.steps.loc[run.steps["step"] == step, "step_ms"]
    if recorded.empty or not math.isclose(outcome.record.step_ms, recorded.iloc[0], rel_tol=1e-6):
        raise PlotError(
            f"{run.path}: replayed step {step} takes {outcome.record.step_ms:.3f} ms but the run recorded "
            f"{recorded.iloc[0] if not recorded.empty else 'nothing'}; the profile or engine changed since, re-run it"
        )
    ops = pd.DataFrame(outcome.timeline.trace,
                       columns=["start_ms", "end_ms", "dp_rank", "stage", "kind", "micro_batch"])
    barrier = float(outcome.timeline.finish_ms.max(initial=0.0))
    return StepTrace(label or run.policy, step, ops, barrier, outcome.record.step_ms, outcome.record.bubble_fraction,
                     layout.dp, layout.pp)


def _draw_trace(ax, trace: StepTrace, label_mbs: bool) -> None:
    rows = trace.dp * trace.pp
    for row in range(rows):
        ax.broken_barh([(0, trace.barrier_ms)], (row - 0.4, 0.8), facecolor=IDLE, edgecolor="none", hatch="///")
        ax.broken_barh([(trace.barrier_ms, trace.step_ms - trace.barrier_ms)], (row - 0.4, 0.8), facecolor=COMM)
    row_of = trace.ops["dp_rank"] * trace.pp + trace.ops["stage"]
    for kind, colour in (("F", FORWARD), ("B", BACKWARD)):
        sel = trace.ops["kind"] == kind
        for row, group in trace.ops[sel].groupby(row_of[sel]):
            spans = list(zip(group["start_ms"], group["end_ms"] - group["start_ms"]))
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolor=colour, edgecolor="white", linewidth=0.6)
    if label_mbs:  # micro-batch numbers where they fit
        min_width = 0.025 * trace.step_ms
        for op, row in zip(trace.ops.itertuples(), row_of):
            if op.end_ms - op.start_ms >= min_width:
                ax.text((op.start_ms + op.end_ms) / 2, row, str(op.micro_batch), ha="center", va="center",
                        fontsize=6, color="black" if op.kind == "F" else "white")
    ax.set_ylim(rows - 0.5, -0.5)
    if trace.pp == 1:
        ax.set_yticks(range(rows), [f"rank {r}" for r in range(trace.dp)])
    else:
        ax.set_yticks(range(rows), [f"r{r} / stage {s}" for r in range(trace.dp) for s in range(trace.pp)])
    ax.set_xlabel("time within the step (ms)")
    ax.set_title(f"{trace.label}: step {trace.step}, {trace.step_ms:.0f} ms, "
                 f"bubble {100 * trace.bubble_fraction:.1f}%", fontsize=10)


def plot_timeline(traces: list[StepTrace], label_mbs: bool = True) -> Figure:
    """Gantt charts of one step side by side on a common time axis: ranks x time, compute/comm/idle."""
    if not traces:
        raise PlotError("no step traces to draw")
    rows = traces[0].dp * traces[0].pp
    # At least 11 inches: the four-entry legend and the title need it even for a single panel.
    fig = Figure(figsize=(max(11.0, 6.0 * len(traces) + 1), 1.2 + 0.32 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(traces), sharex=True, sharey=True))
    for ax, trace in zip(axes, traces):
        _draw_trace(ax, trace, label_mbs)
    axes[0].set_ylabel("DP rank" if traces[0].pp == 1 else "DP rank / pipeline stage")
    legend = [
        Patch(facecolor=FORWARD, label="forward compute (number: micro-batch)"),
        Patch(facecolor=BACKWARD, label="backward compute"),
        Patch(facecolor=IDLE, hatch="///", label="idle (waiting for other ranks, stages, p2p hand-offs)"),
        Patch(facecolor=COMM, label="gradient all-reduce (communication)"),
    ]
    fig.legend(handles=legend, loc="outside lower center", ncols=4, fontsize=8)
    t = traces[0]
    who = " vs ".join(tr.label for tr in traces)
    fig.suptitle(f"One step per rank: {who} (dp{t.dp}×pp{t.pp}, CP exchange overlapped with compute)")
    return fig


def pick_timeline_runs(runs: list[Run]) -> list[Run]:
    """Two runs of one setting to set side by side: baseline and sparsebalance if a setting has both, else
    the first setting's baseline (or first run) and its fastest other policy."""
    replayable = [r for r in runs if r.summary.get("source") != "runner" and (r.path / ".hydra" / "config.yaml").is_file()]
    if not replayable:
        raise PlotError("no sim.run runs (with .hydra/config.yaml) to draw a timeline from")
    by_setting: dict[str, dict[str, Run]] = {}
    for run, setting in zip(replayable, settings(replayable)):
        by_setting.setdefault(setting, {}).setdefault(run.policy, run)
    for group in by_setting.values():
        if {"baseline", "sparsebalance"} <= set(group):
            return [group["baseline"], group["sparsebalance"]]
    group = next(iter(by_setting.values()))
    first = group.get("baseline", next(iter(group.values())))
    others = sorted((r for r in group.values() if r is not first), key=lambda r: r.summary["step_ms"])
    return [first, *others[:1]]


# ----------------------------------------------------------------------------- calibration
def read_profile(path: str | Path) -> dict:
    from sim.core import ConfigError
    from sim.cost import load_profile

    try:
        return load_profile(str(path))
    except ConfigError as exc:
        raise PlotError(str(exc)) from None


def raw_csv_of(profile_path: Path, profile: dict) -> Path:
    """The raw measurements a profile was fitted on (named in its meta, else ``<gpu>_raw.csv``)."""
    name = profile.get("meta", {}).get("raw_csv") or f"{profile.get('gpu', profile_path.stem)}_raw.csv"
    return profile_path.parent / name


def calibration_frame(profile_path: str | Path) -> pd.DataFrame:
    """One row per raw measurement: measured and fitted ms, batch shape, split and residual (%)."""
    from calibrate.fit import FeatureSource, layer_prediction, load_measurements, predict
    from calibrate.run import meta_path

    profile_path = Path(profile_path)
    profile = read_profile(profile_path)
    csv = raw_csv_of(profile_path, profile)
    if profile.get("provisional") or not csv.is_file():
        raise PlotError(
            f"{profile_path}: no measurements to compare with ({'provisional profile, ' if profile.get('provisional') else ''}"
            f"no {csv.name}); measure with `python -m calibrate.run` on a GPU, then `python -m calibrate.fit`"
        )
    meta = meta_path(csv)
    if not meta.is_file():
        raise PlotError(f"{csv}: no {meta.name} beside it (written by calibrate.run)")
    grid = json.loads(meta.read_text())["runs"][-1]["grid"]
    features = FeatureSource(grid["models"], grid["block_size"])
    coefs = profile["terms"]
    rows = []
    for m in load_measurements(csv):
        feats = features(m)
        pred = layer_prediction(coefs, feats) if m.term == "layer_full" else predict(coefs[m.term], feats[m.term])
        lengths = np.array(m.lengths, dtype=float)
        # Kept fractions weighted by each sequence's causal work (~ length^2), what the kernel pays for: the
        # one the kernel realised, and the one the grid asked for (the key's last field), which groups points.
        work = lengths**2 / np.dot(lengths, lengths)
        asked = [float(f) for f in m.key.split("|")[-1].split("+")]
        rows.append({
            "term": m.term, "split": m.split, "model": m.model, "tokens": int(lengths.sum()),
            "sequences": len(m.lengths), "kept_fraction": float(np.dot(m.kept_fractions, work)),
            "budget": round(float(np.dot(asked, work)), 3), "measured_ms": m.median_ms, "predicted_ms": pred,
        })
    return _with_residuals(pd.DataFrame(rows))


def _with_residuals(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(residual_pct=100 * (frame["predicted_ms"] - frame["measured_ms"]) / frame["measured_ms"])


def benchmark_vs_profile(bench: pd.DataFrame, profile_path: str | Path, model: str = "qwen2.5-3b") -> pd.DataFrame:
    """Our kernel's benchmarked single-sequence times against what the profile predicts for them.

    The benchmark (16 query heads, D = 128) matches the attention shape of ``model``, so the profile's
    ``attn_fwd`` and ``attn_fwd + attn_bwd`` terms price the very same work; a check of the cost model on
    measurements from another harness, also for a provisional profile.
    """
    from calibrate.fit import FeatureSource, Measurement, predict
    from sim.shapes import load_shapes

    profile = read_profile(profile_path)
    (shape,) = load_shapes([model])
    features = FeatureSource({model: vars(shape)}, profile["block_size"])
    coefs = profile["terms"]
    ours = bench[(bench["impl"] == "triton_sparse") & (bench["ndocs"] == 1)]
    if ours.empty:
        raise PlotError("the benchmark has no single-sequence timings of our kernel")
    rows = []
    for r in ours.itertuples():
        feats = features(Measurement("", "", "", model, (int(r.T),), (float(r.kept_fraction),), 1.0, 0.0))
        fwd = predict(coefs["attn_fwd"], feats["attn_fwd"])
        both = fwd + predict(coefs["attn_bwd"], feats["attn_bwd"])
        for term, measured, predicted in (("attn_fwd", r.fwd_ms, fwd), ("attn_fwd+bwd", r.fwdbwd_ms, both)):
            rows.append({"term": term, "split": "benchmark", "model": model, "tokens": int(r.T), "sequences": 1,
                         "kept_fraction": float(r.kept_fraction), "budget": round(1.0 - float(r.sparsity), 3),
                         "measured_ms": float(measured), "predicted_ms": predicted})
    return _with_residuals(pd.DataFrame(rows))


def _profile_title(profile: dict) -> str:
    meta = profile.get("meta", {})
    kind = "provisional roofline" if profile.get("provisional") else "fitted"
    return f"{profile.get('gpu', '?')} profile, {kind}, {str(meta.get('fitted') or meta.get('date', '?'))[:10]}"


TERM_ORDER = ("attn_fwd", "attn_bwd", "attn_fwd+bwd", "select", "layer_fwd", "layer_bwd")


def plot_calibration(frame: pd.DataFrame, profile: dict, model: str | None = None,
                     source: str = "calibration grid") -> Figure:
    """Measured (markers) vs fitted (lines) time of single sequences over length, one line per kept fraction."""
    model = model or frame["model"].value_counts().index[0]
    singles = frame[(frame["sequences"] == 1) & (frame["model"] == model)]
    terms = [t for t in TERM_ORDER if t in set(singles["term"])]
    if not terms:
        raise PlotError(f"no single-sequence measurements of model {model!r} to plot")
    fractions = sorted(singles["budget"].unique(), reverse=True)
    cmap = _viridis(len(fractions))
    fig = Figure(figsize=(max(9.0, 3.4 * len(terms) + 2.0), 4.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(terms)))
    for ax, term in zip(axes, terms):
        sub = singles[singles["term"] == term]
        for colour, kf in zip(cmap, fractions):
            pts = sub[sub["budget"] == kf].sort_values("tokens")
            if pts.empty:
                continue
            ax.plot(pts["tokens"], pts["predicted_ms"], color=colour, lw=1.2)
            ax.scatter(pts["tokens"], pts["measured_ms"], color=colour, s=18, label=f"{kf:g}", zorder=3)
        ax.set_xscale("log", base=2)
        _plain_log(ax, x=False)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(term)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("time per layer (ms)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, title="kept fraction\n(markers: measured,\nlines: cost model)", loc="outside right",
               fontsize=8)
    fig.suptitle(f"Measured vs cost-model time per layer, {model}\n(measured: {source}; {_profile_title(profile)})")
    return fig


def _viridis(n: int) -> list:
    from matplotlib import colormaps

    return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.9, max(n, 1))]


def plot_residuals(frame: pd.DataFrame, profile: dict) -> Figure:
    """Relative error of the fitted model per measurement, by term, fit vs held-out vs validation points."""
    # The simulator prices selection of an all-dense batch at zero by design (calibrate.fit does not fit
    # those points either); their -100% would only squash the axis, so they are counted, not drawn.
    zero = frame["predicted_ms"] <= 0
    frame = frame[~zero]
    colours = dict(zip(sorted(frame["term"].unique()), OKABE_ITO[1:] * 2))
    markers = {"fit": "o", "heldout": "^", "validate": "s", "benchmark": "D"}
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.axhspan(-10, 10, color="0.92", zorder=0, label="±10%")
    for (term, split), sub in frame.groupby(["term", "split"]):
        ax.scatter(sub["measured_ms"], sub["residual_pct"], s=20, color=colours[term],
                   marker=markers.get(split, "x"), facecolors="none" if split == "fit" else colours[term],
                   label=f"{term} ({split})")
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("measured time (ms)")
    ax.set_ylabel("residual: (model − measured) / measured (%)")
    # The honest numbers: error on points the fit did not see (the fit's own error is in its legend marker).
    unseen = [s for s in ("heldout", "validate", "benchmark") if s in set(frame["split"])]
    note = "; ".join(f"{s} median |error| {frame.loc[frame['split'] == s, 'residual_pct'].abs().median():.1f}%"
                     for s in unseen) or "no held-out points"
    if zero.any():
        note += f"\n({int(zero.sum())} selection points of dense batches, priced at 0 by design, not shown)"
    ax.set_title(f"Cost model vs measurements, per point ({_profile_title(profile)})\n{note}", fontsize=10)
    ax.legend(fontsize=7, ncols=2, loc="best")
    ax.grid(alpha=0.3)
    return fig


# ----------------------------------------------------------------------------- kernel benchmark
DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "calibrate" / "profiles" / "h200.json"
BENCH_COLUMNS = ("case", "T", "ndocs", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms")
IMPLS = {"triton_sparse": ("our Triton block-sparse kernel", OKABE_ITO[1], "o"),
         "flex": ("FlexAttention (same blocks)", OKABE_ITO[2], "s"),
         "cudnn_dense": ("cuDNN SDPA dense causal", OKABE_ITO[0], None)}


def read_benchmark(path: str | Path) -> pd.DataFrame:
    """Rows of benchmarks/attention.py's CSV that carry a time (failed configs are dropped, and counted)."""
    path = Path(path)
    if not path.is_file():
        raise PlotError(f"{path}: no such benchmark CSV (made by `python benchmarks/attention.py --csv {path}`)")
    frame = pd.read_csv(path)
    missing = [c for c in BENCH_COLUMNS if c not in frame.columns]
    if missing:
        raise PlotError(f"{path}: not a kernel benchmark CSV (no column {', '.join(missing)})")
    timed = frame[frame["impl"].isin(IMPLS) & frame["fwdbwd_ms"].notna()]
    if timed.empty:
        raise PlotError(f"{path}: no timed rows of {', '.join(IMPLS)}")
    return timed.assign(failed=len(frame[frame["impl"].isin(IMPLS)]) - len(timed))


def _plain_log(ax, x: bool = True) -> None:
    """Log axes labelled 0.1, 0.2, 0.5, 1, ... instead of crowded 2x10^-1 minor labels."""
    if x:
        ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis) if x else (ax.yaxis,):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def plot_kernel_comparison(bench: pd.DataFrame, title: str = "") -> Figure:
    """Forward+backward time over kept fraction per case: our kernel vs FlexAttention vs dense cuDNN."""
    cases = list(dict.fromkeys(zip(bench["case"], bench["T"])))
    fig = Figure(figsize=(3.4 * len(cases) + 1, 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(cases)))
    for ax, (case, T) in zip(axes, cases):
        sub = bench[(bench["case"] == case) & (bench["T"] == T)]
        for impl, (label, colour, marker) in IMPLS.items():
            pts = sub[sub["impl"] == impl].sort_values("kept_fraction")
            if pts.empty:
                continue
            if marker is None:  # dense has one time whatever the budget: a reference line
                ax.axhline(pts["fwdbwd_ms"].iloc[0], color=colour, ls="--", lw=1.2, label=label)
            else:
                ax.plot(pts["kept_fraction"], pts["fwdbwd_ms"], color=colour, marker=marker, label=label)
        _plain_log(ax)
        ax.set_xlabel("kept fraction of causal blocks")
        docs = int(sub["ndocs"].iloc[0])
        ax.set_title(f"{case}: {T // 1024}K tokens" + (f", {docs} documents" if docs > 1 else ""), fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("forward + backward time (ms, lower is better)")
    entries = {}  # every implementation once, whichever panel has it
    for ax in axes:
        entries.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=3, fontsize=8)
    failed = int(bench["failed"].iloc[0]) if "failed" in bench else 0
    note = f"; {failed} config(s) failed, not shown" if failed else ""
    fig.suptitle(f"Attention fwd+bwd: our kernel vs FlexAttention vs dense{title}{note}")
    return fig


# ----------------------------------------------------------------------------- fidelity
def fidelity_frame(runs: list[Run], skip: int | None = None) -> pd.DataFrame:
    """Per step of each runner run: measured and simulator-predicted step time (runner.compare's table).

    ``predicted_ms`` replays the run's Plans with the kept fractions the kernel really selected (the time model
    alone); ``plan_ms`` with the Plans' own budgets (the coverage model decides what is kept, as in a policy
    sweep). The first ``skip`` steps of each run (kernel compilation) are left out: by default as many as
    runner.compare left out of its scores (``compare.json``), else 1.
    """
    measured = [r for r in runs if r.summary.get("source") == "runner"]
    if not measured:
        raise PlotError(
            f"no runner Results among {len(runs)} run(s) (summary.json source='runner'); "
            "make some with `torchrun -m runner.train ...` then `python -m runner.compare <run dir>`"
        )
    return pd.concat([_compare_table(r, skip) for r in measured], ignore_index=True)


def _compare_table(run: Run, skip: int | None) -> pd.DataFrame:
    """runner.compare's compare.csv, computed now if the run has none."""
    from sim.core import ConfigError

    if (run.path / "compare.csv").is_file():
        table = pd.read_csv(run.path / "compare.csv")
        if skip is None and (run.path / "compare.json").is_file():
            skip = json.loads((run.path / "compare.json").read_text()).get("skipped_warmup_steps")
        skip = 1 if skip is None else skip  # runner.compare's default
    else:
        from runner.compare import DEFAULT_PROFILE, replay

        skip = 1 if skip is None else skip
        try:
            table, _ = replay(run.path, DEFAULT_PROFILE, skip)
        except ConfigError as exc:
            raise PlotError(str(exc)) from None
    missing = [c for c in ("step", "measured_ms", "sim_ms", "sim_plan_ms") if c not in table.columns]
    if missing:
        raise PlotError(f"{run.path}/compare.csv: unknown schema (no column {', '.join(missing)}); re-run runner.compare")
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
                       zorder=3, label=f"{group}, Plan budgets ({_median_ape(sub['plan_ms'], sub['measured_ms']):.1f}%)")
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


# ----------------------------------------------------------------------------- CLI
def results_figures(path: Path, step: int, skip: int | None = None) -> dict[str, Figure]:
    """Policy figures (two or more runs) and a timeline for simulated runs, step fidelity for runner runs."""
    runs = read_runs(path)
    simulated = [r for r in runs if r.summary.get("source") != "runner"]
    figures = {}
    if len(simulated) > 1:  # one run has nothing to compare with (its baseline is only summarised)
        figures["policies"] = plot_policies(simulated)
        figures["frontier"] = plot_frontier(simulated)
    if simulated:
        chosen = pick_timeline_runs(simulated)
        labels = dict(zip(map(id, simulated), settings(simulated)))
        traces = [replay_step(r, step, label=" ".join(filter(None, (r.policy, labels[id(r)])))) for r in chosen]
        figures["timeline"] = plot_timeline(traces)
    if len(simulated) < len(runs):
        figures["fidelity"] = plot_step_fidelity(fidelity_frame(runs, skip))
    return figures


def profile_figures(path: Path) -> dict[str, Figure]:
    profile = read_profile(path)
    frame = calibration_frame(path)
    return {
        "calibration": plot_calibration(frame, profile),
        "residuals": plot_residuals(frame, profile),
        "layer_fidelity": plot_fidelity(validation_frame(profile), "whole-layer fwd+bwd time",
                                        f"Cost model vs measured whole layers ({_profile_title(profile)})"),
    }


def figures_for(path: Path, step: int, skip: int | None = None) -> dict[str, Figure]:
    """The figures a path calls for, by what it is."""
    if path.is_dir():
        return results_figures(path, step, skip)
    if path.suffix == ".json":
        return profile_figures(path)
    if path.suffix == ".csv":
        bench = read_benchmark(path)
        model = benchmark_vs_profile(bench, DEFAULT_PROFILE)
        profile = read_profile(DEFAULT_PROFILE)
        return {"kernels": plot_kernel_comparison(bench),
                "kernel_model": plot_calibration(model, profile, source=f"benchmark {path.name}"),
                "kernel_model_residuals": plot_residuals(model, profile)}
    raise PlotError(f"{path}: not a Results directory, a profile (.json) or a benchmark CSV")


def save(figures: dict[str, Figure], out: Path, fmt: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        paths.append(out / f"{name}.{fmt}")
        fig.savefig(paths[-1], dpi=130)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.plot", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path, help="Results dir, profile .json or benchmark .csv")
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
        raise SystemExit(f"error: {exc}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
