"""The learning recipe (conf/experiment/learning.yaml, run by scripts/gpu_learning.sh): every run of the script
passes the runner's checks, and the recipe trains and evaluates on the CPU with its lengths cut to 512."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.runner import train
from sparsebalance.runner.capacity import Device
from sparsebalance.runner.evaluate import main as evaluate
from sparsebalance.runner.train import check_inputs, compose
from tiny import ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ["+experiment=learning"]
# The script's runs: the multihop task under baseline, the retrieval task under both policies.
# The multihop run is the script's clock: more steps than its time limit allows (inside the runner's size guard).
RUNS = [["runner.task.kind=multihop", "policy=baseline", "steps=20000"],
        ["runner.task.kind=retrieval", "policy=baseline"], ["runner.task.kind=retrieval", "policy=sparsebalance"]]
CPU = ["runner.device=cpu", "workload.max_len=512", "workload.median=256", "workload.global_batch=4", "steps=2",
       "runner.checkpoint_every=2", "write_plans=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("run", RUNS, ids=["multihop-baseline", "retrieval-baseline", "retrieval-sparsebalance"])
def test_every_run_of_the_script_passes_the_checks(run, monkeypatch):
    # The script runs on a GPU, whose memory its runs are checked against there; this machine's is no measure.
    monkeypatch.setattr(train, "device_capacity", lambda *_: Device("a GPU", 1e12, "the test's"))
    check_inputs([*RECIPE, *run], ONE_RANK)


def test_the_recipe_is_the_tiny_model_on_long_sequences():
    cfg = compose(RECIPE)
    assert (cfg.model.name, cfg.model.layers, cfg.model.hidden, cfg.model.max_context) == ("tiny", 4, 256, 32768)
    assert (cfg.workload.min_len, cfg.workload.max_len, cfg.workload.global_batch) == (256, 8192, 32)
    assert cfg.runner.task.n_queries == cfg.runner.task.max_pairs == 8  # every item asked
    assert cfg.cost.name == "roofline" and cfg.cluster.gpus_per_node == 1


@pytest.mark.slow
def test_the_recipe_trains_and_its_checkpoint_evaluates_on_the_cpu(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run}", *RECIPE, RUNS[0][0],
           "policy=sparsebalance", *CPU]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = pd.read_csv(run / "train.csv")
    assert list(train["step"]) == [0, 1] and train["answers"].min() >= 4  # one answer per sequence at least
    assert evaluate([str(run), "--lengths", "256", "--p", "1.0,0.9", "--sequences", "4"]) == 0
    summary = pd.read_csv(run / "eval_summary.csv")
    assert summary[["steps", "length", "p", "sequences"]].values.tolist() == [[2, 256, 1.0, 4], [2, 256, 0.9, 4]]
    assert summary["chance"].tolist() == pytest.approx([1 / 32, 1 / 32])
