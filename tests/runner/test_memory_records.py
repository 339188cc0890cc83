"""What the runner measures of memory and compilation, and runner.compare's memory table.

One real 1-rank CPU run: the peak-memory columns exist and are empty cells (the CPU has no allocator counter),
every step records zero compilations (the reference attention compiles nothing), and runner.compare prices
every (DP rank, stage) with sim.memory as sim.run does for the same Plans, the measured side left empty. A run's
measured column, where there is one, gives the relative error. The model hands every layer's attention one
VarlenBatch per micro-batch.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from pinned import PINNED_PROFILE
from sparsebalance.model import TinyLlama
from sparsebalance.runner.attention import make_attention
from sparsebalance.sim.shapes import ModelShape
from tiny import TINY_ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cpu_run(once) -> Path:
    """The run, made once per session (its tests may run on different xdist workers); tests that run
    runner.compare, which writes into a run, work on a copy."""
    return once("memory-records", _train)


def _train(run_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-m", "sparsebalance.runner.train", f"hydra.run.dir={run_dir}",
                           *TINY_ONE_RANK, f"steps={STEPS}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def raw(path: Path) -> pd.DataFrame:
    """A CSV as the text of its cells: an empty cell stays '' instead of becoming NaN."""
    return pd.read_csv(path, dtype=str, keep_default_na=False)


@pytest.mark.slow
def test_cpu_run_leaves_the_peak_memory_cells_empty_and_counts_no_compilations(cpu_run):
    rows = raw(cpu_run / "micro_batches.csv")
    assert len(rows) == STEPS * 2 and rows["peak_memory_gb"].tolist() == [""] * len(rows)
    assert raw(cpu_run / "steps.csv")["peak_memory_gb"].tolist() == [""] * STEPS
    train = raw(cpu_run / "train.csv")
    assert train["peak_memory_gb"].tolist() == [""] * STEPS
    assert train["compilations"].tolist() == ["0"] * STEPS
    for name in ("micro_batches.csv", "steps.csv", "train.csv"):
        assert "nan" not in (cpu_run / name).read_text().lower(), name
    assert json.loads((cpu_run / "summary.json").read_text())["peak_memory_gb"] is None


@pytest.mark.slow
def test_compare_prices_each_rank_and_stage_as_sim_run_and_leaves_measured_empty(cpu_run, tmp_path):
    from sparsebalance.runner.compare import main
    from sparsebalance.sim.config import compose_config
    from sparsebalance.sim.run import simulate

    run = tmp_path / "run"
    shutil.copytree(cpu_run, run)
    assert main([str(run), "--profile", str(PINNED_PROFILE), "--skip", "0"]) == 0
    table = raw(run / "memory.csv")
    assert table.columns.tolist() == ["dp_rank", "stage", "predicted_bytes", "measured_bytes", "error_pct"]
    assert table[["dp_rank", "stage", "measured_bytes", "error_pct"]].values.tolist() == [["0", "0", "", ""]]
    # sim.run of the same config (the runner keeps its activations) reports the same peak for the same Plans
    shared = [o for o in TINY_ONE_RANK if not o.startswith("runner.")]
    sim = simulate(compose_config([*shared, f"steps={STEPS}", "memory.activation_checkpointing=false"]))
    assert int(table["predicted_bytes"][0]) == pytest.approx(sim.summary["peak_memory_gb"] * 1e9, rel=1e-8)
    assert json.loads((run / "compare.json").read_text())["peak_memory_max_abs_error_pct"] is None


@pytest.mark.slow
def test_compare_gives_the_relative_error_of_a_measured_peak(cpu_run, tmp_path):
    from sparsebalance.runner.compare import main

    run = tmp_path / "run"
    shutil.copytree(cpu_run, run)
    assert main([str(run), "--profile", str(PINNED_PROFILE), "--skip", "0"]) == 0
    predicted = int(raw(run / "memory.csv")["predicted_bytes"][0])
    rows = pd.read_csv(run / "micro_batches.csv")
    rows["peak_memory_gb"] = [0.0005, 0.002, 0.001, 0.0015][: len(rows)]  # GB; the largest counts
    rows.to_csv(run / "micro_batches.csv", index=False)
    assert main([str(run), "--profile", str(PINNED_PROFILE), "--skip", "0"]) == 0
    table = pd.read_csv(run / "memory.csv")
    assert table["measured_bytes"].tolist() == [2_000_000]
    assert table["error_pct"][0] == pytest.approx(100 * (predicted - 2e6) / 2e6, rel=1e-5)
    summary = json.loads((run / "compare.json").read_text())
    assert summary["peak_memory_max_abs_error_pct"] == pytest.approx(abs(table["error_pct"][0]))


def test_every_layer_attends_over_one_varlen_batch_per_forward():
    from sparsebalance.kernels.sparse_attention import VarlenBatch

    shape = ModelShape(name="tiny", hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16, ffn=64, vocab=64,
                       max_context=256)
    model = TinyLlama(shape, seed=0)
    attend, seen = make_attention("naive", 32), []

    def spy(q, k, v, docs, budgets):
        seen.append(docs)
        return attend(q, k, v, docs, budgets)

    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    budgets = (torch.tensor([0.5, 0.5]), None)
    for _ in range(2):  # two micro-batches
        model(torch.randint(0, 64, (100,)), cu, budgets, torch.tensor([39, 99]), spy)
    assert all(isinstance(d, VarlenBatch) and d.offsets == (0, 40, 100) for d in seen)
    assert len(seen) == 6 and seen[0] is seen[2] and seen[3] is seen[5] and seen[0] is not seen[3]
