"""``python -m sim.compare experiment=paper [--seeds N] [overrides...]``: the SparseBalance comparison as one table.

Simulates every policy of ``--policies`` on one composed config (same workload, seed and steps for all),
over ``--seeds`` consecutive seeds from ``seed``, and prints per policy the mean (and, with several seeds,
the standard deviation) over seeds of: step time; speedup over the first policy (``speedup``) and over the
fastest of the ``--baselines`` on the same seed (``vs_best``); bubble; and coverage: the plain mean over
sequences, weighted by tokens (``tok_cov``) and by attention work, length ** 2 (``attn_cov``), the longest
quarter's (``long_cov``) and the minimum. ``--bounds`` adds two rows per named policy: ``even: <policy>``,
the step time with the work of the policy's own plans (its budgets, its micro-batch overheads) spread
exactly evenly over DP ranks and micro-batches (equal micro-batches: with pp > 1 the 1F1B bubble stays, and
a plan with lighter micro-batches at the pipeline's ends can beat it); and ``bound: <policy>``, per step the
larger of that work spread over the DP ranks with no bubble at all and the time the plan's longest sequence
alone takes through the pipeline (its forward across every stage, then its backward): a lower bound for
any placement of that work. ``--ablation`` compares the mechanisms one
by one (ABLATION). A policy is named as in ``conf/policy/``, optionally with overrides of its own config:
``sparsebalance:sparsity.params.coverage_weight=sequence``. ``experiment=<name>`` selects a preset from
``conf/experiment/``; other arguments are Hydra overrides (``steps=100``, ``workload.sigma=1.2``). Nothing
is written to disk.
"""
from __future__ import annotations

import sys

from sparsebalance.sim.core import interrupts_as_one_line

with interrupts_as_one_line():  # Ctrl-C while these load (seconds): one line
    import numpy as np
    import pandas as pd
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from sparsebalance.sim.cluster import Cluster, Layout
    from sparsebalance.sim.config import AttentionBackend, PolicyConfig, compose_config, register
    from sparsebalance.sim.core import (ArgumentParser, ConfigError, did_you_mean, fail, group_options, hydra_reason,
                                        interrupted, preset_overrides)
    from sparsebalance.sim.cost import make_cost
    from sparsebalance.sim.engine import Engine, run_pipeline
    from sparsebalance.sim.plan import Plan
    from sparsebalance.sim.progress import with_progress
    from sparsebalance.sim.run import simulate, trace_note
    from sparsebalance.sim.setup import load_policy, prepare

# Every balancer that uses no SparseBalance mechanism (fixed budget p = 0.9; verl_topk: one top-k budget per step
# at the coverage sparsebalance_topk keeps), then ours and the cross; verl_dense is what a user who does not
# train sparse runs (dense on the fastest dense kernel the profile prices).
BASELINES = ("baseline", "lbb", "lbb_ordered", "verl", "token_cap", "verl_topk", "verl_dense")
POLICIES = (*BASELINES, "sab", "dst", "verl_dst", "sparsebalance", "sparsebalance_topk")
BOUNDS = ("baseline", "sparsebalance")
FIXED_K = "verl_fixed_k"  # the matched fixed-top-k baseline row (seed_runs)
MATCHED = "sparsebalance_topk"  # whose coverage it matches by default
# bound rows: the policy planning with every sequence's true sensitivity
ORACLES = ("sparsebalance", "sparsebalance_topk")
FIT, SEARCH = "batching.params.pipeline_order=fit", "batching.params.pipeline_order=search"
ABLATION = (  # the strongest baseline, then one mechanism at a time
    "verl", f"verl:{SEARCH}", f"verl:{FIT}", "sab", f"sab:{FIT}", "verl_dst", f"sparsebalance:{SEARCH}",
    "sparsebalance", "sparsebalance:sparsity.params.floor=0.9", "sparsebalance:sparsity.params.floor=0.7",
    "sparsebalance:sparsity.params.coverage_weight=sequence",
)
FIGURES = {  # table column -> summary key
    "step_ms": "step_ms", "bubble_%": "bubble_fraction", "mean_cov": "mean_coverage",
    "tok_cov": "token_coverage", "attn_cov": "attention_coverage", "long_cov": "long_coverage",
    "min_cov": "min_coverage",
    "peak_GB": "peak_memory_gb",  # the most any GPU holds in any step (sim.memory)
    "pred_err_%": "prediction_error_pct",  # median over steps of realized / predicted step time - 1
}


def compare(overrides: list[str], policies: tuple[str, ...] | None = None, seeds: int = 1,
            baselines: tuple[str, ...] | None = None, bounds: tuple[str, ...] = (),
            oracles: tuple[str, ...] = (), matched: str | None = None) -> pd.DataFrame:
    """One row per policy (then per bound), the columns of FIGURES plus ``speedup`` and ``vs_best``, as
    means over seeds, with ``<column>_std`` beside each when seeds > 1; ``matched``: seed_runs's."""
    if seeds < 1:
        raise ConfigError(f"--seeds={seeds} must be >= 1")
    check_overrides(overrides)
    base = compose_config(overrides)
    policies, baselines = with_defaults(base, policies, baselines)
    if matched is not None and matched not in policies:
        raise ConfigError(f"--fixed-k-of {matched!r} is not among the policies; allowed: {', '.join(policies)}")
    runs = pd.concat([seed_runs(base, seed, policies, baselines, bounds, oracles, matched)
                      for seed in with_progress(range(base.seed, base.seed + seeds), "sim.compare", unit="seed")],
                     ignore_index=True)
    return seed_statistics(runs, seeds > 1)


def seed_runs(base: DictConfig, seed: int, policies: tuple[str, ...], baselines: tuple[str, ...],
              bounds: tuple[str, ...], oracles: tuple[str, ...] = (), matched: str | None = None) -> pd.DataFrame:
    """One seed: a row per policy and per bound, with speedups over the first policy and the best baseline.
    Policies plan blind (their config's estimator, never the oracle); ``oracles`` adds a row ``oracle: <policy>``
    per name, the policy planning with every sequence's true sensitivity: a bound, not a plan a trainer can make.
    ``matched`` (one of ``policies``) adds the baseline row FIXED_K: verl with one top-k for the whole run, the
    fewest blocks whose attention-weighted coverage over the run reaches that policy's (``matched_k``)."""
    cfg = OmegaConf.merge(base, {"seed": seed, "write_plans": True})
    option: dict[str, str] = {}  # each policy once, named in errors by the first list that has it
    for flag, listed in (("--policies", policies), ("--baselines", baselines), ("--bounds", bounds)):
        for name in listed:
            option.setdefault(name, flag)
    variants = {name: blind(policy_variant(name, flag), name, flag) for name, flag in option.items()}
    variants.update({f"oracle: {name}": OmegaConf.merge(policy_variant(name, "--oracles"), {"estimator": "oracle"})
                     for name in oracles})  # every name checked before anything runs
    outputs = {name: simulate(cfg, variant, progress=True) for name, variant in variants.items()}
    labels = {**{name: label(name) for name in policies},
              **{f"oracle: {name}": f"oracle: {label(name)}" for name in oracles}}
    if matched is not None:
        k = matched_k(cfg, outputs[matched].summary["attention_coverage"])
        outputs[FIXED_K] = simulate(cfg, policy_variant(f"verl:sparsity.params.top_k={k}"), progress=True)
        labels[FIXED_K] = FIXED_K
        baselines = (*baselines, FIXED_K)
        print(f"seed {seed}: {FIXED_K} runs k={k}, the fewest blocks whose attention-weighted coverage reaches "
              f"{matched}'s {outputs[matched].summary['attention_coverage']:.4f}", file=sys.stderr)
    rows = [{"policy": labels[name], **{col: outputs[name].summary[key] for col, key in FIGURES.items()}}
            for name in labels]
    for name in bounds:
        even, bound = balance_bounds(cfg, outputs[name].results.plans, outputs[name].kept)
        # The plan's coverage; no bubble or memory figure, since no plan is simulated for these rows.
        figures = {col: outputs[name].summary[key] for col, key in FIGURES.items()}
        figures.update({col: np.nan for col in ("bubble_%", "peak_GB") if col in figures})
        rows.append({"policy": f"even: {name}", **figures, "step_ms": even})
        rows.append({"policy": f"bound: {name}", **figures, "step_ms": bound})
    frame = pd.DataFrame(rows)
    frame["bubble_%"] *= 100
    frame["speedup"] = outputs[policies[0]].summary["step_ms"] / frame["step_ms"]
    frame["vs_best"] = min(outputs[name].summary["step_ms"] for name in baselines) / frame["step_ms"]
    frame["seed"] = seed
    return frame


def matched_k(cfg: DictConfig, coverage: float) -> int:
    """The fewest top-k blocks per query block at which every step's sequences, at their true sensitivities,
    keep a mean attention-weighted coverage of at least ``coverage``: the one budget a production trainer would
    fix for the run to match it (the choice uses the run's outcome, as a matched baseline does; the row's
    planning is verl's, blind)."""
    typed = OmegaConf.to_object(cfg)
    setup = prepare(typed)
    batches = [setup.workload.batch(step) for step in range(typed.steps)]
    longest = max(s.length for batch in batches for s in batch)
    ks = np.arange(1, -(-longest // setup.cost.block_size) + 1)
    reached = np.zeros(ks.size)
    for batch in batches:
        lengths = np.array([s.length for s in batch], dtype=np.float64)
        sens = np.array([s.sensitivity for s in batch])
        kept = setup.cost.kept_fractions(lengths[None], sens[None], 1.0, None, ks[:, None].astype(np.float64))
        reached += setup.cost.coverages(sens[None], kept) @ lengths**2 / (lengths**2).sum()
    meets = reached / len(batches) >= coverage - 1e-12
    return int(ks[np.argmax(meets)]) if meets.any() else int(ks[-1])


def policy_variant(spec: str, option: str = "--policies") -> PolicyConfig:
    """``name`` or ``name:key=value:...``: a policy of conf/policy/ with overrides of its own config; errors
    name ``option``, the list it came from."""
    name, *overrides = spec.split(":")
    try:
        policy = load_policy(name)
    except ConfigError:
        raise ConfigError(f"{option} {spec!r}: no policy {name!r} in conf/policy/"
                          f"{did_you_mean(name, group_options('policy'))}; allowed: "
                          f"{', '.join(group_options('policy'))}") from None
    try:
        return OmegaConf.merge(policy, OmegaConf.from_dotlist(overrides))
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"{option} {spec!r}: {str(exc).splitlines()[0]}") from None


def blind(policy: PolicyConfig, spec: str, option: str) -> PolicyConfig:
    """The policy as a table row plans it: never with the oracle, which only ``--oracles`` rows may use."""
    if str(getattr(policy.estimator, "value", policy.estimator)) == "oracle":
        raise ConfigError(f"{option} {spec!r}: estimator=oracle is a bound; name the policy in --oracles instead")
    return policy


def label(spec: str) -> str:
    """A policy spec as a row name: overrides shown by their last key (``sab:pipeline_order=fit``)."""
    name, *overrides = spec.split(":")
    return ":".join([name, *(o.split("=")[0].rsplit(".", 1)[-1] + "=" + o.partition("=")[2] for o in overrides)])


def balance_bounds(cfg: DictConfig, plans: list[str], kept_per_step: list[np.ndarray]) -> tuple[float, float]:
    """Mean step times over the plans: ``even`` with each plan's total forward and backward work (at its own
    kept fractions) and hand-offs spread exactly evenly over the DP ranks and micro-batches, what a perfect
    balancer with equal micro-batches reaches with that work; and ``bound``, per plan the larger of that
    work over the DP ranks without any bubble (a stage's share, back to back) and the pipeline time of the
    longest sequence alone (at its own kept fraction), which no placement can beat."""
    typed = OmegaConf.to_object(cfg)
    cluster = Cluster.from_config(typed.cluster)
    layout = Layout.from_config(typed.layout, Cluster.gpus(typed.cluster))
    cost = make_cost(typed.cost, typed.model, cluster, recompute=typed.memory.activation_checkpointing)
    engine = Engine(layout, cost, cluster)
    slots = layout.dp * layout.micro_batches
    evens, bounds = [], []
    for text, kept in zip(plans, kept_per_step, strict=True):
        plan = Plan.from_json(text)
        length = plan.lengths
        group = plan.dp_ranks * layout.micro_batches + plan.micro_batch_ids
        mb = cost.micro_batch_costs(length, kept, group, slots, layout)
        even = np.full((1, layout.micro_batches), 1.0 / slots)
        p2p = cost.hand_off_ms(mb.tokens, layout).sum() * even
        evens.append(pipeline_time(mb.fwd_ms.sum() * even, mb.bwd_ms.sum() * even, p2p, layout.pp)
                     + engine.exposed_allreduce_ms(float(mb.bwd_ms.sum()) / slots))
        longest = int(np.argmax(length))
        alone = cost.micro_batch_costs(length[[longest]], kept[[longest]], np.zeros(1, dtype=np.int64), 1, layout)
        latency = pipeline_time(alone.fwd_ms[None], alone.bwd_ms[None],
                                cost.hand_off_ms(alone.tokens, layout)[None], layout.pp)
        no_bubble = float(mb.fwd_ms.sum() + mb.bwd_ms.sum()) / layout.dp
        # the last gradient bucket is reduced after the last backward, whatever the placement
        bounds.append(max(no_bubble, latency) + engine.bucket_ms)
    return float(np.mean(evens)), float(np.mean(bounds))


def pipeline_time(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, pp: int) -> float:
    """Finish time of one rank's 1F1B pipeline ([1, m] busy times per stage), as the engine runs it."""
    return float(run_pipeline(fwd, bwd, p2p, pp).finish_ms.max())


def seed_statistics(runs: pd.DataFrame, with_std: bool) -> pd.DataFrame:
    columns = [*FIGURES, "speedup", "vs_best"]
    grouped = runs.groupby("policy", sort=False)[columns]
    table = grouped.mean()
    if with_std:
        spread = grouped.std(ddof=1)
        for col in columns:
            table.insert(table.columns.get_loc(col) + 1, f"{col}_std", spread[col])
        table["vs_best_min"] = runs.groupby("policy", sort=False)["vs_best"].min()  # the worst seed's
    return table.reset_index()


def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: ``mean +- std`` where there is a spread."""
    digits = {"step_ms": 1, "bubble_%": 1, "speedup": 3, "vs_best": 3, "vs_best_min": 3, "peak_GB": 1}
    out = pd.DataFrame({"policy": table["policy"]})
    for col in [c for c in table.columns if c != "policy" and not c.endswith("_std")]:
        places = digits.get(col, 4)
        text = table[col].map(lambda v, places=places: "-" if pd.isna(v) else f"{v:.{places}f}")
        if f"{col}_std" in table:
            text = text + table[f"{col}_std"].map(lambda v, places=places: "" if pd.isna(v) else f" +- {v:.{places}f}")
        out[col] = text
    return out


def names(text: str) -> tuple[str, ...]:
    return tuple(filter(None, (t.strip() for t in text.split(","))))


def with_defaults(base: DictConfig, policies: tuple[str, ...] | None,
                  baselines: tuple[str, ...] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The lists as given, or where None the defaults this config can price (default_lists)."""
    if policies is not None and baselines is not None:
        return policies, baselines
    default_policies, default_baselines, _ = default_lists(base)
    return (default_policies if policies is None else policies, default_baselines if baselines is None else baselines)


def default_lists(base: DictConfig, ablation: bool = False) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
    """(policies, baselines) by default, and a note per policy left out: one that trains on a dense backend
    (``attention_backend``, verl_dense) only where the run's cost model prices one (a profile with a
    ``backends`` section). Named explicitly, such a policy is an error there instead."""
    typed = OmegaConf.to_object(base)
    cost = make_cost(typed.cost, typed.model, Cluster.from_config(typed.cluster), recompute=False)
    unpriced = [] if cost.dense_backends() else [
        name for name in BASELINES if load_policy(name).attention_backend not in (None, AttentionBackend.ours)]
    where = f"the profile {typed.cost.profile}" if typed.cost.name == "calibrated" else f"cost={typed.cost.name}"
    notes = [f"{name}: left out, {where} prices no dense attention backend" for name in unpriced]
    policies = ABLATION if ablation else POLICIES
    return (tuple(n for n in policies if n not in unpriced), tuple(n for n in BASELINES if n not in unpriced), notes)


def check_work(base: DictConfig, seeds: int, runs: int) -> None:
    """What sim.run checks before it runs, over the whole comparison (``runs`` policies, each on every seed):
    sim.config's size guard, and the warning for a trace shorter than a run."""
    typed = OmegaConf.to_object(base)
    typed.check_size(runs=seeds * runs, across=f"--seeds {seeds} x {runs} policies")
    note = trace_note(typed)
    if note:
        print(note, file=sys.stderr)


def finite(table: pd.DataFrame) -> pd.DataFrame:
    """The table, once every step time in it is a finite number: an absurd but finite input (a peak rate) can
    overflow a time to inf, and every other figure derives from the step times."""
    bad = table.loc[~np.isfinite(table["step_ms"].astype(float)), "policy"]
    if len(bad):
        raise ConfigError(f"{bad.iloc[0]}: a step time is not a finite number (check the magnitudes of the cost "
                          "profile's coefficients and the cluster's rates)")
    return table


# Keys of a run that sim.compare sets itself: each policy's config comes from --policies, and nothing is written.
NOT_READ = {"policy": "it compares the policies of --policies, each with its own config; allowed: a policy's own "
                      "overrides there, --policies <name>:<key>=<value> (e.g. sparsebalance:estimator=prior), or "
                      "--oracles for the estimator=oracle bound rows",
            "baseline": "--baselines names the policies vs_best is over",
            "write_plans": "it writes nothing", "plot": "it writes nothing"}


def check_overrides(overrides: list[str]) -> None:
    """One ConfigError line for an override of a key that sim.compare does not read (NOT_READ): it would show in
    the table's header while changing nothing."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        top = key.split(".", 1)[0]
        if top in NOT_READ:
            raise ConfigError(f"{override}: sim.compare does not read {top}: {NOT_READ[top]}")


def vs_best_note(policies: tuple[str, ...], baselines: tuple[str, ...]) -> str | None:
    """Where vs_best is over rows the table does not show, a line that names them."""
    hidden = [name for name in baselines if name not in policies]
    return f"vs_best: over the fastest of {', '.join(baselines)} on each seed (not shown: {', '.join(hidden)})" \
        if hidden else None


def shown_baselines(policies: tuple[str, ...]) -> tuple[str, ...]:
    """vs_best's default over a chosen --policies: the baselines among them, else the first of them."""
    return tuple(name for name in policies if name.split(":")[0] in BASELINES) or policies[:1]


def main() -> None:
    parser = ArgumentParser(prog="python -m sim.compare", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("overrides", nargs="*", help="experiment=<name> and Hydra overrides")
    parser.add_argument("--policies",
                        help=f"comma-separated; `speedup` is over the first (default {','.join(POLICIES)})")
    parser.add_argument("--baselines", help=f"`vs_best` is over the fastest of these (default {','.join(BASELINES)}; "
                                            "verl_dense where the profile prices a dense backend; with --policies, "
                                            "the baselines among them, else the first)")
    parser.add_argument("--seeds", type=int, default=1, help="consecutive seeds from `seed` (mean +- std)")
    parser.add_argument("--bounds", nargs="?", const=",".join(BOUNDS), default="",
                        help=f"perfect-balance rows for these policies' plans (alone: {','.join(BOUNDS)})")
    parser.add_argument("--oracles", default=",".join(ORACLES),
                        help="bound rows 'oracle: <policy>': the policy planning with the data's true sensitivities")
    parser.add_argument("--ablation", action="store_true", help="the mechanisms one by one instead of --policies")
    parser.add_argument("--fixed-k-of", default=None,
                        help=f"add the baseline {FIXED_K}: verl at the fewest top-k blocks, one for the whole run, "
                             f"whose attention-weighted coverage reaches this policy's (default {MATCHED} where it "
                             "runs; '' for none)")
    try:
        args = parser.parse_intermixed_args()  # overrides may come before or after the options
        register()
        overrides = preset_overrides(args.overrides)  # experiment=<name> as well as +experiment=<name>
        check_overrides(overrides)
        base = compose_config(overrides)
        policies, baselines, notes = default_lists(base, args.ablation)
        if args.policies is not None and not args.ablation:
            policies = names(args.policies)
            baselines = shown_baselines(policies) if policies else baselines
        baselines = names(args.baselines) if args.baselines is not None else baselines
        notes += [note for note in [vs_best_note(policies, baselines)] if note]
        check_work(base, args.seeds, len({*policies, *baselines, *names(args.bounds)}) + len(names(args.oracles)))
        with np.errstate(over="ignore", invalid="ignore"):  # reported once below, as a time that is not finite
            matched = args.fixed_k_of if args.fixed_k_of is not None else (MATCHED if MATCHED in policies else "")
            table = finite(compare(overrides, policies, args.seeds, baselines, names(args.bounds),
                                   names(args.oracles), matched or None))
    except ConfigError as exc:
        fail(str(exc))
    except (HydraException, OmegaConfBaseException) as exc:
        fail(hydra_reason(exc))
    except KeyboardInterrupt:
        interrupted()
    print(" ".join(args.overrides), f"(seeds {args.seeds})" if args.seeds > 1 else "")
    for note in notes:
        print(note)
    print(formatted(table).to_string(index=False))


if __name__ == "__main__":
    main()
