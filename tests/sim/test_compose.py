"""Every option of every config group composes, validates and simulates."""
from pathlib import Path

import pytest

from sim.run import simulate

from sim.core import GROUPS, compose_config, group_options
from pinned import pinned

SMALL = pinned(["steps=2", "workload.global_batch=32", "layout.micro_batches=1"])  # h200_4nodes: DP 32
CASES = [(group, option) for group in GROUPS for option in group_options(group)]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_group_option_composes_and_runs(group, option):
    cfg = compose_config([f"{group}={option}", *SMALL])
    out = simulate(cfg)
    assert out.summary["steps"] == 2 and out.summary["step_ms"] > 0


def test_each_group_has_at_least_two_options():
    assert all(len(group_options(g)) >= 2 for g in GROUPS)


def test_mistyped_override_fails_at_composition():
    with pytest.raises(Exception, match="layout.cp"):
        compose_config(["layout.cp=two"])


def test_default_profile_is_the_measured_one():
    import json

    from sim.cost import PROFILE_SCHEMA_VERSION

    profile = json.loads((Path(__file__).resolve().parents[2] / "calibrate/profiles/h200.json").read_text())
    assert profile["provisional"] is False and profile["schema_version"] == PROFILE_SCHEMA_VERSION
