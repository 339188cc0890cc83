"""One line where a traceback used to be: Ctrl-C while a command's heavy imports load, a Slurm launcher where no
Slurm is, and the runner's console scripts where torch (the gpu extra) is not installed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sparsebalance.sim.run as sim_run
from sparsebalance.sim.core import ConfigError, interrupts_as_one_line

ROOT = Path(__file__).resolve().parents[2]


def python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_ctrl_c_during_the_imports_is_one_line():
    """The process sends itself SIGINT inside the block, as Ctrl-C during ``import pandas`` would arrive."""
    done = python("import os, signal, time\n"
                  "from sparsebalance.sim.core import interrupts_as_one_line\n"
                  "with interrupts_as_one_line():\n"
                  "    os.kill(os.getpid(), signal.SIGINT)\n"
                  "    time.sleep(600)\n")
    assert done.returncode == 130 and done.stderr == "interrupted\n" and done.stdout == ""


def test_the_handler_before_the_block_is_back_after_it():
    before = signal.getsignal(signal.SIGINT)
    with interrupts_as_one_line():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_the_slurm_launcher_without_slurm_is_one_line_before_anything_is_written(monkeypatch, tmp_path):
    monkeypatch.setattr(sim_run.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^hydra/launcher=slurm: no Slurm here \(srun is not on PATH\); allowed: "):
        sim_run.check_composition(["-m", "hydra/launcher=slurm", "policy=kk,sparsebalance",
                                   f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("script", ["train", "replay"])
def test_a_runner_script_without_torch_says_to_install_the_gpu_extra(script, tmp_path):
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    done = python(f"import sys; sys.argv = ['sparsebalance-{script}', '--help']\n"
                  f"from sparsebalance.runner.entry import {script}\n{script}()",
                  env={"PYTHONPATH": os.pathsep.join([str(stub.parent), str(ROOT)])})
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: sparsebalance-{script} needs torch, which did not import (No module named 'torch'); install the "
        "gpu extra: pip install 'sparsebalance-sim[gpu]'"]
