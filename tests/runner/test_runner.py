"""The real runner on the CPU: 2 gloo ranks of a tiny model under torchrun.

One full run (module fixture) serves the training, Results and Plan-identity checks; a run stopped
half-way and resumed from its checkpoint must reproduce its loss curve; bad input fails in one line
before training; a rank that hangs or dies ends the job within the configured timeout.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from equivalence import check_replanned
from pinned import PINNED_PROFILE
from sparsebalance.runner.dist import DIAGNOSIS_TIMEOUTS
from sparsebalance.sim.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# Short, yet well above the skew of two healthy ranks on a loaded 2-core machine (the CP test's too).
FAULT_TIMEOUT_S = 5

# The same overrides drive runner.train and sim.run: a tiny model, short sequences, 2 GPUs of 2 micro-batches.
SHARED = [
    "cost=roofline", "cost.block_size=32", "cluster.gpus_per_node=2", "layout.micro_batches=2",
    "model.hidden=64", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=16",
    "model.ffn=128", "model.vocab=256", "model.max_context=1024",
    "workload.global_batch=8", "workload.min_len=128", "workload.max_len=1024", "workload.median=256",
    "seed=3", "policy=sparsebalance",
]
RUNNER = ["runner.task.n_keys=32", "runner.task.n_values=32", "runner.lr=1e-2"]

pytestmark = pytest.mark.slow


def torchrun(run_dir: Path, *overrides: str, nproc: int = 2, script: str | None = None, env: dict | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    target = [script] if script else ["-m", "sparsebalance.runner.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target,
           f"hydra.run.dir={run_dir}", *SHARED, *RUNNER, *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runner") / "full"
    ok(torchrun(run_dir, f"steps={STEPS}"))
    return run_dir


def test_training_writes_results_and_loss_decreases(full_run):
    for name in ("micro_batches.csv", "steps.csv", "plans.jsonl", "summary.json", "train.csv", "sequences.csv"):
        assert (full_run / name).is_file(), name
    train = pd.read_csv(full_run / "train.csv")
    assert list(train["step"]) == list(range(STEPS))
    assert train["loss"].tail(2).mean() < train["loss"].iloc[0] - 0.2
    steps = pd.read_csv(full_run / "steps.csv")
    assert (steps["step_ms"] > 0).all() and steps["mean_coverage"].between(0, 1).all()
    rows = pd.read_csv(full_run / "micro_batches.csv")
    assert len(rows) == STEPS * 2 * 2  # steps x ranks x micro-batches
    assert rows["kept_fraction"].dropna().between(0, 1).all()


def test_plans_are_the_simulators_and_ranks_train_their_share(full_run):
    """Step 0's Plan is sim.run's; each later one is what the same planner makes when shown what the kernel
    reported of the steps before (sequences.csv, steps.csv), where sim.run's planner is shown the cost model's."""
    from sparsebalance.runner.dist import World
    from sparsebalance.runner.train import build_planner, compose
    from sparsebalance.sim.run import simulate
    from sparsebalance.sim.config import compose_config

    # The runner keeps its activations (conf/runner.yaml), so sim.run plans the same step without recompute.
    cfg = compose_config([*SHARED, f"steps={STEPS}", "memory.activation_checkpointing=false"])
    recorded = (full_run / "plans.jsonl").read_text().splitlines()
    assert len(recorded) == STEPS and recorded[0] == simulate(cfg).results.plans[0]
    planner, _ = build_planner(compose([*SHARED, *RUNNER, f"steps={STEPS}"]), World(rank=0, size=2, local_rank=0))
    check_replanned(full_run, planner)
    expected = "".join(line + "\n" for line in recorded)
    # The runner checked every step that all ranks held a Plan with one digest: the planner's.
    digests = pd.read_csv(full_run / "train.csv")["plan_sha256"]
    assert list(digests) == [hashlib.sha256(line.encode()).hexdigest() for line in expected.splitlines()]

    # Each rank packed exactly the sequences the Plan gave it.
    rows = pd.read_csv(full_run / "micro_batches.csv").set_index(["step", "dp_rank", "micro_batch"])
    for line in expected.splitlines():
        plan = Plan.from_json(line)
        for a_rank in range(plan.dp):
            for mb in range(plan.micro_batches):
                tokens = sum(a.length for a in plan.micro_batch(a_rank, mb))
                assert rows.loc[(plan.step, a_rank, mb), "tokens"] == tokens


def test_resume_continues_the_same_loss_curve(full_run, tmp_path):
    half = tmp_path / "half"
    ok(torchrun(half, f"steps={STEPS // 2}", f"runner.checkpoint_every={STEPS // 2}"))
    resumed = tmp_path / "resumed"
    ok(torchrun(resumed, f"steps={STEPS}", f"runner.resume={half / 'checkpoint.pt'}"))
    full = pd.read_csv(full_run / "train.csv")
    again = pd.read_csv(resumed / "train.csv")
    pd.testing.assert_series_equal(full["loss"], again["loss"], rtol=1e-6)
    assert (resumed / "plans.jsonl").read_bytes() == (full_run / "plans.jsonl").read_bytes()


def test_compare_replays_the_run_through_the_simulator(full_run):
    from sparsebalance.runner.compare import main

    assert main([str(full_run), "--profile", str(PINNED_PROFILE)]) == 0
    table = pd.read_csv(full_run / "compare.csv")
    assert list(table["step"]) == list(range(STEPS))
    assert (table["sim_ms"] > 0).all() and np.isfinite(table["error_pct"]).all()
    summary = json.loads((full_run / "compare.json").read_text())
    assert summary["steps_compared"] == STEPS - 1 and summary["policy"] == "sparsebalance"


def test_compare_refuses_a_negative_skip_before_writing(full_run, capsys):
    from sparsebalance.runner.compare import main

    before = {p.name: p.read_bytes() for p in full_run.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as exc:
        main([str(full_run), "--skip", "-1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --skip -1: must be >= 0 (the number of "
                                                             "warm-up steps left out)")
    assert {p.name: p.read_bytes() for p in full_run.iterdir() if p.is_file()} == before


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert lines, proc.stderr[-3000:]
    return lines[0]


def test_world_size_must_match_the_layout(tmp_path):
    proc = torchrun(tmp_path / "run", "steps=2", "cluster.gpus_per_node=4")
    assert proc.returncode != 0
    assert "world size 2 does not match the layout dp*cp*pp = 4*1*1" in one_error_line(proc)
    assert not (tmp_path / "run" / "train.csv").exists()


@pytest.mark.parametrize("override, message", [
    ("policy=no_such_policy", "unknown policy 'no_such_policy'"),
    ("workload.max_len=4096", "exceeds the model's max context 1024"),
])
def test_bad_input_is_one_line_before_training(tmp_path, override, message):
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={tmp_path}", *SHARED, *RUNNER,
           "cluster.gpus_per_node=1", override]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in one_error_line(proc)
    assert not (tmp_path / "train.csv").exists()


@pytest.mark.parametrize("kind, layout", [("hang", "layout.pp=1"), ("die", "layout.pp=1"), ("hang", "layout.pp=2")])
def test_a_failed_rank_ends_the_job_within_the_timeout(tmp_path, kind, layout):
    """At pp=1 the healthy rank waits in the gradient reduction, at pp=2 for the hung stage's gradients."""
    # The faulty rank would sleep an hour: ending at all, within the bound, is the timeout's doing (the line
    # below names it); how soon depends on the machine's load, so it is not asserted.
    proc = torchrun(tmp_path, "steps=4", layout, f"runner.timeout_s={FAULT_TIMEOUT_S}",
                    script="tests/runner/faulty_train.py",
                    env={"RUNNER_FAULT": kind, "RUNNER_FAULT_RANK": "1", "RUNNER_FAULT_STEP": "1"}, timeout=900)
    assert proc.returncode != 0
    if kind == "hang":
        line = one_error_line(proc)
        assert line.startswith(f"error: rank 0: step 1 failed or timed out after {FAULT_TIMEOUT_S} s"), line
        waited_ms = DIAGNOSIS_TIMEOUTS * FAULT_TIMEOUT_S * 1000
        assert line.endswith(f"Ranks 1 failed to pass monitoredBarrier in {waited_ms} ms"), line
    else:
        assert "exitcode  : 17" in proc.stderr
