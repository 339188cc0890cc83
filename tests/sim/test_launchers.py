"""Sweeps of ``python -m sim.run -m`` through Hydra's plugins: the joblib launcher by default, submitit's (the
Slurm config, and its local executor run for real), and the Optuna sweeper over DST's parameters
(hydra/sweeper=dst_optuna): the value each job returns, the up-front checks of a search space, one-line errors."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from hypothesis import strategies as st

from pinned import pinned
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.run import (COVERAGE_TOLERANCE, apply_values, check_composition, hydra_config, objective,
                                   parse, search_corners, simulate)

ROOT = Path(__file__).resolve().parents[2]
FILES = ("micro_batches.csv", "steps.csv", "summary.json", "plans.jsonl")
SEARCH_KEYS = ("policy.sparsity.params.floor", "policy.sparsity.params.cap", "policy.sparsity.params.levels")


def sim_run(*args) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    flags = [a for a in args if a.startswith("-")]  # before the overrides: Hydra's parser wants them there
    overrides = [a for a in args if not a.startswith("-")]
    return subprocess.Popen([sys.executable, "-m", "sparsebalance.sim.run", *flags, "steps=2", *pinned(overrides)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return out


def test_sweeps_run_on_joblib_unless_told_otherwise():
    assert hydra_config([]).launcher._target_.endswith("JoblibLauncher")
    assert hydra_config(["hydra/launcher=basic"]).launcher._target_.endswith("BasicLauncher")


def test_the_slurm_launcher_asks_for_a_cpu_job():
    launcher = hydra_config(["hydra/launcher=slurm"]).launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    asked = (launcher.cpus_per_task, launcher.gpus_per_node, launcher.timeout_min, launcher.partition)
    assert asked == (2, None, 60, None)
    assert hydra_config(["hydra/launcher=slurm", "hydra.launcher.partition=cpu"]).launcher.partition == "cpu"


@pytest.mark.slow
def test_a_submitit_sweep_writes_what_plain_runs_write(tmp_path):
    sweep = sim_run("-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                    "policy=kk,baseline")
    plain = {policy: sim_run(f"policy={policy}", f"hydra.run.dir={tmp_path / policy}") for policy in ("kk", "baseline")}
    for proc in (sweep, *plain.values()):
        finished(proc)
    for job, policy in enumerate(plain):
        for name in FILES:
            swept = (tmp_path / "sweep" / str(job) / name).read_bytes()
            assert swept == (tmp_path / policy / name).read_bytes(), (policy, name)
    assert json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())["policy"] == "kk"
    assert len(list((tmp_path / "sweep" / ".submitit").glob("*/*_result.pkl"))) == 2  # both ran through submitit


@pytest.mark.slow
def test_an_optuna_sweep_is_reproducible_and_reports_its_best_trial(tmp_path):
    runs = [sim_run("-m", "hydra/sweeper=dst_optuna", "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={tmp_path / name}")
            for name in ("a", "b")]
    for proc in runs:
        finished(proc)
    results = (tmp_path / "a" / "optimization_results.yaml").read_text()
    assert results == (tmp_path / "b" / "optimization_results.yaml").read_text()  # the sampler's seed is fixed
    best = yaml.safe_load(results)
    assert sorted(best["best_params"]) == sorted(SEARCH_KEYS)
    baseline = simulate(compose_config(pinned(["steps=2", "policy=verl"]))).summary
    trials = {}
    for job in sorted(p for p in (tmp_path / "a").iterdir() if p.name.isdigit()):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        trials[frozenset(overrides)] = objective(json.loads((job / "summary.json").read_text()), baseline)
    assert len(trials) == 3
    best_overrides = {f"{key}={value}" for key, value in best["best_params"].items()}
    (best_job,) = [job for job in trials if best_overrides <= job]
    assert best["best_value"] == pytest.approx(trials[best_job], rel=1e-8)
    assert best["best_value"] == pytest.approx(max(trials.values()), rel=1e-8)


def summary(speedup: float, coverage: float) -> dict:
    return {"speedup_vs_baseline": speedup, "attention_coverage": coverage}


def test_the_objective_is_the_speedup_while_coverage_holds_and_the_loss_otherwise():
    base = summary(1.0, 0.9)
    assert objective(summary(1.25, 0.9), base) == 1.25
    assert objective(summary(1.25, 0.9 - COVERAGE_TOLERANCE / 2), base) == 1.25  # rounding is no loss
    assert objective(summary(1.25, 0.95), base) == 1.25
    assert objective(summary(1.5, 0.85), base) == pytest.approx(-0.05)
    assert objective(summary(1.25, 0.9), None) is None


@given(kept=st.floats(0.01, 100), lossy=st.floats(0.01, 100), lost=st.floats(1e-6, 0.9), less=st.floats(0.01, 0.99))
def test_losing_coverage_ranks_below_keeping_it_and_less_loss_above_more(kept, lossy, lost, less):
    base = summary(1.0, 0.95)
    worse = objective(summary(lossy, 0.95 - lost), base)
    assert worse < objective(summary(kept, 0.95), base)
    assert objective(summary(lossy, 0.95 - lost * less), base) > worse


def test_the_corners_of_a_search_space_are_its_choices_and_both_ends():
    jobs = search_corners(["a=interval(0.5, 0.9)", "b=choice(x,y,z)", "c=int(interval(3, 31))", "d=range(1,4)",
                           "e=1", "e=2"])
    assert len(jobs) == 2 * 3 * 2 * 2
    assert jobs[0] == ["a=0.5", "b=x", "c=3", "d=1", "e=2"]  # the last of a key wins, as in the sweepers
    assert jobs[-1] == ["a=0.9", "b=z", "c=31", "d=4", "e=2"]  # Optuna samples a range up to its stop


@pytest.mark.parametrize("args, message", [
    (["hydra/launcher=nope"], "Could not find 'hydra/launcher/nope'; allowed: basic, joblib, slurm, submitit_local"),
    (["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=two"], "hydra.launcher.cpus_per_task=two"),
    (["hydra/sweeper=nope"], "Could not find 'hydra/sweeper/nope'; allowed: basic, dst_optuna, optuna"),
    (["hydra/sweeper=dst_optuna", "hydra.sweeper.n_trials=0"],
     "hydra.sweeper.n_trials=0 is out of range; allowed: >= 1"),
    (["hydra/sweeper=dst_optuna", "hydra.sweeper.direction=up"],
     "hydra.sweeper.direction=up is not allowed; allowed: minimize, maximize"),
    (["hydra/sweeper=dst_optuna", "baseline=null"],
     "baseline=null: an Optuna trial's value is the speedup over the baseline"),
    (["hydra/sweeper=dst_optuna", "policy.sparsity.params.floor=interval(0.5, 0.95)"],
     "need 0 < floor <= p <= cap <= 1, got floor=0.95, p=0.9, cap=0.95 (at a corner of the search space: "),
    (["hydra/sweeper=dst_optuna", "policy.sparsity.params.nope=choice(1, 2)"],
     "could not override 'policy.sparsity.params.nope': it is not in the config; allowed: a key of the config, "
     "or +key=value to add one (at a corner of the search space: "),
    (["hydra/sweeper=dst_optuna", "policy.sparsity.params.floor=interval(0.5"], "no viable alternative"),
    (["policy=dst", "policy.sparsity.params.floor=interval(0.5, 0.8)"],
     "the basic sweeper runs choices and ranges, not intervals (an Optuna sweeper samples those)"),
], ids=["launcher", "launcher-option", "sweeper", "n_trials", "direction", "no-baseline", "corner", "unknown-key",
        "syntax", "basic-interval"])
def test_bad_launcher_and_sweeper_options_are_one_line(args, message):
    with pytest.raises(ConfigError) as error:
        check_composition(["-m", "steps=2", *args])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_sweeper_option_stops_the_command_before_it_writes(tmp_path):
    proc = sim_run("-m", "hydra/sweeper=dst_optuna", "hydra.sweeper.n_trials=-1",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.splitlines() == ["error: hydra.sweeper.n_trials=-1 is out of range; allowed: >= 1"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, key, value", [
    ("policy.sparsity.params.floor=0.7", "policy.sparsity.params.floor", 0.7),
    ("++policy.sparsity.params.floor=0.75", "policy.sparsity.params.floor", 0.75),
    ("+extra.note=1", "extra.note", 1),
    ("++extra.other=x", "extra.other", "x"),
])
def test_a_search_corner_applies_as_hydra_applies_it(override, key, value):
    """Hydra's rules, through OmegaConf's public API: key=value sets a key that exists, + adds one, ++ does
    either; the composed config's schema still types every value."""
    cfg = compose_config(["policy=sparsebalance"])
    apply_values(cfg, parse([override]))
    assert OmegaConf.select(cfg, key) == value


@pytest.mark.parametrize("override, error", [
    ("+policy.sparsity.params.floor=0.7", "could not override 'policy.sparsity.params.floor': it exists already"),
    ("policy.sparsity.params.flor=0.7", "it is not in the config (did you mean 'floor'?)"),
    ("~policy.sparsity.params.floor", "deletes it; allowed: key=value"),
])
def test_a_search_corner_that_hydra_would_refuse_is_refused(override, error):
    cfg = compose_config(["policy=sparsebalance"])
    with pytest.raises(ConfigError, match=re.escape(error)):
        apply_values(cfg, parse([override]))


def test_a_search_corner_of_the_wrong_type_is_refused_by_the_schema():
    cfg = compose_config(["policy=sparsebalance"])
    with pytest.raises(ValidationError, match="layout.cp"):
        apply_values(cfg, parse(["layout.cp=two"]))

