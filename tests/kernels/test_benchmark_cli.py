"""benchmarks/attention.py on a machine without a GPU, and with bad lists: one-line errors, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--lengths", "8k"], "argument --lengths: '8k': expected comma-separated positive token counts"),
    (["--lengths", "8192,0"], "argument --lengths: '8192,0': [0] not allowed, expected positive token counts"),
    (["--sparsities", "0,1"], "argument --sparsities: '0,1': [1.0] not allowed, expected sparsities in [0, 1)"),
], ids=["lengths-not-int", "lengths-zero", "sparsity-one"])
def test_bad_lists_are_one_line_errors(args, message):
    out = run_script(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].endswith("error: " + message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_no_gpu_is_one_line(tmp_path):
    out = run_script("--bench", "--csv", str(tmp_path / "grid.csv"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: no CUDA GPU here" in out.stderr.splitlines()[-1]
    assert not (tmp_path / "grid.csv").exists()
