"""Figures of simulated runs need only the simulator's dependencies: where ``import torch`` fails (a stub package
first on the path stands in for an install without the ``gpu`` extra), ``sim.run ... plot=true`` and
``python -m viz <run dir>`` still write their figures; where torch is installed, ``viz`` does not import it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pinned import PINNED_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]


def python(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_plot_and_viz_draw_a_simulated_run_where_torch_cannot_be_imported(tmp_path):
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'torch' (a simulator-only install)\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(ROOT)])}
    assert python("-c", "import torch", env=env).returncode == 1  # the stub is what the processes import

    run_dir = tmp_path / "run"
    done = python("-m", "sparsebalance.sim.run", "policy=sparsebalance", "steps=2", "plot=true",
                  f"hydra.run.dir={run_dir}", *PINNED_OVERRIDES, env=env)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    assert (run_dir / "figures" / "timeline.png").stat().st_size > 0

    out = tmp_path / "figures"
    done = python("-m", "sparsebalance.viz", str(run_dir), "--out", str(out), env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert [p.name for p in out.iterdir()] == ["timeline.png"] and (out / "timeline.png").stat().st_size > 0


def test_viz_imports_no_torch():
    code = ("import sys, viz.cli, viz.figures, viz.callbacks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    done = python("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"
