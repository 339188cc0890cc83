"""benchmarks/attention.py on a machine without a GPU, and with bad lists: one-line errors, no traceback;
its interleaved timing rounds."""
from __future__ import annotations

import importlib.util
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
    (["--rounds", "0"], "argument --rounds: '0': expected a round count (an integer >= 1)"),
    (["--rounds", "two"], "argument --rounds: 'two': expected a round count (an integer >= 1)"),
    (["--graph-max-tokens", "-1"], "argument --graph-max-tokens: '-1': expected a token count (an integer >= 0)"),
], ids=["lengths-not-int", "lengths-zero", "sparsity-one", "rounds-zero", "rounds-not-int", "graph-tokens-negative"])
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


def load_benchmark():
    spec = importlib.util.spec_from_file_location("attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_take_turns_and_report_medians(monkeypatch):
    """Each round times every implementation's fwd then fwd+bwd, in turn; the result is the median per
    implementation; one that raises keeps its exception and sits out the later rounds."""
    bm = load_benchmark()
    calls = []
    samples = {"a.f": [3.0, 1.0, 2.0], "a.fb": [30.0, 10.0, 20.0], "b.f": [5.0, 7.0, 6.0], "b.fb": [50.0, 70.0, 60.0]}

    def fake_bench(fn):
        name = fn()
        calls.append(name)
        if name == "c.fb" and calls.count(name) == 2:
            raise RuntimeError("no graph")
        return samples[name].pop(0) if name in samples else 1.0

    monkeypatch.setattr(bm, "bench", fake_bench)
    fns = {impl: (lambda impl=impl: f"{impl}.f", lambda impl=impl: f"{impl}.fb") for impl in "abc"}
    out = bm.interleaved_ms(fns, 3)
    assert calls == ["a.f", "a.fb", "b.f", "b.fb", "c.f", "c.fb"] * 2 + ["a.f", "a.fb", "b.f", "b.fb"]
    assert out["a"] == (2.0, 20.0) and out["b"] == (6.0, 60.0)
    assert isinstance(out["c"], RuntimeError)


def test_grid_cases_packed_first_or_left_out():
    bm = load_benchmark()
    cases = bm.grid_cases([8192, 131072], packed=True)
    assert [c for c, _ in cases] == ["packed64k", "single", "single"]
    assert sum(cases[0][1]) == 65536 and cases[1][1] == [8192] and cases[2][1] == [131072]
    assert bm.grid_cases([131072], packed=False) == [("single", [131072])]
