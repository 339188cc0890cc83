"""``python -m runner.collect RUN_DIR [RUN_DIR ...] --out DIR``: the tables of several training runs in one place,
every row labelled with its run (the run dir's name).

Written to ``DIR``, each file where at least one run has its source:

- ``train.csv``: every run's ``train.csv`` (per step loss, accuracy and times), without the plan hash: the plans
  themselves stay in the run dirs.
- ``eval_summary.csv`` and ``eval.csv``: ``runner.evaluate``'s tables (per length and budget; per sequence).
- ``budgets.csv``: per run and step, from ``sequences.csv``: the Plans' budgets (mean, min, max ``p``) and the
  kernel's kept fraction and coverage, as plain means over sequences and as attention-weighted means (weight
  length squared, the attention work), which is what the kernel sees.
- ``coverage_by_length.csv``: the same per run and length bucket over all steps: which lengths got the budget,
  which the attention-weighted means hide.

Every run dir is read before anything is written; a table is replaced whole or not at all.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from sparsebalance.sim.core import (ArgumentParser, ConfigError, atomic_path, check_writable, number_list,
                                    one_line_errors)

# Six significant digits: the tables are read by people and plots, and stay a few MB for thousands of steps.
TABLE_FORMAT = "%.6g"
CONCATENATED = ("train.csv", "eval_summary.csv", "eval.csv")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m runner.collect", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs of runner.train (each with train.csv)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the tables")
    parser.add_argument("--length-edges", type=number_list(int), default=[128, 192, 256, 384],
                        help="inner edges of the length buckets, ascending (the outer ones are the shortest "
                             "and longest sequence)")
    return parser.parse_args(argv)


def check_edges(edges: list[int]) -> None:
    if edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ConfigError(f"--length-edges {','.join(map(str, edges))}: edges must be positive and strictly ascending")


def run_names(runs: list[Path]) -> list[str]:
    """The label of every run: its dir's name, which must exist, hold train.csv and be unique."""
    for run in runs:
        if not (run / "train.csv").is_file():
            raise ConfigError(f"{run}: not a training run dir (no train.csv)")
    names = [run.name for run in runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"run dirs share the name {', '.join(twice)}; rows are labelled by dir name")
    return names


def concatenated(runs: list[Path], names: list[str], file: str) -> pd.DataFrame | None:
    """One file of every run that has it, the run's label first; None when no run has it."""
    frames = [pd.read_csv(run / file).assign(run=name)
              for run, name in zip(runs, names, strict=True) if (run / file).is_file()]
    if not frames:
        return None
    table = pd.concat(frames, ignore_index=True)
    return table[["run", *(c for c in table.columns if c != "run")]]


def budgets(sequences: pd.DataFrame) -> pd.DataFrame:
    """Per run and step: budgets, and the kernel's kept fraction and coverage, plain and attention-weighted."""
    weight = sequences["length"].astype(float) ** 2
    frame = sequences.assign(weight=weight, kept_weighted=sequences["kept_fraction"] * weight,
                             coverage_weighted=sequences["coverage"] * weight)
    grouped = frame.groupby(["run", "step"], sort=False)
    sums = grouped[["weight", "kept_weighted", "coverage_weighted"]].sum()
    table = pd.DataFrame({
        "mean_p": grouped["p"].mean(), "min_p": grouped["p"].min(), "max_p": grouped["p"].max(),
        "kept_fraction": grouped["kept_fraction"].mean(),
        "kept_fraction_attn": sums["kept_weighted"] / sums["weight"],
        "coverage": grouped["coverage"].mean(), "coverage_attn": sums["coverage_weighted"] / sums["weight"],
    })
    return table.reset_index()


def coverage_by_length(sequences: pd.DataFrame, edges: list[int]) -> pd.DataFrame:
    """Per run and length bucket over all steps: sequences, mean budget, kept fraction and coverage."""
    shortest, longest = int(sequences["length"].min()), int(sequences["length"].max())
    bins = [shortest - 1, *(e for e in edges if shortest - 1 < e < longest), longest]
    buckets = pd.cut(sequences["length"], bins)
    # sorted by run, then by the buckets' length order (categorical), not by their labels' text
    table = sequences.assign(length_bucket=buckets).groupby(["run", "length_bucket"], observed=True).agg(
        sequences=("p", "size"), mean_p=("p", "mean"), kept_fraction=("kept_fraction", "mean"),
        coverage=("coverage", "mean")).reset_index()
    return table.assign(length_bucket=table["length_bucket"].astype(str))


def tables(runs: list[Path], edges: list[int]) -> dict[str, pd.DataFrame]:
    names = run_names(runs)
    out = {file: concatenated(runs, names, file) for file in CONCATENATED}
    if out["train.csv"] is not None:
        out["train.csv"] = out["train.csv"].drop(columns=["plan_sha256"], errors="ignore")
    sequences = concatenated(runs, names, "sequences.csv")
    if sequences is not None:
        out["budgets.csv"] = budgets(sequences)
        out["coverage_by_length.csv"] = coverage_by_length(sequences, edges)
    return {file: table for file, table in out.items() if table is not None}


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_edges(args.length_edges)
    check_writable(args.out, "--out", directory=True)
    collected = tables(args.runs, args.length_edges)
    for file, table in collected.items():
        with atomic_path(args.out / file) as tmp:
            table.to_csv(tmp, index=False, float_format=TABLE_FORMAT)
        print(f"{args.out / file}: {len(table)} rows")
    return 0


if __name__ == "__main__":
    main()
