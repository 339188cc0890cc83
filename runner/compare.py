"""``python -m runner.compare <runner run dir>``: the simulator's step time for the runner's own steps.

Replays every recorded Plan through ``sim.engine.Engine`` with the calibrated cost model and the run's
layout, twice:

* ``sim_ms``: with the kept fractions the kernel actually selected (``sequences.csv``) as fixed budgets, on
  the attention backend each micro-batch ran (``micro_batches.csv``), which tests the time model alone;
* ``sim_plan_ms``: with the Plan's own budgets, so the simulator's coverage model also decides how much
  is kept (what a policy comparison in the simulator sees).

Both price each sequence with its sensitivity as the run's data generator drew it (``sequences.csv``): the data's
truth, which Plans do not carry.

Prints per-step predicted vs measured step time and the median absolute % error (warm-up steps, which
compile kernels, skipped; each step's Triton compilations beside it), and writes ``compare.csv`` and
``compare.json`` into the run dir. Then the peak memory per (DP rank, pipeline stage) over the compared steps:
``sim.memory`` for the same Plans (at the coverage model's kept fractions of each sequence's sensitivity), layout,
block size and memory config as the run's, against what the runner
measured on CUDA (``peak_memory_gb`` of ``micro_batches.csv``; empty for a CPU run), with the relative error,
printed and written to ``memory.csv``. Given several run dirs (the first is the baseline), also the measured
speedup, coverage and retrieval accuracy of each against the first. ``--out X.csv`` writes all of it there
instead of into the run dirs: one CSV (per step, every run), ``X.json`` (per run) and ``X_memory.csv`` (every
run's memory table), so that run dirs one only reads (committed results) stay as they are.

No cost profile describes a CPU: a run on the CPU is refused (one line, exit code 2) unless ``--profile`` names a
GPU's profile to price it with anyway, and then a note on stderr says that its errors measure the CPU against that
GPU.

A key that the config schema has made mandatory since a run wrote its ``.hydra/config.yaml`` (``cluster.hbm_gb``)
is read from the run's own group option (``conf/cluster/<its cluster.name>.yaml``), with a note on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.runner.config import TrainConfig
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.gpu_kinds import default_kind
from sparsebalance.sim.config import CostConfig, compose_config, validate
from sparsebalance.sim.core import (ArgumentParser, ConfigError, atomic_path, check_writable, group_options,
                                    one_line_errors, write_json_atomic)
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.cost import ROOFLINE_KEYS, make_cost
from sparsebalance.sim.engine import Engine, PlanArrays
from sparsebalance.sim.memory import GB, MemoryModel
from sparsebalance.sim.plan import Budget, Plan
from sparsebalance.sim.setup import policy_run

DEFAULT_PROFILE = default_kind().profile  # the default cluster's measured profile
# What the replay reads of each file, beyond its existence.
COLUMNS = {"steps.csv": ("step", "step_ms"), "sequences.csv": ("step", "seq_id", "sensitivity", "kept_fraction"),
           "micro_batches.csv": ("step", "dp_rank", "micro_batch", "stage")}
MEASURED_PEAK = "peak_memory_gb"  # micro_batches.csv; absent from runs older than the measurement, empty on CPU
SUMMARY_KEYS = ("mean_coverage", "final_loss", "final_accuracy")


def load_run(run_dir: Path):
    """The run's config (against the runner's schema), Plans, measured steps, micro-batch rows, per-sequence
    kernel stats and summary; a file that is missing or not what ``runner.train`` writes is one ConfigError
    naming it."""
    files = {name: run_dir / name for name in (".hydra/config.yaml", "plans.jsonl", "steps.csv", "micro_batches.csv",
                                                "sequences.csv", "summary.json")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ConfigError(f"{run_dir} is not a complete runner run dir: missing {', '.join(missing)}")
    return (_config(files[".hydra/config.yaml"]), _plans(files["plans.jsonl"]), _csv(files["steps.csv"]),
            _csv(files["micro_batches.csv"]), _csv(files["sequences.csv"]), _summary(files["summary.json"]))


def _config(path: Path) -> TrainConfig:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
        _fill_new_keys(merged, path)
        cfg = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{path} is not a runner config: {_first_line(exc)}") from None
    try:
        validate(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return cfg


def _fill_new_keys(cfg, path: Path) -> None:
    """Each mandatory key inside a group that the run's config lacks (the schema gained it after the run) from the
    group option the run names (``conf/<group>/<name>.yaml``), where that option exists; else one line saying which
    key is missing and how to supply it. A missing whole group is left to the schema's own error."""
    for key in sorted(k for k in OmegaConf.missing_keys(cfg) if "." in k):
        group = key.split(".")[0]
        name = OmegaConf.select(cfg, f"{group}.name", default=None)
        if name not in group_options(group):
            raise ConfigError(f"it lacks {key} (a key added to the schema after the run) and {group}.name={name!r} "
                              f"is no conf/{group}/ option to read it from; allowed: a config that sets {key}")
        value = OmegaConf.select(compose_config([f"{group}={name}"]), key)
        OmegaConf.update(cfg, key, value)
        print(f"note: {path} lacks {key} (added to the schema after the run); read as {value} from "
              f"conf/{group}/{name}.yaml", file=sys.stderr)


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


def backends_ran(micro_batches: pd.DataFrame, step: int, layout: Layout) -> np.ndarray | None:
    """``[dp, m]`` the backend each micro-batch of ``step`` ran its attention on, as micro_batches.csv records it
    (its first stage); None for a run that records none (before the backends), which ran ours throughout."""
    if "attention_backend" not in micro_batches:
        return None
    rows = micro_batches[(micro_batches["step"] == step) & (micro_batches["stage"] == 0)]
    ran = np.full((layout.dp, layout.micro_batches), OURS, dtype=object)
    ran[rows["dp_rank"].to_numpy(), rows["micro_batch"].to_numpy()] = rows["attention_backend"].astype(str).to_numpy()
    return ran.astype(str)


def replay(run_dir: Path, profile: str | None, skip: int) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(per-step table, memory table, summary) of one run dir, priced by ``profile`` (None: ``DEFAULT_PROFILE``,
    which a run on the CPU is refused)."""
    cfg, plans, steps, micro_batches, sequences, run_summary = load_run(run_dir)
    if cfg.runner.one_process:
        raise ConfigError(f"{run_dir} trained its layout's replicas one after another (runner.one_process=true): "
                          "its times are not a distributed step's; allowed: a run with one process per GPU "
                          "(python -m runner.replay times a Plan's replicas on one GPU)")
    profile = profile_for(run_dir, str(run_summary.get("device", "")), profile)
    cfg = policy_run(cfg)  # the attention backend the run trained on (runner.train's)
    cluster = Cluster.from_config(cfg.cluster)
    layout = Layout.from_config(cfg.layout, Cluster.gpus(cfg.cluster))
    # the run's own cost model: its block size is the one the kernel selected blocks at
    run_cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    # priced by the profile at its own block size and coefficients, whatever the run's roofline keys were
    cfg.cost = replace(cfg.cost, name="calibrated", profile=profile,
                       **{key: getattr(CostConfig, key) for key in ("block_size", *ROOFLINE_KEYS)})
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    engine = Engine(layout, cost, cluster)
    by_sequence = sequences.set_index(["step", "seq_id"])
    kept, sensitivity = by_sequence["kept_fraction"], by_sequence["sensitivity"]

    rows, truths = [], {}
    ran = {plan.step: backends_ran(micro_batches, plan.step, layout) for plan in plans}
    for plan in plans:
        absent = [a.seq_id for a in plan.assignments if (plan.step, a.seq_id) not in kept.index]
        if absent:
            raise ConfigError(f"{run_dir / 'sequences.csv'} has no row for step {plan.step}, seq_id {absent[0]} "
                              "of plans.jsonl; allowed: the files of one run")
        truth = truths[plan.step] = {a.seq_id: float(sensitivity[(plan.step, a.seq_id)]) for a in plan.assignments}
        measured_kf = {a.seq_id: Budget(p=a.budget.p, kept_fraction=float(kept[(plan.step, a.seq_id)]))
                       for a in plan.assignments}
        rows.append({
            "step": plan.step,
            "sim_ms": engine.step(plan.with_budgets(measured_kf), truth, ran=ran[plan.step]).record.step_ms,
            "sim_plan_ms": engine.step(plan, truth).record.step_ms,
        })
    table = steps[["step", "step_ms"]].rename(columns={"step_ms": "measured_ms"}).merge(pd.DataFrame(rows), on="step")
    table["compilations"] = _compilations(run_dir / "train.csv", table["step"])
    table["error_pct"] = 100 * (table["sim_ms"] - table["measured_ms"]) / table["measured_ms"]
    table["plan_error_pct"] = 100 * (table["sim_plan_ms"] - table["measured_ms"]) / table["measured_ms"]
    scored = table[table["step"] >= table["step"].min() + skip]
    if scored.empty:
        raise ConfigError(f"--skip {skip} leaves none of the run's {len(table)} steps to compare")
    memory = memory_table(MemoryModel.from_config(cfg, layout, run_cost.block_size), run_cost,
                          [p for p in plans if p.step in set(scored["step"])], truths, ran, micro_batches)
    errors = memory["error_pct"].dropna().abs()
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
        # Triton compilations in the compared steps (a step that compiles is no cost model's); null: not recorded
        "compilations_in_compared_steps": None if scored["compilations"].isna().any()
        else int(scored["compilations"].sum()),
        # over (DP rank, stage); null where nothing was measured (a CPU run)
        "peak_memory_max_abs_error_pct": float(errors.max()) if len(errors) else None,
        **{key: run_summary[key] for key in SUMMARY_KEYS},
    }
    return table.assign(policy=summary["policy"]), memory, summary


def profile_for(run_dir: Path, device: str, profile: str | None) -> str:
    """The profile that prices a run: the one named, else ``DEFAULT_PROFILE``. No profile describes a CPU, so a
    CPU run is refused one by default and is priced by a named GPU profile only with a note that says so."""
    if not device.startswith("cpu"):
        return profile or DEFAULT_PROFILE
    if profile is None:
        raise ConfigError(f"{run_dir} ran on the CPU (summary.json device={device!r}), and no cost profile describes a "
                          f"CPU: {DEFAULT_PROFILE} prices the {default_kind().gpu}, so its errors would measure the "
                          "CPU against that GPU; allowed: a run on a GPU, or a GPU's profile named to price this one "
                          "anyway (runner.compare --profile PATH: a check of the pipeline, not of the cost model)")
    print(f"note: {run_dir} ran on the CPU, which no cost profile describes: priced by {profile}, its errors measure "
          "the CPU against that profile's GPU, not the cost model", file=sys.stderr)
    return profile


def _compilations(path: Path, step: pd.Series) -> pd.Series:
    """Each step's Triton compilations from the runner's train.csv, missing (an empty cell) where the run
    recorded none (runs older than the count, or no train.csv)."""
    if path.is_file():
        train = pd.read_csv(path)
        if "compilations" in train.columns:
            by_step = pd.to_numeric(train.set_index("step")["compilations"], errors="coerce")
            return step.map(by_step).astype("Int64")
    return pd.Series(pd.NA, index=step.index, dtype="Int64")


def memory_table(memory: MemoryModel, cost, plans: list[Plan], truths: dict[int, dict[int, float]],
                 ran: dict[int, np.ndarray | None], micro_batches: pd.DataFrame) -> pd.DataFrame:
    """Per (DP rank, stage), the most bytes sim.memory predicts over the Plans' micro-batches (at the kept
    fractions the coverage model gives each sequence's sensitivity, ``truths``: step -> {id: s}, on the backends
    they ran, ``ran``: step -> ``backends_ran``) and the most the runner measured over the same steps' rows, and
    the relative error; measured and error are missing (an empty cell) where the run measured nothing."""
    layout = memory.layout
    predicted = np.max([truth_bytes(memory, cost, plan, truths[plan.step], ran[plan.step]) for plan in plans],
                       axis=(0, 2))  # [dp, pp]
    rows = micro_batches[micro_batches["step"].isin([p.step for p in plans])]
    if MEASURED_PEAK in rows.columns:
        measured = pd.to_numeric(rows[MEASURED_PEAK], errors="coerce").groupby(
            [rows["dp_rank"], rows["stage"]]).max()
    else:
        measured = pd.Series(dtype=float)
    index = pd.MultiIndex.from_product([range(layout.dp), range(layout.pp)], names=["dp_rank", "stage"])
    got = (measured.reindex(index) * GB).round().astype("Int64")  # <NA>: an empty cell, never a NaN
    want = pd.Series(predicted.reshape(-1), index=index).round().astype("Int64")
    error = (100 * (want - got) / got).astype("Float64")
    return pd.DataFrame({"predicted_bytes": want, "measured_bytes": got, "error_pct": error}).reset_index()


def truth_bytes(memory: MemoryModel, cost, plan: Plan, truth: dict[int, float], ran: np.ndarray | None) -> np.ndarray:
    """[dp, m, pp] bytes of a plan run on sequences of these sensitivities (``MemoryModel.plan_bytes`` prices
    the most its budgets can keep, as a planner must), with the micro-batches that ran on a sparse peer
    (``ran``, ``[dp, m]`` names: ``backends_ran``; None: none) holding its padded copies."""
    arrays = PlanArrays.from_plan(plan, truth)
    on_peer = None if ran is None else np.isin(np.reshape(ran, -1), cost.sparse_backends())
    return memory.bytes_of(arrays.dp_rank, arrays.micro_batch, arrays.length, arrays.kept(cost),
                           arrays.budgets.fixes_blocks, on_peer)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m runner.compare", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="runner run dirs; the first is the baseline")
    parser.add_argument("--profile", default=None,
                        help=f"calibrated cost profile (JSON; default {DEFAULT_PROFILE}, which no CPU run gets)")
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the error")
    parser.add_argument("--out", type=Path, help="write the combined per-step CSV here (its .json and _memory.csv "
                                                 "beside it) instead of into the run dirs")
    args = parser.parse_args(argv)
    if args.skip < 0:
        raise ConfigError(f"--skip {args.skip}: must be >= 0 (the number of warm-up steps left out)")
    if args.out is not None:
        if not args.out.parent.is_dir():
            raise ConfigError(f"--out {args.out}: no directory {args.out.parent} to write it in")
        if args.out.suffix == ".json":
            raise ConfigError(f"--out {args.out}: names the CSV, and its JSON goes to the same path with .json; "
                              "allowed: a path not ending in .json (e.g. compare.csv)")
        check_writable(args.out, "--out")  # its .json and _memory.csv go into the same directory
    return args


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every run is replayed before anything is written: a bad run dir among several leaves no file behind.
    replayed = [replay(run_dir, args.profile, args.skip) for run_dir in args.run_dirs]
    tables, summaries = [t for t, _, _ in replayed], [s for _, _, s in replayed]
    base = summaries[0]
    for summary in summaries:
        summary["measured_speedup_vs_first"] = base["measured_step_ms_median"] / summary["measured_step_ms_median"]
        summary["sim_speedup_vs_first"] = base["sim_step_ms_median"] / summary["sim_step_ms_median"]
    for run_dir, (table, memory, summary) in zip(args.run_dirs, replayed, strict=True):
        if not args.out:
            _write_csv(table, run_dir / "compare.csv")
            _write_csv(memory, run_dir / "memory.csv")
            write_json_atomic(run_dir / "compare.json", summary)
        print(table.round(2).to_string(index=False))
        print(f"{summary['policy']}: median |error| {summary['median_abs_error_pct']:.2f}% over "
              f"{summary['steps_compared']} steps (measured kept fractions); "
              f"{summary['median_abs_error_pct_plan_budgets']:.2f}% with the Plan's budgets")
        print(f"{summary['policy']}: peak memory per (DP rank, stage), predicted (sim.memory) vs measured")
        print(memory.round(3).astype(object).where(memory.notna(), "-").to_string(index=False))
    if len(summaries) > 1:
        cols = ["policy", "measured_step_ms_median", "sim_step_ms_median", "median_abs_error_pct",
                "measured_speedup_vs_first", "sim_speedup_vs_first", "mean_coverage", "final_accuracy",
                "compilations_in_compared_steps", "peak_memory_max_abs_error_pct"]
        print(pd.DataFrame(summaries)[cols].round(4).to_string(index=False))
    if args.out:
        _write_csv(pd.concat(tables), args.out)
        memories = [memory.assign(policy=summary["policy"]) for (_, memory, summary) in replayed]
        _write_csv(pd.concat(memories), memory_path(args.out))
        write_json_atomic(args.out.with_suffix(".json"), {"profile": summaries[0]["profile"], "runs": summaries})
    return 0


def memory_path(out: Path) -> Path:
    """Where ``--out`` puts every run's memory table: beside it, ``<stem>_memory.csv``."""
    return out.with_name(f"{out.stem}_memory.csv")


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.6g")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
