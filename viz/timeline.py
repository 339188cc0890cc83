"""The per-rank timeline of one step: replayed through the engine from a run's saved config and Plan, on the
sequences its workload drew (their sensitivities, the data's truth, which Plans do not carry)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.config import RunConfig
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.plan import Plan
from sparsebalance.sim.workload import Workload, truth_of
from sparsebalance.viz.runs import PlotError, Run, settings
from sparsebalance.viz.style import BACKWARD, COMM, FORWARD, IDLE


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
    """Re-simulate one step of a sim.run run from its saved config and Plan, with the engine's trace. The
    engine prices the Plan with the sensitivities of the step's sequences, drawn again from the config's
    workload and seed.

    Results keep per-micro-batch totals, not start times; the replay recovers them exactly, and is checked
    against the run's own step time so a changed profile or engine cannot draw a different step silently.
    """
    config = run.path / ".hydra" / "config.yaml"
    if not config.is_file():
        raise PlotError(f"{run.path}: no .hydra/config.yaml; the timeline replays `python -m sim.run` runs only")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(config))
        cluster = Cluster.from_config(cfg.cluster)
        layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
        cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
        engine = Engine(layout, cost, cluster)
        workload = Workload(OmegaConf.to_object(cfg.workload), cfg.model.max_context, cfg.seed)
    except (ConfigError, OmegaConfBaseException) as exc:
        raise PlotError(f"{config}: cannot rebuild the run ({str(exc).splitlines()[0]})") from None
    outcome = engine.step(Plan.from_json(_plan_line(run, step)), truth_of(workload.batch(step)), trace=True)
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
            spans = list(zip(group["start_ms"], group["end_ms"] - group["start_ms"], strict=True))
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolor=colour, edgecolor="white", linewidth=0.6)
    if label_mbs:  # micro-batch numbers where they fit
        min_width = 0.025 * trace.step_ms
        for op, row in zip(trace.ops.itertuples(), row_of, strict=True):
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
    for ax, trace in zip(axes, traces, strict=True):
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
    replayable = [r for r in runs
                  if r.summary.get("source") != "runner" and (r.path / ".hydra" / "config.yaml").is_file()]
    if not replayable:
        raise PlotError("no sim.run runs (with .hydra/config.yaml) to draw a timeline from")
    by_setting: dict[str, dict[str, Run]] = {}
    for run, setting in zip(replayable, settings(replayable), strict=True):
        by_setting.setdefault(setting, {}).setdefault(run.policy, run)
    for group in by_setting.values():
        if {"baseline", "sparsebalance"} <= set(group):
            return [group["baseline"], group["sparsebalance"]]
    group = next(iter(by_setting.values()))
    first = group.get("baseline", next(iter(group.values())))
    others = sorted((r for r in group.values() if r is not first), key=lambda r: r.summary["step_ms"])
    return [first, *others[:1]]
