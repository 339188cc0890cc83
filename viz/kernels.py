"""Kernel benchmark figure: our block-sparse kernel vs FlexAttention vs dense cuDNN (python -m benchmarks.attention)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from viz.runs import PlotError
from viz.style import OKABE_ITO, plain_log

BENCH_COLUMNS = ("case", "T", "ndocs", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms")
IMPLS = {"triton_sparse": ("our Triton block-sparse kernel", OKABE_ITO[1], "o"),
         "flex": ("FlexAttention (same blocks)", OKABE_ITO[2], "s"),
         "cudnn_dense": ("cuDNN SDPA dense causal", OKABE_ITO[0], None)}


def read_benchmark(path: str | Path) -> pd.DataFrame:
    """Rows of the CSV of python -m benchmarks.attention that carry a time (failed configs are dropped, and counted)."""
    path = Path(path)
    if not path.is_file():
        raise PlotError(f"{path}: no such benchmark CSV (made by `python -m benchmarks.attention --csv {path}`)")
    frame = pd.read_csv(path)
    missing = [c for c in BENCH_COLUMNS if c not in frame.columns]
    if missing:
        raise PlotError(f"{path}: not a kernel benchmark CSV (no column {', '.join(missing)})")
    timed = frame[frame["impl"].isin(IMPLS) & frame["fwdbwd_ms"].notna()]
    if timed.empty:
        raise PlotError(f"{path}: no timed rows of {', '.join(IMPLS)}")
    return timed.assign(failed=len(frame[frame["impl"].isin(IMPLS)]) - len(timed))


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
        plain_log(ax)
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
