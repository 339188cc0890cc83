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
from omegaconf import OmegaConf

from sim.plan import Budget, Plan
from sim.cluster import Cluster, Layout
from sim.core import ConfigError, write_json_atomic
from sim.cost import make_cost
from sim.engine import Engine

DEFAULT_PROFILE = "calibrate/profiles/h200.json"


def load_run(run_dir: Path):
    """The run's composed config, Plans, measured steps and per-sequence kernel stats."""
    needed = [run_dir / ".hydra" / "config.yaml", run_dir / "plans.jsonl", run_dir / "steps.csv",
              run_dir / "sequences.csv"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(f"{run_dir} is not a complete runner run dir: missing {', '.join(missing)}")
    cfg = OmegaConf.load(needed[0])
    plans = [Plan.from_json(line) for line in needed[1].read_text().splitlines() if line]
    return cfg, plans, pd.read_csv(needed[2]), pd.read_csv(needed[3])


def replay(run_dir: Path, profile: str, skip: int) -> tuple[pd.DataFrame, dict]:
    cfg, plans, steps, sequences = load_run(run_dir)
    cfg.cost = OmegaConf.merge(cfg.cost, {"name": "calibrated", "profile": profile})
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    cost = make_cost(cfg.cost, cfg.model, cluster)
    engine = Engine(layout, cost, cluster)
    kept = sequences.set_index(["step", "seq_id"])["kept_fraction"]

    rows = []
    for plan in plans:
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
    run_summary = json.loads((run_dir / "summary.json").read_text())
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
        "mean_coverage": run_summary["mean_coverage"],
        "final_loss": run_summary["final_loss"],
        "final_accuracy": run_summary["final_accuracy"],
    }
    return table.assign(policy=summary["policy"]), summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="runner run dirs; the first is the baseline")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="calibrated cost profile (JSON)")
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the error")
    parser.add_argument("--out", type=Path, help="write the combined per-step CSV here (and a .json beside it)")
    args = parser.parse_args(argv)
    if args.skip < 0:
        parser.error(f"--skip {args.skip}: must be >= 0 (the number of warm-up steps left out)")
    tables, summaries = [], []
    for run_dir in args.run_dirs:
        try:
            table, summary = replay(run_dir, args.profile, args.skip)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        table.to_csv(run_dir / "compare.csv", index=False, float_format="%.6g")
        write_json_atomic(run_dir / "compare.json", summary)
        print(table.round(2).to_string(index=False))
        print(f"{summary['policy']}: median |error| {summary['median_abs_error_pct']:.2f}% over "
              f"{summary['steps_compared']} steps (measured kept fractions); "
              f"{summary['median_abs_error_pct_plan_budgets']:.2f}% with the Plan's budgets")
        tables.append(table)
        summaries.append(summary)
    base = summaries[0]
    for summary in summaries:
        summary["measured_speedup_vs_first"] = base["measured_step_ms_median"] / summary["measured_step_ms_median"]
        summary["sim_speedup_vs_first"] = base["sim_step_ms_median"] / summary["sim_step_ms_median"]
    if len(summaries) > 1:
        cols = ["policy", "measured_step_ms_median", "sim_step_ms_median", "median_abs_error_pct",
                "measured_speedup_vs_first", "sim_speedup_vs_first", "mean_coverage", "final_accuracy"]
        print(pd.DataFrame(summaries)[cols].round(4).to_string(index=False))
    if args.out:
        pd.concat(tables).to_csv(args.out, index=False, float_format="%.6g")
        write_json_atomic(args.out.with_suffix(".json"), {"profile": args.profile, "runs": summaries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
