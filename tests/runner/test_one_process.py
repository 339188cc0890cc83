"""``runner.one_process=true``: one process trains every replica's micro-batches of a dp x cp x pp layout's Plans
on the whole model, and computes the gradient the distributed run computes (held against the same reference
as the torchrun layouts, equivalence.one_process); under sparsebalance it trains the layout's shifted budgets,
which a one-GPU layout never has; bad uses are one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from equivalence import LR, RUNNER, SHARED, check_loss_and_gradients, check_plans, layout_overrides, plans_of, probe
from sparsebalance.runner.compare import main as compare_main

pytestmark = pytest.mark.slow  # every test trains or launches runs
ROOT = Path(__file__).resolve().parents[2]
ONE_PROCESS = "runner.one_process=true"


def run_one_process(run_dir: Path, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    return probe(run_dir, nproc, f"runner.lr={LR}", ONE_PROCESS, *overrides)


@pytest.fixture(scope="module")
def pp2xdp2(once) -> Path:
    """The PP2 x DP2 layout's first step in one process."""
    def make(run_dir: Path) -> None:
        proc = run_one_process(run_dir, *layout_overrides("pp2xdp2-ddp"))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return once("one-process-pp2xdp2", make)


def test_one_process_trains_what_the_layout_trains(pp2xdp2):
    check_loss_and_gradients(pp2xdp2)


def test_one_process_plans_are_the_layouts(pp2xdp2):
    check_plans("pp2xdp2-ddp", pp2xdp2)
    rows = pd.read_csv(pp2xdp2 / "micro_batches.csv")
    plan = plans_of(pp2xdp2)[0]
    # one row per (replica, micro-batch) of the whole model; no waits on other replicas or stages (the
    # replicas ran one after another), only the microseconds between the clock's own marks
    assert sorted(zip(rows["dp_rank"], rows["micro_batch"], strict=True)) == [(r, m) for r in range(2)
                                                                              for m in range(2)]
    assert (rows["stage"] == 0).all() and (rows["idle_ms"] < 1.0).all()
    sequences = pd.read_csv(pp2xdp2 / "sequences.csv")
    assert sorted(sequences["seq_id"]) == sorted(a.seq_id for a in plan.assignments)
    assert sorted(sequences["dp_rank"].unique()) == [0, 1]


def test_sparsebalance_trains_the_layouts_shifted_budgets(tmp_path):
    """At DP4 DST moves budgets off the baseline's 0.9; one process trains exactly the Plans' budgets."""
    overrides = [o for o in SHARED if not o.startswith(("policy=", "steps=", "workload.global_batch="))]
    overrides += ["policy=sparsebalance", "steps=2", "workload.global_batch=16", "cluster.gpus_per_node=4"]
    proc = run_one_process(tmp_path, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = {a.seq_id: a.budget.p for plan in plans_of(tmp_path) for a in plan.assignments}
    trained = pd.read_csv(tmp_path / "sequences.csv").set_index("seq_id")["p"].to_dict()
    assert trained == pytest.approx(planned)
    assert len(set(planned.values())) > 1 and set(planned.values()) != {0.9}


def test_one_process_under_several_processes_is_one_line(tmp_path):
    proc = run_one_process(tmp_path / "run", *SHARED, "cluster.gpus_per_node=2", nproc=2)
    assert proc.returncode != 0  # torchrun's own code for a worker's exit 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors and "runner.one_process=true" in errors[0] and "allowed: 1" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "run" / "train.csv").exists()


def test_compare_refuses_a_one_process_run(pp2xdp2, capsys):
    with pytest.raises(SystemExit) as exit_:
        compare_main([str(pp2xdp2)])
    assert exit_.value.code == 2
    assert "runner.one_process=true" in capsys.readouterr().err
    assert not (pp2xdp2 / "compare.csv").exists()


def test_plain_runs_side_by_side_take_their_own_ports(tmp_path):
    """Without torchrun a run is a world of one and picks a free port: two at once do not collide."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={tmp_path / str(i)}",
                               *SHARED, *RUNNER, "cluster.gpus_per_node=1"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    assert all((tmp_path / str(i) / "summary.json").is_file() for i in range(2))
