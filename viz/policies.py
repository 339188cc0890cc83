"""Policy comparison of simulated runs: speedup and bubble per policy, and the speed/coverage frontier."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sparsebalance.viz.runs import Run, summary_frame
from sparsebalance.viz.style import policy_colours


def _context(runs: list[Run]) -> str:
    """What the runs share, for titles: model, workload, layout and steps ('various' where they differ)."""

    def shared(key: str) -> str:
        values = {str(r.summary.get(key, "?")) for r in runs}
        return values.pop() if len(values) == 1 else "various"

    layout = f"dp{shared('dp')}×cp{shared('cp')}×pp{shared('pp')}, {shared('micro_batches')} micro-batches"
    return f"{shared('model')}, {shared('workload')} workload, {layout}, {shared('steps')} steps, {shared('cost')} cost"


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
        for p, v in zip(pos, sub["speedup"], strict=True):
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
    for idx, cov in zip(ordered.index, ordered["mean_coverage"], strict=True):
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
