"""The runner's first run on a CPU (``+experiment=cpu_smoke`` on 2 ranks), what ``runner.train`` prints, and the
check that every sequence fits the memory of the device before a run starts (runner/capacity.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparsebalance.runner.capacity import Device, check_fits
from sparsebalance.runner.config import register
from sparsebalance.runner.dist import World
from sparsebalance.runner.train import build_planner, check_inputs
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from tiny import ONE_RANK, TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["+experiment=cpu_smoke", "policy=sparsebalance"]
TWO_RANKS = World(rank=0, size=2, local_rank=0, local_size=2)
# The command that grew to 11.4 GB per rank before it was killed: the default workload's 32K-token sequences
# through the CPU's reference attention.
TOO_LONG = ["policy=sparsebalance", "model=tiny", "cluster.gpus_per_node=2", "steps=3"]


def check(overrides: list[str], device: Device, device_type: str = "cpu") -> None:
    register()
    cfg = compose_config(overrides, config_name="runner")
    planner, _ = build_planner(cfg, TWO_RANKS)
    check_fits(cfg, planner.workload, planner.layout, planner.cost.block_size, device, device_type)


def test_the_preset_needs_less_than_a_gigabyte_per_rank_and_passes_the_checks():
    check(SMOKE, Device("cpu", 1e9, "a 1 GB test device"))
    check_inputs(SMOKE, TWO_RANKS)  # this machine's RAM, as torchrun's ranks see it


def test_a_sequence_the_device_cannot_hold_is_refused_in_one_line_naming_it_and_the_bytes():
    with pytest.raises(ConfigError) as exc:
        check(TOO_LONG, Device("cpu", 11.4e9, "the test's"))
    message = str(exc.value)
    assert message.startswith("step 0: sequence ") and "\n" not in message, message
    assert " tokens) needs " in message
    assert "GB on cpu alone in a micro-batch (the PyTorch reference attention" in message
    assert "above the 11.40 GB available there (the test's); allowed: shorter sequences (workload.max_len)" in message


def test_the_reference_attentions_scores_are_what_the_cpu_cannot_hold():
    check(TOO_LONG, Device("cpu", 1e12, "a 1 TB test device"))
    check(TOO_LONG, Device("cuda:0", 11.4e9, "the test's"), device_type="cuda")  # the kernel keeps no scores
    check([*TOO_LONG, "memory.overflow=allow"], Device("cpu", 11.4e9, "the test's"))  # allow: report only


def test_a_run_no_device_holds_is_refused_before_its_run_dir_exists(tmp_path):
    lengths = ["model.max_context=262144", "workload.min_len=262144", "workload.median=262144",
               "workload.max_len=262144"]  # 2 TB of scores per sequence
    with pytest.raises(ConfigError, match=r"^step 0: sequence 0 \(262144 tokens\) needs \d+\.\d\d GB on cpu "):
        check_inputs([*TINY_ONE_RANK, *lengths, "steps=1", f"hydra.run.dir={tmp_path / 'run'}"], ONE_RANK)
    assert not (tmp_path / "run").exists()


def test_one_rank_of_a_layout_for_two_is_checked_before_the_memory():
    with pytest.raises(ConfigError, match="world size 1 does not match"):
        check_inputs(SMOKE, ONE_RANK)


@pytest.mark.slow
def test_the_preset_trains_under_torchrun_and_prints_its_summary_and_run_dir(tmp_path):
    run_dir = tmp_path / "smoke"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "sparsebalance.runner.train", *SMOKE, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, row, last = proc.stdout.splitlines()
    assert header.split()[:3] == ["policy", "layout", "step_ms"] and header.split()[-2:] == ["loss", "accuracy"]
    assert row.split()[:2] == ["sparsebalance", "dp2xcp1xpp1"]
    assert last.startswith(f"results: {run_dir}  (") and "summary.json" in last
    assert "\r" not in proc.stderr  # off a terminal: lines, never a progress bar's redraws
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
