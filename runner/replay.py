"""``python -m runner.replay +experiment=paper steps=3 --policies baseline,lbb,verl,sparsebalance``: the work of
every GPU of a layout, timed on the one local device, composed into steps by the simulator's own schedule.

For a config of ``sim.run`` (the same overrides) each policy's Plans are made exactly as ``sim.run`` makes them
(``sim.setup.make_planner``), step by step, each planner shown what the kernel reported of the steps before
(its kept fraction and coverage per sequence) and the replayed step time. Then, on this one device, every DP rank's
micro-batches and,
with pipeline stages, every stage's share of the layers run one after another: the forward through the stages
in order, the backward in reverse, each stage's forward and backward timed apart (CUDA events; the host clock
on the CPU) after ``--warmup`` untimed runs of the same micro-batch, which compile the kernels' specialisations
off the clock. They run the runner's own model stages (``runner.staged``: built as ``runner.train`` builds them,
the same weights) on the micro-batch packed as the runner packs it, with the Plan's per-sequence budgets,
through the real attention backend; where the cost model charges activation checkpointing (``cost.recompute``),
every layer's backward recomputes its forward with the blocks its forward selected. ``sim.engine.Engine``
then composes each step from those measured per-(rank, stage, micro-batch)
times instead of the cost model's: 1F1B, the barrier, and the communication -- stage hand-offs and the
gradient all-reduce -- which is modelled (sim.cluster's alpha-beta model), not run. Nothing else runs on the
clock either: no optimiser step, no data loading.

Writes into ``--out`` (a new directory, all at the end): per policy a Results directory in ``sim.run``'s schema
(the kernel's kept fractions as the Plans' budgets, so kept fraction and work are what ran; ``plans.jsonl``
holds the Plans unchanged) plus ``replay.csv``, per (step, rank, micro-batch, stage) measured vs predicted ms;
and ``comparison.csv``/``.json``, the printed tables: per policy the replayed step time, the simulator's for
the same Plans (``sim_ms``, what ``sim.run`` reports; ``sim_kf_ms`` with the kernel's kept fractions as the
budgets, the time model alone), the median absolute per-micro-batch cost-model error at the kernel's kept
fractions (``mb_err_%``) and at the Plans' modelled ones (``mb_err_plan_%``); and the speedups over each
baseline, replayed (``x_<baseline>``), simulated (``sim_x_``) and simulated at the kernel's kept fractions
(``sim_kf_x_``), printed one row per pair with the replayed one's difference in percent.

Every policy replays the same steps: steps run in rounds (step s of every policy) and ``--deadline-s`` stops
before a round that the last one says would end past it. Bad input is one ``error:`` line and exit code 2
before anything runs or is written.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsebalance.runner.attention import BACKENDS
from sparsebalance.runner.data import pack
from sparsebalance.runner.device import check_attention, device_type
from sparsebalance.runner.staged import Clock, Measured, StagedModel, clock_name, make_clock, replay_step
from sparsebalance.runner.task import TaskConfig
from sparsebalance.sim.cluster import Layout
from sparsebalance.sim.compare import BASELINES, label, names, policy_variant
from sparsebalance.sim.config import PolicyConfig, RunConfig, compose_config
from sparsebalance.sim.core import (ArgumentParser, ConfigError, check_writable, group_options, one_line_errors,
                                    preset_overrides, temporary_dir, write_json_atomic)
from sparsebalance.sim.engine import Engine, PlanArrays
from sparsebalance.sim.plan import Budget, Plan
from sparsebalance.sim.planner import Planner
from sparsebalance.sim.results import FLOAT_FORMAT, Results
from sparsebalance.sim.setup import load_policy, make_planner, policy_setup, prepare
from sparsebalance.sim.shapes import ModelShape
from sparsebalance.sim.workload import requests, truth_of

COMMUNICATION_NOTE = ("communication is modelled, not run: stage hand-offs and the gradient all-reduce come from "
                      "sim.cluster's alpha-beta model; only compute is measured")


# ----------------------------------------------------------------------------- composition
def kernel_budgets(plan: Plan, measured: Measured) -> Plan:
    """The Plan with the kept fraction each sequence's kernel selection reached as its budget, whatever the
    Plan's budget was (coverage target, kept fraction, top-k with or without its floor): what ran."""
    return plan.with_budgets({a.seq_id: Budget(p=a.budget.p, kept_fraction=min(1.0, measured.kept[a.seq_id]))
                              for a in plan.assignments})


@dataclass
class PolicyReplay:
    """One policy's replayed steps: the Results, the per-micro-batch comparison, and the simulator's steps."""

    name: str
    policy: PolicyConfig
    planner: Planner
    results: Results
    rows: list[pd.DataFrame]
    sim_ms: list[float]
    sim_kf_ms: list[float]


def compose(replay: PolicyReplay, engine: Engine, plan: Plan, measured: Measured, truth: dict[int, float]) -> float:
    """The step from the measured times (the engine's schedule and modelled communication), the simulator's
    own step for the same Plan, and the per-micro-batch comparison; returns the replayed step's ms."""
    at_kernel = kernel_budgets(plan, measured)
    outcome = engine.step(at_kernel, truth, busy_ms=(measured.fwd_ms, measured.bwd_ms),
                          predicted_ms=replay.planner.predicted_ms)
    replay.results.add(outcome.record, outcome.rows, plan.to_json())
    replay.sim_ms.append(engine.step(plan, truth).record.step_ms)
    replay.sim_kf_ms.append(engine.step(at_kernel, truth).record.step_ms)
    replay.rows.append(micro_batch_rows(engine, plan, measured, truth))
    return outcome.record.step_ms


def micro_batch_rows(engine: Engine, plan: Plan, measured: Measured, truth: dict[int, float]) -> pd.DataFrame:
    """Per non-empty (rank, micro-batch, stage): measured vs the cost model's ms, at the kernel's kept
    fractions and at the Plan's modelled ones (the coverage model's)."""
    cost, layout = engine.cost, engine.layout
    dp, m, pp = layout.dp, layout.micro_batches, layout.pp
    arrays = PlanArrays.from_plan(plan, truth)
    group = arrays.dp_rank * m + arrays.micro_batch
    kernel = np.array([measured.kept[a.seq_id] for a in plan.assignments])
    kernel_cov = np.array([measured.coverage[a.seq_id] for a in plan.assignments])
    kept_kernel = cost.kept_fractions(arrays.length, arrays.sensitivity, arrays.budgets.p, kernel)
    kept_plan = arrays.kept(cost)
    at_kernel = cost.micro_batch_costs(arrays.length, kept_kernel, group, dp * m, layout)
    at_plan = cost.micro_batch_costs(arrays.length, kept_plan, group, dp * m, layout)
    count = np.bincount(group, minlength=dp * m)

    def mean(values):  # over each micro-batch's sequences; NaN for an empty one (dropped below)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.bincount(group, weights=values, minlength=dp * m) / count

    frame = pd.DataFrame({
        "step": plan.step,
        "dp_rank": np.repeat(np.arange(dp), m * pp),
        "micro_batch": np.tile(np.repeat(np.arange(m), pp), dp),
        "stage": np.tile(np.arange(pp), dp * m),
        "sequences": np.repeat(count, pp),
        "tokens": np.repeat(at_kernel.tokens, pp),
        "kernel_kept_fraction": np.repeat(mean(kernel), pp),
        "kernel_coverage": np.repeat(mean(kernel_cov), pp),
        "plan_kept_fraction": np.repeat(mean(kept_plan), pp),
        "measured_fwd_ms": measured.fwd_ms.reshape(-1),
        "measured_bwd_ms": measured.bwd_ms.reshape(-1),
        "predicted_fwd_ms": np.repeat(at_kernel.fwd_ms, pp),
        "predicted_bwd_ms": np.repeat(at_kernel.bwd_ms, pp),
        "predicted_plan_ms": np.repeat(at_plan.fwd_ms + at_plan.bwd_ms, pp),
    })
    frame.insert(frame.columns.get_loc("predicted_fwd_ms"), "measured_ms",
                 frame["measured_fwd_ms"] + frame["measured_bwd_ms"])
    frame.insert(frame.columns.get_loc("predicted_plan_ms"), "predicted_ms",
                 frame["predicted_fwd_ms"] + frame["predicted_bwd_ms"])
    frame["error_pct"] = 100 * (frame["predicted_ms"] - frame["measured_ms"]) / frame["measured_ms"]
    frame["plan_error_pct"] = 100 * (frame["predicted_plan_ms"] - frame["measured_ms"]) / frame["measured_ms"]
    return frame[frame["sequences"] > 0].reset_index(drop=True)


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Inputs:
    cfg: RunConfig
    layout: Layout
    policies: list[tuple[str, PolicyConfig]]  # (label, config), in --policies order
    baselines: list[str]  # labels
    device: torch.device
    attention: str


def load_inputs(overrides: list[str], policies: str | None, baselines: str | None, device: str,
                attention: str) -> Inputs:
    """Every check, before any model, device work or file exists."""
    try:
        cfg = OmegaConf.to_object(compose_config(preset_overrides(overrides)))
    except (HydraException, OmegaConfBaseException) as exc:
        reason = str(exc).splitlines()[0]
        if exc.__cause__ is not None:
            reason += f" ({str(exc.__cause__).splitlines()[0]})"
        raise ConfigError(reason) from None
    setup = prepare(cfg)
    if setup.layout.cp > 1:
        raise ConfigError(f"layout.cp={setup.layout.cp}: the replay runs whole micro-batches, not CP shards; "
                          "allowed: layout.cp=1")
    check_task(cfg)
    chosen = policy_list(cfg, policies)
    labels = [name for name, _ in chosen]
    if baselines is None:
        baselines_list = [name for name in labels if name in BASELINES]
    else:
        baselines_list = list(names(baselines))
        for name in baselines_list:
            if name not in labels:
                raise ConfigError(f"--baselines={baselines}: {name!r} is not among the replayed policies; "
                                  f"allowed: {', '.join(labels)}")
    kind = device_type(device, "--device")
    check_attention(attention, kind, "--attention")
    return Inputs(cfg, setup.layout, chosen, baselines_list, torch.device(kind), attention)


def policy_list(cfg: RunConfig, policies: str | None) -> list[tuple[str, PolicyConfig]]:
    """``--policies`` (names or ``name:key=value`` variants, as sim.compare takes them), or sim.run's pair:
    the baseline and the configured policy."""
    if policies is None:
        chosen = [(cfg.policy.name, cfg.policy)]
        if cfg.baseline and cfg.baseline != cfg.policy.name:
            chosen.insert(0, (cfg.baseline, load_policy(cfg.baseline)))
    else:
        specs = names(policies)
        if not specs:
            raise ConfigError(f"--policies={policies!r}: names no policy; "
                              f"allowed: {', '.join(group_options('policy'))}")
        for spec in specs:
            if spec.split(":")[0] not in group_options("policy"):
                raise ConfigError(f"--policies={policies}: {spec.split(':')[0]!r} is not a policy; "
                                  f"allowed: {', '.join(group_options('policy'))}")
        chosen = [(label(spec), policy_variant(spec)) for spec in specs]
    labels = [name for name, _ in chosen]
    if len(set(labels)) < len(labels):
        raise ConfigError(f"--policies={policies}: a policy is named twice; allowed: each policy once")
    typed = [(name, OmegaConf.to_object(p) if isinstance(p, DictConfig) else p) for name, p in chosen]
    for _name, policy in typed:
        make_planner(*policy_setup(cfg, policy))  # its parameters and estimator (the replay has no oracle), checked now
    return typed


def check_task(cfg: RunConfig) -> None:
    """The runner's retrieval task (its defaults) must fit the model's vocabulary and the shortest sequence."""
    task = TaskConfig()
    if cfg.model.vocab < task.min_vocab():
        raise ConfigError(f"model.vocab={cfg.model.vocab} is too small for the runner's task; allowed: "
                          f">= {task.min_vocab()}")
    if cfg.workload.min_len < task.min_length(1.0):
        raise ConfigError(f"workload.min_len={cfg.workload.min_len} is too short for the runner's task; allowed: "
                          f">= {task.min_length(1.0)} tokens")


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out={out}: exists and is not an empty directory; allowed: a new or empty directory")
    check_writable(out, "--out", directory=True)


# ----------------------------------------------------------------------------- the run
def run_replay(inputs: Inputs, out: Path, warmup: int, deadline_s: float | None, clock: Clock | None = None,
               log=print) -> pd.DataFrame:
    """Plan, run, compose and write; the comparison table. ``clock`` defaults to the device's."""
    cfg, device = inputs.cfg, inputs.device
    setup = prepare(cfg)
    layout = setup.layout
    clock = clock or make_clock(device)
    engine = Engine(layout, setup.cost, setup.cluster, setup.memory)
    replays = [PolicyReplay(name, policy, make_planner(*policy_setup(cfg, policy)), Results(), [], [], [])
               for name, policy in inputs.policies]
    staged = StagedModel(ModelShape.from_config(cfg.model), layout.pp, cfg.seed, device, inputs.attention,
                         setup.cost.block_size, recompute=setup.cost.recompute)
    task = TaskConfig()

    def packer(assignments, truth):
        return pack(assignments, truth, task, cfg.model.vocab, cfg.seed, device)

    log(f"replay: dp{layout.dp} x cp{layout.cp} x pp{layout.pp} ({layout.gpus} GPUs, {layout.micro_batches} "
        f"micro-batches), {cfg.model.layers} layers of {cfg.model.name}, on {device} ({clock_name(clock)}, "
        f"{warmup} warm-up run(s) per micro-batch, activation checkpointing {'on' if staged.recompute else 'off'})")
    log(f"replay: {COMMUNICATION_NOTE}")
    started = time.monotonic()
    last_round = 0.0
    for step in range(cfg.steps):
        elapsed = time.monotonic() - started
        if deadline_s is not None and step > 0 and elapsed + last_round > deadline_s:
            log(f"replay: --deadline-s={deadline_s:g} reached after {step} of {cfg.steps} steps ({elapsed:.0f} s)")
            break
        round_start = time.monotonic()
        batch = setup.workload.batch(step)
        truth = truth_of(batch)
        for replay in replays:
            plan = replay.planner.plan(requests(batch), step)
            measured = replay_step(staged, replay.name, plan, layout.pp, clock, warmup,
                                   lambda a, truth=truth: packer(a, truth))
            step_ms = compose(replay, engine, plan, measured, truth)
            replay.planner.observe(plan, [measured.kept[a.seq_id] for a in plan.assignments],
                                   [measured.coverage[a.seq_id] for a in plan.assignments], step_ms,
                                   measured.fwd_ms + measured.bwd_ms)
        last_round = time.monotonic() - round_start
        print(f"replay: step {step + 1}/{cfg.steps} of {len(replays)} policies in {last_round:.1f} s",
              file=sys.stderr, flush=True)
    table = comparison(replays, inputs.baselines)
    gains = speedups(table, inputs.baselines)
    write_all(out, replays, table, gains, inputs, warmup, clock)
    log(table[["policy", "steps", "replay_ms", "pred_ms", "sim_ms", "sim_kf_ms", "mb_err_%", "mb_err_plan_%"]].round(3)
        .to_string(index=False))
    if not gains.empty:
        log(gains.round(3).to_string(index=False))
    log(f"results: {out}  ({', '.join(r.name for r in replays)}, comparison.csv, comparison.json)")
    return table


def comparison(replays: list[PolicyReplay], baselines: list[str]) -> pd.DataFrame:
    frame = pd.DataFrame([{
        "policy": r.name,
        "steps": len(r.sim_ms),
        "replay_ms": float(r.results.steps_frame()["step_ms"].mean()),
        "pred_ms": float(r.results.steps_frame()["predicted_ms"].mean()),  # the planner's own, blind
        "sim_ms": float(np.mean(r.sim_ms)),
        "sim_kf_ms": float(np.mean(r.sim_kf_ms)),
        "mb_err_%": float(np.median(np.abs(pd.concat(r.rows)["error_pct"]))),
        "mb_err_plan_%": float(np.median(np.abs(pd.concat(r.rows)["plan_error_pct"]))),
    } for r in replays])
    ms = frame.set_index("policy")
    for base in baselines:
        for prefix, col in (("x", "replay_ms"), ("pred_x", "pred_ms"), ("sim_x", "sim_ms"), ("sim_kf_x", "sim_kf_ms")):
            frame[f"{prefix}_{base}"] = ms.loc[base, col] / frame[col]
    return frame


def speedups(table: pd.DataFrame, baselines: list[str]) -> pd.DataFrame:
    """The speedups of ``comparison`` one row per (policy, baseline), with the replayed one's difference from
    the simulator's in percent (the issue's target: within 3%)."""
    rows = [{"policy": row["policy"], "over": base, "replayed": row[f"x_{base}"], "predicted": row[f"pred_x_{base}"],
             "simulated": row[f"sim_x_{base}"], "simulated_kf": row[f"sim_kf_x_{base}"]}
            for _, row in table.iterrows() for base in baselines if base != row["policy"]]
    frame = pd.DataFrame(rows, columns=["policy", "over", "replayed", "predicted", "simulated", "simulated_kf"])
    frame["diff_pred_%"] = 100 * (frame["replayed"] / frame["predicted"] - 1)
    frame["diff_%"] = 100 * (frame["replayed"] / frame["simulated"] - 1)
    frame["diff_kf_%"] = 100 * (frame["replayed"] / frame["simulated_kf"] - 1)
    return frame


def summary_of(replay: PolicyReplay, inputs: Inputs, warmup: int, clock: Clock, row: dict) -> dict:
    cfg, layout = inputs.cfg, inputs.layout
    summary = replay.results.summary(
        policy=replay.policy.name, dp=layout.dp, cp=layout.cp, pp=layout.pp, micro_batches=layout.micro_batches,
        gpus=layout.gpus, seed=cfg.seed, model=cfg.model.name, workload=cfg.workload.name, cost=cfg.cost.name,
    )
    summary.update(
        source="replay", label=replay.name, communication="modelled", compute=f"measured ({clock_name(clock)})",
        note=COMMUNICATION_NOTE, device=str(inputs.device), attention=inputs.attention, warmup_runs=warmup,
        steps_planned=cfg.steps, sim_step_ms=row["sim_ms"], sim_kernel_kept_step_ms=row["sim_kf_ms"],
        median_abs_error_pct=row["mb_err_%"], median_abs_error_pct_plan_budgets=row["mb_err_plan_%"],
    )
    return summary


def write_all(out: Path, replays: list[PolicyReplay], table: pd.DataFrame, gains: pd.DataFrame, inputs: Inputs,
              warmup: int, clock: Clock) -> None:
    """Everything into a temporary directory beside ``out``, renamed to ``out`` when complete."""
    with temporary_dir(out) as tmp:
        rows = table.set_index("policy")
        for replay in replays:
            run_dir = tmp / dir_name(replay.name)
            replay.results.write(run_dir, summary_of(replay, inputs, warmup, clock, rows.loc[replay.name].to_dict()))
            pd.concat(replay.rows).to_csv(run_dir / "replay.csv", index=False, float_format=FLOAT_FORMAT)
        table.to_csv(tmp / "comparison.csv", index=False, float_format=FLOAT_FORMAT)
        write_json_atomic(tmp / "comparison.json", {
            "communication": "modelled", "note": COMMUNICATION_NOTE, "device": str(inputs.device),
            "compute": f"measured ({clock_name(clock)})", "warmup_runs": warmup, "baselines": inputs.baselines,
            "policies": table.to_dict(orient="records"), "speedups": gains.to_dict(orient="records"),
            "steps": {r.name: [{"step": int(s.step), "replay_ms": float(s.step_ms), "sim_ms": sim, "sim_kf_ms": kf}
                               for s, sim, kf in zip(r.results.steps, r.sim_ms, r.sim_kf_ms, strict=True)]
                      for r in replays},
        })
        if out.exists():
            out.rmdir()  # empty (check_out)
        os.replace(tmp, out)


def dir_name(name: str) -> str:
    """A policy label as a directory name (variants carry ':' and '=')."""
    return re.sub(r"[^A-Za-z0-9._=-]", "_", name)


# ----------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m runner.replay", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="sim.run's overrides (+experiment=<name>, layout.dp=8, steps=3)")
    parser.add_argument("--policies", help="comma-separated names or name:key=value variants "
                                           "(default: sim.run's baseline and policy)")
    parser.add_argument("--baselines", help="speedups over these (default: the replayed policies among "
                                            f"{', '.join(BASELINES)})")
    parser.add_argument("--out", type=Path, help="a new directory (default outputs/replay/<date>/<time>)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each micro-batch before its timed one")
    parser.add_argument("--deadline-s", type=float, help="no step round starts that would end after this many seconds")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--attention", default="kernel", help=f"attention backend: {', '.join(BACKENDS)}")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        raise ConfigError(f"--warmup={args.warmup}: allowed: a count >= 0")
    if args.deadline_s is not None and not (math.isfinite(args.deadline_s) and args.deadline_s > 0):
        raise ConfigError(f"--deadline-s={args.deadline_s}: allowed: a number of seconds > 0")
    if args.out is None:
        args.out = Path("outputs/replay") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    check_out(args.out)
    return args


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    inputs = load_inputs(args.overrides, args.policies, args.baselines, args.device, args.attention)
    run_replay(inputs, args.out, args.warmup, args.deadline_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
