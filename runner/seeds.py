"""``python -m runner.seeds RUN_DIR [RUN_DIR ...] [--baseline baseline] [--policy sparsebalance] [--out CSV]``:
does a policy's training change held-out accuracy? Compared over seeds, not over answers.

Every run dir holds ``summary.json`` (its policy and seed, written by ``runner.train``) and ``eval_summary.csv``
(written by ``runner.evaluate``). A run's accuracy under a budget ``p`` is its correct answers over all
evaluated lengths divided by its answers. Runs of the two policies are paired by seed (same data, same
initialisation), and the paired differences give the mean effect with a Student-t interval over seeds and a
Wilcoxon signed-rank p-value (scipy). Answer-level intervals (``eval_summary.csv``'s Wilson ones) hold the
answer noise of one run only; the seed-to-seed spread, which decides whether a run finds the lookup at all, is
far larger, so only the seeds can say whether the policy matters.

Printed per budget ``p``: one row per seed (both accuracies, the difference) and the summary; written to
``--out`` (if given) as one CSV of the per-seed rows. From one seed pair there is no spread to estimate: the
summary gives the difference and says that the interval and the p-value are n/a (one seed pair).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from scipy import stats

from sparsebalance.sim.core import ArgumentParser, ConfigError, atomic_path, check_writable, one_line_errors
from sparsebalance.sim.results import FLOAT_FORMAT

CONFIDENCE = 0.95


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m runner.seeds", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs, each with summary.json and eval_summary.csv")
    parser.add_argument("--baseline", default="baseline", help="the policy compared against")
    parser.add_argument("--policy", default="sparsebalance", help="the policy whose effect is asked")
    parser.add_argument("--out", type=Path, help="CSV of the per-seed rows")
    return parser.parse_args(argv)


def run_accuracy(run: Path) -> pd.DataFrame:
    """One run's held-out accuracy per budget p, pooled over lengths, with its policy, seed and steps."""
    try:
        summary = json.loads((run / "summary.json").read_text())
        table = pd.read_csv(run / "eval_summary.csv")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{run}: not an evaluated run dir ({exc}); needs summary.json and eval_summary.csv") from exc
    table["correct"] = table["accuracy"] * table["answers"]
    pooled = table.groupby("p").agg(steps=("steps", "first"), correct=("correct", "sum"),
                                    answers=("answers", "sum")).reset_index()
    pooled["accuracy"] = pooled["correct"] / pooled["answers"]
    return pooled.assign(run=run.name, policy=summary["policy"], seed=summary["seed"])


def paired(runs: pd.DataFrame, baseline: str, policy: str) -> pd.DataFrame:
    """Per seed and p: the two policies' accuracies and their difference; only seeds both policies ran."""
    for name in (baseline, policy):
        if name not in set(runs["policy"]):
            raise ConfigError(f"--baseline/--policy {name!r}: no run of it; runs are of "
                              f"{', '.join(sorted(set(runs['policy'])))}")
    steps = sorted(set(runs.loc[runs["policy"].isin([baseline, policy]), "steps"]))
    if len(steps) != 1:
        raise ConfigError(f"runs trained different steps ({', '.join(map(str, steps))}); compare runs of equal steps")
    a = runs[runs["policy"] == baseline].set_index(["p", "seed"])["accuracy"]
    b = runs[runs["policy"] == policy].set_index(["p", "seed"])["accuracy"]
    both = pd.concat({baseline: a, policy: b}, axis=1).dropna()
    if both.empty:
        raise ConfigError(f"no seed has runs of both {baseline} and {policy}")
    both["difference"] = both[policy] - both[baseline]
    return both.reset_index().sort_values(["p", "seed"], ascending=[False, True])


def effect(differences: pd.Series) -> dict:
    """Mean paired difference, its Student-t interval over seeds, and the Wilcoxon signed-rank p-value; the last
    three None from one seed pair, which has no spread."""
    n, mean = len(differences), float(differences.mean())
    if n < 2:
        return {"seeds": n, "mean": mean, "ci_low": None, "ci_high": None, "wilcoxon_p": None}
    sem = stats.sem(differences)
    # Equal differences have no spread: the interval is the mean itself (scipy's t.interval gives NaN at scale 0).
    low, high = (mean, mean) if sem == 0 else stats.t.interval(CONFIDENCE, n - 1, loc=mean, scale=sem)
    nonzero = differences[differences != 0]
    wilcoxon = float(stats.wilcoxon(nonzero).pvalue) if len(nonzero) else 1.0
    return {"seeds": n, "mean": mean, "ci_low": float(low), "ci_high": float(high), "wilcoxon_p": wilcoxon}


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out:
        check_writable(args.out, "--out")
    runs = pd.concat([run_accuracy(run) for run in args.runs], ignore_index=True)
    rows = paired(runs, args.baseline, args.policy)
    for p, group in rows.groupby("p", sort=False):
        e = effect(group["difference"])
        spread = ("interval and Wilcoxon p n/a (one seed pair)" if e["seeds"] < 2 else
                  f"[{e['ci_low']:+.4f}, {e['ci_high']:+.4f}] ({CONFIDENCE:.0%} t over seeds), "
                  f"Wilcoxon p = {e['wilcoxon_p']:.3f}")
        print(f"p = {p:g}: {args.policy} - {args.baseline} over {e['seeds']} seeds: {e['mean']:+.4f} {spread}")
        print(group.drop(columns="p").to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    if args.out:
        with atomic_path(args.out) as tmp:
            rows.to_csv(tmp, index=False, float_format=FLOAT_FORMAT)
    return 0


if __name__ == "__main__":
    main()
