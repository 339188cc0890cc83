"""Every option of every config group composes, validates and simulates."""
import math
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from sparsebalance.sim.run import simulate

from sparsebalance.sim.core import GROUPS, group_options
from sparsebalance.sim.config import compose_config
from pinned import BACKENDS_PROFILE, pinned

SMALL = pinned(["steps=2", "workload.global_batch=32", "layout.micro_batches=1"])  # h200_4nodes: DP 32
# an H100's 80 GB hold a 4-sequence micro-batch of the default workload only in parts (the memory check refuses
# one micro-batch per step)
FITS = {("cluster", "h100"): ["layout.micro_batches=4", "cost.profile=calibrate/profiles/h100.json"],  # its own GPU's
        ("policy", "verl_dense"): [f"cost.profile={BACKENDS_PROFILE}"]}  # dense attention needs a dense backend
CASES = [(group, option) for group in GROUPS for option in group_options(group)]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_group_option_composes_and_runs(group, option):
    """The option is the one simulated, every figure of the summary is finite and in its range, the throughput
    is the micro-batches' tokens over the steps' time, and no sequence falls below the policy's coverage floor."""
    cfg = compose_config([f"{group}={option}", *SMALL, *FITS.get((group, option), [])])
    out = simulate(cfg)
    s = out.summary
    if group == "cluster":
        assert s["gpus"] == cfg.cluster.nodes * cfg.cluster.gpus_per_node
    else:
        assert s[group] == option
    assert s["steps"] == 2 and s["dp"] * s["cp"] * s["pp"] == s["gpus"]
    figures = {k: v for k, v in s.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in figures.values()), figures
    assert s["step_ms"] > 0 and 0 <= s["bubble_fraction"] < 1 and 0 < s["mfu"] < 1
    assert 0 < s["peak_memory_gb"] <= cfg.cluster.hbm_gb
    assert 0 < s["min_coverage"] <= s["mean_coverage"] <= 1
    assert all(0 < s[key] <= 1 for key in ("token_coverage", "attention_coverage", "long_coverage"))
    rows, steps = out.results.micro_batches(), out.results.steps_frame()
    tokens = rows.loc[rows["stage"] == 0, "tokens"].sum()  # each micro-batch once, at the first stage
    assert s["tokens_per_s"] == pytest.approx(tokens / steps["step_ms"].sum() * 1e3, rel=1e-9)
    params = cfg.policy.sparsity.get("params") or {}
    floor = params.get("floor", params.get("p"))  # top-k budgets (no p) keep a mean, not a floor
    if floor is not None:
        assert s["min_coverage"] >= floor - 1e-9


def test_each_group_has_at_least_two_options():
    assert all(len(group_options(g)) >= 2 for g in GROUPS)


def test_mistyped_override_fails_at_composition():
    """Hydra names the override; its cause, the schema's check, names the value, the key and the type wanted."""
    with pytest.raises(ConfigCompositionException, match=r"^Error merging override layout\.cp=two$") as failed:
        compose_config(["layout.cp=two"])
    cause = failed.value.__cause__
    assert isinstance(cause, ValidationError)
    assert str(cause).startswith("Value 'two' of type 'str' could not be converted to Integer\n    full_key: layout.cp")


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_committed_profiles_are_measured_ones(gpu):
    """The default (H200) and the H100 profile are measured, not provisional, and of this simulator's schema."""
    import json

    from sparsebalance.sim.profile import PROFILE_SCHEMA_VERSION

    profile = json.loads((Path(__file__).resolve().parents[2] / f"calibrate/profiles/{gpu}.json").read_text())
    assert profile["provisional"] is False and profile["schema_version"] == PROFILE_SCHEMA_VERSION
    assert profile["gpu"] == gpu
