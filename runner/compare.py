"""``python -m runner.compare <runner run dir>``: the simulator's step time for the runner's own steps.

Replays every recorded Plan through ``sim.engine.Engine`` with the calibrated cost model and the run's
layout, twice:

* ``sim_ms``: with the kept fractions the kernel actually selected (``sequences.csv``) as fixed budgets,
  which tests the time model alone;
* ``sim_plan_ms``: with the Plan's own budgets, so the simulator's coverage model also decides how much
  is kept (what a policy comparison in the simulator sees).

Prints per-step predicted vs measured step time and the median absolute % error (warm-up steps, which
compile kernels, skipped), and writes ``compare.csv`` and ``compare.json`` into the run dir. Given several
run dirs (the first is the baseline), also the measured speedup, coverage and retrieval accuracy of each
against the first; ``--out`` writes all of it as one CSV (per step) and JSON (per run).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config import TrainConfig
from sim.cluster import Cluster, Layout
from sim.config import validate
from sim.core import ConfigError, atomic_path, one_line_errors, write_json_atomic
from sim.cost import make_cost
from sim.engine import Engine
from sim.plan import Budget, Plan

DEFAULT_PROFILE = "calibrate/profiles/h200.json"
# What the replay reads of each file, beyond its existence.
COLUMNS = {"steps.csv": ("step", "step_ms"), "sequences.csv": ("step", "seq_id", "kept_fraction")}
SUMMARY_KEYS = ("mean_coverage", "final_loss", "final_accuracy")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ConfigError line, as every other bad input."""

    def error(self, message: str):
        raise ConfigError(message)


def load_run(run_dir: Path):
    """The run's config (against the runner's schema), Plans, measured steps, per-sequence kernel stats and
    summary; a file that is missing or not what ``runner.train`` writes is one ConfigError naming it."""
    files = {name: run_dir / name for name in (".hydra/config.yaml", "plans.jsonl", "steps.csv", "sequences.csv",
                                                "summary.json")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ConfigError(f"{run_dir} is not a complete runner run dir: missing {', '.join(missing)}")
    return (_config(files[".hydra/config.yaml"]), _plans(files["plans.jsonl"]), _csv(files["steps.csv"]),
            _csv(files["sequences.csv"]), _summary(files["summary.json"]))


def _config(path: Path) -> TrainConfig:
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path)))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{path} is not a runner config: {_first_line(exc)}") from None
    try:
        validate(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return cfg


def _plans(path: Path) -> list[Plan]:
    plans = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line:
            continue
        try:
            plans.append(Plan.from_json(line))
        except (ValueError, KeyError, TypeError) as exc:  # JSON, missing fields, out-of-range budgets
            raise ConfigError(f"{path} line {number} is not a Plan: {type(exc).__name__}: {_first_line(exc)}") from None
    return plans


def _csv(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not a CSV table: {_first_line(exc)}") from None
    absent = [c for c in COLUMNS[path.name] if c not in frame.columns]
    numeric = frame[[c for c in COLUMNS[path.name] if c in frame.columns]].apply(pd.to_numeric, errors="coerce")
    if absent or numeric.isna().any().any():
        raise ConfigError(f"{path} needs the numeric columns {', '.join(COLUMNS[path.name])}"
                          f"{f'; missing {absent}' if absent else ''} (as runner.train writes it)")
    return frame


def _summary(path: Path) -> dict:
    try:
        summary = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not JSON: {_first_line(exc)}") from None
    if not isinstance(summary, dict) or any(k not in summary for k in SUMMARY_KEYS):
        raise ConfigError(f"{path} is not a runner summary: it needs the keys {', '.join(SUMMARY_KEYS)}")
    return summary


def replay(run_dir: Path, profile: str, skip: int) -> tuple[pd.DataFrame, dict]:
    cfg, plans, steps, sequences, run_summary = load_run(run_dir)
    cfg.cost.name, cfg.cost.profile = "calibrated", profile
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    engine = Engine(layout, cost, cluster)
    kept = sequences.set_index(["step", "seq_id"])["kept_fraction"]

    rows = []
    for plan in plans:
        absent = [a.seq_id for a in plan.assignments if (plan.step, a.seq_id) not in kept.index]
        if absent:
            raise ConfigError(f"{run_dir / 'sequences.csv'} has no row for step {plan.step}, seq_id {absent[0]} "
                              "of plans.jsonl; allowed: the files of one run")
        measured_kf = {a.seq_id: Budget(p=a.budget.p, kept_fraction=float(kept[(plan.step, a.seq_id)]))
                       for a in plan.assignments}
        rows.append({
            "step": plan.step,
            "sim_ms": engine.step(plan.with_budgets(measured_kf)).record.step_ms,
            "sim_plan_ms": engine.step(plan).record.step_ms,
        })
    table = steps[["step", "step_ms"]].rename(columns={"step_ms": "measured_ms"}).merge(pd.DataFrame(rows), on="step")
    table["error_pct"] = 100 * (table["sim_ms"] - table["measured_ms"]) / table["measured_ms"]
    table["plan_error_pct"] = 100 * (table["sim_plan_ms"] - table["measured_ms"]) / table["measured_ms"]
    scored = table[table["step"] >= table["step"].min() + skip]
    if scored.empty:
        raise ConfigError(f"--skip {skip} leaves none of the run's {len(table)} steps to compare")
    summary = {
        "run_dir": str(run_dir),
        "policy": cfg.policy.name,
        "profile": profile,
        "steps_compared": int(len(scored)),
        "skipped_warmup_steps": skip,
        "median_abs_error_pct": float(np.median(np.abs(scored["error_pct"]))),
        "mean_abs_error_pct": float(np.mean(np.abs(scored["error_pct"]))),
        "median_abs_error_pct_plan_budgets": float(np.median(np.abs(scored["plan_error_pct"]))),
        "measured_step_ms_median": float(scored["measured_ms"].median()),
        "sim_step_ms_median": float(scored["sim_ms"].median()),
        **{key: run_summary[key] for key in SUMMARY_KEYS},
    }
    return table.assign(policy=summary["policy"]), summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="python -m runner.compare", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="runner run dirs; the first is the baseline")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="calibrated cost profile (JSON)")
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the error")
    parser.add_argument("--out", type=Path, help="write the combined per-step CSV here (and a .json beside it)")
    args = parser.parse_args(argv)
    if args.skip < 0:
        raise ConfigError(f"--skip {args.skip}: must be >= 0 (the number of warm-up steps left out)")
    if args.out is not None and not args.out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: no directory {args.out.parent} to write it in")
    return args


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every run is replayed before anything is written: a bad run dir among several leaves no file behind.
    replayed = [replay(run_dir, args.profile, args.skip) for run_dir in args.run_dirs]
    tables, summaries = [t for t, _ in replayed], [s for _, s in replayed]
    base = summaries[0]
    for summary in summaries:
        summary["measured_speedup_vs_first"] = base["measured_step_ms_median"] / summary["measured_step_ms_median"]
        summary["sim_speedup_vs_first"] = base["sim_step_ms_median"] / summary["sim_step_ms_median"]
    for run_dir, table, summary in zip(args.run_dirs, tables, summaries):
        _write_csv(table, run_dir / "compare.csv")
        write_json_atomic(run_dir / "compare.json", summary)
        print(table.round(2).to_string(index=False))
        print(f"{summary['policy']}: median |error| {summary['median_abs_error_pct']:.2f}% over "
              f"{summary['steps_compared']} steps (measured kept fractions); "
              f"{summary['median_abs_error_pct_plan_budgets']:.2f}% with the Plan's budgets")
    if len(summaries) > 1:
        cols = ["policy", "measured_step_ms_median", "sim_step_ms_median", "median_abs_error_pct",
                "measured_speedup_vs_first", "sim_speedup_vs_first", "mean_coverage", "final_accuracy"]
        print(pd.DataFrame(summaries)[cols].round(4).to_string(index=False))
    if args.out:
        _write_csv(pd.concat(tables), args.out)
        write_json_atomic(args.out.with_suffix(".json"), {"profile": args.profile, "runs": summaries})
    return 0


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.6g")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
