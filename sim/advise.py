"""``python -m sim.advise [preset=paper] [trace.path=...] [model_config=...] [current=[...]] ...``: what to
run for your own data, model and cluster.

From a starting point (a preset and sim.run overrides), the user's inputs (a length trace, a Hugging Face
``config.json``, a cluster file, a measured sensitivity profile) and their current configuration, it searches
batching policies, sparsity budgets and coverage targets, attention backends, micro-batch counts and layouts
(``conf/advise.yaml``: the space as data), cheap first (sim.advise_space prunes what cannot run or fit,
sim.advise_search prices every candidate with the planner, then simulates the promising ones over rungs of more
steps and seeds), and writes a ranked table, the Pareto front of step time against coverage, a Markdown and an
HTML report, and the override line and ``build_planner`` call that deploy the recommendation (sim.advise_report).
Blind planning only: the planners start from the stated prior and learn from what the simulated steps report.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hydra
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from sparsebalance.sim.advise_inputs import (
    cluster_file,
    dotted,
    hf_model,
    override_value,
    read_user_trace,
)
from sparsebalance.sim.advise_report import Advice, ms, table, tie, write
from sparsebalance.sim.advise_search import Rung, halving, rank, simulated
from sparsebalance.sim.advise_space import Candidate, enumerate_space
from sparsebalance.sim.config import compose_config, register
from sparsebalance.sim.core import (
    CONF_DIR,
    ConfigError,
    fail,
    group_options,
    hydra_reason,
    interrupted,
    preset_overrides,
)
from sparsebalance.sim.sensitivity import load_sensitivity_profile


def base_overrides(cfg: DictConfig, out: Path) -> tuple[list[str], list[str]]:
    """The sim.run overrides of the starting point with the user's inputs, and a line per input about it."""
    base, facts = [], []
    if cfg.preset:
        base.append(f"experiment={cfg.preset}")
    if cfg.model_config:
        model = hf_model(cfg.model_config)
        base += dotted("model", model)
        facts.append(f"model: {cfg.model_config} ({model['layers']} layers, hidden {model['hidden']}, "
                     f"{model['heads']} heads / {model['kv_heads']} KV heads, context {model['max_context']})")
    if cfg.cluster_file:
        base += dotted("cluster", cluster_file(cfg.cluster_file))
        facts.append(f"cluster: {cfg.cluster_file}")
    if cfg.trace.path:
        trace = read_user_trace(cfg.trace.path, cfg.trace.length_column, cfg.trace.task_column, out)
        base += ["workload=trace", f"workload.trace_path={override_value(trace.path)}",
                 f"workload.max_len={int(trace.lengths.max())}"]
        facts.append(f"trace: {cfg.trace.path}, {trace.lengths.size:,} sequences, lengths {int(trace.lengths.min())}"
                     f"-{int(trace.lengths.max())} (median {int(sorted(trace.lengths)[trace.lengths.size // 2])})"
                     + (f"; tasks {trace.tasks}" if trace.tasks else ""))
        base += task_overrides(cfg, trace.tasks, facts)
    elif cfg.sensitivity_profile:
        base.append(f"workload.sensitivity_profile={override_value(cfg.sensitivity_profile)}")
    return [*base, *cfg.overrides], facts


def task_overrides(cfg: DictConfig, tasks: dict[str, int], facts: list[str]) -> list[str]:
    """The profile and, with task labels, its task: the most frequent label the profile measured (the workload
    draws every sequence from one task's model)."""
    if not cfg.sensitivity_profile:
        if tasks:
            facts.append("task labels read; without a sensitivity profile every sequence's s comes from the Beta prior")
        return []
    out = [f"workload.sensitivity_profile={override_value(cfg.sensitivity_profile)}"]
    if tasks:
        model = None
        for task in sorted(tasks, key=tasks.get, reverse=True):
            try:
                model = load_sensitivity_profile(cfg.sensitivity_profile, task)
                break
            except ConfigError:
                continue
        if model is None:
            raise ConfigError(f"trace.task_column: no label of {sorted(tasks)} is a task of sensitivity_profile="
                              f"{cfg.sensitivity_profile!r}")
        out.append(f"workload.sensitivity_task={model.task}")
        facts.append(f"sensitivities: task {model.task!r} of {cfg.sensitivity_profile} for every sequence "
                     f"(the most frequent label it measured)")
    return out


def reference(cfg: DictConfig, base: DictConfig) -> tuple[Candidate, str]:
    """The user's current configuration, or the named baseline on the starting point's layout."""
    gpus = base.cluster.nodes * base.cluster.gpus_per_node
    layout = base.layout
    dp = layout.dp if layout.dp is not None else gpus // (layout.cp * layout.pp)
    settings = [("layout.dp", dp), ("layout.cp", layout.cp), ("layout.pp", layout.pp),
                ("layout.micro_batches", layout.micro_batches)]
    if cfg.current is None:
        name = cfg.baseline or DEFAULT_BASELINE
        return Candidate(name, tuple(settings)), f"baseline {name}"
    if cfg.baseline is not None:
        raise ConfigError(f"baseline={cfg.baseline} with current set: the reference is your configuration; "
                          "allowed: one of the two")
    policy = base.policy.name
    for item in cfg.current:
        key, sep, value = str(item).partition("=")
        if not sep:
            raise ConfigError(f"current: {item!r} is not key=value; allowed: sim.run overrides such as policy=verl")
        if key == "policy":
            policy = value
        else:
            settings = [(k, v) for k, v in settings if k != key] + [(key, yaml.safe_load(value))]
    if policy not in group_options("policy"):
        raise ConfigError(f"current: policy={policy!r}; allowed: {', '.join(group_options('policy'))}")
    return Candidate(policy, tuple(settings)), "current configuration"


def check_keys(cfg: DictConfig) -> None:
    """Settings that would otherwise go unused."""
    if not cfg.trace.path and (cfg.trace.task_column or cfg.trace.length_column != "length"):
        raise ConfigError("trace.task_column / trace.length_column name columns of trace.path, which is not set; "
                          "allowed: trace.path=<your trace>")
    if cfg.search.jobs == 0:
        raise ConfigError("search.jobs=0; allowed: a number of processes >= 1, or -1 for one per core")


def rungs_of(cfg: DictConfig, steps: int) -> list[Rung]:
    rungs = [Rung(int(r.keep), int(r.steps or steps), int(r.seeds)) for r in cfg.search.rungs]
    if not rungs or min(min(r.keep, r.steps, r.seeds) for r in rungs) < 1 or cfg.search.cheap_steps < 1:
        raise ConfigError("search.rungs: keep, steps and seeds must be >= 1, with at least one rung; "
                          "search.cheap_steps >= 1")
    return rungs


def advise(cfg: DictConfig, out: Path) -> tuple[Advice, list]:
    start, load, own_cpu = time.monotonic(), os.getloadavg()[0], time.process_time()
    check_keys(cfg)
    overrides, facts = base_overrides(cfg, out)
    base = composed_outside(preset_overrides(overrides))
    rungs = rungs_of(cfg, base.steps)
    ref, ref_name = reference(cfg, base)
    last = rungs[-1]
    ref_run = simulated(ref, base, len(rungs), last.steps, range(base.seed, base.seed + last.seeds))
    floor = cfg.min_coverage if cfg.min_coverage is not None else ref_run.coverage
    space = enumerate_space(cfg.space, base)
    if not space.candidates:
        raise ConfigError(f"no candidate of the space can run here; left out: {dict(space.pruned)}")
    failed, history, search_cpu = halving(space.candidates, base, floor, cfg.search.cheap_steps, rungs, base.seed,
                              cfg.search.jobs)
    facts += [
        f"starting point: {' '.join(overrides) or 'conf/config.yaml'}",
        f"prior: {prior_of(base)}; blind planning (the online estimator, never the data's truth)",
        f"space: {len(space.candidates) + sum(space.pruned.values())} candidates, {len(space.candidates)} can run; "
        "left out: " + "; ".join(f"{n} {reason} (e.g. {space.examples[reason]})"
                                 for reason, n in space.pruned.items()),
        f"rung 0: the planner's price of {len(space.candidates)} candidates over {cfg.search.cheap_steps} batches"
        + (f", {len(failed)} of them refused by the memory model's check of their plans" if failed else ""),
        *[f"rung {i}: {len(h)} candidates simulated, {r.steps} steps x {r.seeds} seeds"
          for i, (h, r) in enumerate(zip(history[1:], rungs, strict=True), start=1)],
        f"coverage floor: {floor:.4f} ({'min_coverage' if cfg.min_coverage is not None else ref_name})",
        (f"machine load (1-min average) {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
         f"{os.cpu_count()} cores; CPU time {cpu_s(own_cpu, search_cpu, cfg.search.jobs):.0f} s"),
    ]
    return Advice(rank([*history[-1], ref_run], floor), ref_run, ref_name, floor, overrides, facts,
                  time.monotonic() - start), history


def cpu_s(own_start: float, search: float, jobs: int) -> float:
    """CPU seconds of the advice: this process's, plus the search's in its worker processes where it had any."""
    return time.process_time() - own_start + (search if jobs != 1 else 0.0)


def composed_outside(overrides: list[str]) -> DictConfig:
    """The sim.run config of ``overrides``, composed from inside this Hydra app: Hydra's global state is set
    aside while sim.config composes its own, then put back (HydraConfig reads it)."""
    hydra_state = GlobalHydra.instance()
    saved = hydra_state.hydra
    hydra_state.clear()
    try:
        return compose_config(overrides)
    finally:
        hydra_state.clear()
        if saved is not None:
            hydra_state.initialize(saved)


def prior_of(base: DictConfig) -> str:
    workload = base.workload
    if workload.sensitivity_profile:
        return (f"the measured profile {workload.sensitivity_profile} "
                f"(task {workload.sensitivity_task or 'its only one'})")
    return f"Beta({workload.sensitivity_a:g}, {workload.sensitivity_b:g}) for every length (workload.sensitivity_a/b)"


DEFAULT_BASELINE = "verl_topk"  # the strongest baseline of the README's tables on both presets
register()


@hydra.main(config_path=str(CONF_DIR), config_name="advise", version_base="1.3")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        advice, history = advise(cfg, out)
    except (ConfigError, OmegaConfBaseException, HydraException) as exc:
        fail(hydra_reason(exc) if isinstance(exc, HydraException) else str(exc).splitlines()[0])
    files = write(advice, history, out)
    print(table(advice).to_string(index=False))
    best = advice.ranked[0]
    tied, noise = tie(advice.ranked, advice.floor)
    print(f"recommended: {best.candidate.label()}" + (f" (a tie with {len(tied)} more within {ms(noise)} ms)"
                                                      if tied else ""))
    print(advice.line(best))
    print(f"report: {files[0]}  ({', '.join(f.name for f in files)})")
    print(f"elapsed: {advice.elapsed_s:.0f} s")


def split_argv(argv: list[str]) -> list[str]:
    """The command line as Hydra reads it: the advisor's own keys (conf/advise.yaml's, ``hydra.*``) as they are;
    ``current.<key>=<value>`` a sim.run override of the user's configuration, gathered into ``current``; every
    other ``key=value`` a sim.run override of the starting point, gathered into ``overrides``."""
    own = {*OmegaConf.load(CONF_DIR / "advise.yaml").keys(), "hydra"}
    advisor, lists = [], {"overrides": [], "current": []}
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~").split(".")[0]
        if arg.startswith("-") or "=" not in arg:
            advisor.append(arg)
        elif key == "current" and arg.startswith("current."):
            lists["current"].append(arg.removeprefix("current."))
        elif key in own:
            advisor.append(arg)
        else:
            lists["overrides"].append(arg)
    for name, items in lists.items():
        if items and any(a.startswith(f"{name}=") for a in advisor):
            fail(f"give {name} either as {name}=[...] or item by item, not both")
        if items:
            advisor.append(f"{name}=[{','.join(hydra_string(a) for a in items)}]")
    return advisor


def hydra_string(text: str) -> str:
    """A quoted string in Hydra's override grammar."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def check_config(argv: list[str]) -> None:
    """The advisor's own keys, composed before Hydra runs, so that a bad one is one line."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="advise", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        fail(hydra_reason(exc))


def cli() -> None:
    """Bare sim.run overrides go to ``overrides``; the advisor's keys are checked; then Hydra runs ``main``."""
    sys.argv[1:] = split_argv(sys.argv[1:])
    check_config(sys.argv[1:])
    try:
        main()
    except KeyboardInterrupt:
        interrupted()


if __name__ == "__main__":
    cli()
