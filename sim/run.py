"""``python -m sim.run policy=<name> ...``: simulate a policy, compare with the baseline, write Results.

``-m`` sweeps run their jobs on the joblib launcher unless another is named (hydra/launcher=slurm); each job
returns its ``objective``, which hydra/sweeper=dst_optuna maximises over DST's parameters.

Bad input is reported as one line on stderr with a non-zero exit and leaves no run directory behind.
"""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sparsebalance.sim.core import interrupts_as_one_line

with interrupts_as_one_line():  # Ctrl-C while these load (seconds): one line
    import hydra
    import numpy as np
    import pandas as pd
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from sparsebalance.sim.cluster import Layout
    from sparsebalance.sim.config import (LengthDistribution, PolicyConfig, RunConfig, compose_config, register,
                                          validate)
    from sparsebalance.sim.core import (CONF_DIR, PRESETS, ConfigError, check_group_overrides, check_writable,
                                        did_you_mean, fail, group_options, hydra_reason, interrupted, preset_options,
                                        preset_overrides, quiet_interrupts_in_callbacks)
    from sparsebalance.sim.outputs import claimed_run_dir, discard_outputs, discard_run, output_dir, pin_output_dir
    from sparsebalance.sim.engine import Engine
    from sparsebalance.sim.profile import profile_source
    from sparsebalance.sim.progress import with_progress
    from sparsebalance.sim.results import Results
    from sparsebalance.sim.setup import load_policy, make_planner, policy_setup
    from sparsebalance.sim.workload import read_trace, requests, truth_of

OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
# DST meets its coverage target in its own sums; the engine's sums of the same coverages differ by rounding.
COVERAGE_TOLERANCE = 1e-9


@dataclass
class RunOutput:
    results: Results
    summary: dict
    kept: list  # per step, each sequence's kept fraction in plan order (what the kernel reported)


def simulate(cfg: RunConfig | DictConfig, policy: PolicyConfig | DictConfig | None = None,
             progress: bool = False) -> RunOutput:
    """Run ``cfg.steps`` steps of one policy (default ``cfg.policy``) in memory."""
    # Plain dataclasses from here on: attribute access on DictConfig is ~50x slower in the step loop.
    cfg = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
    cfg, setup = policy_setup(cfg, policy)
    policy, layout = cfg.policy, setup.layout
    planner = make_planner(cfg, setup, truth=lambda step: truth_of(setup.workload.batch(step)))
    engine = Engine(layout, setup.cost, setup.cluster, setup.memory)
    results, kept = Results(), []
    for step in with_progress(range(cfg.steps), policy.name, enabled=progress):
        batch = setup.workload.batch(step)
        plan = planner.plan(requests(batch), step)
        outcome = engine.step(plan, truth_of(batch), predicted_ms=planner.predicted_ms)
        planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)
        results.add(outcome.record, outcome.rows, plan.to_json() if cfg.write_plans else None)
        kept.append(outcome.kept)
    summary = results.summary(
        policy=row_label(policy), dp=layout.dp, cp=layout.cp, pp=layout.pp, micro_batches=layout.micro_batches,
        gpus=layout.gpus, seed=cfg.seed, model=cfg.model.name, workload=cfg.workload.name, cost=cfg.cost.name,
        **({"cp_mode": layout.cp_mode} if layout.dynamic else {}),
        **({"tp": layout.tp} if layout.tp > 1 else {}),  # tp = 1 summaries keep their keys
        **profile_source(cfg.cost.profile if cfg.cost.name == "calibrated" else None),
    )
    return RunOutput(results, summary, kept)


def row_label(policy: PolicyConfig) -> str:
    """The policy's name, marked ``oracle: `` where it plans with the data's truth: a bound, never a result."""
    oracle = str(getattr(policy.estimator, "value", policy.estimator)) == "oracle"
    return f"oracle: {policy.name}" if oracle else policy.name


def run(cfg: DictConfig, run_dir: Path) -> float | None:
    """Simulate the policy and its baseline, write the Results, print the summary table; return the
    ``objective``."""
    main_run = simulate(cfg, progress=True)
    rows = [main_run.summary]
    if cfg.baseline and cfg.baseline != cfg.policy.name:
        rows.append(simulate(cfg, load_policy(cfg.baseline), progress=True).summary)
    baseline_ms = rows[-1]["step_ms"] if cfg.baseline else None
    main_run.summary["baseline"] = cfg.baseline
    main_run.summary["speedup_vs_baseline"] = baseline_ms / main_run.summary["step_ms"] if baseline_ms else None
    files = main_run.results.write(run_dir, main_run.summary)
    print(summary_table(rows, baseline_ms).to_string(index=False))
    print(f"results: {files[0].parent}  ({', '.join(f.name for f in files)})")
    return objective(main_run.summary, rows[-1] if cfg.baseline else None)


def objective(summary: dict, baseline: dict | None) -> float | None:
    """What a sweeper optimises (hydra/sweeper=dst_optuna maximises it): the speedup over the baseline while
    the coverage weighted by attention work is no lower than the baseline's, else minus the coverage lost, so
    that a run that loses coverage ranks below every run that keeps it, and one that loses less above one
    that loses more. None without a baseline."""
    if baseline is None:
        return None
    lost = baseline["attention_coverage"] - summary["attention_coverage"]
    return summary["speedup_vs_baseline"] if lost <= COVERAGE_TOLERANCE else -lost


def summary_table(rows: list[dict], baseline_ms: float | None) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    table = pd.DataFrame({
        "policy": frame["policy"],
        "layout": [Layout(r["dp"], r["cp"], r["pp"], tp=r.get("tp", 1)).name for r in rows],
        "step_ms": frame["step_ms"].round(2),
        "bubble_%": (100 * frame["bubble_fraction"]).round(2),
        "tokens/s": frame["tokens_per_s"].round(0).astype(int),
        "MFU_%": (100 * frame["mfu"]).round(2),
        "mean_cov": frame["mean_coverage"].round(4),
        "tok_cov": frame["token_coverage"].astype(float).round(4),  # weighted by length
        "attn_cov": frame["attention_coverage"].astype(float).round(4),  # weighted by length ** 2
        "long_cov": frame["long_coverage"].astype(float).round(4),  # the longest quarter's
        "min_cov": frame["min_coverage"].round(4),
        "peak_GB": frame["peak_memory_gb"].astype(float).round(1),
    })
    if baseline_ms:
        table["speedup"] = (baseline_ms / frame["step_ms"]).round(3)
    return table


def check_composition(argv: list[str]) -> list[str]:
    """Compose and validate every job up front (one for a run, each combination of a ``-m`` sweep, the corners
    of an Optuna search space), and the launcher and sweeper they run under, so that a bad value is one line
    and no job runs or writes anything when any job of a sweep is bad. Returns the warnings to print once
    (``trace_note``)."""
    overrides = command_overrides(argv)
    job_overrides = [a for a in overrides if not a.startswith("hydra.")]
    if not is_sweep(argv):
        if len(job_overrides) < len(overrides):  # hydra.* values: checked on the hydra node, not in the job
            hydra_config(overrides)
            check_output_dir(overrides, "run")
        return check_jobs([job_overrides], "")
    fixed = fixed_overrides(overrides)
    node = hydra_config(fixed)
    check_launcher(node.launcher)
    check_output_dir(fixed, "sweep")
    params = [f"{key}={value}" for key, value in (node.sweeper.get("params") or {}).items()]
    if node.sweeper._target_ != OPTUNA_SWEEPER:
        return check_jobs(sweep_jobs(params + job_overrides), " (in the sweep job: {})")
    check_optuna(node.sweeper)
    return check_search_space(params + job_overrides)


def is_sweep(argv: list[str]) -> bool:
    return any(arg in ("-m", "--multirun") for arg in argv)


def command_overrides(argv: list[str]) -> list[str]:
    """The overrides of a command line: ``key=value`` and the deletions ``~key``, not its ``--flags``."""
    return [a for a in argv if ("=" in a or a.startswith("~")) and not a.startswith("-")]


def fixed_overrides(overrides: list[str]) -> list[str]:
    """The overrides that every job of a sweep shares (no swept values)."""
    return [o.input_line for o in parse(overrides) if not o.is_sweep_override()]


def check_launcher(launcher: DictConfig) -> None:
    """What a launcher reports with a traceback after the sweep has begun (and its multirun.yaml is written):
    Slurm's absence, the joblib launcher's process count."""
    if launcher._target_ == SLURM_LAUNCHER and shutil.which("srun") is None:
        raise ConfigError("hydra/launcher=slurm: no Slurm here (srun is not on PATH); allowed: a Slurm cluster's "
                          "login node, or hydra/launcher=joblib (the default) or submitit_local on this machine")
    if launcher._target_ == JOBLIB_LAUNCHER and launcher.get("n_jobs") == 0:
        raise ConfigError("hydra.launcher.n_jobs=0 is out of range; allowed: a number of processes >= 1, or -1 for "
                          "one per core (-2: all but one, and so on)")


def check_output_dir(overrides: list[str], mode: str, config_name: str = "config") -> None:
    """A run (``mode`` "run") or sweep directory set by ``overrides`` (no swept values) must be writable before
    any job runs: Hydra makes it with a traceback otherwise. The path is resolved as in the job, ``${hydra:...}``
    included; the default one, under the working directory, is left to Hydra."""
    key = f"hydra.{mode}.dir"
    if not any(o.split("=", 1)[0].lstrip("+") == key for o in overrides):
        return
    check_writable(output_dir(overrides, mode, config_name)[0], key, directory=True)


def check_jobs(jobs: list[list[str]], label: str) -> list[str]:
    """Compose and check each job's config; ``label`` names the job in the error (``{}``: its overrides). Returns
    the jobs' warnings, each once."""
    notes = {}
    for job in jobs:
        where = label.format(" ".join(job))
        notes[check_composed(composed(job, where), where)] = None
    return [note for note in notes if note]


def composed(job: list[str], where: str) -> DictConfig:
    try:
        return compose_config(job)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(hydra_reason(exc) + where) from None


def check_composed(cfg: DictConfig, where: str, trial: bool = False) -> str | None:
    """``check_job`` on a composed config, ``where`` appended to its error; returns its ``trace_note``. An Optuna
    trial also needs a baseline: its value is the speedup over it."""
    try:
        typed = OmegaConf.to_object(cfg)
        check_job(typed)
    except (ConfigError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{str(exc).splitlines()[0]}{where}") from None
    if trial and not typed.baseline:
        raise ConfigError(f"baseline=null: an Optuna trial's value is the speedup over the baseline; "
                          f"allowed: {', '.join(group_options('policy'))}{where}")
    return trace_note(typed)


def trace_note(cfg: RunConfig) -> str | None:
    """The warning for a trace shorter than the run, which the workload replays from its start again whenever
    it runs out (a user reading the trace's size may expect the run to stop there)."""
    if LengthDistribution(cfg.workload.distribution) is not LengthDistribution.trace:
        return None
    size, needed = len(read_trace(cfg.workload.trace_path)), cfg.steps * cfg.workload.global_batch
    if size >= needed:
        return None
    return (f"warning: workload.trace_path={cfg.workload.trace_path!r} holds {size:,} sequences, fewer than the "
            f"{cfg.steps} steps x workload.global_batch={cfg.workload.global_batch} = {needed:,} of the run, which "
            f"goes through it {needed / size:.3g} times, starting it over each time it ends")


def check_search_space(overrides: list[str]) -> list[str]:
    """Check every corner of an Optuna search space (``search_corners``). Composing is the slow part, so each
    choice of config groups is composed once and each corner's values are applied to a copy of it, with
    Hydra's own override rules (composition applies the same after merging the groups)."""
    parsed = parse(overrides)
    values = [o for o in parsed if o.is_sweep_override() and not (CONF_DIR / o.key_or_group).is_dir()]
    fixed = [o.input_line for o in parsed if o not in values]
    notes = {}
    for job in search_corners(fixed):
        groups = composed(job, f" (at a corner of the search space: {' '.join(job)})")
        for corner in itertools.product(*map(corner_values, values)):
            where = f" (at a corner of the search space: {' '.join([*job, *corner])})"
            cfg = copy.deepcopy(groups)
            try:
                apply_values(cfg, parse(list(corner)))
            except (ConfigError, HydraException, OmegaConfBaseException) as exc:
                raise ConfigError(hydra_reason(exc) + where) from None
            notes[check_composed(cfg, where, trial=True)] = None
    return [note for note in notes if note]


def apply_values(cfg: DictConfig, overrides: list[Override]) -> None:
    """Hydra's rules for ``key=value``, ``+key=value`` and ``++key=value`` on a composed config, through
    OmegaConf's public API: a plain override needs the key to exist, ``+`` needs it absent, ``++`` sets it either
    way; the schema checks each value's type."""
    for o in overrides:
        key, value = o.key_or_group, o.value()
        exists = OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT
        if o.is_delete():
            raise ConfigError(f"could not override {key!r}: {o.input_line!r} deletes it; allowed: key=value")
        if o.is_add() and exists:
            raise ConfigError(f"could not override {key!r}: it exists already; allowed: key=value or ++key=value")
        if not (exists or o.is_add() or o.is_force_add()):
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            near = did_you_mean(leaf, [str(k) for k in node.keys()]) if isinstance(node, DictConfig) else ""
            raise ConfigError(f"could not override {key!r}: it is not in the config{near}; allowed: a key of the "
                              "config, or +key=value to add one")
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=True)


_ABSENT = object()


def hydra_config(overrides: list[str]) -> DictConfig:
    """The ``hydra`` node a run composes to (launcher, sweeper and their options), checked as the jobs are."""
    register()
    check_group_overrides(overrides, "config")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides, return_hydra_config=True).hydra
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(hydra_reason(exc)) from None


def check_optuna(sweeper: DictConfig) -> None:
    """The Optuna sweeper's own options that it would otherwise report with a traceback mid-sweep."""
    for key in ("n_trials", "n_jobs"):
        if sweeper[key] < 1:
            raise ConfigError(f"hydra.sweeper.{key}={sweeper[key]} is out of range; allowed: >= 1")
    directions = sweeper.direction if OmegaConf.is_list(sweeper.direction) else [sweeper.direction]
    for direction in directions:
        if getattr(direction, "name", direction) not in ("minimize", "maximize"):  # the schema's default is an Enum
            raise ConfigError(f"hydra.sweeper.direction={direction} is not allowed; allowed: minimize, maximize")


def check_job(cfg: RunConfig) -> None:
    validate(cfg)  # before the copy below, which keeps the schema's fields only: an added +key is reported here
    make_planner(*policy_setup(cfg), truth=dict)  # the policies and the estimator (the simulator may give truth)
    if cfg.baseline and cfg.baseline != cfg.policy.name:
        make_planner(*policy_setup(cfg, load_policy(cfg.baseline)), truth=dict)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override list of every job of a basic sweep (the cartesian product of its swept values)."""
    return [list(job) for job in itertools.product(*map(swept_values, parse(overrides)))]


def swept_values(o: Override) -> list[str]:
    """One override as the basic sweeper runs it: every value of a choice or a range, a plain value alone."""
    if not o.is_sweep_override():
        return [o.input_line]
    if not o.is_discrete_sweep():
        raise ConfigError(f"{o.input_line}: the basic sweeper runs choices and ranges, not intervals "
                          "(an Optuna sweeper samples those)")
    return [f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()]


def search_corners(overrides: list[str]) -> list[list[str]]:
    """The jobs at the corners of an Optuna search space: every choice, both ends of an interval or a range
    (Optuna samples a range up to its stop). The checks of a config are ranges and orderings of its values,
    which hold everywhere inside a box when they hold at its corners."""
    return [list(job) for job in itertools.product(*map(corner_values, parse(overrides)))]


def corner_values(o: Override) -> list[str]:
    value = o.value()
    if o.is_interval_sweep():
        ends = (value.start, value.end)
    elif o.is_range_sweep() and not value.shuffle:
        ends = (value.start, value.stop)
    else:
        return swept_values(o)
    return [f"{o.get_key_element()}={end}" for end in ends]


def parse(overrides: list[str]) -> list[Override]:
    """The overrides parsed, the last of each key kept (the sweepers' precedence: the command line wins over
    ``hydra.sweeper.params``)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    return list({o.get_key_element(): o for o in parsed}.values())


register()


# An absolute path: Hydra then reads files whether this module runs as __main__ or is imported by a wrapper.
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """One job; its value (``objective``) is what a sweeper such as hydra/sweeper=dst_optuna optimises."""
    quiet_interrupts_in_callbacks()  # a sweep's jobs run in joblib workers, which get Ctrl-C too
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # A time that overflows is reported once, as a result that is not finite (Results.write refuses it).
        with np.errstate(over="ignore", invalid="ignore"):
            return run(cfg, run_dir)
    except (ConfigError, OmegaConfBaseException) as exc:
        discard_run(run_dir, HydraConfig.get().job.name)
        fail(str(exc).splitlines()[0])


def cli() -> None:
    """Check every job, then run them; Ctrl-C ends the command with one line, exit code 130, and removes what
    never got its results (``sim.outputs``)."""
    quiet_interrupts_in_callbacks()
    argv = preset_overrides(sys.argv[1:])  # experiment=<name> as well as +experiment=<name>
    if "--help" in argv or "-h" in argv:
        return print_help(argv)
    try:
        for note in check_composition(argv):  # each job's composition checks its group options first
            print(note, file=sys.stderr)
        argv, outputs = pin_output_dir(argv, fixed_overrides(command_overrides(argv)), is_sweep(argv))
    except ConfigError as exc:
        fail(str(exc))
    sys.argv[1:] = argv
    try:
        with claimed_run_dir(outputs, overwrite(argv), "run"):
            main()
    except ConfigError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        interrupted(discard_outputs(outputs, "run"))


def overwrite(argv: list[str]) -> bool:
    """The ``overwrite`` override's value (the composition checked its type)."""
    values = [o.value() for o in parse(command_overrides(argv)) if o.get_key_element().lstrip("+") == "overwrite"]
    return bool(values and values[-1] is True)


def print_help(argv: list[str]) -> None:
    """Hydra's ``--help``, with the presets line naming only the presets sim.run composes (runner.train's set
    ``runner`` keys) and both of their spellings."""
    sys.argv[1:] = argv
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        main()
    presets = f"{PRESETS}: {', '.join(preset_options('config'))} ({PRESETS}=<name> or +{PRESETS}=<name>)"
    print(re.sub(rf"^{PRESETS}: .*$", presets, text.getvalue(), flags=re.M), end="")


if __name__ == "__main__":
    cli()
