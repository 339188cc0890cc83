"""End to end through ``python -m sim.run``: determinism and one-line errors on bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sim_speed import main as sim_speed_main
from pinned import pinned

ROOT = Path(__file__).resolve().parents[2]
FILES = ("micro_batches.csv", "steps.csv", "summary.json", "plans.jsonl")


def sim_run(run_dir, *overrides):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(
        [sys.executable, "-m", "sparsebalance.sim.run", f"hydra.run.dir={run_dir}", "steps=3", *pinned(overrides)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
    )


@pytest.mark.slow
def test_same_seed_gives_byte_identical_files(tmp_path):
    runs = [sim_run(tmp_path / name, "policy=kk", "seed=7") for name in ("a", "b")]
    for run in runs:
        assert run.returncode == 0, run.stderr
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["policy"] == "kk" and summary["speedup_vs_baseline"] > 0
    assert "results:" in runs[0].stdout and "speedup" in runs[0].stdout


@pytest.mark.slow
def test_different_seed_changes_results(tmp_path):
    for seed in (1, 2):
        assert sim_run(tmp_path / str(seed), f"seed={seed}").returncode == 0
    assert (tmp_path / "1" / "steps.csv").read_bytes() != (tmp_path / "2" / "steps.csv").read_bytes()


@pytest.mark.slow
def test_a_run_without_plans_leaves_no_plans_file_not_even_an_earlier_runs(tmp_path):
    assert sim_run(tmp_path, "seed=1").returncode == 0
    assert (tmp_path / "plans.jsonl").stat().st_size > 0
    done = sim_run(tmp_path, "seed=2", "write_plans=false", "overwrite=true")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "plans.jsonl").exists()
    assert "plans.jsonl" not in done.stdout and "steps.csv" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--policies", "baseline,nope"], "--policies: unknown nope; allowed: "),
    (["--gpus", "64,63"], "--gpus: '64,63': 63 is not allowed; allowed: positive multiples of 8"),
], ids=["steps", "policy", "gpus"])
def test_sim_speed_benchmark_bad_arguments_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        sim_speed_main(args)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and len(stderr.splitlines()) == 1 and message in stderr, stderr
