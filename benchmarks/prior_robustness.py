"""What a wrong prior costs each blind policy, and how many steps the online estimator needs to recover from it.

One truth: the ``paper`` preset with sensitivities drawn from ``benchmarks/prior_truth.json`` (logit s rising
linearly in ln(length) from -1.6 at 1K tokens to 0 at 32K, std 0.6: short documents sparse, long ones dense).
Every policy plans from the correct prior (that same file as ``policy.prior.profile``, as if the user had measured
it) and from three wrong ones, all with the default ``online`` estimator: too sparse (s 0.1 +- 0.05), too dense
(s 0.8 +- 0.1) and the length trend reversed (s 0.31 +- 0.13 at 5.8K, logit s -0.32 per doubling). Per
(policy, prior) it prints the mean step time and attention-weighted coverage; ``x_correct``, the correct-prior
run's step time over this one's; ``first5_%``, how much slower the first 5 steps ran than with the correct prior;
``recovered``, the first step (the worst seed's; the run's length where never) from which the run's later steps
take within 1% of the correct-prior run's time at no less coverage (0.002 allowed); and ``vs_base`` and
``vs_base_5+``, the speedup over the policy's own baseline (OWN_BASELINE, planning from the same prior), over all
steps and from step 5 on.

    python -m benchmarks.prior_robustness [--seeds 1] [--steps 50] [--policies verl,verl_topk,...]
"""
from __future__ import annotations

import pandas as pd
from omegaconf import OmegaConf

from sparsebalance.sim.compare import policy_variant
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.core import ArgumentParser, one_line_errors
from sparsebalance.sim.run import simulate

TRUTH = ["+experiment=paper", "workload.sensitivity_profile=benchmarks/prior_truth.json"]
PRIORS = {
    "correct": {"profile": "benchmarks/prior_truth.json"},
    "too sparse": {"mean": 0.1, "spread": 0.05},
    "too dense": {"mean": 0.8, "spread": 0.1},
    "trend reversed": {"mean": 0.31, "spread": 0.13, "trend": -0.32, "pivot": 5793},
}
# each blind policy against the policy it improves on (the same balancer or budget without the mechanism)
OWN_BASELINE = {"verl": "baseline", "verl_topk": "baseline", "verl_dst": "verl", "sparsebalance": "verl",
                "sparsebalance_topk": "verl_topk"}
WARM_STEPS = 5
RECOVERED_WITHIN = 0.01  # of the correct-prior run's time over the later steps
COVERAGE_SLACK = 0.002


def steps_of(policy: str, prior: dict, seed: int, steps: int) -> pd.DataFrame:
    cfg = compose_config([*TRUTH, f"seed={seed}", f"steps={steps}", "write_plans=false"])
    variant = policy_variant(policy, "--policies", OmegaConf.merge(cfg.policy.prior, prior))
    frame = simulate(cfg, variant).results.steps_frame()
    return frame[["step", "step_ms", "attention_coverage"]].assign(policy=policy, seed=seed)


def recovered(wrong: pd.DataFrame, correct: pd.DataFrame) -> int:
    """The first step from which the wrong-prior run's later steps take within RECOVERED_WITHIN of the correct
    one's, in sum, at no less coverage (COVERAGE_SLACK allowed); the number of steps where it never does."""
    time_w, time_c = wrong["step_ms"].to_numpy(), correct["step_ms"].to_numpy()
    cov_w, cov_c = wrong["attention_coverage"].to_numpy(), correct["attention_coverage"].to_numpy()
    for step in range(len(time_w)):
        close = abs(time_w[step:].sum() / time_c[step:].sum() - 1) <= RECOVERED_WITHIN
        if close and cov_w[step:].mean() >= cov_c[step:].mean() - COVERAGE_SLACK:
            return step
    return len(time_w)


def table(policies: list[str], seeds: int, steps: int) -> pd.DataFrame:
    needed = sorted({*policies, *(OWN_BASELINE[p] for p in policies)})
    runs = {(p, name, seed): steps_of(p, prior, seed, steps)
            for p in needed for name, prior in PRIORS.items() for seed in range(seeds)}
    rows = []
    for policy in policies:
        for name in PRIORS:
            for seed in range(seeds):
                run, correct = runs[policy, name, seed], runs[policy, "correct", seed]
                base = runs[OWN_BASELINE[policy], name, seed]
                late = slice(WARM_STEPS, None)
                rows.append({
                    "policy": policy, "prior": name, "seed": seed, "step_ms": run["step_ms"].mean(),
                    "attn_cov": run["attention_coverage"].mean(),
                    "x_correct": correct["step_ms"].mean() / run["step_ms"].mean(),
                    "first5_%": 100 * (run["step_ms"][:WARM_STEPS].sum() / correct["step_ms"][:WARM_STEPS].sum() - 1),
                    "recovered": recovered(run, correct),
                    "vs_base": base["step_ms"].mean() / run["step_ms"].mean(),
                    "vs_base_5+": base["step_ms"][late].mean() / run["step_ms"][late].mean(),
                    "baseline": OWN_BASELINE[policy],
                })
    frame = pd.DataFrame(rows)
    return frame.groupby(["policy", "prior", "baseline"], sort=False).agg(
        step_ms=("step_ms", "mean"), attn_cov=("attn_cov", "mean"), x_correct=("x_correct", "mean"),
        first5_pct=("first5_%", "mean"), recovered=("recovered", "max"), vs_base=("vs_base", "mean"),
        vs_base_5=("vs_base_5+", "min")).reset_index()


@one_line_errors
def main() -> None:
    parser = ArgumentParser(prog="python -m benchmarks.prior_robustness", description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(OWN_BASELINE), help="comma-separated, among OWN_BASELINE's")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (vs_base_5+: the worst seed's)")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in OWN_BASELINE]
    if unknown or args.seeds < 1 or args.steps <= WARM_STEPS:
        parser.error(f"--policies {unknown[0]!r}: allowed: {', '.join(OWN_BASELINE)}" if unknown else
                     f"--seeds={args.seeds} --steps={args.steps}: allowed: --seeds >= 1 and --steps > {WARM_STEPS}")
    frame = table(policies, args.seeds, args.steps)
    print(f"truth: {' '.join(TRUTH)}; seeds {args.seeds}, {args.steps} steps")
    print(frame.round({"step_ms": 1, "attn_cov": 4, "x_correct": 3, "first5_pct": 1, "vs_base": 3,
                       "vs_base_5": 3}).to_string(index=False))


if __name__ == "__main__":
    main()
