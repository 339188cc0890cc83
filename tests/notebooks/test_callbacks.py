"""viz.callbacks.RunFigures: ``python -m sim.run ... plot=true`` draws through a Hydra callback, per job, only for
jobs that completed, and ``sim`` never imports ``viz`` (``tests/test_layers.py`` holds that)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from pinned import PINNED_OVERRIDES
from sparsebalance.viz.callbacks import RunFigures

ROOT = Path(__file__).resolve().parents[2]


def sim_run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsebalance.sim.run", *overrides, *PINNED_OVERRIDES], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("status, plot, drawn", [
    (JobStatus.COMPLETED, True, True),
    (JobStatus.COMPLETED, False, False),
    (JobStatus.FAILED, True, False),
])
def test_only_a_completed_job_that_asks_draws(sweep_copy, status, plot, drawn):
    job_dir = sweep_copy / "1"
    config = OmegaConf.create({"plot": plot, "hydra": {"runtime": {"output_dir": str(job_dir)}}})
    RunFigures().on_job_end(config=config, job_return=JobReturn(status=status))
    assert (job_dir / "figures" / "timeline.png").is_file() is drawn
    assert (job_dir / "figures").exists() is drawn


@pytest.mark.slow
def test_a_sweep_draws_every_job(tmp_path):
    done = sim_run("-m", "policy=baseline,kk", "steps=1", "layout.micro_batches=4", "baseline=null", "plot=true",
                   f"hydra.sweep.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    for job in ("0", "1"):
        assert f"figures: {tmp_path / job / 'figures'}  (timeline.png)" in done.stdout
        assert (tmp_path / job / "figures" / "timeline.png").stat().st_size > 0


def test_bad_input_with_plot_leaves_nothing(tmp_path):
    done = sim_run("plot=true", "steps=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2
    assert done.stderr.startswith("error: steps=0") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "run").exists()


def test_figures_without_plans_are_refused_before_the_run(tmp_path):
    done = sim_run("plot=true", "write_plans=false", "steps=1", "baseline=null", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: plot=true needs write_plans=true (the timeline replays the Plans)"]
    assert not (tmp_path / "run").exists()


def test_the_callback_loads_no_plotting_library():
    code = "import sys, viz.callbacks; print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"
