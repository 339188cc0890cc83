"""The weighted coverage figures of the Results and the multi-seed comparison table."""
import numpy as np
import pytest

from sparsebalance.sim.compare import compare
from sparsebalance.sim.core import preset_overrides
from sparsebalance.sim.results import coverage_fields
from pinned import pinned


def test_coverage_fields_weigh_by_tokens_and_attention_work():
    lengths = np.array([1000, 3000, 2000, 4000, 1000, 1000, 1000, 1000])
    coverage = np.array([1.0, 0.5, 1.0, 0.8, 1.0, 1.0, 1.0, 1.0])
    fields = coverage_fields(lengths, coverage)
    assert fields["token_coverage"] == pytest.approx((1000 * 5 + 1500 + 2000 + 3200) / 14000)
    assert fields["attention_coverage"] == pytest.approx((5e6 + 4.5e6 + 4e6 + 12.8e6) / (5e6 + 9e6 + 4e6 + 16e6))
    assert fields["long_coverage"] == pytest.approx((0.8 + 0.5) / 2)  # the longest quarter: 4000 and 3000


def test_long_coverage_takes_at_least_one_sequence():
    assert coverage_fields(np.array([10, 20, 30]), np.array([0.9, 0.8, 0.7]))["long_coverage"] == pytest.approx(0.7)


@pytest.fixture(scope="module")
def two_seeds():
    overrides = pinned(preset_overrides(["experiment=paper", "steps=3"]))
    return compare(overrides, ("baseline", "verl", "sparsebalance"), seeds=2, bounds=("baseline",)).set_index("policy")


def test_compare_reports_seed_spread_and_weighted_coverage(two_seeds):
    for col in ("step_ms", "speedup", "vs_best", "attn_cov", "tok_cov", "long_cov"):
        assert col in two_seeds and f"{col}_std" in two_seeds
    assert two_seeds.loc["baseline", "speedup"] == pytest.approx(1.0) and two_seeds.loc["baseline", "speedup_std"] == 0
    assert (two_seeds["step_ms_std"].drop("even: baseline") > 0).all()  # two workloads, two step times
    # vs_best is over the fastest baseline of each seed (baseline, lbb, lbb_ordered, verl)
    assert two_seeds.loc["verl", "vs_best"] <= 1.0 + 1e-12


def test_even_spread_beats_verl_at_the_same_budgets_on_the_paper_preset(two_seeds):
    assert two_seeds.loc["even: baseline", "step_ms"] < two_seeds.loc["verl", "step_ms"]
    assert two_seeds.loc["even: baseline", "attn_cov"] == two_seeds.loc["baseline", "attn_cov"]


def test_policy_variants_override_a_policy_config():
    from sparsebalance.sim.compare import label, policy_variant
    from sparsebalance.sim.core import ConfigError

    variant = policy_variant("sparsebalance:sparsity.params.floor=0.7:batching.params.pipeline_order=search")
    assert variant.sparsity.params.floor == 0.7 and variant.batching.params.pipeline_order == "search"
    assert label("sparsebalance:sparsity.params.floor=0.7") == "sparsebalance:floor=0.7"
    with pytest.raises(ConfigError, match="no policy 'nope'"):
        policy_variant("nope:sparsity.params.floor=0.7")


def test_bound_is_below_every_plan_at_those_budgets(two_seeds):
    """The bound of the baseline's work (p = 0.9 everywhere) is below any balancer's step at p = 0.9."""
    assert two_seeds.loc["bound: baseline", "step_ms"] <= two_seeds.loc["verl", "step_ms"]
    assert two_seeds.loc["bound: baseline", "step_ms"] <= two_seeds.loc["even: baseline", "step_ms"]
