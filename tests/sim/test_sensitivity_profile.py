"""The workload's measured-sensitivity option (``workload.sensitivity_profile``, sim/sensitivity.py): draws lie in
(0, 1] and follow the profile's mean and spread by length, are seeded, leave the lengths alone, and leave the
Beta prior's draws exactly as they were; a bad profile is one line.

Every test reads the hand-written fixture ``tests/fixtures/sensitivity_profile.json`` (never a measured profile):
task ``retrieval`` has logit(s) = -0.4 ln(length / 512) + 0.5 z over [512, 32768] (median s 0.5 at 512 tokens,
0.159 at 32768); ``spread`` logit(s) ~ N(0, 1.5^2) at every length; ``knots`` means 0, 1, -1 and stds 0.2, 0.4,
0.2 at 512, 4096 and 32768 tokens.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy.special import expit, logit

from sparsebalance.sim.config import WorkloadConfig
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.sensitivity import load_sensitivity_profile
from sparsebalance.sim.workload import MIN_SENSITIVITY, Workload

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "sensitivity_profile.json"
CONTEXT = 32768


def workload(task: str | None = "retrieval", profile: Path | None = FIXTURE, **kwargs) -> Workload:
    cfg = WorkloadConfig(name="test", sensitivity_profile=None if profile is None else str(profile),
                         sensitivity_task=task if profile is not None else None, **kwargs)
    return Workload(cfg, CONTEXT, seed=7)


def test_the_fixture_models_interpolate_in_log_length_and_hold_their_end_knots():
    retrieval = load_sensitivity_profile(str(FIXTURE), "retrieval")
    np.testing.assert_allclose(expit(retrieval.mean([512, 32768])), [0.5, 0.15934], atol=1e-4)
    np.testing.assert_allclose(retrieval.mean([4096]), [-0.4 * np.log(8)], atol=1e-5)
    np.testing.assert_array_equal(retrieval.mean([64, 10**7]), retrieval.mean([512, 32768]))
    knots = load_sensitivity_profile(str(FIXTURE), "knots")
    middle = np.sqrt(512 * 4096)  # halfway in ln(length)
    np.testing.assert_allclose(knots.mean([middle, 4096, 100_000]), [0.5, 1.0, -1.0])
    np.testing.assert_allclose(knots.std([middle, 4096, 1]), [0.3, 0.4, 0.2])


@settings(max_examples=60, derandomize=True)
@given(task=st.sampled_from(["retrieval", "spread", "knots"]), seed=st.integers(0, 2**32 - 1),
       lengths=st.lists(st.integers(1, 10**7), min_size=1, max_size=50))
def test_drawn_sensitivities_lie_in_0_1(task, seed, lengths):
    s = workload(task).sensitivities(np.array(lengths), np.random.default_rng(seed))
    assert s.shape == (len(lengths),)
    assert np.all(s >= MIN_SENSITIVITY) and np.all(s <= 1.0)


@settings(max_examples=25, derandomize=True)
@given(task=st.sampled_from(["retrieval", "knots"]), length=st.integers(64, 100_000), seed=st.integers(0, 2**32 - 1))
def test_drawn_sensitivities_follow_the_profile_mean_and_spread_by_length(task, length, seed):
    """logit(s) of many draws at one length: the knots' mean and std interpolated in ln(clamped length) (within 5
    standard errors)."""
    n = 4000
    s = workload(task).sensitivities(np.full(n, length), np.random.default_rng(seed))
    z = logit(s)
    knots = {"retrieval": ([512, 32768], [0.0, -1.66355], [0.5, 0.5]),
             "knots": ([512, 4096, 32768], [0.0, 1.0, -1.0], [0.2, 0.4, 0.2])}[task]
    x, means, stds = np.log(knots[0]), knots[1], knots[2]
    mean, std = np.interp(np.log(length), x, means), np.interp(np.log(length), x, stds)
    assert abs(z.mean() - mean) < 5 * std / np.sqrt(n)
    assert abs(z.std() - std) < 5 * std / np.sqrt(2 * n)


def test_longer_sequences_draw_lower_sensitivities_as_the_profile_says():
    w = workload(global_batch=4096)
    batch = w.batch(0)
    lengths = np.array([q.length for q in batch])
    s = np.array([q.sensitivity for q in batch])
    short, long = s[lengths <= 2048], s[lengths >= 8192]
    assert np.median(short) > 0.35 and np.median(long) < 0.25


def test_same_seed_same_draws_and_the_lengths_are_the_priors():
    a, b = workload(), workload()
    assert a.batch(3) == b.batch(3) and a.batch(3) != a.batch(4)
    prior = workload(profile=None)
    assert [q.length for q in a.batch(3)] == [q.length for q in prior.batch(3)]
    assert [q.sensitivity for q in a.batch(3)] != [q.sensitivity for q in prior.batch(3)]


def test_the_prior_draws_exactly_as_before():
    """Without a profile: the step's generator draws the lengths, then Beta(a, b), nothing else in between."""
    cfg = WorkloadConfig(name="test", global_batch=64)
    batch = Workload(cfg, CONTEXT, seed=11).batch(2)
    rng = np.random.default_rng([11, 2])
    rng.lognormal(np.log(cfg.median), cfg.sigma, cfg.global_batch)
    expected = np.clip(rng.beta(cfg.sensitivity_a, cfg.sensitivity_b, cfg.global_batch), MIN_SENSITIVITY, 1.0)
    assert [q.sensitivity for q in batch] == expected.tolist()


def edited(edit):
    profile = copy.deepcopy(json.loads(FIXTURE.read_text()))
    edit(profile)
    return json.dumps(profile)


def _set(path: str, value):
    def edit(profile):
        *parents, last = path.split(".")
        node = profile
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


def _drop(key: str):
    return lambda profile: profile.pop(key)


BAD = {
    # name: (file text, what the one line must say)
    "not JSON": ("{tasks:", "not valid JSON"),
    "a list": ("[1, 2]", "the top level is a list"),
    "another version": (edited(_set("schema_version", 2)), "schema_version=2: this simulator reads 1"),
    "a cost profile": (edited(_set("kind", "cost")), "kind='cost': allowed: 'sensitivity'"),
    "no tasks": (edited(_drop("tasks")), "missing key 'tasks'"),
    "an extra key": (edited(_set("terms", {})), "unknown key 'terms'"),
    "another family": (edited(_set("family", "beta")), "family='beta': allowed: 'logit_normal'"),
    "empty tasks": (edited(_set("tasks", {})), "tasks={}: must map at least one task"),
    "a task without stds": (edited(lambda p: p["tasks"]["retrieval"].pop("logit_std")),
                            "tasks.retrieval=['lengths', 'logit_mean']: must have exactly the keys"),
    "a NaN mean": ('{"schema_version": 1, "kind": "sensitivity", "family": "logit_normal", "meta": {}, '
                   '"fit": {}, "tasks": {"t": {"lengths": [1, 2], "logit_mean": [0, NaN], "logit_std": [1, 1]}}}',
                   "tasks.t.logit_mean=[0, nan]: must be finite numbers"),
    "a string mean": (edited(_set("tasks.retrieval.logit_mean", ["0", 1])), "tasks.retrieval.logit_mean=['0', 1]"),
    "a huge integer mean": (edited(_set("tasks.retrieval.logit_mean", [10**400, 0])), "must be finite numbers"),
    "a negative std": (edited(_set("tasks.retrieval.logit_std", [0.5, -0.5])),
                       "tasks.retrieval.logit_std=[0.5, -0.5]: must be >= 0"),
    "a std too few": (edited(_set("tasks.retrieval.logit_std", [0.5])),
                      "tasks.retrieval.logit_std=[0.5]: must be a list of one number per knot"),
    "decreasing knots": (edited(_set("tasks.retrieval.lengths", [4096, 512])),
                         "tasks.retrieval.lengths=[4096, 512]: must be increasing whole lengths"),
    "a repeated knot": (edited(_set("tasks.retrieval.lengths", [512, 512])), "tasks.retrieval.lengths=[512, 512]"),
    "a fractional knot": (edited(_set("tasks.retrieval.lengths", [512.5, 4096])), "tasks.retrieval.lengths=[512.5"),
    "no knots": (edited(_set("tasks.spread.lengths", [])), "tasks.spread.lengths=[]: must be increasing"),
    "meta as a string": (edited(_set("meta", "x")), "meta='x': must be a JSON object"),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_profile_is_one_line_naming_the_key(tmp_path, name):
    path = tmp_path / "profile.json"
    path.write_text(BAD[name][0])
    with pytest.raises(ConfigError) as exc:
        workload(task=None, profile=path)
    message = str(exc.value)
    assert message.startswith(f"workload.sensitivity_profile='{path}': ") and "\n" not in message
    assert BAD[name][1] in message


@pytest.mark.parametrize("task, needle", [
    (None, "holds the tasks knots, retrieval, spread; set workload.sensitivity_task to one of them"),
    ("chat", "workload.sensitivity_task='chat' is not in workload.sensitivity_profile="),
])
def test_a_task_the_profile_lacks_is_one_line(task, needle):
    with pytest.raises(ConfigError, match="allowed: knots, retrieval, spread|set workload.sensitivity_task") as exc:
        workload(task=task)
    assert needle in str(exc.value)


@pytest.mark.parametrize("overrides, needle", [
    (["workload.sensitivity_profile=tests/fixtures/missing.json"], "no such file"),
    (["workload.sensitivity_task=retrieval"],
     "workload.sensitivity_task='retrieval' needs workload.sensitivity_profile"),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, overrides, needle):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sparsebalance.sim.run", f"hydra.run.dir={run_dir}", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert not run_dir.exists()
