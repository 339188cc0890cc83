"""Learning curves from runner.collect's tables: training accuracy over steps per run, and held-out accuracy per
run, runs grouped by their name without the seed (``retrieval_baseline_s3`` -> ``retrieval_baseline``)."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from sparsebalance.viz.runs import PlotError
from sparsebalance.viz.style import policy_colours

TRAIN_COLUMNS = ("run", "step", "accuracy", "answers")
EVAL_COLUMNS = ("run", "p", "accuracy", "answers", "item_chance")
_SEED = re.compile(r"_s\d+$")


def is_learning_tables(path: Path) -> bool:
    """Whether ``path`` is a directory of runner.collect's tables (runs labelled in a ``run`` column), not a run."""
    train = path / "train.csv"
    if not train.is_file() or (path / "summary.json").is_file():
        return False
    with train.open() as f:
        return "run" in f.readline().strip().split(",")


def _read(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PlotError(f"{path}: unreadable ({str(exc).splitlines()[0]})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise PlotError(f"{path}: no column {', '.join(missing)} (expected runner.collect's tables)")
    if frame.empty:
        raise PlotError(f"{path}: no rows")
    return frame


def read_learning(path: Path) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The collected ``train.csv`` and, where present, ``eval_summary.csv``."""
    train = _read(path / "train.csv", TRAIN_COLUMNS)
    held_out = path / "eval_summary.csv"
    return train, (_read(held_out, EVAL_COLUMNS) if held_out.is_file() else None)


def group_of(run: str) -> str:
    """A run's group: its name without a trailing ``_s<seed>``."""
    return _SEED.sub("", run)


def rolling_accuracy(train: pd.DataFrame, window: int) -> pd.DataFrame:
    """Per run and step, training accuracy over the last ``window`` steps, weighted by answers."""
    frames = []
    for run, rows in train.sort_values(["run", "step"]).groupby("run", sort=False):
        correct = (rows["accuracy"] * rows["answers"]).rolling(window, min_periods=window).sum()
        frames.append(pd.DataFrame({"run": run, "group": group_of(run), "step": rows["step"],
                                    "accuracy": correct / rows["answers"].rolling(window, min_periods=window).sum()}))
    return pd.concat(frames, ignore_index=True).dropna(subset=["accuracy"])


def held_out_accuracy(summary: pd.DataFrame) -> pd.DataFrame:
    """Per run, held-out accuracy at the densest evaluated budget, pooled over lengths (weighted by answers),
    and the item chance pooled the same way."""
    dense = summary[summary["p"] == summary["p"].max()]
    weighted = dense.assign(correct=dense["accuracy"] * dense["answers"],
                            chance=dense["item_chance"] * dense["answers"])
    pooled = weighted.groupby("run", sort=False)[["correct", "chance", "answers"]].sum()
    return pd.DataFrame({"run": pooled.index, "group": [group_of(r) for r in pooled.index],
                         "accuracy": (pooled["correct"] / pooled["answers"]).to_numpy(),
                         "item_chance": (pooled["chance"] / pooled["answers"]).to_numpy()})


def plot_learning(train: pd.DataFrame, summary: pd.DataFrame | None, window: int = 50, title: str = "") -> Figure:
    """Training accuracy (``window``-step mean) per run, coloured by group; beside it, with held-out results,
    each run's held-out accuracy per group against the item chance (answering with a random value of the
    sequence's own records)."""
    curves = rolling_accuracy(train, window)
    if curves.empty:
        raise PlotError(f"no run has {window} steps: too few for a {window}-step mean")
    colours = policy_colours(curves["group"])
    fig = Figure(figsize=(11.0 if summary is not None else 6.4, 4.6), layout="constrained")
    axes = fig.subplots(1, 2 if summary is not None else 1, squeeze=False)[0]
    ax = axes[0]
    labelled = set()
    for _, rows in curves.groupby("run", sort=False):
        group = rows["group"].iloc[0]
        ax.plot(rows["step"], rows["accuracy"], color=colours[group], lw=1.0, alpha=0.8,
                label=None if group in labelled else group)
        labelled.add(group)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training accuracy ({window}-step mean)")
    ax.set_title("learning curves, one line per run")
    if summary is not None:
        held = held_out_accuracy(summary)
        _plot_held_out(axes[1], held, colours)
        ax.axhline(held["item_chance"].mean(), color="grey", ls=":", lw=1, label="held-out item chance")
    ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(title or "Learning: training and held-out accuracy")
    return fig


def _plot_held_out(ax, held: pd.DataFrame, colours: dict[str, str]) -> None:
    groups = list(dict.fromkeys(held["group"]))
    for i, group in enumerate(groups):
        rows = held[held["group"] == group]
        mean = rows["accuracy"].mean()
        ax.scatter([i] * len(rows), rows["accuracy"], color=colours.get(group, "grey"), zorder=3)
        ax.hlines(mean, i - 0.25, i + 0.25, color=colours.get(group, "grey"))
        ax.annotate(f"mean {mean:.3f}\n{len(rows)} run{'s' if len(rows) > 1 else ''}", (i + 0.27, mean),
                    va="center", fontsize="small")
    ax.axhline(held["item_chance"].mean(), color="grey", ls=":", lw=1, label="item chance")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize="small")
    ax.set_xlim(-0.6, len(groups) - 0.1)
    ax.set_xlabel("group")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("held-out, densest budget, pooled over lengths")
    ax.legend(loc="best", fontsize="small")


def learning_figures(path: Path) -> dict[str, Figure]:
    train, summary = read_learning(path)
    return {"learning": plot_learning(train, summary, title=f"Learning: {path.name}")}
