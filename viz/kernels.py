"""Kernel benchmark figures of python -m benchmarks.attention: its grid CSV (our block-sparse kernel vs
FlexAttention vs dense cuDNN over kept fraction) and its --fair CSV (each peer's time over ours per sparsity)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sparsebalance.viz.runs import PlotError
from sparsebalance.viz.style import OKABE_ITO, plain_log

BENCH_COLUMNS = ("case", "T", "ndocs", "sparsity", "kept_fraction", "impl", "fwd_ms", "fwdbwd_ms")
FAIR_COLUMNS = ("heads", "T", "sparsity", "impl", "fwdbwd_ms")
OURS = ("triton_sparse", "triton_sparse_aligned")  # ours on the unaligned and on the aligned batch
IMPLS = {"triton_sparse": ("our Triton block-sparse kernel", OKABE_ITO[1], "o"),
         "flex": ("FlexAttention (same blocks)", OKABE_ITO[2], "s"),
         "cudnn_dense": ("cuDNN SDPA dense causal", OKABE_ITO[0], None)}


def read_csv(path: str | Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """A CSV of python -m benchmarks.attention with ``columns``; anything else is one PlotError line."""
    path = Path(path)
    if not path.is_file():
        raise PlotError(f"{path}: no such benchmark CSV (made by `python -m benchmarks.attention --csv {path}`)")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PlotError(f"{path}: unreadable ({str(exc).splitlines()[0]})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise PlotError(f"{path}: not a kernel benchmark CSV (no column {', '.join(missing)}); viz draws the grid "
                        "CSV (--bench --csv) and the --fair CSV of python -m benchmarks.attention")
    return frame


def is_fair(path: Path) -> bool:
    """Whether a CSV is the --fair grid's (its rows name their head layout)."""
    with path.open(errors="replace") as f:
        return "heads" in f.readline().strip().split(",")


def read_benchmark(path: str | Path) -> pd.DataFrame:
    """Rows of the grid CSV of python -m benchmarks.attention that carry a time (failed configs are dropped,
    and counted)."""
    frame = read_csv(path, BENCH_COLUMNS)
    timed = frame[frame["impl"].isin(IMPLS) & frame["fwdbwd_ms"].notna()]
    if timed.empty:
        raise PlotError(f"{path}: no timed rows of {', '.join(IMPLS)}")
    return timed.assign(failed=len(frame[frame["impl"].isin(IMPLS)]) - len(timed))


def plot_kernel_comparison(bench: pd.DataFrame, title: str = "") -> Figure:
    """Forward+backward time over kept fraction per case: our kernel vs FlexAttention vs dense cuDNN."""
    cases = list(dict.fromkeys(zip(bench["case"], bench["T"], strict=True)))
    fig = Figure(figsize=(3.4 * len(cases) + 1, 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(cases)))
    for ax, (case, T) in zip(axes, cases, strict=True):
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
    shared_legend(fig, axes)
    failed = int(bench["failed"].iloc[0]) if "failed" in bench else 0
    note = f"; {failed} config(s) failed, not shown" if failed else ""
    fig.suptitle(f"Attention fwd+bwd: our kernel vs FlexAttention vs dense{title}{note}")
    return fig


def fair_ratios(path: str | Path) -> pd.DataFrame:
    """Rows of a --fair CSV: each peer's fwd+bwd time over ours on the same batch (heads, sparsity, tokens:
    ours on the unaligned batch for the peers that start from it, on the aligned one for the others)."""
    frame = read_csv(path, FAIR_COLUMNS)
    timed = frame[frame["fwdbwd_ms"].notna()]
    ours = timed[timed["impl"].isin(OURS)][["heads", "sparsity", "T", "fwdbwd_ms"]]
    pairs = timed[~timed["impl"].isin(OURS)].merge(ours, on=["heads", "sparsity", "T"], suffixes=("", "_ours"))
    if pairs.empty:
        raise PlotError(f"{path}: no peer timed on a batch that ours ({', '.join(OURS)}) is timed on")
    return pairs.assign(ratio=pairs["fwdbwd_ms"] / pairs["fwdbwd_ms_ours"])


def plot_fair(ratios: pd.DataFrame) -> Figure:
    """Each peer's fwd+bwd time over ours per sparsity, a panel per head layout (above 1: ours is faster)."""
    layouts = list(dict.fromkeys(ratios["heads"]))
    colours = dict(zip(dict.fromkeys(ratios["impl"]), OKABE_ITO[1:] * 2, strict=False))
    fig = Figure(figsize=(3.8 * len(layouts) + 1, 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(layouts), sharey=True))
    for ax, heads in zip(axes, layouts, strict=True):
        for impl, pts in ratios[ratios["heads"] == heads].groupby("impl", sort=False):
            pts = pts.sort_values("sparsity")
            ax.plot(pts["sparsity"], pts["ratio"], color=colours[impl], marker="o", label=impl)
        ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
        plain_log(ax, x=False)
        ax.set_xlabel("sparsity (share of causal blocks left out)")
        ax.set_title(f"heads {heads} (query:KV)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("peer's fwd+bwd time / ours (above 1: ours faster)")
    shared_legend(fig, axes)
    fig.suptitle("Fair comparison on one packed batch: each peer against ours on the same batch")
    return fig


def shared_legend(fig: Figure, axes) -> None:
    """One legend below the panels, each label once, whichever panel has it."""
    entries = {}
    for ax in axes:
        entries.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=3, fontsize=8)
