"""``python -m benchmarks.attention`` on a machine without a GPU, and with bad lists: one-line errors, no
traceback; its interleaved timing rounds."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import attention as bm

ROOT = Path(__file__).resolve().parents[2]


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.attention", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--lengths", "8k"], "argument --lengths: '8k': expected comma-separated positive token counts"),
    (["--lengths", "8192,0"], "argument --lengths: '8192,0': [0] not allowed, expected positive token counts"),
    (["--sparsities", "0,1"], "argument --sparsities: '0,1': [1.0] not allowed, expected sparsities in [0, 1)"),
    (["--rounds", "0"], "argument --rounds: '0': expected a round count (an integer >= 1)"),
    (["--rounds", "two"], "argument --rounds: 'two': expected a round count (an integer >= 1)"),
    (["--graph-max-tokens", "-1"], "argument --graph-max-tokens: '-1': expected a token count (an integer >= 0)"),
], ids=["lengths-not-int", "lengths-zero", "sparsity-one", "rounds-zero", "rounds-not-int", "graph-tokens-negative"])
def test_bad_lists_are_one_line_errors(args, message):
    out = run_module(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].endswith("error: " + message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_no_gpu_is_one_line(tmp_path):
    out = run_module("--bench", "--csv", str(tmp_path / "grid.csv"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: no CUDA GPU here" in out.stderr.splitlines()[-1]
    assert not (tmp_path / "grid.csv").exists()


def test_rounds_take_turns_and_report_medians(monkeypatch):
    """Each round times every implementation's fwd then fwd+bwd, in turn; the result is the median per
    implementation; one that raises keeps its exception and sits out the later rounds."""
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
    cases = bm.grid_cases([8192, 131072], packed=True)
    assert [c for c, _ in cases] == ["packed64k", "single", "single"]
    assert sum(cases[0][1]) == 65536 and cases[1][1] == [8192] and cases[2][1] == [131072]
    assert bm.grid_cases([131072], packed=False) == [("single", [131072])]


GRID_CSV = """case,T,ndocs,sparsity,kept_fraction,impl,fwd_ms,fwdbwd_ms,speedup_vs_flex_fwdbwd,fwdbwd_graph_ms,speedup_vs_flex_fwdbwd_graph,error
selection_32k,32768,1,0.9,0.1,select[kept_fraction=0.1],0.2,4.0,,,,select/attn_fwdbwd=0.050
selection_32k,32768,1,0.9,0.1,select[kept_fraction=0.1],0.4,4.0,,,,select/attn_fwdbwd=0.100
packed64k,65536,3,0.5,0.5,flex,1.0,6.0,,,,block_mask_build_s=0.00
packed64k,65536,3,0.5,0.5,triton_sparse,1.0,3.0,2.0,,,
single,8192,1,0.0,1.0,cudnn_dense,0.5,2.0,,1.5,,
single,8192,1,0.0,1.0,triton_sparse,0.5,2.5,1.1,3.0,1.2,
single,8192,1,0.5,0.5,triton_sparse,0.5,1.25,,,,
"""


def test_results_table_from_a_grid_csv(tmp_path):
    """The README's table: ours (speedup over Flex) per case and sparsity, the graph timing as its own row,
    missing points as '-', dense against cuDNN; one line per selection mode. No GPU needed."""
    path = tmp_path / "grid.csv"
    path.write_text(GRID_CSV)
    out = run_module("--table", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "| fwd+bwd ms (FlexAttention's time / ours) | sparsity 0 | sparsity 0.5 | dense: cuDNN's time / ours |",
        "| --- | --- | --- | --- |",
        "| packed 64K (3 documents) | - | 3.00 (2.00x) | - |",
        "| single 8K | 2.50 (1.10x) | 1.25 | 0.80x |",
        "| single 8K, CUDA graph | 3.00 (1.20x) | - | 0.50x |",
        "",
        "* selection (kept_fraction=0.1) at 32K tokens: 0.20-0.40 ms, 5.0-10.0% of the fwd+bwd over it (2 samples)",
    ]


def test_missing_table_csv_is_one_line(tmp_path):
    out = run_module("--table", str(tmp_path / "none.csv"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].endswith("none.csv': no such file (a grid CSV of this benchmark)")


def test_kernel_ptx_names_a_missing_reference_directory_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel_ptx", str(tmp_path / "out"), "--compare",
                          str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].endswith("is not a directory (write one first: python -m "
                                                "benchmarks.kernel_ptx REF_DIR)")
    assert not (tmp_path / "out").exists()
