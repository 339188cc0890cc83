"""Every option of every config group composes, validates and simulates."""
from pathlib import Path

import pytest

from sparsebalance.sim.run import simulate

from sparsebalance.sim.core import GROUPS, group_options
from sparsebalance.sim.config import compose_config
from pinned import BACKENDS_PROFILE, pinned

SMALL = pinned(["steps=2", "workload.global_batch=32", "layout.micro_batches=1"])  # h200_4nodes: DP 32
# an H100's 80 GB hold a 4-sequence micro-batch of the default workload only in parts (the memory check refuses
# one micro-batch per step)
FITS = {("cluster", "h100"): ["layout.micro_batches=4"],
        ("policy", "verl_dense"): [f"cost.profile={BACKENDS_PROFILE}"]}  # dense attention needs a dense backend
CASES = [(group, option) for group in GROUPS for option in group_options(group)]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_group_option_composes_and_runs(group, option):
    cfg = compose_config([f"{group}={option}", *SMALL, *FITS.get((group, option), [])])
    out = simulate(cfg)
    assert out.summary["steps"] == 2 and out.summary["step_ms"] > 0


def test_each_group_has_at_least_two_options():
    assert all(len(group_options(g)) >= 2 for g in GROUPS)


def test_mistyped_override_fails_at_composition():
    with pytest.raises(Exception, match="layout.cp"):
        compose_config(["layout.cp=two"])


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_committed_profiles_are_measured_ones(gpu):
    """The default (H200) and the H100 profile are measured, not provisional, and of this simulator's schema."""
    import json

    from sparsebalance.sim.profile import PROFILE_SCHEMA_VERSION

    profile = json.loads((Path(__file__).resolve().parents[2] / f"calibrate/profiles/{gpu}.json").read_text())
    assert profile["provisional"] is False and profile["schema_version"] == PROFILE_SCHEMA_VERSION
    assert profile["gpu"] == gpu
